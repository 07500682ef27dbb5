package floodgate

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// serveThrough runs one request through h and on to next, at the time of
// h's clock.
func serveThrough(h *Handler, r *http.Request, next caddyhttp.Handler) (*httptest.ResponseRecorder, error) {
	return serveNextAt(h, r, next, h.now())
}

// pass moves h's clock on by d as time passes on a server: in steps of half
// a sweep interval, each zone's table swept after each, as its background
// sweep does (without it, a counter idle for 2³¹ ticks, two seconds at a
// million a second, would read as ahead again).
func pass(h *Handler, clock *testclock.Clock, d time.Duration) {
	step := d
	for _, z := range h.zones {
		step = min(step, z.buckets.SweepInterval()/2)
	}
	for d > 0 {
		s := min(step, d)
		clock.Advance(s)
		d -= s
		for _, z := range h.zones {
			z.buckets.Sweep(clock.Now())
		}
	}
}

// slowWeight is an upstream of h that answers after taking d, reporting cost
// in X-Cost.
func slowWeight(h *Handler, clock *testclock.Clock, d time.Duration, cost string) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		pass(h, clock, d)
		w.Header().Set("X-Cost", cost)
		w.WriteHeader(http.StatusOK)
		return nil
	})
}

// slowDownload is an upstream of h that sends n chunks of size bytes, one
// per step.
func slowDownload(h *Handler, clock *testclock.Clock, n, size int, step time.Duration) caddyhttp.Handler {
	chunk := make([]byte, size)
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		for range n {
			pass(h, clock, step)
			if _, err := w.Write(chunk); err != nil {
				return err
			}
		}
		return nil
	})
}

// byteRateHandler is a handler with one zone of a million per second and a
// burst of a million, charged after the response as edit makes it, on a clock
// of its own.
func byteRateHandler(t *testing.T, name string, edit func(*Zone)) (*Handler, *testclock.Clock) {
	t.Helper()
	clock := testclock.New(time.Now().Add(time.Hour))
	zc := &Zone{Limit: zoneconf.Limit{MaxEvents: 1_000_000, Window: caddy.Duration(time.Second), Burst: 1_000_000, Memory: 4096}}
	edit(zc)
	return newTestHandler(t, clock, map[string]*Zone{name: zc}), clock
}

// remaining is what the zone's key of weightedRequest holds at h's time.
func remaining(h *Handler) int64 {
	z := h.zones[0]
	return z.buckets.PeekHash(keyOf(z, "192.0.2.1:1", "", nil), 1, h.now()).Remaining
}

// A cost the response reports is charged when the response reports it, not
// at the request's arrival: a charge dated seconds in the past would be
// refilled away already, or be read against a counter time that has moved
// on since.
func TestResponseWeightIsChargedWhenTheResponseReportsIt(t *testing.T) {
	for _, tt := range []struct {
		name     string
		took     time.Duration
		cost     int64
		min, max int64 // what the key holds right after the response
	}{
		// A 6 s response with X-Cost 100000 leaves the key 100000 short
		// of full, not in debt.
		{"six_seconds", 6 * time.Second, 100_000, 899_000, 900_001},
		// A 3 s response's charge does not vanish: the key is not full.
		{"three_seconds", 3 * time.Second, 100_000, 899_000, 900_001},
		// A ten-minute response is charged as much as an instant one.
		{"ten_minutes", 10 * time.Minute, 500_000, 499_000, 500_001},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, clock := byteRateHandler(t, "slow_"+tt.name, func(z *Zone) { z.WeightResponseHeader = "X-Cost" })
			if _, err := serveThrough(h, weightedRequest("/"), slowWeight(h, clock, tt.took, strconv.FormatInt(tt.cost, 10))); err != nil {
				t.Fatal(err)
			}
			if got := remaining(h); got < tt.min || got > tt.max {
				t.Errorf("after a %v response costing %d: %d left, want %d to %d", tt.took, tt.cost, got, tt.min, tt.max)
			}
			w, err := serve(h, weightedRequest("/"))
			if err != nil {
				t.Fatalf("the next request: %v (RateLimit %q), want it to pass", err, w.Header().Get("RateLimit"))
			}
		})
	}
}

