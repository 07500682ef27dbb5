package floodgate

import (
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// A zone without burst with action delay holds a request over its window
// until the window ends, and counts it in the next window: held requests
// never let more than events through a window.
func TestWindowZoneDelayHoldsForTheNextWindow(t *testing.T) {
	h, held := delayHandler(t, "delay_window", 0, 2*time.Second)
	for i := range 11 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
	}
	if w := held.held(); len(w) != 1 || w[0] <= 0 || w[0] > time.Second {
		t.Fatalf("waits %v, want one, until the window's end (at most 1s)", w)
	}
	// The held request is the new window's first: 9 more pass at once,
	// the tenth waits for the window after.
	for i := range 10 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("request %d of the next window: %v", i+1, err)
		}
	}
	if w := held.held(); len(w) != 2 || w[1] != time.Second {
		t.Fatalf("waits %v, want a second one of a whole window (1s)", w)
	}
}

// Weights and action log on a zone without burst speak in the window:
// a request of weight w takes w of events, a denial waits for the window's
// end, and a logged request charges nothing.
func TestWindowZoneWeightsAndLog(t *testing.T) {
	cost, _ := weight.Parse("{http.request.header.X-Cost}")
	h := newTestHandler(t, nil, map[string]*Zone{
		"window_weight": {Limit: zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Hour)}, Weights: []*weight.Rule{{Weight: cost}}},
	})
	w, err := serve(h, weightedRequest("/", "X-Cost: 4"))
	if err != nil || w.Header().Get("RateLimit") != `"window_weight";r=6;t=3600` || w.Header().Get("RateLimit-Policy") != `"window_weight";q=10;w=3600` {
		t.Fatalf("weight 4: %v, %q %q", err, w.Header().Get("RateLimit-Policy"), w.Header().Get("RateLimit"))
	}
	w, err = serve(h, weightedRequest("/", "X-Cost: 7"))
	if status(err) != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "3600" {
		t.Fatalf("weight 7 of 6 left: %v, Retry-After %q, want 429 until the window ends", err, w.Header().Get("Retry-After"))
	}
	if _, err := serve(h, weightedRequest("/", "X-Cost: 6")); err != nil {
		t.Fatalf("weight 6 of 6 left: %v", err)
	}

	logged := newTestHandler(t, nil, map[string]*Zone{
		"window_log": {Limit: zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(time.Hour)}, Action: "log"},
	})
	for i := range 4 {
		if _, err := serve(logged, weightedRequest("/")); err != nil {
			t.Fatalf("logged request %d: %v", i+1, err)
		}
	}
	z := logged.zones[0]
	if d := z.buckets.PeekHash(keyOf(z, "192.0.2.1:1", "", nil), 1, time.Now()); d.Remaining != 0 || d.Allowed {
		t.Fatalf("after 2 allowed and 2 logged: %+v, want the window full, not over it", d)
	}
	if z.counts.requests[outcomeLogged].Load() != 2 {
		t.Fatalf("logged %d, want 2", z.counts.requests[outcomeLogged].Load())
	}
}
