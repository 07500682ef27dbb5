package floodgate

import (
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// A review found (response_time meter, high), now fixed: a request whose handler panics is
// never taken off the meter. serveCharged ends its timed runs after
// next.ServeHTTP returns, not in a defer, and Caddy's own handlers panic
// with http.ErrAbortHandler as a matter of course: the `abort` directive
// (StaticResponse.Abort) and reverse_proxy when a streamed response breaks
// (reverseproxy.go: "aborting with incomplete response"). net/http recovers
// the panic and the server goes on, but the run stays in its shard for the
// life of the process: every tick charges the key the time since the
// aborted request started, so the key is locked out for ever (and the
// meter's memory grows by one run per abort).
func TestAPanickingHandlerLeavesNoRunOnTheMeter(t *testing.T) {
	h, _, advance := timeZone(t, "review_abort_time")
	abort := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		panic(http.ErrAbortHandler) // what `abort` and a broken proxied stream do
	})
	func() {
		defer func() {
			if r := recover(); r != http.ErrAbortHandler {
				t.Fatalf("recovered %v, want http.ErrAbortHandler", r)
			}
		}()
		_, _ = serveThrough(h, weightedRequest("/", "X-Key: a"), abort)
	}()
	// The aborted request took no time. A minute later the key is whole,
	// and no request is in flight.
	for range 4 {
		advance(15 * time.Second)
		h.meter.tickAt(h.now())
	}
	if n := h.meter.live.Load(); n != 0 {
		t.Errorf("%d runs still on the meter a minute after the only request was aborted, want 0", n)
	}
	if got := left(h, "a"); got < 1000 {
		t.Errorf("a minute after an aborted request that took 0 ms, the key has %d ms left, want all 1000", got)
	}
	ok := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return nil })
	if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), ok); err != nil {
		t.Errorf("the key's next request a minute later: %v, want it served", err)
	}
}

// A review found (window zone hold, high), now fixed: held requests' reservations push the
// real grants of the window out of its counters, and then give themselves
// back, so a window zone admits without bound in one window. zone.reserve
// charges a window zone with Windows.Charge, which keeps at most 2·events
// per counter by dropping the OLDEST counts: the grants that fill the
// window. Twenty requests held on a full window of 10 (10 + 20 > 20) drop
// all ten grants; when their clients leave, each Refund takes back only its
// own place, so the window is empty again and ten newcomers are admitted at
// once. A client that holds and cancels twenty requests (its own: leaving
// is free) gets ten more each round: here 40 in 100 ms under `events 10
// window 1s`.
func TestHeldReservationsNeverEraseTheWindowsGrants(t *testing.T) {
	h, held := delayHandler(t, "review_window_overflow", 0, 2*time.Second)
	held.block = true
	z := h.zones[0]
	key := keyOf(z, "192.0.2.1:1", "", nil)
	granted := 0
	for i := range 10 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
		granted++
	}
	held.clock.Advance(100 * time.Millisecond)
	// The counters hold 2·events: ten held requests fit beside the ten
	// grants; an eleventh is denied, not held.
	const rounds, n = 3, 10
	for range rounds {
		cancel, errs := heldRequests(t, h, held, n)
		if err := serveOrGiveUp(h); status(err) != http.StatusTooManyRequests {
			t.Errorf("a request beyond the places a full window can reserve: %v, want 429", err)
		}
		cancel() // their clients leave
		for range n {
			if err := <-errs; err == nil {
				t.Fatal("a held request whose client left was served")
			}
		}
		if c := z.counts.held.Load(); c != 0 {
			t.Fatalf("%d still held", c)
		}
		// Still 100 ms after the first 10 grants: the window is full.
		for range 10 {
			if d, _ := z.buckets.TakeHash(key, 1, held.clock.Now()); d.Allowed {
				granted++
			}
		}
	}
	if granted > 10 {
		t.Errorf("%d requests granted within 100 ms under events 10 window 1s, after %d rounds of %d held requests whose clients left: the window's bound is broken", granted, rounds, n)
	}
}

// A review found (response_status, medium), now fixed: a connection upgraded to a WebSocket
// (reverse_proxy writes 101 Switching Protocols, hijacks the connection and
// returns nil when the socket closes) is charged as a 200. WriteHeader
// treats 101 as not final, so no status is seen, and Done(nil) then reports
// 200: `weight response_status 2xx` (or 200) charges every WebSocket
// session, although Caddy's access log records it as 101 and the docs say
// the status charged is the one the access log records.
func TestAnUpgradedConnectionIsNotChargedAsA200(t *testing.T) {
	h, _ := keyedHandler(t, "review_upgrade_status", zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour), Burst: 1}, func(z *Zone) {
		z.WeightResponseStatus = []string{"2xx"}
	})
	upgrade := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.WriteHeader(http.StatusSwitchingProtocols) // then hijacked; the handler returns when the socket closes
		return nil
	})
	for i := range 3 {
		if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), upgrade); err != nil {
			t.Fatalf("WebSocket %d under weight response_status 2xx (budget 1): %v, want it served: its status is 101", i+1, err)
		}
	}
	if got := left(h, "a"); got != 1 {
		t.Errorf("after 3 upgrades the key holds %d, want 1: a 101 is not a 2xx", got)
	}
}
