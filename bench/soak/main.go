// Command soak runs three Caddy instances with floodgate on loopback, sharing
// a real redis-server, under fair clients and floods, while it reloads their
// configs every 2–5 s, SIGKILLs and restarts one instance every minute and
// restarts redis-server once. Every 10 s it records each instance's resident
// memory, goroutines and open descriptors, the statuses answered, the fair
// clients' success rate and the cluster's allowed ÷ limit for a key spread
// over all three instances; at the end it checks them against the
// thresholds of the issue that asked for it and exits non-zero if any fails.
//
//	go build -o /tmp/caddy ./cmd/caddy   # from the repository root
//	cd bench/soak && go run . -caddy /tmp/caddy -duration 10m -out soak.csv
//
// Everything runs on 127.0.0.0/8 on free ports; every loop stops with the
// run. It needs redis-server on PATH.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/floodgate-rl/floodgate/bench/perf/proc"
)

var (
	caddyBin = flag.String("caddy", "", "Caddy built with floodgate and caddy.storage.redis (go build ./cmd/caddy)")
	duration = flag.Duration("duration", 10*time.Minute, "how long to run")
	out      = flag.String("out", "", "write the samples as CSV here")
	killN    = flag.Duration("kill-every", time.Minute, "SIGKILL and restart instance 2 this often")
	sample   = flag.Duration("sample", 10*time.Second, "record every")
)

// Limits of the spread zone: one key over its limit on every instance.
const (
	spreadEvents = 600
	spreadWindow = time.Minute
)

func main() {
	flag.Parse()
	if *caddyBin == "" {
		fmt.Fprintln(os.Stderr, "soak: -caddy is required")
		os.Exit(2)
	}
	ok, err := run()
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		os.Exit(1)
	}
	if !ok {
		os.Exit(1)
	}
}

type instance struct {
	i               int
	home            string
	admin, http, l4 int
	redis           int
	mu              sync.Mutex
	cmd             *exec.Cmd
	done            chan struct{}
	variant         int
	reloads, failed atomic.Int64
	// life is held by a reload and by a kill and restart, so that a
	// reload never meets an instance being killed.
	life sync.Mutex
}

func (in *instance) caddyfile(variant int) string {
	// Variants 0 and 1 lower and raise every zone's limit but the spread
	// zone's, whose ratio to its limit is what the run measures.
	f := []int{1, 2}[variant]
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	default_bind 127.0.0.1
	auto_https off
	persist_config off
	grace_period 2s
	storage redis {
		address 127.0.0.1:%d
		key_prefix soak
		timeout 1
	}
	rate_limit {
		zone spread {
			key {http.request.header.X-Spread}
			events %d
			window %s
			burst %d
			memory 256KiB
		}
		zone spreadwin {
			key {http.request.header.X-Spread}
			events %d
			window %s
			memory 256KiB
		}
		distributed {
			read_interval 500ms
			write_interval 500ms
		}
	}
	layer4 {
		127.0.0.1:%d {
			@flood rate_limit {
				events %d
				window 1s
				burst %d
				ipv4_prefix 32
				memory 256KiB
			}
			route @flood {
				close
			}
			route {
				echo
			}
		}
	}
}

