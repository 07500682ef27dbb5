// Package cluster tests distributed zones with several real Caddy processes
// (built once from ./cmd/caddy, which includes caddy.storage.redis) sharing
// one storage on loopback: a file_system directory, or a redis-server the
// tests start.
//
// Ports are picked free at run time (testcaddy.FreePorts): each process its
// admin and HTTP port, each redis-server its own port and directory, so two
// copies of the suite on one machine never meet. Every answer carries the
// answering process's X-Node token, and a request answered by any other
// process fails the test. Each process gets its own XDG_DATA_HOME, hence
// its own Caddy instance id, unless a test shares one on purpose.
//
// The tests wait for real processes' background sync (intervals of 100ms
// set in their configs) by watching what it writes, with every loop bounded
// by a deadline; windows are a few seconds where a test needs them to age
// out.
package cluster

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"io"

	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

var caddyBin string

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(0)
	}
	dir, err := os.MkdirTemp("", "floodgate-cluster-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	caddyBin = filepath.Join(dir, "caddy")
	build := exec.Command("go", "build", "-o", caddyBin, "../../cmd/caddy")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building caddy:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// node is one Caddy process.
type node struct {
	t    *testing.T
	i    int
	home string // its XDG_DATA_HOME / XDG_CONFIG_HOME
	cfg  string
	// storage and body make its config with its ports.
	storage, body string
	env           []string // extra environment
	admin         int      // admin port
	http          int      // HTTP port
	token         string   // its X-Node header
	cmd           *exec.Cmd
	mu            sync.Mutex
	log           bytes.Buffer
	done          chan struct{}
	alive         bool
}

// startNode starts Caddy number i, on free admin and HTTP ports, with the
// Caddyfile body (global options are added) and waits until it serves.
// home keeps its instance id across restarts.
func startNode(t *testing.T, i int, home, storage, body string) *node {
	t.Helper()
	n := newNode(t, i, home, storage, body)
	n.start()
	return n
}

// newNode prepares Caddy number i as startNode does, without starting it.
func newNode(t *testing.T, i int, home, storage, body string) *node {
	t.Helper()
	n := &node{t: t, i: i, home: home, storage: storage, body: body}
	n.pickPorts()
	t.Cleanup(n.kill)
	return n
}

// pickPorts gives the node free admin and HTTP ports, and the config and
// X-Node token that go with them.
func (n *node) pickPorts() {
	n.t.Helper()
	ports, err := testcaddy.FreePorts(2)
	if err != nil {
		n.t.Fatal(err)
	}
	n.admin, n.http = ports[0], ports[1]
	n.token = fmt.Sprintf("%d-%d-%d", os.Getpid(), n.i, n.http)
	n.cfg = fmt.Sprintf(`{
	admin localhost:%d
	http_port %d
	auto_https off
	persist_config off
	grace_period 1ns
	%s
}
:%d {
	header X-Node %s
	%s
}
`, n.admin, n.http, n.storage, n.http, n.token, n.body)
}

// portAttempts bounds how often a node starts again on new ports when one
// of its ports was taken between FreePorts and Caddy's bind: the kernel
// may hand a port that was just free to any outgoing connection.
const portAttempts = 5

// start starts the process and waits until it serves, on new ports if one
// of its own was taken meanwhile.
func (n *node) start() {
	n.t.Helper()
	for attempt := 1; ; attempt++ {
		if n.startOnce(attempt == portAttempts) {
			return
		}
		n.pickPorts()
	}
}

// startOnce starts the process and waits until it serves; it reports false
// if the process exited because a port was taken, unless last.
func (n *node) startOnce(last bool) bool {
	t := n.t
	t.Helper()
	cfgFile := filepath.Join(n.home, "Caddyfile")
	if err := os.MkdirAll(n.home, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfgFile, []byte(n.cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	n.cmd = exec.Command(caddyBin, "run", "--config", cfgFile, "--adapter", "caddyfile")
	n.cmd.Env = append(append(os.Environ(), "XDG_DATA_HOME="+n.home, "XDG_CONFIG_HOME="+n.home, "HOME="+n.home), n.env...)
	stderr, err := n.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	n.done = make(chan struct{})
	n.alive = true
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			n.mu.Lock()
			n.log.Write(sc.Bytes())
			n.log.WriteByte('\n')
			n.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, stderr)
		_ = n.cmd.Wait()
		close(n.done)
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if n.serves() {
			return true
		}
		select {
		case <-n.done:
			n.alive = false
			if !last && strings.Contains(n.logs(), "address already in use") {
				t.Logf("node %d: a port was taken before Caddy bound it; starting again on others", n.i)
				n.mu.Lock()
				n.log.Reset()
				n.mu.Unlock()
				return false
			}
			t.Fatalf("node %d exited while starting:\n%s", n.i, n.logs())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %d did not listen within 30s:\n%s", n.i, n.logs())
		}
	}
}

// serves reports whether the node's own process answers on its HTTP port:
// an answer from another process (one that took the port) does not count.
func (n *node) serves() bool {
	req, err := http.NewRequest(http.MethodOptions, "http://"+n.addr()+"/", nil)
	if err != nil {
		return false
	}
	req.Close = true
	resp, err := (&http.Client{Timeout: time.Second}).Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.Header.Get("X-Node") == n.token
}

func (n *node) addr() string { return fmt.Sprintf("127.0.0.1:%d", n.http) }

func (n *node) logs() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.log.String()
}

