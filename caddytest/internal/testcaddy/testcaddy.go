// Package testcaddy holds what floodgate's integration test packages share
// about the in-process Caddy they load configs into: loading a config and
// waiting until only the new config listens (Load, Settle), the requests
// the tests send it (Request, Do, Codes, JSON, ClientFrom; requests.go), an
// events handler that records what it is given (Events), an app that fails
// to start (StartFailure), and what an operator reads: `caddy rate-limit`'s
// output (RateLimit) and the JSON logs (LogEntries; operator.go), and a
// Prometheus scraping it that runs contrib/grafana's dashboard queries
// (StartPrometheus, DashboardQueries; prometheus.go). Only tests import it.
package testcaddy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// Load posts cfg ("caddyfile" or "json") to the /load endpoint of the admin
// listener on localhost:adminPort (Post), waits until the config that
// serves afterwards is the only one listening on ports (Settle), and
// returns the error Caddy reports, if any. It fails the test if the admin
// endpoint does not answer.
func Load(t testing.TB, adminPort int, cfg, adapter string, ports ...int) error {
	t.Helper()
	err := Post(adminPort, cfg, adapter)
	var refused *LoadError
	if err != nil && !errors.As(err, &refused) {
		t.Fatal(err)
	}
	Settle(t, ports...)
	return err
}

// LoadError is a load that Caddy's admin endpoint answered with another
// status than 200.
type LoadError struct {
	Status int
	Body   string
}

func (e *LoadError) Error() string { return fmt.Sprintf("%d: %s", e.Status, e.Body) }

// Post posts cfg ("caddyfile" or "json") to the /load endpoint of the admin
// listener on localhost:adminPort and returns the error Caddy reports (a
// *LoadError), or the request's. It does not wait for the old config's
// sockets to close (Settle does), and it touches no testing.TB, so a test
// may run it in a goroutine of its own (a reload that waits for a request
// in flight).
func Post(adminPort int, cfg, adapter string) error {
	ct := "application/json"
	if adapter == "caddyfile" {
		ct = "text/caddyfile"
	}
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", adminPort), strings.NewReader(cfg))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", ct)
	req.Header.Set("Cache-Control", "must-revalidate")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return &LoadError{Status: resp.StatusCode, Body: string(body)}
	}
	return nil
}

// Do sends req with c and returns the answer's status and body; it fails
// the test if there is no answer.
func Do(t testing.TB, c *http.Client, req *http.Request) (int, string, *http.Response) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body), resp
}

// Settle waits until none of ports has more than one listening socket.
// Caddy listens with SO_REUSEPORT: a load opens the new config's sockets
// beside the old ones, and the replaced HTTP servers and admin endpoint (or
// the servers of a config that failed to start) close theirs in goroutines,
// after /load has answered. Until then the kernel hands some new connections
// to an old socket, where the old config answers them or its closing resets
// them. /load answers after the new sockets listen, so nothing else needs
// waiting for.
func Settle(t testing.TB, ports ...int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		port, n := 0, 0
		for _, p := range ports {
			c, err := Listening(p)
			if err != nil {
				t.Fatalf("counting the sockets listening on port %d: %v", p, err)
			}
			if c > 1 {
				port, n = p, c
			}
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s after a config load, %d sockets still listen on port %d", n, port)
		}
		time.Sleep(time.Millisecond) // Caddy's goroutines closing sockets, not a rate
	}
}

// Listening returns how many TCP sockets of this network namespace listen on
// port, IPv4 and IPv6 (Linux only, as are the 127.0.0.0/8 client addresses
// the tests use).
func Listening(port int) (int, error) {
	n := 0
	for _, file := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		table, err := os.ReadFile(file)
		if err != nil {
			return 0, err
		}
		// sl local_address rem_address st ...; addresses are HEXIP:HEXPORT,
		// state 0A is LISTEN.
		for _, line := range strings.Split(string(table), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) < 4 || f[3] != "0A" {
				continue
			}
			p, err := strconv.ParseUint(f[1][strings.LastIndexByte(f[1], ':')+1:], 16, 16)
			if err != nil {
				return 0, fmt.Errorf("%s: %q: %v", file, line, err)
			}
			if int(p) == port {
				n++
			}
		}
	}
	return n, nil
}

func init() {
	caddy.RegisterModule(recorder{})
}

// recorder is the events handler `floodgate_test_recorder`, which keeps the
// data of every event it is given (see Events).
type recorder struct{}

var recorded struct {
	sync.Mutex
	events []map[string]any
}

func (recorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "events.handlers.floodgate_test_recorder",
		New: func() caddy.Module { return new(recorder) },
	}
}

func (recorder) Handle(_ context.Context, e caddy.Event) error {
	recorded.Lock()
	defer recorded.Unlock()
	data := map[string]any{"event": e.Name()}
	for k, v := range e.Data {
		data[k] = v
	}
	recorded.events = append(recorded.events, data)
	return nil
}

