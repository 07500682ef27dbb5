package floodgate

import (
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// timeZone is a handler with one zone of weight response_time keyed by
// X-Key: a second of upstream time per second, up to a second at once.
func timeZone(t *testing.T, name string) (*Handler, func(time.Duration) caddyhttp.Handler, func(time.Duration)) {
	h, clock := keyedHandler(t, name, zoneconf.Limit{MaxEvents: 1000, Window: caddy.Duration(time.Minute), Burst: 1000}, func(z *Zone) {
		z.WeightResponseTime = true
	})
	// slow is an upstream that takes d.
	slow := func(d time.Duration) caddyhttp.Handler {
		return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			clock.Advance(d)
			return nil
		})
	}
	return h, slow, clock.Advance
}

// With weight response_time, a key pays the milliseconds its requests take:
// a 300 ms upstream under 1000 ms a minute serves a key 4 requests (the
// 4th admitted with 100 ms left, and charged its 300), then refuses it,
// while another key is served.
func TestResponseTimeChargesTheUpstreamsTime(t *testing.T) {
	h, slow, _ := timeZone(t, "upstream_time")
	served := 0
	for range 10 {
		w, err := serveThrough(h, weightedRequest("/", "X-Key: a"), slow(300*time.Millisecond))
		if err != nil {
			if status(err) != http.StatusTooManyRequests {
				t.Fatal(err)
			}
			if got := w.Header().Get("RateLimit-Policy"); !strings.Contains(got, `qu="ms"`) {
				t.Errorf("RateLimit-Policy %q, want the millisecond as its unit", got)
			}
			break
		}
		served++
	}
	if served != 4 {
		t.Errorf("served %d requests of 300 ms on 1000 ms, want 4", served)
	}
	if _, err := serveThrough(h, weightedRequest("/", "X-Key: b"), slow(300*time.Millisecond)); err != nil {
		t.Errorf("another key: %v, want it served", err)
	}
}

// A long response is charged as its time passes, at each tick of the
// meter, so that the key's next request is decided on the time the running
// one has taken so far; its end charges the rest, once.
func TestResponseTimeIsChargedWhileItRuns(t *testing.T) {
	h, _, advance := timeZone(t, "streaming_time")
	var during []int64
	var refused bool
	stream := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		for range 4 {
			advance(200 * time.Millisecond)
			h.meter.tickAt(h.now())
			during = append(during, left(h, "a"))
		}
		// 800 ms in: a second request of the key has about 200 ms
		// left, and is admitted; a third 300 ms later is not.
		if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return nil })); err != nil {
			t.Errorf("a request with 200 ms left: %v", err)
		}
		advance(300 * time.Millisecond)
		h.meter.tickAt(h.now())
		_, err := serveThrough(h, weightedRequest("/", "X-Key: a"), caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return nil }))
		refused = status(err) == http.StatusTooManyRequests
		advance(400 * time.Millisecond)
		return nil
	})
	if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), stream); err != nil {
		t.Fatal(err)
	}
	for i, got := range during {
		// 1000 ms a minute refills 1 ms every 60 ms.
		want := int64(1000 - 200*(i+1) + 200*i/60)
		if got < want-1 || got > want+1 {
			t.Errorf("after %d ms of the response: %d ms left, want %d", 200*(i+1), got, want)
		}
	}
	if !refused {
		t.Error("a request of a key whose running response has taken its budget was admitted")
	}
	// 1500 ms charged once, capped one burst below empty: 0 left, and
	// nothing in flight.
	if got := left(h, "a"); got != 0 {
		t.Errorf("after the response: %d left, want 0", got)
	}
	for i := range h.meter.shards {
		if n := len(h.meter.shards[i].runs); n != 0 {
			t.Errorf("%d runs left in shard %d after the responses ended", n, i)
		}
	}
}