// A download's bytes are charged as they are sent, each at the time it is:
// a long download at a rate the zone allows leaves the key about full, not
// in debt, and the same bytes sent at once cost their size.
func TestResponseBytesAreChargedAsTheyAreSent(t *testing.T) {
	for _, tt := range []struct {
		name     string
		chunks   int
		step     time.Duration
		min, max int64 // what the key holds right after the response
	}{
		// Ten minutes at 1000 bytes a second: the last 1000 are not
		// refilled yet.
		{"ten_minutes", 600, time.Second, 999_000, 999_001},
		// 600000 bytes at one instant.
		{"at_once", 600, 0, 400_000, 400_001},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, clock := byteRateHandler(t, "download_"+tt.name, func(z *Zone) { z.WeightResponseBytes = true })
			if _, err := serveThrough(h, weightedRequest("/"), slowDownload(h, clock, tt.chunks, 1000, tt.step)); err != nil {
				t.Fatal(err)
			}
			if got := remaining(h); got < tt.min || got > tt.max {
				t.Errorf("after 600000 bytes: %d left, want %d to %d", got, tt.min, tt.max)
			}
			w, err := serve(h, weightedRequest("/"))
			if err != nil {
				t.Fatalf("the next request: %v (RateLimit %q), want it to pass", err, w.Header().Get("RateLimit"))
			}
		})
	}
}

// sendWatcher is a response writer that reports, whenever bytes reach it,
// what the key of weightedRequest holds in h's zone then.
type sendWatcher struct {
	*httptest.ResponseRecorder
	h    *Handler
	seen []int64
}

func (w *sendWatcher) Write(p []byte) (int, error) {
	w.seen = append(w.seen, remaining(w.h))
	return w.ResponseRecorder.Write(p)
}

func (w *sendWatcher) WriteString(s string) (int, error) { return w.Write([]byte(s)) }

// Bytes are charged before they are sent, whether the handler writes them or
// hands the writer a reader (as a file server does): the client cannot have
// the end of a body, and come back, before the key has paid for it.
func TestResponseBytesAreChargedBeforeTheyAreSent(t *testing.T) {
	for _, tt := range []struct {
		name string
		body func(w http.ResponseWriter) error
	}{
		{"write", func(w http.ResponseWriter) error { _, err := w.Write(make([]byte, 300_000)); return err }},
		{"read_from", func(w http.ResponseWriter) error {
			_, err := w.(io.ReaderFrom).ReadFrom(strings.NewReader(strings.Repeat("x", 300_000)))
			return err
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, _ := byteRateHandler(t, "sent_"+tt.name, func(z *Zone) { z.WeightResponseBytes = true })
			w := &sendWatcher{ResponseRecorder: httptest.NewRecorder(), h: h}
			r := weightedRequest("/")
			caddyhttp.NewTestReplacer(r)
			err := h.serveAt(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return tt.body(w) }), h.now())
			if err != nil {
				t.Fatal(err)
			}
			if w.Body.Len() != 300_000 {
				t.Fatalf("%d bytes sent, want 300000", w.Body.Len())
			}
			// The first bytes to arrive were already paid for: the
			// key holds at most a million less what reached the
			// writer with them.
			if len(w.seen) == 0 || w.seen[0] > 1_000_000-min(int64(w.Body.Len()), 32*1024)+1 {
				t.Errorf("the key held %v as the bytes were sent, want them charged first", w.seen)
			}
			if got := remaining(h); got < 700_000 || got > 700_001 {
				t.Errorf("after 300000 bytes: %d left, want 700000 or 700001", got)
			}
		})
	}
}

// A quota counts a reported cost in the window where it was reported.
func TestResponseWeightCountsInTheQuotaWhenReported(t *testing.T) {
	h, clock := byteRateHandler(t, "slow_quota", func(z *Zone) {
		z.WeightResponseHeader = "X-Cost"
		z.Quotas = []Quota{{MaxEvents: 200_000, Window: caddy.Duration(time.Minute)}}
	})
	// Two windows later, the arrival's window weighs nothing any more.
	if _, err := serveThrough(h, weightedRequest("/"), slowWeight(h, clock, 2*time.Minute, "150000")); err != nil {
		t.Fatal(err)
	}
	z := h.zones[0]
	if got := z.quotas[0].(*limiter.Sketch).Estimate(keyOf(z, "192.0.2.1:1", "", nil), clock.Now()); got < 149_999 {
		t.Errorf("quota estimate %v after a response costing 150000, want at least 149999", got)
	}
}
