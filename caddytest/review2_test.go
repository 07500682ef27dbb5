package caddytest

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// A review found (response_time meter, high), now fixed: behind a zone with weight
// response_time, a request that Caddy's `abort` directive closes (it panics
// with http.ErrAbortHandler, as reverse_proxy does when a streamed response
// breaks) stays on the shared meter for the life of the process: each tick
// charges its key the time since it started, so the key is refused within
// a second or two and for ever after (until Caddy restarts: a reload does
// not help, the meter is the process's). The client here waits a couple of
// ticks after the abort (real time: the meter's ticker runs on the wall
// clock) and asks again; a request that took 0 ms must leave it ~all of
// its 1000 ms.
func TestAbortedRequestDoesNotChargeItsKeyForEver(t *testing.T) {
	newTester(t).InitServer(config("", `
	rate_limit {
		zone review_abort_time {
			key {client_ip}
			events 1000
			window 1m
			burst 1000
			weight response_time
		}
	}
	handle /abort {
		abort
	}
	respond "ok" 200`), "caddyfile")

	c := clientFrom("127.0.0.1")
	if resp, err := c.Get(baseURL + "/abort"); err == nil {
		resp.Body.Close()
		t.Fatalf("/abort answered %s, want the connection closed", resp.Status)
	}
	// Each "ok" costs a few ms at most; 500 ms of them is far beyond.
	expectTimeLeft(t, c, 8, 500, "after an aborted request that took no time")
}