// A tick between a run's end and the next tick charges nothing twice: the
// meter charges each millisecond once, however many ticks see it.
func TestTimeMeterChargesEachMillisecondOnce(t *testing.T) {
	h, _, advance := timeZone(t, "ticks_once")
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		for range 5 {
			advance(30 * time.Millisecond)
			h.meter.tickAt(h.now())
			h.meter.tickAt(h.now())
		}
		return nil
	})
	if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), next); err != nil {
		t.Fatal(err)
	}
	h.meter.tickAt(h.now())
	if got := left(h, "a"); got < 849 || got > 853 {
		t.Errorf("after 150 ms ticked 10 times: %d left, want 850 (+ its refill)", got)
	}
}

// Runs starting and ending on many goroutines while ticks charge them are
// each charged their time exactly once, and leave nothing behind.
func TestTimeMeterConcurrentRunsAreChargedOnce(t *testing.T) {
	h, clock := keyedHandler(t, "meter_concurrent", zoneconf.Limit{MaxEvents: 1_000_000, Window: caddy.Duration(time.Hour), Burst: 1_000_000}, func(z *Zone) {
		z.WeightResponseTime = true
	})
	z := h.zones[0]
	hash := keyOf(z, "192.0.2.1:1", "", map[string]string{"X-Key": "a"})
	t0 := clock.Now()
	const goroutines, runs = 8, 50
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			for range runs {
				r := h.meter.start(afterCharge{z: z, hash: hash}, t0)
				h.meter.end(r, t0.Add(10*time.Millisecond))
			}
		})
	}
	wg.Go(func() {
		for i := range 200 {
			h.meter.tickAt(t0.Add(time.Duration(i%10) * time.Millisecond))
		}
	})
	wg.Wait()
	// 400 runs of 10 ms, charged within 10 ms of t0: 4000 ms, and the
	// refill of at most 10 ms at a million an hour (3).
	left := z.buckets.PeekHash(hash, 1, t0.Add(10*time.Millisecond)).Remaining
	if want := int64(1_000_000 - goroutines*runs*10); left < want || left > want+3 {
		t.Errorf("%d ms left after %d runs of 10 ms, want %d", left, goroutines*runs, want)
	}
	if n := h.meter.live.Load(); n != 0 {
		t.Errorf("%d runs live after all ended", n)
	}
}

// The ticker starts with the first run and charges runs on its own, at the
// meter's clock's time: here a test clock moved by a second, so the charge
// is a second whenever the real ticker fires.
func TestTimeMeterTicksOnItsOwn(t *testing.T) {
	h, clock := keyedHandler(t, "meter_ticker", zoneconf.Limit{MaxEvents: 60_000, Window: caddy.Duration(time.Minute), Burst: 60_000}, func(z *Zone) {
		z.WeightResponseTime = true
	})
	m := &timeMeter{clock: clock.Now, auto: true}
	z := h.zones[0]
	hash := keyOf(z, "192.0.2.1:1", "", map[string]string{"X-Key": "a"})
	r := m.start(afterCharge{z: z, hash: hash}, clock.Now())
	clock.Advance(time.Second)
	deadline := time.Now().Add(10 * time.Second) // 40 ticks
	for z.buckets.PeekHash(hash, 1, clock.Now()).Remaining > 59_000 {
		if time.Now().After(deadline) {
			t.Fatal("no tick charged the run within 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	m.end(r, clock.Now())
	if got := z.buckets.PeekHash(hash, 1, clock.Now()).Remaining; got != 59_000 {
		t.Errorf("a second charged by the ticker, then the run ended: %d left, want 59000 (charged once)", got)
	}
}

// A request whose handler panics is taken off the meter all the same
// (serveCharged ends its timed runs in a defer). Caddy's own handlers panic
// with http.ErrAbortHandler as a matter of course: the `abort` directive
// (StaticResponse.Abort) and reverse_proxy when a streamed response breaks
// (reverseproxy.go: "aborting with incomplete response"). net/http recovers
// the panic and the server goes on; a run left in its shard would stay for
// the life of the process, every tick charging the key the time since the
// aborted request started, so the key would be locked out for ever (and the
// meter's memory would grow by one run per abort).
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
