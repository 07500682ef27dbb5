package caddytest

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// A weight the upstream reports is charged when the response reports it. The
// upstream here answers only when the test releases it, after the key could
// have refilled a charge made at the request's arrival a whole burst over:
// the charge must be there after the response, not refilled away before it
// was made. The release comes after a real pause, long enough for a charge
// dated at arrival to have been refilled; what is asserted depends only on
// the time the test measures after the release.
func TestSlowResponseWeightIsChargedWhenReported(t *testing.T) {
	arrived, release := make(chan struct{}, 1), make(chan struct{})
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			arrived <- struct{}{}
			select {
			case <-release:
			case <-time.After(30 * time.Second): // a bound, should the test fail first
			}
			w.Header().Set("X-Cost", "1000000")
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(upstream.Close)
	// Both requests come from 127.0.0.1, one key.
	newTester(t).InitServer(config("", `
	rate_limit {
		zone slow_response_cost {
			events 1000000
			window 1s
			burst 1000000
			weight response_header X-Cost
		}
	}
	reverse_proxy `+strings.TrimPrefix(upstream.URL, "http://")), "caddyfile")

	slow := make(chan *http.Response, 1)
	go func() {
		resp, err := clientFrom("127.0.0.1").Get(baseURL + "/slow")
		if err != nil {
			slow <- &http.Response{Status: err.Error()}
			return
		}
		resp.Body.Close()
		slow <- resp
	}()
	select {
	case <-arrived:
	case <-time.After(10 * time.Second):
		t.Fatal("the request did not reach the upstream within 10s")
	}
	// A million a second refills a charge of a million, dated at the
	// arrival, in one second.
	time.Sleep(1200 * time.Millisecond)
	start := time.Now()
	close(release)
	first := <-slow
	if first.StatusCode != http.StatusOK || first.Header.Get("X-Cost") != "1000000" {
		t.Fatalf("the slow request: %s, X-Cost %q; want 200, 1000000", first.Status, first.Header.Get("X-Cost"))
	}
	req, _ := http.NewRequest(http.MethodGet, baseURL+"/fast", nil)
	code, _, resp := do(t, clientFrom("127.0.0.1"), req)
	elapsed := time.Since(start)
	if code != http.StatusOK {
		t.Fatalf("the next request: %d (RateLimit %q), want 200: the key owes at most what a second refills", code, resp.Header.Get("RateLimit"))
	}
	if elapsed >= 900*time.Millisecond {
		t.Skipf("the two answers took %v: too slow to tell a charge made then from one refilled away", elapsed)
	}
	// Charged to empty when the header came, the key then refilled for
	// at most elapsed at a million a second.
	_, r, _ := parseRateLimitItem(resp.Header.Get("RateLimit"))
	n, err := strconv.ParseInt(r, 10, 64)
	if most := int64(elapsed.Seconds()*1e6) + 1; err != nil || n > most {
		t.Errorf("RateLimit %q %v after the response charged a million (its own RateLimit %q): want r at most %d, what %v refills",
			resp.Header.Get("RateLimit"), err, first.Header.Get("RateLimit"), most, elapsed)
	}
}

// basic_auth answers a wrong password by returning a 401 error, which Caddy
// writes after the handlers have returned: a zone with weight
// response_status 401 charges it all the same, and a key whose failures are
// spent is refused before basic_auth hashes its next guess.
func TestFailedBasicAuthIsChargedAndRefusedBeforeIt(t *testing.T) {
	hash, err := bcrypt.GenerateFromPassword([]byte("right"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	hits := new(atomic.Int64)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }))
	t.Cleanup(upstream.Close)
	newTester(t).InitServer(config("", `
	rate_limit {
		zone failed_basic_auth {
			key {client_ip}
			events 3
			window 1h
			burst 3
			weight response_status 401
		}
	}
	handle_errors 429 {
		respond "try again later" 429
	}
	basic_auth {
		alice `+string(hash)+`
	}
	reverse_proxy `+strings.TrimPrefix(upstream.URL, "http://")), "caddyfile")
	c := clientFrom("127.0.0.51")
	login := func(password string) int {
		req := testcaddy.Request(t, http.MethodGet, baseURL+"/")
		req.SetBasicAuth("alice", password)
		code, _, _ := do(t, c, req)
		return code
	}
	for i := range 6 {
		if code := login("right"); code != 200 {
			t.Fatalf("successful login %d: %d", i+1, code)
		}
	}
	for i := range 3 {
		if code := login("guess"); code != 401 {
			t.Fatalf("failed login %d after six successful ones: %d, want 401", i+1, code)
		}
	}
	if code := login("guess"); code != 429 {
		t.Errorf("fourth failed login: %d, want 429", code)
	}
	if code := login("right"); code != 429 {
		t.Errorf("the right password after three failures: %d, want 429 (the key is spent)", code)
	}
	if n := hits.Load(); n != 6 {
		t.Errorf("the upstream saw %d requests, want the 6 successful logins", n)
	}
	req := testcaddy.Request(t, http.MethodGet, baseURL+"/")
	req.SetBasicAuth("alice", "guess")
	if code, _, _ := do(t, clientFrom("127.0.0.52"), req); code != 401 {
		t.Errorf("another client's failed login: %d, want 401", code)
	}
}