// Events returns the data of the events recorded since the last call (with
// the event's name under "event"), and forgets them.
func Events() []map[string]any {
	recorded.Lock()
	defer recorded.Unlock()
	e := recorded.events
	recorded.events = nil
	return e
}

// Main runs a test package's tests against an in-process Caddy whose admin
// endpoint listens on localhost:adminPort, and returns m.Run's code. The
// instance ID and autosave go to a temporary directory (named after name)
// instead of $HOME. No client of the process keeps a connection alive: one
// kept from before a config load would reach a server the load shut down
// (reset, EOF, or an answer from the old config). Caddy is started here
// rather than by caddytest's first InitServer, which polls for it once a
// second for at most 10 s: on a loaded machine that was not always enough.
func Main(m *testing.M, name string, adminPort int) int {
	dir, err := os.MkdirTemp("", "floodgate-"+name+"-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	os.Setenv("XDG_DATA_HOME", dir)
	os.Setenv("XDG_CONFIG_HOME", dir)
	http.DefaultTransport.(*http.Transport).DisableKeepAlives = true
	admin := fmt.Sprintf(`{"admin": {"listen": "localhost:%d", "config": {"persist": false}}}`, adminPort)
	if err := caddy.Load([]byte(admin), false); err != nil {
		fmt.Fprintln(os.Stderr, "starting Caddy:", err)
		return 1
	}
	defer caddy.Stop()
	return m.Run()
}

// Globals returns the global options block of a test config on the given
// ports, with extra options inside it.
func Globals(adminPort, httpPort, httpsPort int, extra string) string {
	return fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	http_port %d
	https_port %d
	grace_period 1ns
	persist_config off
	%s
}
`, adminPort, httpPort, httpsPort, extra)
}

// FreePorts returns n distinct TCP ports that were free a moment ago, for a
// test package's Caddy (admin, HTTP, HTTPS, …) or redis-server, and that no
// other process calling FreePorts gets while this one runs. Two copies of
// the suite on one machine thus get different ports, where fixed ones
// collided.
//
// The ports are below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range), where a port the kernel picked (port 0)
// would be: a test opens a connection per request, and one of them can take
// the server's port as its own local port while a config load has the
// server's socket closed, so that the next load fails with "address already
// in use". A port is free if a lock file of its own (in the temporary
// directory) can be locked, and held until the process exits, and the port
// can be listened on, on every interface as Caddy does.
func FreePorts(n int) ([]int, error) {
	lo, hi := 10000, ephemeralStart()
	if hi-lo < 1000 {
		return nil, fmt.Errorf("finding a free port: the ephemeral range starts at %d, leaving too few ports above %d", hi, lo)
	}
	dir := filepath.Join(os.TempDir(), "floodgate-ports")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return nil, fmt.Errorf("finding a free port: %w", err)
	}
	ports := make([]int, 0, n)
	for tries := 0; len(ports) < n; tries++ {
		if tries == 1000 {
			return nil, fmt.Errorf("finding a free port: none of 1000 tried between %d and %d was", lo, hi)
		}
		p := lo + rand.IntN(hi-lo)
		if claim(dir, p) {
			ports = append(ports, p)
		}
	}
	return ports, nil
}

// claim locks port p's file in dir for the rest of the process, if no one
// holds it, and reports whether it did and p can be listened on. The file
// stays open (a lock lives as long as its descriptor) unless the port is not
// taken.
func claim(dir string, p int) bool {
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(p)), os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return false
	}
	if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
		f.Close()
		return false
	}
	l, err := net.Listen("tcp", fmt.Sprintf(":%d", p))
	if err != nil {
		f.Close()
		return false
	}
	l.Close()
	claimed.Lock()
	claimed.files = append(claimed.files, f)
	claimed.Unlock()
	return true
}

// claimed holds the lock files of the ports FreePorts returned.
var claimed struct {
	sync.Mutex
	files []*os.File
}

// ephemeralStart is the first port of the kernel's ephemeral range.
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 32768
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return n
}

// WithPorts returns s, a config or URL written for any test package, with
// ADMIN_PORT, HTTP_PORT and HTTPS_PORT replaced by the given ports.
func WithPorts(s string, adminPort, httpPort, httpsPort int) string {
	return strings.NewReplacer(
		"ADMIN_PORT", strconv.Itoa(adminPort),
		"HTTPS_PORT", strconv.Itoa(httpsPort),
		"HTTP_PORT", strconv.Itoa(httpPort),
	).Replace(s)
}

// MustFreePorts is FreePorts for a TestMain: it exits the process, saying
// why, if no port can be had.
func MustFreePorts(n int) []int {
	p, err := FreePorts(n)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	return p
}