http://127.0.0.1:%d {
	handle /fair {
		rate_limit {
			zone fair {
				key {http.request.header.X-Client}
				events %d
				window 10s
				burst %d
				quota %d 1h
				memory 256KiB
			}
		}
		respond "fair"
	}
	handle /weighted {
		rate_limit {
			zone weighted {
				key {http.request.header.X-Client}
				events %d
				window 10s
				burst %d
				weight {http.request.header.X-Cost}
				weight response_header X-Resp-Cost
				memory 256KiB
			}
		}
		header X-Resp-Cost 3
		respond "weighted"
	}
	handle /delay {
		rate_limit {
			zone held {
				key {http.request.header.X-Client}
				events %d
				window 1s
				burst 5
				action delay 500ms
				memory 256KiB
			}
		}
		respond "delayed"
	}
	handle /log {
		rate_limit {
			zone dry {
				key {http.request.header.X-Key}
				events 1
				window 1m
				burst 1
				action log
				memory 256KiB
			}
		}
		respond "logged"
	}
	handle /bytes {
		rate_limit {
			zone bytes {
				key {client_ip}
				events 1000000
				window 1s
				burst 1048576
				weight response_bytes
				memory 256KiB
			}
		}
		respond "0123456789abcdef0123456789abcdef"
	}
	handle /flood {
		rate_limit {
			zone keys {
				key {http.request.header.X-Key}
				events %d
				window 1m
				burst %d
				memory 1MiB
			}
		}
		respond "flood"
	}
	handle /addr {
		rate_limit {
			zone addrs {
				key {client_ip}
				events %d
				window 10s
				burst %d
				ipv4_prefix 32
				memory 1MiB
			}
		}
		respond "addr"
	}
	handle /plain {
		respond "plain"
	}
	handle /spread {
		rate_limit spread
		respond "spread"
	}
	handle /spreadwin {
		rate_limit spreadwin
		respond "spreadwin"
	}
	handle_errors 429 {
		respond "slow down" 429
	}
}
`, in.admin, in.redis, spreadEvents, spreadWindow, spreadEvents, spreadEvents, spreadWindow, in.l4, 2*f, 3*f, in.http,
		100*f, 50*f, 10000*f, 1000*f, 1000*f, 20*f, 5*f, 5*f, 2*f, 2*f)
}

// start runs the instance's Caddy and waits until its HTTP port answers.
func (in *instance) start() error {
	in.mu.Lock()
	body := in.caddyfile(in.variant)
	in.mu.Unlock()
	if err := os.MkdirAll(in.home, 0o700); err != nil {
		return err
	}
	cfg := filepath.Join(in.home, "Caddyfile")
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(in.home, "caddy.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	cmd := exec.Command(*caddyBin, "run", "--config", cfg, "--adapter", "caddyfile")
	cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+in.home, "XDG_CONFIG_HOME="+in.home, "HOME="+in.home)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return err
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(done) }()
	in.mu.Lock()
	in.cmd, in.done = cmd, done
	in.mu.Unlock()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			log, _ := os.ReadFile(filepath.Join(in.home, "caddy.log"))
			return fmt.Errorf("instance %d exited at start:\n%s", in.i, log[max(0, len(log)-2000):])
		default:
		}
		if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", in.http), 200*time.Millisecond); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("instance %d did not listen within 30 s", in.i)
}

func (in *instance) kill() {
	in.mu.Lock()
	cmd, done := in.cmd, in.done
	in.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

func (in *instance) pid() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.cmd == nil || in.cmd.Process == nil {
		return 0
	}
	return in.cmd.Process.Pid
}

// reload loads the other variant through the admin API.
func (in *instance) reload(c *http.Client) {
	in.life.Lock()
	defer in.life.Unlock()
	in.mu.Lock()
	in.variant ^= 1
	body := in.caddyfile(in.variant)
	in.mu.Unlock()
	req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://127.0.0.1:%d/load", in.admin), strings.NewReader(body))
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := c.Do(req)
	in.reloads.Add(1)
	if err != nil {
		in.failed.Add(1)
		fmt.Printf("soak: reload of instance %d: %v\n", in.i, err)
		return
	}
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 2000))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		in.failed.Add(1)
		fmt.Printf("soak: reload of instance %d: %d %s\n", in.i, resp.StatusCode, msg)
	}
}

// procStats reads resident memory (bytes) and open descriptors of pid.
func procStats(pid int) (rss int64, fds int) {
	if pid == 0 {
		return 0, 0
	}
	return proc.RSS(pid), proc.FDs(pid)
}

// goroutines asks the admin endpoint's pprof for the goroutine count.
func goroutines(c *http.Client, admin int) int {
	resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/debug/pprof/goroutine?debug=1", admin))
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	n, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "goroutine profile: total")))
	return n
}

// counters of one sampling interval, swapped out at each sample.
type counters struct {
	fairOK, fairAll   atomic.Int64
	other             atomic.Int64 // statuses besides 200 and 429 (fair: besides 200)
	dropped           atomic.Int64 // transport errors on instances not being killed
	droppedPlain      atomic.Int64 // of those, on the route without a limit
	droppedAddr       atomic.Int64 // and on the limited route with as many requests
	droppedLayer4     atomic.Int64 // connections to the layer4 server not made
	droppedPlainKept  atomic.Int64 // on the route without a limit, kept-alive connections
	droppedKilled     atomic.Int64 // on the instance that is killed
	heavyOK, heavyAll atomic.Int64 // one client far over its limit
	spreadOK          atomic.Int64
	spreadWinOK       atomic.Int64
	floodOK, floodAll atomic.Int64
	l4Conns, l4Closed atomic.Int64
}

// How a request that failed was sent: on a kept-alive connection or a new
// one, to a limited route or the plain one; or a connection to the layer4
// server that could not be made.
type sentAs int

const (
	keptLimited sentAs = iota
	keptPlain
	freshLimited
	freshPlain
	freshLayer4
)

// drop counts a request that failed on instance i (2 is the one killed), by
// how it was sent. A connection to the layer4 server has a count of its own:
// it is not a request to /addr, whose count is compared with /plain's at as
// many requests.
func (c *counters) drop(i int, as sentAs) {
	if i == 2 {
		c.droppedKilled.Add(1)
		return
	}
	c.dropped.Add(1)
	switch as {
	case freshPlain:
		c.droppedPlain.Add(1)
	case freshLimited:
		c.droppedAddr.Add(1)
	case freshLayer4:
		c.droppedLayer4.Add(1)
	case keptPlain:
		c.droppedPlainKept.Add(1)
	}
}

// twins are the routes of the requests sent in pairs on new connections:
// each request to the limited route has a twin to the route without a
// limit.
var twins = [2]struct {
	path string
	as   sentAs
}{{"/addr", freshLimited}, {"/plain", freshPlain}}

// sendTwins sends a request to each of twins at the same moment, calling
// send with its index, path and kind in a goroutine of its own, and returns
// once both are answered. A reload resets the new connections its old
// server holds before reading their requests, whatever their route: twins
// sent together to one instance meet every reload together, so the two
// routes' drops differ only by the chance of each connection (which socket
// the kernel gives it). Sent in turn by clients ticking together, on a
// sequence per client, both clients sent /addr on one tick and /plain on
// the next for long stretches, and a reload that caught both connections of
// a tick dropped two of one route: one chance counted twice against it.
func sendTwins(send func(i int, path string, as sentAs)) {
	var wg sync.WaitGroup
	for i, t := range twins {
		wg.Go(func() { send(i, t.path, t.as) })
	}
	wg.Wait()
}

// runOver reports whether the run, whose context is ctx, has ended: a
// request it cuts is neither served nor refused. Its deadline counts as its
// end before ctx says so: a dial that the deadline cuts fails with "i/o
// timeout" while ctx.Err() may still be nil (its timer has not run yet; a
// probe of 100 such dials saw it in 71). Two 10-minute runs each had a
// layer4 dial fail so in their last 10 s, and one was counted as a drop.
func runOver(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	end, ok := ctx.Deadline()
	return ok && !time.Now().Before(end)
}

type redisServer struct {
	port int
	dir  string
	cmd  *exec.Cmd
	done chan struct{}
}

func (r *redisServer) start() error {
	r.cmd = exec.Command("redis-server", "--port", strconv.Itoa(r.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", r.dir)
	if err := r.cmd.Start(); err != nil {
		return err
	}
	r.done = make(chan struct{})
	go func() { _ = r.cmd.Wait(); close(r.done) }()
	for range 100 {
		if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", r.port), 100*time.Millisecond); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("redis-server did not listen")
}

func (r *redisServer) stop() {
	_ = r.cmd.Process.Signal(syscall.SIGKILL)
	<-r.done
}

type sampleRow struct {
	t                          time.Duration
	rss                        [3]int64
	gor, fds                   [3]int
	other, dropped, dropKilled int64
	fair                       float64
	// cluster is the spread key's worst interval ending in this sample:
	// allowed in it ÷ what the token bucket promises for it, burst +
	// rate × its length (see bucketExcess); clusterN and clusterSpan are
	// that interval's grants and length.
	cluster     float64
	clusterN    int
	clusterSpan time.Duration
	window      float64 // the bucket's: allowed in the trailing window ÷ events, for reference
	// windowSpan is the window zone's (spreadwin) most grants in any
	// span of its window ending in this sample, ÷ its events.
	windowSpan                float64
	droppedPlain, droppedAddr int64
	droppedLayer4             int64
	droppedPlainKept          int64
	heavyOK, heavyAll         int64
	floodOK, floodAll         int64
	l4Conns, l4Closed         int64
	reloads, reloadFails      int64
}

func run() (bool, error) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		return false, errors.New("redis-server is not on PATH")
	}
	tmp, err := os.MkdirTemp("", "floodgate-soak-")
	if err != nil {
		return false, err
	}
	defer os.RemoveAll(tmp)
	ports, err := proc.FreePorts(10)
	if err != nil {
		return false, err
	}
	rd := &redisServer{port: ports[9], dir: tmp}
	if err := rd.start(); err != nil {
		return false, err
	}
	defer func() { rd.stop() }()
	ins := make([]*instance, 3)
	for i := range ins {
		ins[i] = &instance{i: i, home: filepath.Join(tmp, fmt.Sprintf("node%d", i)),
			admin: ports[3*i], http: ports[3*i+1], l4: ports[3*i+2], redis: rd.port}
	}
	defer func() {
		for _, in := range ins {
			in.kill()
		}
	}()
	for _, in := range ins {
		if err := in.start(); err != nil {
			return false, err
		}
	}
	fmt.Printf("soak: %v, instances on HTTP %d %d %d, redis %d, logs under %s\n", *duration, ins[0].http, ins[1].http, ins[2].http, rd.port, tmp)

	ctx, cancel := context.WithTimeout(context.Background(), *duration)
	defer cancel()
	var cur atomic.Pointer[counters]
	cur.Store(new(counters))
	var killing atomic.Int32 // 1 while instance 2 is down or starting
	var wg sync.WaitGroup
	loop := func(every time.Duration, f func(*rand.Rand)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(rand.Uint64(), 1))
			t := time.NewTicker(every)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					f(rng)
				}
			}
		}()
	}
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	get := func(client *http.Client, in *instance, path string, hdr map[string]string) (int, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d%s", in.http, path), nil)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := client.Do(req)
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	dropped := func(c *counters, in *instance, err error, as sentAs) {
		if runOver(ctx) {
			return
		}
		c.drop(in.i, as)
		if in.i != 2 {
			fmt.Printf("soak: dropped on instance %d: %v\n", in.i, err)
		}
	}
	// tally counts an answer to a request that may be denied: a drop, a
	// grant (in the counter granted picks, if any), a 429, or any other
	// status. It reports a grant.
	tally := func(in *instance, code int, err error, as sentAs, granted func(*counters) *atomic.Int64) bool {
		c := cur.Load()
		switch {
		case err != nil:
			dropped(c, in, err, as)
		case code == http.StatusOK:
			if granted != nil {
				granted(c).Add(1)
			}
			return true
		case code != http.StatusTooManyRequests:
			c.other.Add(1)
		}
		return false
	}
	flood := func(c *counters) *atomic.Int64 { return &c.floodOK }
	// Fair clients: under every limit in both variants, on the instances
	// that are never killed. Each asks 2 times a second, round the paths.
	paths := []string{"/fair", "/weighted", "/delay", "/log", "/bytes"}
	for f := range 6 {
		id := fmt.Sprintf("fair-%d", f)
		n := 0
		loop(500*time.Millisecond, func(rng *rand.Rand) {
			in := ins[f%2]
			p := paths[n%len(paths)]
			n++
			code, err := get(client, in, p, map[string]string{"X-Client": id, "X-Cost": strconv.Itoa(1 + rng.IntN(3)), "X-Key": id})
			if err != nil && runOver(ctx) {
				return // cut by the end of the run, not answered: not a request served or refused
			}
			c := cur.Load()
			c.fairAll.Add(1)
			switch {
			case err != nil:
				dropped(c, in, err, keptLimited)
			case code == http.StatusOK:
				c.fairOK.Add(1)
			default:
				c.other.Add(1)
				fmt.Printf("soak: fair client %s got %d on %s from instance %d\n", id, code, p, in.i)
			}
		})
	}
	// A flood of distinct keys, on every instance.
	for range 2 {
		loop(10*time.Millisecond, func(rng *rand.Rand) {
			in := ins[rng.IntN(3)]
			code, err := get(client, in, "/flood", map[string]string{"X-Key": strconv.FormatUint(rng.Uint64(), 36)})
			cur.Load().floodAll.Add(1)
			tally(in, code, err, keptLimited, flood)
		})
	}
	// As many requests on kept-alive connections to a route without a
	// limit: what plain Caddy drops when a reload closes a connection a
	// request is being sent on.
	for range 2 {
		loop(10*time.Millisecond, func(rng *rand.Rand) {
			in := ins[rng.IntN(2)]
			code, err := get(client, in, "/plain", nil)
			tally(in, code, err, keptPlain, nil)
		})
	}
	// A flood of source addresses across 127.0.0.0/8: a new connection
	// from a random address for every request, to HTTP and to layer4.
	addrClient := func(rng *rand.Rand) *http.Client {
		src := &net.TCPAddr{IP: net.IPv4(127, byte(rng.IntN(256)), byte(rng.IntN(256)), byte(1+rng.IntN(254)))}
		d := &net.Dialer{LocalAddr: src, Timeout: 2 * time.Second}
		return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
	}
	// Every request to the limited route has a twin to a route without a
	// limit, sent at the same moment to the same instance: what plain
	// Caddy drops across the same reloads, beside what the limited route
	// drops. Two clients, each sending a pair every 20 ms: 100 requests a
	// second to each route.
	for range 2 {
		loop(20*time.Millisecond, func(rng *rand.Rand) {
			in := ins[rng.IntN(2)]
			clients := [len(twins)]*http.Client{addrClient(rng), addrClient(rng)}
			sendTwins(func(i int, path string, as sentAs) {
				code, err := get(clients[i], in, path, nil)
				cur.Load().floodAll.Add(1)
				tally(in, code, err, as, flood)
			})
		})
	}
	loop(10*time.Millisecond, func(rng *rand.Rand) {
		in := ins[rng.IntN(2)]
		// A few sources repeat, so the layer4 limit closes some.
		src := &net.TCPAddr{IP: net.IPv4(127, 1, byte(rng.IntN(4)), byte(1+rng.IntN(4)))}
		d := &net.Dialer{LocalAddr: src, Timeout: 2 * time.Second}
		conn, err := d.DialContext(ctx, "tcp", fmt.Sprintf("127.0.0.1:%d", in.l4))
		c := cur.Load()
		if err != nil {
			dropped(c, in, err, freshLayer4)
			return
		}
		defer conn.Close()
		c.l4Conns.Add(1)
		_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := conn.Write([]byte("ping\n")); err != nil {
			c.l4Closed.Add(1)
			return
		}
		buf := make([]byte, 5)
		if _, err := io.ReadFull(conn, buf); err != nil {
			c.l4Closed.Add(1)
		}
	})
	// One client far over its limit.
	loop(20*time.Millisecond, func(rng *rand.Rand) {
		in := ins[rng.IntN(2)]
		code, err := get(client, in, "/fair", map[string]string{"X-Client": "heavy"})
		cur.Load().heavyAll.Add(1)
		tally(in, code, err, keptLimited, func(c *counters) *atomic.Int64 { return &c.heavyOK })
	})
	// The spread keys: over their limits, round all three instances, one
	// to a token-bucket zone, one to a window zone.
	sendRound := func(path string, ok func(c *counters) *atomic.Int64) *grantLog {
		g := new(grantLog)
		var n atomic.Int64
		loop(20*time.Millisecond, func(rng *rand.Rand) {
			in := ins[n.Add(1)%3]
			if in.i == 2 && killing.Load() == 1 {
				return
			}
			code, err := get(client, in, path, map[string]string{"X-Spread": "spread"})
			if tally(in, code, err, keptLimited, ok) {
				g.mu.Lock()
				g.times = append(g.times, time.Now())
				g.mu.Unlock()
			}
		})
		return g
	}
	spread := sendRound("/spread", func(c *counters) *atomic.Int64 { return &c.spreadOK })
	win := sendRound("/spreadwin", func(c *counters) *atomic.Int64 { return &c.spreadWinOK })
	// Reloads every 2–5 s, each instance in turn.
	admin := &http.Client{Timeout: 20 * time.Second}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 0; ; n++ {
			select {
			case <-ctx.Done():
				return
			case <-time.After(2*time.Second + rand.N(3*time.Second)):
			}
			in := ins[n%3]
			if in.i == 2 && killing.Load() == 1 {
				continue
			}
			in.reload(admin)
		}
	}()
	// SIGKILL and restart instance 2 every kill-every; redis-server
	// restarted once, at 40% of the run.
	wg.Add(1)
	go func() {
		defer wg.Done()
		kills := time.NewTicker(*killN)
		defer kills.Stop()
		redisAt := time.After(*duration * 2 / 5)
		for {
			select {
			case <-ctx.Done():
				return
			case <-kills.C:
				ins[2].life.Lock()
				killing.Store(1)
				ins[2].kill()
				fmt.Printf("soak: killed instance 2 at %v\n", time.Since(startTime).Round(time.Second))
				if err := ins[2].start(); err != nil {
					fmt.Println("soak:", err)
				}
				killing.Store(0)
				ins[2].life.Unlock()
			case <-redisAt:
				rd.stop()
				time.Sleep(time.Second)
				if err := rd.start(); err != nil {
					fmt.Println("soak: redis restart:", err)
				}
				fmt.Printf("soak: restarted redis-server at %v\n", time.Since(startTime).Round(time.Second))
			}
		}
	}()

	var rows []sampleRow
	tick := time.NewTicker(*sample)
	stats := &http.Client{Timeout: 5 * time.Second}
sampling:
	for {
		select {
		case <-ctx.Done():
			break sampling
		case <-tick.C:
		}
		c := cur.Swap(new(counters))
		r := sampleRow{t: time.Since(startTime).Round(time.Second)}
		for i, in := range ins {
			r.rss[i], r.fds[i] = procStats(in.pid())
			r.gor[i] = goroutines(stats, in.admin)
		}
		r.other, r.dropped, r.dropKilled = c.other.Load(), c.dropped.Load(), c.droppedKilled.Load()
		r.droppedPlain, r.droppedAddr = c.droppedPlain.Load(), c.droppedAddr.Load()
		r.droppedPlainKept, r.droppedLayer4 = c.droppedPlainKept.Load(), c.droppedLayer4.Load()
		r.heavyOK, r.heavyAll = c.heavyOK.Load(), c.heavyAll.Load()
		r.fair = 1
		if n := c.fairAll.Load(); n > 0 {
			r.fair = float64(c.fairOK.Load()) / float64(n)
		}
		spread.mu.Lock()
		r.cluster, r.clusterN, r.clusterSpan = bucketExcess(spread.times, spread.checked, spreadEvents, spreadEvents, spreadWindow)
		spread.checked = len(spread.times)
		// Allowed for the spread key in the trailing window ÷ its events.
		cut := time.Now().Add(-spreadWindow)
		k := len(spread.times)
		for k > 0 && !spread.times[k-1].Before(cut) {
			k--
		}
		r.window = float64(len(spread.times)-k) / spreadEvents
		spread.mu.Unlock()
		win.mu.Lock()
		r.windowSpan = float64(mostInASpan(win.times, win.checked, spreadWindow)) / spreadEvents
		win.checked = len(win.times)
		win.mu.Unlock()
		r.floodOK, r.floodAll = c.floodOK.Load(), c.floodAll.Load()
		r.l4Conns, r.l4Closed = c.l4Conns.Load(), c.l4Closed.Load()
		for _, in := range ins {
			r.reloads += in.reloads.Load()
			r.reloadFails += in.failed.Load()
		}
		rows = append(rows, r)
		fmt.Printf("%5v rss MiB %5.1f %5.1f %5.1f  goroutines %4d %4d %4d  fds %3d %3d %3d  other %d dropped %d (plain %d+%d, killed instance %d)  fair %.4f  heavy %d/%d  cluster %.3f (%d in %v; window %.3f)  window zone %.3f  flood %d/%d  l4 %d closed %d  reloads %d failed %d\n",
			r.t, mib(r.rss[0]), mib(r.rss[1]), mib(r.rss[2]), r.gor[0], r.gor[1], r.gor[2], r.fds[0], r.fds[1], r.fds[2],
			r.other, r.dropped, r.droppedPlain, r.droppedPlainKept, r.dropKilled, r.fair, r.heavyOK, r.heavyAll, r.cluster, r.clusterN, r.clusterSpan.Round(time.Millisecond), r.window, r.windowSpan, r.floodOK, r.floodAll, r.l4Conns, r.l4Closed, r.reloads, r.reloadFails)
	}
	cancel()
	wg.Wait()
	if *out != "" {
		if err := writeCSV(*out, rows); err != nil {
			return false, err
		}
	}
	return verdict(rows), nil
}

// A grantLog is every grant of a spread key, in order, and how many of
// them have been measured.
type grantLog struct {
	mu      sync.Mutex
	times   []time.Time
	checked int
}

// mostInASpan is the most grants (their times, in order) within a span of
// window, over the spans that end at grants from index from on.
func mostInASpan(grants []time.Time, from int, window time.Duration) int {
	most := 0
	for j, i := from, 0; j < len(grants); j++ {
		for grants[j].Sub(grants[i]) >= window {
			i++
		}
		most = max(most, j-i+1)
	}
	return most
}

// windowBound is what docs/cluster.md promises the window zone spreadwin
// in any span of its window, ÷ its events: 1.1 × events + 1, plus what the
// instances grant in a sync lag (write and read intervals, 1 s) at the
// rate the run sends it (every 20 ms).
const windowBound = 1.1 + (1+float64(time.Second/(20*time.Millisecond)))/spreadEvents

// bucketExcess measures grants (their times, in order) against what a
// token bucket of burst tokens refilled at events per window promises: in
// any interval, at most burst + events × its length ÷ window grants, the
// interval's first included. It returns the worst ratio of grants to that
// bound over the intervals that end at grants from index from on, with
// that interval's grants and length. (A zone whose policy is a window
// would be measured over windows anchored as the zone anchors them; the
// spread zone is a bucket.)
func bucketExcess(grants []time.Time, from int, burst, events int64, window time.Duration) (worst float64, n int, span time.Duration) {
	rate := float64(events) / float64(window)
	for j := from; j < len(grants); j++ {
		for i := 0; i <= j; i++ {
			d := grants[j].Sub(grants[i])
			if r := float64(j-i+1) / (float64(burst) + rate*float64(d)); r > worst {
				worst, n, span = r, j-i+1, d
			}
		}
	}
	return worst, n, span
}

var startTime = time.Now()

func mib(b int64) float64 { return float64(b) / (1 << 20) }

func writeCSV(path string, rows []sampleRow) error {
	var b strings.Builder
	b.WriteString("t_s,rss0,rss1,rss2,goroutines0,goroutines1,goroutines2,fds0,fds1,fds2,other,dropped,dropped_plain,dropped_plain_kept,dropped_killed,fair,heavy_ok,heavy_all,cluster,cluster_window,flood_ok,flood_all,l4_conns,l4_closed,reloads,reload_failures,cluster_grants,cluster_span_s,dropped_addr,dropped_layer4\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%.5f,%d,%d,%.4f,%.4f,%d,%d,%d,%d,%d,%d,%d,%.3f,%d,%d\n", int(r.t.Seconds()),
			r.rss[0], r.rss[1], r.rss[2], r.gor[0], r.gor[1], r.gor[2], r.fds[0], r.fds[1], r.fds[2],
			r.other, r.dropped, r.droppedPlain, r.droppedPlainKept, r.dropKilled, r.fair, r.heavyOK, r.heavyAll, r.cluster, r.window, r.floodOK, r.floodAll, r.l4Conns, r.l4Closed, r.reloads, r.reloadFails, r.clusterN, r.clusterSpan.Seconds(), r.droppedAddr, r.droppedLayer4)
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// verdict checks the thresholds and prints each: memory,
// goroutines and descriptors of the instances never killed flat (the last
// minute's mean within 10% of the second minute's, counts within 10% and
// 3; for runs shorter than 3 minutes, the last third against the second), no status besides 200
// and 429, nothing dropped by an instance that was not killed, fair clients
// at least 99% served, the cluster at most 1.1 times its limit, and the
// window zone at most windowBound in any span of its window.
func verdict(rows []sampleRow) bool {
	if len(rows) < 3 {
		fmt.Println("soak: too few samples to judge")
		return false
	}
	per := int(time.Minute / *sample)
	var early, late []sampleRow
	if len(rows) >= 3*per {
		early, late = rows[per:2*per], rows[len(rows)-per:]
	} else {
		third := len(rows) / 3
		early, late = rows[third:2*third], rows[2*third:]
	}
	ok := true
	check := func(name string, pass bool, format string, args ...any) {
		status := "ok  "
		if !pass {
			status, ok = "FAIL", false
		}
		fmt.Printf("soak: %s %-34s %s\n", status, name, fmt.Sprintf(format, args...))
	}
	for i := range 2 {
		// Counts of about 20 move by a few with the requests in flight
		// at the sample: they may grow by 3 beyond the 10%.
		for _, m := range []struct {
			name  string
			v     func(sampleRow) float64
			slack float64
		}{
			{"resident memory (MiB)", func(r sampleRow) float64 { return mib(r.rss[i]) }, 0},
			{"goroutines", func(r sampleRow) float64 { return float64(r.gor[i]) }, 3},
			{"open descriptors", func(r sampleRow) float64 { return float64(r.fds[i]) }, 3},
		} {
			e, l := mean(early, m.v), mean(late, m.v)
			check(fmt.Sprintf("instance %d %s flat", i, m.name), l <= e*1.1+m.slack, "%.1f then %.1f (%+.1f%%)", e, l, 100*(l/e-1))
		}
	}
	var other, dropped, plain, addr, layer4, plainKept, dropKilled int64
	worstFair, worstWindow, worstSpan, worst := 1.0, 0.0, 0.0, rows[0]
	for _, r := range rows {
		other += r.other
		dropped += r.dropped
		plain += r.droppedPlain
		addr += r.droppedAddr
		layer4 += r.droppedLayer4
		plainKept += r.droppedPlainKept
		dropKilled += r.dropKilled
		worstFair = min(worstFair, r.fair)
		worstWindow = max(worstWindow, r.window)
		worstSpan = max(worstSpan, r.windowSpan)
		if r.cluster > worst.cluster {
			worst = r
		}
	}
	last := rows[len(rows)-1]
	check("no status besides 200 and 429", other == 0, "%d", other)
	// Drops are compared with plain Caddy's under the same reloads, in
	// two kinds: a new connection per request (as many to /addr as to
	// /plain, and as many to the layer4 server), which a reload may reset
	// after the old server accepted it; and kept-alive connections
	// (/plain at the rate of the key flood's /flood), which a reload may
	// close as a request is sent on one. The allowance of 2 + 2× plain's
	// is for chance: drops are few and random.
	limitedKept := dropped - plain - addr - layer4 - plainKept
	check("no drop beyond plain Caddy's", addr <= 2+2*plain && layer4 <= 2+2*plain && limitedKept <= 2+2*plainKept,
		"new connections: /addr %d, layer4 %d, /plain %d; kept alive: limited routes %d, /plain %d (instance 2, killed: %d)",
		addr, layer4, plain, limitedKept, plainKept, dropKilled)
	check("fair clients served >= 99%", worstFair >= 0.99, "worst interval %.4f", worstFair)
	check("cluster allowed/limit <= 1.1", worst.cluster <= 1.1, "%.3f of burst + refill in the worst interval (%d granted in %v, at %v); worst trailing window %.3f of events",
		worst.cluster, worst.clusterN, worst.clusterSpan.Round(time.Millisecond), worst.t, worstWindow)
	check(fmt.Sprintf("window zone in any span <= %.3f", windowBound), worstSpan <= windowBound && worstSpan > 0,
		"%.3f of events in the worst span of %v (the cluster's sliding count, plus a sync lag's grants)", worstSpan, spreadWindow)
	check("reloads loaded", last.reloadFails == 0, "%d of %d failed", last.reloadFails, last.reloads)
	return ok
}

func mean(rows []sampleRow, v func(sampleRow) float64) float64 {
	s := 0.0
	for _, r := range rows {
		s += v(r)
	}
	return s / float64(len(rows))
}