// timeConfig is a site whose zone (keyed by X-Key) charges the response's
// time, 10000 ms a minute, in front of upstream; tag marks the config.
func timeConfig(zone, upstream, tag string) string {
	return config("", `
	rate_limit {
		zone `+zone+` {
			key {header.X-Key}
			events 10000
			window 1m
			burst 10000
			weight response_time
		}
	}
	header X-Config `+tag+`
	reverse_proxy `+strings.TrimPrefix(upstream, "http://"))
}

// msLeft asks the zone, through a request of key that takes no time at
// the upstream (the path /now), how many ms key has left.
func msLeft(t *testing.T, zone, key string) int {
	t.Helper()
	code, _, resp := do(t, clientFrom("127.0.0.53"), testcaddy.Request(t, http.MethodGet, baseURL+"/now", "X-Key: "+key))
	if code != 200 {
		t.Fatalf("asking what %s has left: %d", key, code)
	}
	return remaining(t, resp, zone)
}

// streamingUpstream streams a chunk every 100 ms for d on /stream, and
// answers anything else at once.
func streamingUpstream(t *testing.T, d time.Duration) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/stream" {
			return
		}
		end := time.Now().Add(d)
		for time.Now().Before(end) {
			_, _ = w.Write([]byte("tick\n"))
			w.(http.Flusher).Flush()
			time.Sleep(100 * time.Millisecond)
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// A streaming response's time is charged while it streams: a request of
// the same key in the middle of it sees what the stream has taken so far.
func TestStreamingResponseTimeIsChargedWhileItStreams(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(timeConfig("streaming_time", streamingUpstream(t, 2500*time.Millisecond), "one"), "caddyfile")
	key := "streamer-" + strconv.FormatInt(time.Now().UnixNano(), 36) // a key of this run's own
	done := make(chan error, 1)
	go func() {
		resp, err := clientFrom("127.0.0.54").Do(testcaddy.Request(t, http.MethodGet, baseURL+"/stream", "X-Key: "+key))
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		done <- err
	}()
	start := time.Now()
	time.Sleep(1500 * time.Millisecond)
	mid := msLeft(t, "streaming_time", key)
	elapsed := time.Since(start)
	// Charged at most what ran until the question, at least what ran
	// until the last tick (250 ms before it at most), and refilled
	// meanwhile at 10000 ms a minute: up to 260 ms in 1.5 s. Uncharged,
	// the key would hold 10000.
	if lo, hi := 10000-int(elapsed.Milliseconds())-10, 10000-1500+250+260+50; mid < lo || mid > hi {
		t.Errorf("%v into a stream: %d ms left, want %d to %d: its time charged as it runs", elapsed, mid, lo, hi)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// 2.5 s charged, less what 10000 ms a minute refilled meanwhile
	// (about 420 ms over the stream, and what the test took after it).
	if after := msLeft(t, "streaming_time", key); after > 10000-2500+600 || after < 10000-2500-300 {
		t.Errorf("after a 2.5 s stream: %d ms left, want about 7500 plus its refill", after)
	}
}

// A request in flight across a reload is charged its time once: by the
// meter that holds it, whatever the reload did, in the zone's state, which
// the new config keeps.
func TestReloadMidRequestChargesTimeOnce(t *testing.T) {
	tc := newTester(t)
	upstream := streamingUpstream(t, 1500*time.Millisecond)
	tc.InitServer(timeConfig("reload_time", upstream, "one"), "caddyfile")
	key := "reloaded-" + strconv.FormatInt(time.Now().UnixNano(), 36) // a key of this run's own
	done := make(chan error, 1)
	go func() {
		resp, err := clientFrom("127.0.0.55").Do(testcaddy.Request(t, http.MethodGet, baseURL+"/stream", "X-Key: "+key))
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		done <- err
	}()
	time.Sleep(500 * time.Millisecond)
	reloaded := make(chan error, 1)
	// Caddy's reload waits for the old server's requests: run it beside.
	go func() {
		reloaded <- testcaddy.Post(adminPort, withPorts(timeConfig("reload_time", upstream, "two")), "caddyfile")
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := <-reloaded; err != nil {
		t.Fatal(err)
	}
	testcaddy.Settle(t, adminPort, httpPort, httpsPort)
	code, _, resp := do(t, clientFrom("127.0.0.53"), testcaddy.Request(t, http.MethodGet, baseURL+"/now", "X-Key: "+key))
	if code != 200 || resp.Header.Get("X-Config") != "two" {
		t.Fatalf("after the reload: %d from config %q, want 200 from two", code, resp.Header.Get("X-Config"))
	}
	// 1.5 s charged once (twice would leave 7000, none 10000), less
	// the refill since (10000 a minute: a few hundred at most).
	if r := remaining(t, resp, "reload_time"); r < 10000-1500-100 || r > 10000-1500+400 {
		t.Errorf("after a 1.5 s request across a reload: %d ms left, want about 8500", r)
	}
}
