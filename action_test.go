package floodgate

import (
	"net/http"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
)

// distributedDelayHandler is a handler with one distributed zone of 10
// requests per second, burst 10, action delay up to maxDelay, on a clock of
// its own. Its cluster c is exhausted for the key of weightedRequest (as if
// the other instances had spent it); the local bucket is full. twin is a
// cluster of the same shape with the same history, that no request
// touches, to compare with.
func distributedDelayHandler(t *testing.T, name string, maxDelay time.Duration) (h *Handler, held *heldClock, c, twin *storage.Cluster, key uint64) {
	t.Helper()
	h, held = delayHandler(t, name, 10, maxDelay)
	z := h.zones[0]
	cluster := func(name string) (*storage.Cluster, storage.Shape) {
		shape := storage.Shape{Zone: name, Window: time.Second, Width: 64}
		c, _, err := storage.Acquire(shape, 10)
		if err != nil {
			t.Fatal(err)
		}
		return c, shape
	}
	c, shape := cluster(name)
	z.dist = &distributedZone{cluster: c, synced: []syncedCount{{cluster: c, shape: shape}}} // released with the zone
	twin, twinShape := cluster(name + "_twin")
	t.Cleanup(func() { storage.Release(twinShape) })
	key = keyOf(z, "192.0.2.1:1", "", nil)
	exhaust(t, c, held.clock.Now(), key)
	exhaust(t, twin, held.clock.Now(), key)
	return h, held, c, twin, key
}

// exhaust takes from the cluster for key k until it denies, at now.
func exhaust(t *testing.T, c *storage.Cluster, now time.Time, k uint64) {
	t.Helper()
	for range 20 {
		if d, _ := c.TakeHash(k, 1, now); !d.Allowed {
			return
		}
	}
	t.Fatal("the cluster never denied")
}

// A request that the cluster denies, in a zone that delays, is held until
// the cluster's estimate lets it through, and is counted there then.
func TestDelayInADistributedZoneWaitsForTheCluster(t *testing.T) {
	h, held, c, twin, key := distributedDelayHandler(t, "delay_cluster", 2*time.Second)
	start := held.clock.Now()
	want := c.PeekHash(key, 1, start).RetryAfter
	if want <= 0 || want > 2*time.Second {
		t.Fatalf("the exhausted cluster's wait is %v, want (0, 2s]", want)
	}
	if _, err := serve(h, weightedRequest("/")); err != nil {
		t.Fatalf("held request: %v, want it to pass after its wait", err)
	}
	if w := held.held(); len(w) != 1 || w[0] != want {
		t.Fatalf("waits %v, want [%v]: until the cluster lets the request through", w, want)
	}
	// Counted in the cluster when it went: the twin with the same history
	// has room for one now, the key no longer.
	now := held.clock.Now()
	if k, tw := c.PeekHash(key, 1, now), twin.PeekHash(key, 1, now); k.Allowed || !tw.Allowed {
		t.Errorf("after the held request the cluster allows the key: %v, its twin: %v; want false, true", k.Allowed, tw.Allowed)
	}
}

// A cluster that would let the request through only after max_delay denies
// it at once, charging nothing.
func TestDelayInADistributedZoneDeniesBeyondMaxDelay(t *testing.T) {
	h, held, c, _, key := distributedDelayHandler(t, "delay_cluster_deny", 10*time.Millisecond)
	if d := c.PeekHash(key, 1, held.clock.Now()); d.RetryAfter <= 10*time.Millisecond {
		t.Fatalf("the exhausted cluster's wait is %v, want more than max_delay", d.RetryAfter)
	}
	for i := range 5 {
		if _, err := serve(h, weightedRequest("/")); status(err) != http.StatusTooManyRequests {
			t.Errorf("request %d: %v, want 429 at once", i+1, err)
		}
	}
	if w := held.held(); len(w) != 0 {
		t.Errorf("waits %v, want none", w)
	}
	z := h.zones[0]
	if d := z.buckets.PeekHash(key, 1, held.clock.Now()); d.Remaining != 10 {
		t.Errorf("local bucket holds %d after denials, want 10: a denial charges nothing", d.Remaining)
	}
}

// A held request whose cluster room was taken by others while it waited
// waits again, within max_delay, rather than pass over the cluster's limit.
func TestDelayedRequestWaitsAgainIfTheClusterFilledMeanwhile(t *testing.T) {
	h, held, c, _, key := distributedDelayHandler(t, "delay_cluster_again", 5*time.Second)
	rounds := 0
	held.meanwhile = func(now time.Time) {
		if rounds++; rounds == 1 {
			exhaust(t, c, now, key)
		}
	}
	if _, err := serve(h, weightedRequest("/")); err != nil {
		t.Fatalf("held request: %v, want it to pass after its waits", err)
	}
	if w := held.held(); len(w) != 2 || w[1] <= 0 {
		t.Errorf("waits %v, want two: the cluster was full again after the first", w)
	}
	if d := c.PeekHash(key, 1, held.clock.Now()); d.Allowed {
		t.Errorf("the cluster lets another request through at once (%+v): the held one was not counted", d)
	}
}

// Denied after its wait if the cluster is still full and the next wait
// would pass max_delay: everything it was charged comes back.
func TestDelayedRequestIsDeniedIfTheClusterStaysFullPastMaxDelay(t *testing.T) {
	h, held, c, _, key := distributedDelayHandler(t, "delay_cluster_full", 1500*time.Millisecond)
	held.meanwhile = func(now time.Time) { exhaust(t, c, now, key) }
	if _, err := serve(h, weightedRequest("/")); status(err) != http.StatusTooManyRequests {
		t.Fatalf("held request: %v, want 429 once the cluster's next wait passes max_delay", err)
	}
	z := h.zones[0]
	if d := z.buckets.PeekHash(key, 1, held.clock.Now()); d.Remaining != 10 {
		t.Errorf("local bucket holds %d after the denial, want 10: its debt was refunded", d.Remaining)
	}
	if n := z.counts.held.Load(); n != 0 {
		t.Errorf("%d still held", n)
	}
}

func TestDelayDebtReservesWhatReturnsWithinMaxDelay(t *testing.T) {
	for _, c := range []struct {
		l        limiter.Limit
		maxDelay time.Duration
		want     int64
	}{
		{limiter.Limit{Events: 5, Window: time.Second, Burst: 1}, time.Second, 5},
		{limiter.Limit{Events: 5, Window: time.Second, Burst: 1}, 1100 * time.Millisecond, 6},
		{limiter.Limit{Events: 100, Window: time.Minute, Burst: 10}, time.Second, 10},
		{limiter.Limit{Events: 1_000_000, Window: time.Second, Burst: 1}, time.Hour, limiter.MaxBurst},
	} {
		if got := delayDebt(c.l, c.maxDelay); got != c.want {
			t.Errorf("%v, max delay %v: debt %d, want %d", c.l, c.maxDelay, got, c.want)
		}
	}
}

// Held requests' reservations never push the real grants of a window out of
// its counters. A window's counters keep at most 2·events each, and a charge
// beyond that (Windows.Charge) drops the OLDEST counts: the grants that fill
// the window. Were a held request's place charged so, twenty requests held on
// a full window of 10 (10 + 20 > 20) would drop all ten grants; when their
// clients left, each Refund taking back only its own place, the window would
// be empty again and admit ten newcomers at once, and a client that holds and
// cancels twenty requests (its own: leaving is free) would get ten more each
// round: 40 in 100 ms under `events 10 window 1s`. zone.reserve reserves a
// place only within the counters' room (Windows.Reserve), and denies the
// request beyond it.
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