// logged reports whether one line of n's log holds every one of parts.
func (n *node) logged(parts ...string) bool {
	for line := range strings.Lines(n.logs()) {
		if all(line, parts) {
			return true
		}
	}
	return false
}

func all(line string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(line, p) {
			return false
		}
	}
	return true
}

// kill9 kills the process at once, as a crash would.
func (n *node) kill() {
	if n.alive {
		_ = n.cmd.Process.Kill()
		<-n.done
		n.alive = false
	}
}

// stop stops the process gracefully (SIGINT), as a restart does.
func (n *node) stop() {
	n.t.Helper()
	if !n.alive {
		return
	}
	_ = n.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-n.done:
	case <-time.After(20 * time.Second):
		n.t.Fatalf("node %d did not stop within 20s", n.i)
	}
	n.alive = false
}

// exited reports whether the process ended on its own.
func (n *node) exited() bool {
	select {
	case <-n.done:
		return n.alive
	default:
		return false
	}
}

// get sends one request with X-Key: key on a new connection and returns
// its status and how long it took.
func (n *node) get(key string) (int, time.Duration) {
	n.t.Helper()
	start := time.Now()
	resp := n.response(key)
	return resp.StatusCode, time.Since(start)
}

// response sends one request with X-Key: key on a new connection and
// returns the response, its body read.
func (n *node) response(key string) *http.Response {
	n.t.Helper()
	req := testcaddy.Request(n.t, http.MethodGet, "http://"+n.addr()+"/", "X-Key: "+key)
	req.Close = true
	_, _, resp := testcaddy.Do(n.t, &http.Client{Timeout: 10 * time.Second}, req)
	if got := resp.Header.Get("X-Node"); got != n.token {
		n.t.Fatalf("node %d: answered by another process (X-Node %q, want %q): its port was taken", n.i, got, n.token)
	}
	return resp
}

// metric returns the sum of the values of a metric's series on the node's
// admin /metrics.
func (n *node) metric(name string) float64 {
	n.t.Helper()
	return testcaddy.MetricSum(testcaddy.Metrics(n.t, n.admin), name)
}

// spread sends total requests for key, one every gap, to the nodes in
// turn, and returns how many were allowed.
func spread(t *testing.T, nodes []*node, key string, total int, gap time.Duration) int {
	t.Helper()
	allowed := 0
	next := time.Now()
	for i := range total {
		time.Sleep(time.Until(next))
		next = next.Add(gap)
		code, _ := nodes[i%len(nodes)].get(key)
		switch code {
		case http.StatusOK:
			allowed++
		case http.StatusTooManyRequests:
		default:
			t.Fatalf("request %d: status %d", i, code)
		}
	}
	return allowed
}

// waitFor polls cond every 20ms until it holds, failing after limit.
func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, limit)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
