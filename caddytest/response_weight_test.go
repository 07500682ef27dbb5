package integration

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
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