// A review found (window zone hold, high), now fixed: a client breaks a window zone's bound
// by sending requests that are held (action delay) and hanging up. Each
// held request reserves its place in the window with a charge that, past
// 2·events, drops the window's OLDEST counts (the real grants), and gives
// back only its own place when its client leaves: twenty held and
// abandoned requests on a full window of 10 erase its ten grants, and the
// client is served ten more at once; twice in a row, 30 in a few hundred
// ms under `events 10 window 1m`.
func TestAbandonedHeldRequestsKeepTheWindowsBound(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone review_window_cancel {
			key {client_ip}
			events 10
			window 1m
			memory 1MiB
			action delay 2m
		}
	}
	respond "ok"`), "caddyfile")
	c := clientFrom("127.0.0.1")
	get := func() int {
		req, _ := http.NewRequest(http.MethodGet, baseURL+"/", nil)
		code, _, _ := do(t, c, req)
		return code
	}
	served := 0
	for range 10 {
		if get() == http.StatusOK {
			served++
		}
	}
	const n = 20
	for range 2 {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{}, n)
		for range n {
			go func() {
				defer func() { done <- struct{}{} }()
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, baseURL+"/", nil)
				if resp, err := c.Do(req); err == nil {
					resp.Body.Close()
				}
			}()
		}
		// A full window's counters hold 2·events: ten are held, the
		// other ten denied rather than held.
		want := `caddy_rate_limit_held_requests{zone="review_window_cancel"} 10`
		deadline := time.Now().Add(10 * time.Second)
		for !strings.Contains(testcaddy.Metrics(t, adminPort), want) {
			if time.Now().After(deadline) {
				cancel()
				t.Fatalf("10 of the %d requests were not held within 10s", n)
			}
			time.Sleep(20 * time.Millisecond)
		}
		cancel() // the client hangs up
		for range n {
			<-done
		}
		deadline = time.Now().Add(10 * time.Second)
		for !strings.Contains(testcaddy.Metrics(t, adminPort), `caddy_rate_limit_held_requests{zone="review_window_cancel"} 0`) {
			if time.Now().After(deadline) {
				t.Fatal("the abandoned requests were still held after 10s")
			}
			time.Sleep(20 * time.Millisecond)
		}
		for range 10 {
			ctx, stop := context.WithTimeout(context.Background(), 2*time.Second) // a held one would wait a minute
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, baseURL+"/", nil)
			if resp, err := c.Do(req); err == nil {
				if resp.StatusCode == http.StatusOK {
					served++
				}
				resp.Body.Close()
			}
			stop()
		}
	}
	if served > 10 {
		t.Errorf("%d requests served within a few seconds under events 10 window 1m, after the client abandoned held requests twice: the window's bound is broken", served)
	}
}

// A review found (response_status, medium), now fixed: a WebSocket proxied by reverse_proxy
// is charged as a 200 by `weight response_status 2xx` (or 200): Caddy
// writes the upstream's 101 through the zone's writer, which does not take
// a 1xx as final, hijacks the connection, and returns nil when the socket
// closes, which Done reports as a 200. Caddy's access log records 101, and
// the docs say the status charged is the one the access log records. Here
// a budget of one 2xx an hour refuses the second WebSocket.
func TestProxiedWebSocketIsNotChargedAsA200(t *testing.T) {
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		brw.Flush()
	}))
	t.Cleanup(upstream.Close)
	newTester(t).InitServer(config("", `
	rate_limit {
		zone review_ws_status {
			key {client_ip}
			events 1
			window 1h
			burst 1
			weight response_status 2xx
			max_concurrent 10
		}
	}
	reverse_proxy `+strings.TrimPrefix(upstream.URL, "http://")), "caddyfile")
	// max_concurrent's gauge says when the proxy has returned: the status
	// is charged (or not) by then, so the next upgrade sees it.
	returned := `caddy_rate_limit_in_flight_requests{zone="review_ws_status"} 0`

	for i := range 3 {
		conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", httpPort), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(conn, "GET /ws HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		conn.Close()
		if err != nil {
			t.Fatalf("WebSocket %d: %v", i+1, err)
		}
		if resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("WebSocket %d under weight response_status 2xx with a budget of 1: %s (RateLimit %q), want 101: an upgrade is not a 2xx", i+1, resp.Status, resp.Header.Get("RateLimit"))
		}
		deadline := time.Now().Add(10 * time.Second) // a bound, should the proxy never return
		for !strings.Contains(testcaddy.Metrics(t, adminPort), returned) {
			if time.Now().After(deadline) {
				t.Fatalf("WebSocket %d: the proxy had not returned 10 s after the client closed", i+1)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// A review found (response_time meter, high), now fixed: the same leak as an `abort`, from
// the most ordinary event there is: a client that closes its connection
// while reverse_proxy streams it a response. reverse_proxy then panics with
// http.ErrAbortHandler (reverseproxy.go: "aborting with incomplete
// response"), serveCharged never ends the request's run, and the meter
// charges the key the time since for ever: a client that gave up on one
// download is refused from then on.
func TestClientLeavingAProxiedStreamIsNotChargedForEver(t *testing.T) {
	wrote := make(chan struct{}, 1)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/stream" {
			return
		}
		w.WriteHeader(http.StatusOK)
		for i := range 40 { // at most 4 s
			if _, err := w.Write([]byte(strings.Repeat("x", 1024) + "\n")); err != nil {
				return
			}
			http.NewResponseController(w).Flush()
			if i == 0 {
				wrote <- struct{}{}
			}
			select {
			case <-r.Context().Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}))
	t.Cleanup(upstream.Close)
	newTester(t).InitServer(config("", `
	rate_limit {
		zone review_stream_time {
			key {client_ip}
			events 1000
			window 1m
			burst 1000
			weight response_time
		}
	}
	reverse_proxy `+strings.TrimPrefix(upstream.URL, "http://")+` {
		flush_interval -1
	}`), "caddyfile")

	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", httpPort), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
	if _, err := http.ReadResponse(bufio.NewReader(conn), nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-wrote:
	case <-time.After(10 * time.Second):
		t.Fatal("the stream did not start within 10s")
	}
	conn.Close() // the client gives up on the download
	// The stream ran well under a second; the small requests cost a few
	// ms each: none may find the key spent.
	expectTimeLeft(t, clientFrom("127.0.0.1"), 12, 0, "after the client left a stream")
}

// expectTimeLeft sends a request every 250 ms (a tick of the time meter,
// whose clock is the process's: the weight is real time), rounds times, and
// fails unless each is served with at least least ms left in its
// response_time zone: a run left on the meter would drain the key.
func expectTimeLeft(t *testing.T, c *http.Client, rounds int, least int64, after string) {
	t.Helper()
	for i := range rounds {
		time.Sleep(250 * time.Millisecond)
		req, _ := http.NewRequest(http.MethodGet, baseURL+"/", nil)
		code, _, resp := do(t, c, req)
		last := resp.Header.Get("RateLimit")
		_, r, _ := parseRateLimitItem(last)
		n, err := strconv.ParseInt(r, 10, 64)
		if code != http.StatusOK || err != nil || n < least {
			t.Fatalf("request %d, %v %s: %d, RateLimit %q; want 200 with at least %d ms left", i+1, time.Duration(i+1)*250*time.Millisecond, after, code, last, least)
		}
	}
}
