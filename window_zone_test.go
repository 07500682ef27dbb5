package floodgate

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// A zone without burst with action delay holds a request over its window
// until the window's grants are a window old, and takes it then: held
// requests never let more than events through a window. The table knows
// a grant's time to a tick (Window/2¹⁷ or finer), so the wait is the
// window and at most a tick; the requests after it wait at most a
// sub-window more (limiter.Windows.ExtraWait), until the last, which
// waits for the window after.
func TestWindowZoneDelayHoldsForTheNextWindow(t *testing.T) {
	h, held := delayHandler(t, "delay_window", 0, 2*time.Second)
	const tick = time.Second >> 16
	for i := range 11 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
	}
	if w := held.held(); len(w) != 1 || w[0] < time.Second || w[0] > time.Second+tick {
		t.Fatalf("waits %v, want one, until the grants are a window old (1s and at most a tick)", w)
	}
	extra := h.zones[0].buckets.(*limiter.Windows).ExtraWait()
	for i := range 10 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("request %d after the held one: %v", i+1, err)
		}
	}
	w := held.held()
	if len(w) < 2 || w[len(w)-1] < time.Second-extra || w[len(w)-1] > time.Second+tick {
		t.Fatalf("waits %v, want the last a window after the held one", w)
	}
	for _, d := range w[1 : len(w)-1] {
		if d > extra+tick {
			t.Fatalf("waits %v: one beside the held one is longer than a sub-window (%v)", w, extra)
		}
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

// A window zone's RateLimit t on a denial is its Retry-After, the time
// until a request would pass, not the time until every grant stops
// counting: events 2 in 1m, requests at 0 and 30 s, one at 40 s is denied
// for 20 s (when the grant of 0 stops counting), though the key is whole
// again only in 50 s.
func TestWindowZoneTellsWhenARequestWouldPass(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour)) // after the tables are made: their clocks start then
	h := newTestHandler(t, clock, map[string]*Zone{
		"window_t": {Limit: zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(time.Minute)}},
	})
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	if _, err := serve(h, req); err != nil {
		t.Fatal(err)
	}
	clock.Advance(30 * time.Second)
	if _, err := serve(h, req); err != nil {
		t.Fatal(err)
	}
	clock.Advance(10 * time.Second)
	// The grant of 0 counts until its sub-window's end is a minute old:
	// 20 s, and at most a sub-window (ExtraWait) more.
	extra := h.zones[0].buckets.(*limiter.Windows).ExtraWait()
	w, err := serve(h, req)
	ra, _ := strconv.Atoi(w.Header().Get("Retry-After"))
	if status(err) != http.StatusTooManyRequests || ra < 20 || time.Duration(ra)*time.Second > 20*time.Second+extra+time.Second ||
		w.Header().Get("RateLimit") != fmt.Sprintf(`"window_t";r=0;t=%d`, ra) {
		t.Fatalf("at 40 s: %v, Retry-After %q, RateLimit %q; want 429, from 20 to 20 + %v, and t the same", err, w.Header().Get("Retry-After"), w.Header().Get("RateLimit"), extra)
	}
}

// A held request's place in a window zone is reserved when it arrives
// (zone.reserve): a newcomer that comes at the very moment the held request
// goes, before it takes its place, finds the window full and is denied, and
// the held request passes after the one wait it was told.
// events 10 in 1s: one grant at 0, nine at 0.5 s, and a request at 0.5 s
// held until the grant of 0 stops counting. Taken only when it went, the
// held request lost its place to the newcomer and waited again, for the
// nine.
func TestWindowZoneHeldRequestKeepsItsPlace(t *testing.T) {
	h, held := delayHandler(t, "delay_window_place", 0, 2*time.Second)
	z := h.zones[0]
	key := keyOf(z, "192.0.2.1:1", "", nil)
	serveN := func(n int) {
		t.Helper()
		for i := range n {
			if _, err := serve(h, weightedRequest("/")); err != nil {
				t.Fatalf("request %d: %v", i+1, err)
			}
		}
	}
	serveN(1)
	held.clock.Advance(500 * time.Millisecond)
	serveN(9)
	var newcomer limiter.Decision
	came := false
	held.meanwhile = func(now time.Time) {
		if !came {
			came = true
			newcomer, _ = z.buckets.TakeHash(key, 1, now)
		}
	}
	serveN(1)
	w := held.held()
	extra := z.buckets.(*limiter.Windows).ExtraWait()
	if len(w) != 1 || w[0] < 500*time.Millisecond || w[0] > 500*time.Millisecond+extra {
		t.Errorf("held request's waits %v, want one, until the grant of 0 stops counting (500ms, and at most %v more)", w, extra)
	}
	if newcomer.Allowed {
		t.Errorf("a newcomer as the held request went (%v after it arrived) was granted (%+v): it took the held request's place", w[0], newcomer)
	}
	if d := z.buckets.PeekHash(key, 1, held.clock.Now()); d.Allowed {
		t.Errorf("after the held request: %+v, want the window full (nine and the held one)", d)
	}
}

// A held request that finds its window full when it goes (a reported cost
// came meanwhile) and cannot wait again within max_delay is denied, its
// place given back once: the window counts the nine and the cost, no less.
func TestWindowZoneHeldRequestDeniedAfterItsWaitGivesItsPlaceBackOnce(t *testing.T) {
	h, held := delayHandler(t, "delay_window_once", 0, 700*time.Millisecond)
	z := h.zones[0]
	key := keyOf(z, "192.0.2.1:1", "", nil)
	for i := range 10 {
		if i == 1 {
			held.clock.Advance(500 * time.Millisecond)
		}
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
	}
	came := false
	held.meanwhile = func(now time.Time) {
		if !came {
			came = true
			z.buckets.Charge(key, 1, now)
		}
	}
	if _, err := serve(h, weightedRequest("/")); status(err) != http.StatusTooManyRequests {
		t.Fatalf("held request: %v, want 429: the window is full until 1.5 s, past max_delay", err)
	}
	if w := held.held(); len(w) != 1 {
		t.Fatalf("waits %v, want one", w)
	}
	if d := z.buckets.PeekHash(key, 1, held.clock.Now()); d.Remaining != 0 {
		t.Errorf("after the denial: %+v, want the nine and the reported cost counted (none left)", d)
	}
	if n := z.counts.held.Load(); n != 0 {
		t.Errorf("%d still held", n)
	}
}
