package caddytest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// slowUpstream is a real upstream on a loopback port picked at run time:
// every request to /slow waits until released (or until its own request is
// cancelled, which it reports on cancelled); /fast answers at once.
type slowUpstream struct {
	addr      string
	arrived   chan string // the X-Key of each /slow request, as it arrives
	cancelled chan string // the X-Key of each /slow request cancelled upstream
	release   chan struct{}
	srv       *http.Server
}

func newSlowUpstream(t *testing.T) *slowUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &slowUpstream{addr: ln.Addr().String(), arrived: make(chan string, 64), cancelled: make(chan string, 64), release: make(chan struct{})}
	u.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/slow" {
			fmt.Fprint(w, "fast")
			return
		}
		u.arrived <- r.Header.Get("X-Key") + r.Header.Get("X-N")
		select {
		case <-u.release:
			fmt.Fprint(w, "slow")
		case <-r.Context().Done():
			u.cancelled <- r.Header.Get("X-Key")
		}
	})}
	go func() { _ = u.srv.Serve(ln) }()
	t.Cleanup(func() {
		close(u.release)
		_ = u.srv.Close()
	})
	return u
}

// wait returns the next value of ch, failing the test after 10 s.
func wait(t *testing.T, ch chan string, what string) string {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
		return ""
	}
}

// inFlight sends GET path with key (and headers, "Name: value") in the
// background and returns a channel that gets its status (0 if the client's
// request failed).
func inFlight(ctx context.Context, t *testing.T, tc *tester, path, key string, headers ...string) chan int {
	t.Helper()
	req := testcaddy.Request(t, http.MethodGet, baseURL+path, append([]string{"X-Key: " + key}, headers...)...).WithContext(ctx)
	got := make(chan int, 1)
	go func() {
		resp, err := tc.Client.Do(req)
		if err != nil {
			got <- 0
			return
		}
		resp.Body.Close()
		got <- resp.StatusCode
	}()
	return got
}

func concurrentConfig(zone, upstream string, n int, extra string) string {
	return config("", fmt.Sprintf(`
	route {
		rate_limit {
			zone %s {
				key {header.X-Key}
				max_concurrent %d
			}
		}
		%s
		reverse_proxy %s
	}`, zone, n, extra, upstream))
}

// eventually retries GET /fast for key until it is served, for at most 5 s:
// the place of a request whose client went away comes back when Caddy's
// handler returns, a moment after the client sees its connection closed.
// A place that never comes back fails the test.
func eventually(t *testing.T, tc *tester, key string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		code, _, _ := get(t, tc, "/fast", "X-Key: "+key)
		if code == http.StatusOK {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("key %s still gets %d 5 s after its requests ended: a place was not given back", key, code)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestMaxConcurrentDeniesTheRequestBeyondN(t *testing.T) {
	tc := newTester(t)
	u := newSlowUpstream(t)
	tc.InitServer(concurrentConfig("conc_n", u.addr, 2, ""), "caddyfile")
	ctx := context.Background()
	a1, a2 := inFlight(ctx, t, tc, "/slow", "a"), inFlight(ctx, t, tc, "/slow", "a")
	wait(t, u.arrived, "a's first request upstream")
	wait(t, u.arrived, "a's second request upstream")
	code, _, resp := get(t, tc, "/slow", "X-Key: a")
	if code != http.StatusTooManyRequests {
		t.Fatalf("a's third request in flight: %d, want 429", code)
	}
	if ra := resp.Header.Get("Retry-After"); ra != "1" {
		t.Errorf("Retry-After %q, want 1 (no table knows when a request ends)", ra)
	}
	if p := resp.Header.Get("RateLimit-Policy"); p != `"conc_n-concurrent";q=2;qu="concurrent-requests"` {
		t.Errorf("RateLimit-Policy %q", p)
	}
	if l := resp.Header.Get("RateLimit"); l != `"conc_n-concurrent";r=0` {
		t.Errorf("RateLimit %q", l)
	}
	// The admin API and the CLI show the key's places and the zone's.
	out, err := testcaddy.RateLimit(t, adminPort, "key", "conc_n", "a")
	if err != nil || !strings.Contains(out, "concurrent (2 in flight)  2      0") {
		t.Errorf("caddy rate-limit key conc_n a: %v\n%s", err, out)
	}
	out, err = testcaddy.RateLimit(t, adminPort, "zones")
	if err != nil || !strings.Contains(out, "zone conc_n: max_concurrent 2: 2 in flight, 1 denied for want of a place") {
		t.Errorf("caddy rate-limit zones: %v\n%s", err, out)
	}
	b := inFlight(ctx, t, tc, "/slow", "b")
	select {
	case k := <-u.arrived:
		if k != "b" {
			t.Fatalf("upstream got %q, want b", k)
		}
	case c := <-b:
		t.Fatalf("b's request while a holds both its places: %d, want it served", c)
	case <-time.After(10 * time.Second):
		t.Fatal("timed out waiting for b's request upstream")
	}
	for range 3 {
		u.release <- struct{}{}
	}
	for _, ch := range []chan int{a1, a2, b} {
		if c := <-ch; c != http.StatusOK {
			t.Errorf("a request in flight ended with %d, want 200", c)
		}
	}
	// Both of a's places came back when its requests ended.
	a3, a4 := inFlight(ctx, t, tc, "/slow", "a"), inFlight(ctx, t, tc, "/slow", "a")
	wait(t, u.arrived, "a's request upstream")
	wait(t, u.arrived, "a's request upstream")
	u.release <- struct{}{}
	u.release <- struct{}{}
	if c1, c2 := <-a3, <-a4; c1 != 200 || c2 != 200 {
		t.Errorf("a after its requests ended: %d %d, want 200 200", c1, c2)
	}
}

func TestMaxConcurrentReleasesAClientThatWentAway(t *testing.T) {
	tc := newTester(t)
	u := newSlowUpstream(t)
	tc.InitServer(concurrentConfig("conc_gone", u.addr, 1, ""), "caddyfile")
	ctx, cancel := context.WithCancel(context.Background())
	got := inFlight(ctx, t, tc, "/slow", "a")
	wait(t, u.arrived, "a's request upstream")
	if code, _, _ := get(t, tc, "/fast", "X-Key: a"); code != http.StatusTooManyRequests {
		t.Fatalf("a's second request: %d, want 429", code)
	}
	cancel()
	<-got
	wait(t, u.cancelled, "the upstream request to be cancelled")
	eventually(t, tc, "a")
}

func TestMaxConcurrentReleasesOnAnUpstreamTimeout(t *testing.T) {
	tc := newTester(t)
	u := newSlowUpstream(t)
	tc.InitServer(config("", fmt.Sprintf(`
	route {
		rate_limit {
			zone conc_timeout {
				key {header.X-Key}
				max_concurrent 1
			}
		}
		reverse_proxy %s {
			transport http {
				response_header_timeout 200ms
			}
		}
	}`, u.addr)), "caddyfile")
	for i := range 3 {
		// Each request times out upstream (a 504) and gives its place
		// back before its answer is written: the next one is admitted.
		if code, _, _ := get(t, tc, "/slow", "X-Key: a"); code != http.StatusGatewayTimeout {
			t.Fatalf("request %d: %d, want 504 (a 429 means the place of a timed-out request was kept)", i+1, code)
		}
		wait(t, u.arrived, "the request upstream")
	}
}

func TestMaxConcurrentReleasesOnAHandlerError(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	route {
		rate_limit {
			zone conc_err {
				key {header.X-Key}
				max_concurrent 1
			}
		}
		error "boom" 503
	}`), "caddyfile")
	if got := codes(t, tc, 3, "/", "X-Key: a"); got != "503 503 503" {
		t.Errorf("statuses %s, want 503 503 503: an error must give the place back", got)
	}
}

// A request admitted under one config releases its place into the table
// the next config uses, and that config's new max_concurrent counts it.
func TestMaxConcurrentReleasesAcrossAReload(t *testing.T) {
	tc := newTester(t)
	u := newSlowUpstream(t)
	tc.InitServer(concurrentConfig("conc_reload", u.addr, 1, ""), "caddyfile")
	ctx := context.Background()
	old := inFlight(ctx, t, tc, "/slow", "a")
	wait(t, u.arrived, "a's request under the first config")
	tc.InitServer(concurrentConfig("conc_reload", u.addr, 2, ""), "caddyfile")
	second := inFlight(ctx, t, tc, "/slow", "a")
	wait(t, u.arrived, "a's request under the second config")
	if code, _, _ := get(t, tc, "/fast", "X-Key: a"); code != http.StatusTooManyRequests {
		t.Fatalf("a's third request: %d, want 429 (the first config's request still holds a place)", code)
	}
	u.release <- struct{}{}
	u.release <- struct{}{}
	if c1, c2 := <-old, <-second; c1 != 200 || c2 != 200 {
		t.Fatalf("the requests in flight: %d %d, want 200 200", c1, c2)
	}
	// Both places are back: two in flight again, and the third denied.
	var wg sync.WaitGroup
	var errs []error
	var mu sync.Mutex
	for range 2 {
		ch := inFlight(ctx, t, tc, "/slow", "a")
		wg.Go(func() {
			if c := <-ch; c != 200 {
				mu.Lock()
				errs = append(errs, fmt.Errorf("status %d", c))
				mu.Unlock()
			}
		})
	}
	wait(t, u.arrived, "a's request")
	wait(t, u.arrived, "a's request")
	if code, _, _ := get(t, tc, "/fast", "X-Key: a"); code != http.StatusTooManyRequests {
		t.Errorf("a's third request after the reload: %d, want 429", code)
	}
	u.release <- struct{}{}
	u.release <- struct{}{}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Error(err)
	}
}

// countingDialer counts the connections a client opens.
type countingDialer struct {
	mu sync.Mutex
	n  int
}

func (d *countingDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	d.mu.Lock()
	d.n++
	d.mu.Unlock()
	return (&net.Dialer{}).DialContext(ctx, network, addr)
}

// HTTP/2 streams on one connection are requests in flight one by one.
func TestMaxConcurrentCountsHTTP2StreamsOneByOne(t *testing.T) {
	tc := newTester(t)
	u := newSlowUpstream(t)
	tc.InitServer(testcaddy.Site(adminPort, httpPort, httpsPort, "servers {\n\t\tprotocols h1 h2c\n\t}", fmt.Sprintf(`
	rate_limit {
		zone conc_h2 {
			key {header.X-Key}
			max_concurrent 2
		}
	}
	reverse_proxy %s`, u.addr)), "caddyfile")
	dialer := &countingDialer{}
	tr := &http.Transport{DialContext: dialer.dial, Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	send := func(path string) chan *http.Response {
		ch := make(chan *http.Response, 1)
		go func() {
			resp, err := c.Do(testcaddy.Request(t, http.MethodGet, baseURL+path, "X-Key: a"))
			if err != nil {
				ch <- nil
				return
			}
			resp.Body.Close()
			ch <- resp
		}()
		return ch
	}
	s1 := send("/slow")
	wait(t, u.arrived, "the first stream upstream")
	s2 := send("/slow")
	wait(t, u.arrived, "the second stream upstream")
	third := <-send("/fast")
	if third == nil || third.StatusCode != http.StatusTooManyRequests || third.ProtoMajor != 2 {
		t.Fatalf("the third stream: %+v, want a 429 over HTTP/2", third)
	}
	u.release <- struct{}{}
	u.release <- struct{}{}
	for _, ch := range []chan *http.Response{s1, s2} {
		if r := <-ch; r == nil || r.StatusCode != http.StatusOK || r.ProtoMajor != 2 {
			t.Errorf("a stream in flight: %+v, want 200 over HTTP/2", r)
		}
	}
	// Both places are back: two more streams pass.
	for range 2 {
		if r := <-send("/fast"); r == nil || r.StatusCode != http.StatusOK {
			t.Errorf("a stream after the others ended: %+v, want 200", r)
		}
	}
	if dialer.n != 1 {
		t.Errorf("the client opened %d connections, want every stream on one", dialer.n)
	}
}

// A soak of clients that go away mid-request, on a few keys: the gauge of
// places in use goes back to 0 at rest, and no key is left locked out.
func TestMaxConcurrentGaugeReturnsToZeroAfterAbortedClients(t *testing.T) {
	tc := newTester(t)
	u := newSlowUpstream(t)
	tc.InitServer(concurrentConfig("conc_soak", u.addr, 3, ""), "caddyfile")
	const clients = 40
	var held []chan int // the admitted clients' answers
	var cancels []context.CancelFunc
	defer func() {
		for _, c := range cancels {
			c()
		}
	}()
	for i := range clients {
		ctx, cancel := context.WithCancel(context.Background())
		cancels = append(cancels, cancel)
		got := inFlight(ctx, t, tc, "/slow", fmt.Sprint("k", i%4))
		// Each key holds at most 3: a client is either upstream (admitted)
		// or answered 429 at once.
		select {
		case <-u.arrived:
			held = append(held, got)
		case c := <-got:
			if c != http.StatusTooManyRequests {
				t.Errorf("client %d: %d, want 429 or held upstream", i, c)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("client %d neither arrived upstream nor was answered", i)
		}
	}
	admitted := len(held)
	if admitted != 4*3 {
		t.Errorf("%d of %d clients admitted, want 3 for each of 4 keys", admitted, clients)
	}
	// Every client goes away mid-request at once.
	for _, c := range cancels {
		c()
	}
	for _, got := range held {
		<-got
	}
	for range admitted {
		wait(t, u.cancelled, "an upstream request to be cancelled")
	}
	metric := `caddy_rate_limit_in_flight_requests{zone="conc_soak"}`
	deadline := time.Now().Add(5 * time.Second)
	for {
		m := testcaddy.Metrics(t, adminPort)
		if !strings.Contains(m, metric) {
			t.Fatalf("/metrics has no %s", metric)
		}
		if v := testcaddy.MetricSum(m, metric); v == 0 {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("%s is %v 5 s after every client went away, want 0", metric, v)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for k := range 4 {
		if code, _, _ := get(t, tc, "/fast", fmt.Sprint("X-Key: k", k)); code != http.StatusOK {
			t.Errorf("key k%d at rest: %d, want 200", k, code)
		}
	}
	t.Logf("%d of %d clients admitted before going away", admitted, clients)
}

// A WebSocket holds its place while it is open, through reverse_proxy's
// hijacked connections, and gives it back when it closes.
func TestMaxConcurrentCountsAnOpenWebSocket(t *testing.T) {
	tc := newTester(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{}, 4)
	upstream := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "websocket" {
			fmt.Fprint(w, "fast")
			return
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		brw.Flush()
		// Echo until the client closes.
		buf := make([]byte, 64)
		for {
			n, err := brw.Read(buf)
			if err != nil {
				closed <- struct{}{}
				return
			}
			conn.Write(buf[:n])
		}
	})}
	go func() { _ = upstream.Serve(ln) }()
	defer upstream.Close()
	tc.InitServer(concurrentConfig("conc_ws", ln.Addr().String(), 1, ""), "caddyfile")
	open := func() net.Conn {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", httpPort))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(c, "GET /ws HTTP/1.1\r\nHost: localhost:%d\r\nX-Key: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", httpPort)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		return c
	}
	status := func(c net.Conn) string {
		buf := make([]byte, 12)
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatalf("reading the status line: %v", err)
		}
		return string(buf[9:12])
	}
	ws := open()
	if s := status(ws); s != "101" {
		t.Fatalf("the WebSocket's status: %s, want 101", s)
	}
	if code, _, _ := get(t, tc, "/fast", "X-Key: a"); code != http.StatusTooManyRequests {
		t.Fatalf("a request beside the open WebSocket: %d, want 429", code)
	}
	ws.Close()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the upstream never saw the WebSocket close")
	}
	eventually(t, tc, "a")
}

// With action delay, a request beyond max_concurrent waits for a place, up
// to max_delay, first come first served per key; one that would wait
// longer is denied.
func TestMaxConcurrentDelayWaitsForAPlaceInOrder(t *testing.T) {
	tc := newTester(t)
	u := newSlowUpstream(t)
	tc.InitServer(config("", fmt.Sprintf(`
	route /q/* {
		rate_limit {
			zone conc_delay {
				key {header.X-Key}
				max_concurrent 1
				action delay 10s
			}
		}
		uri strip_prefix /q
		reverse_proxy %s
	}
	route /short/* {
		rate_limit {
			zone conc_short {
				key {header.X-Key}
				max_concurrent 1
				action delay 100ms
			}
		}
		uri strip_prefix /short
		reverse_proxy %s
	}`, u.addr, u.addr)), "caddyfile")
	ctx := context.Background()
	send := func(prefix, n string) chan int { return inFlight(ctx, t, tc, prefix+"/slow", "a", "X-N: "+n) }
	first := send("/q", "1")
	if k := wait(t, u.arrived, "the first request"); k != "a1" {
		t.Fatalf("upstream got %q first, want a1", k)
	}
	second := send("/q", "2")
	// The second must be queued before the third is sent: it waits
	// without reaching the upstream, so wait until the zone counts it.
	waitQueued(t, "conc_delay", 1)
	third := send("/q", "3")
	waitQueued(t, "conc_delay", 2)
	for _, want := range []string{"a2", "a3"} {
		u.release <- struct{}{}
		if k := wait(t, u.arrived, "the next request in line"); k != want {
			t.Fatalf("upstream got %q, want %q: first come, first served", k, want)
		}
	}
	u.release <- struct{}{}
	for i, ch := range []chan int{first, second, third} {
		if c := <-ch; c != http.StatusOK {
			t.Errorf("request %d: %d, want 200", i+1, c)
		}
	}
	// A request that would wait longer than max_delay is denied.
	held := send("/short", "4")
	wait(t, u.arrived, "the request holding conc_short's place")
	start := time.Now()
	if code, _, _ := get(t, tc, "/short/fast", "X-Key: a"); code != http.StatusTooManyRequests {
		t.Errorf("a request beyond max_delay: %d, want 429", code)
	}
	if waited := time.Since(start); waited < 100*time.Millisecond {
		t.Errorf("denied after %v, before its max_delay of 100ms", waited)
	}
	u.release <- struct{}{}
	if c := <-held; c != http.StatusOK {
		t.Errorf("the held request: %d", c)
	}
}

// waitQueued waits, for at most 10 s, until zone has n requests waiting for
// a place, as the admin API tells.
func waitQueued(t *testing.T, zone string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	for {
		var zi struct {
			Concurrent *struct {
				Waiting int `json:"waiting"`
			} `json:"concurrent"`
		}
		testcaddy.JSON(t, c, testcaddy.Request(t, http.MethodGet, fmt.Sprintf("http://localhost:%d/rate_limit/zones/%s", adminPort, zone)), &zi)
		if zi.Concurrent != nil && zi.Concurrent.Waiting == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("zone %s: never %d waiting for a place", zone, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A reload that resizes a zone's table of places (memory) makes a new
// table, and the request admitted under the old config gives its place
// back there: the new table counts it meanwhile, so the key does not get
// max_concurrent in each, and its place is the key's again once it ends.
// With max_concurrent alone and beside a rate (whose table is resized
// too: the new one keeps the zone's secret, so the key hashes alike).
func TestMaxConcurrentCountsAcrossAReloadThatResizes(t *testing.T) {
	for _, rate := range []string{"", "events 100\n\t\t\t\twindow 1m"} {
		t.Run(fmt.Sprintf("rate %q", rate), func(t *testing.T) {
			tc := newTester(t)
			u := newSlowUpstream(t)
			resized := func(memory string) string {
				return config("", fmt.Sprintf(`
	route {
		rate_limit {
			zone conc_resize {
				key {header.X-Key}
				max_concurrent 1
				memory %s
				%s
			}
		}
		reverse_proxy %s
	}`, memory, rate, u.addr))
			}
			tc.InitServer(resized("64KiB"), "caddyfile")
			ctx := context.Background()
			old := inFlight(ctx, t, tc, "/slow", "a")
			wait(t, u.arrived, "a's request under the first config")
			tc.InitServer(resized("128KiB"), "caddyfile")
			if code, _, _ := get(t, tc, "/fast", "X-Key: a"); code != http.StatusTooManyRequests {
				t.Fatalf("a's second request after the reload that resized the table: %d, want 429 (the first config's request still holds its place)", code)
			}
			if code, _, _ := get(t, tc, "/fast", "X-Key: b"); code != http.StatusOK {
				t.Fatalf("b's request: %d, want 200", code)
			}
			u.release <- struct{}{}
			if c := <-old; c != 200 {
				t.Fatalf("the request in flight across the reload: %d, want 200", c)
			}
			eventually(t, tc, "a")
		})
	}
}

// A reload that gives a zone a new rate table (a burst added: windows
// become token buckets) keeps the zone's secret, so a header key's quota,
// whose sketch the reload keeps, still counts what the key used: a quota
// of 3, used up, is still used up after it (it was the key's afresh).
func TestAReloadThatRemakesTheRateTableKeepsAKeysQuota(t *testing.T) {
	tc := newTester(t)
	zone := func(burst string) string {
		return config("", fmt.Sprintf(`
	rate_limit {
		zone quota_remade {
			key {header.X-Key}
			events 100
			window 1m
			%s
			quota 3 1h
		}
	}
	respond "ok"`, burst))
	}
	tc.InitServer(zone(""), "caddyfile")
	for i := range 3 {
		if code, _, _ := get(t, tc, "/", "X-Key: q"); code != http.StatusOK {
			t.Fatalf("request %d of a quota of 3: %d", i+1, code)
		}
	}
	tc.InitServer(zone("burst 100"), "caddyfile")
	if code, _, _ := get(t, tc, "/", "X-Key: q"); code != http.StatusTooManyRequests {
		t.Fatalf("the 4th request of a quota of 3, after a reload that remade the rate table: %d, want 429", code)
	}
}
