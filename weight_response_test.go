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

// keyedHandler is a handler with one zone keyed by the X-Key header, of
// limit and weight rule edit sets, on a clock of its own.
func keyedHandler(t *testing.T, name string, limit zoneconf.Limit, edit func(*Zone)) (*Handler, *testclock.Clock) {
	t.Helper()
	clock := testclock.New(time.Now().Add(time.Hour))
	limit.Memory = 4096
	zc := &Zone{Key: "{http.request.header.X-Key}", Limit: limit}
	edit(zc)
	return newTestHandler(t, clock, map[string]*Zone{name: zc}), clock
}

// left is what key holds in h's only zone at h's time.
func left(h *Handler, key string) int64 {
	z := h.zones[0]
	return z.buckets.PeekHash(keyOf(z, "192.0.2.1:1", "", map[string]string{"X-Key": key}), 1, h.now()).Remaining
}

// upstream answers with status, written or (as basic_auth does) returned
// as an error, and counts the requests that reach it.
type upstream struct {
	hits     int
	status   int
	returned bool
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	u.hits++
	if u.returned {
		return caddyhttp.Error(u.status, io.EOF)
	}
	w.WriteHeader(u.status)
	return nil
}

// A zone with weight response_status charges only the responses whose
// status it names, written or returned as an error, and refuses a key whose
// budget they spent before its request reaches the upstream.
func TestResponseStatusChargesOnlyMatchingResponses(t *testing.T) {
	for _, returned := range []bool{false, true} {
		t.Run(map[bool]string{false: "written", true: "returned"}[returned], func(t *testing.T) {
			h, _ := keyedHandler(t, "logins_"+strconv.FormatBool(returned), zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Burst: 3}, func(z *Zone) {
				z.WeightResponseStatus = []string{"401", "403"}
			})
			ok := &upstream{status: http.StatusOK, returned: false}
			for i := range 10 {
				if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), ok); err != nil {
					t.Fatalf("successful login %d: %v", i+1, err)
				}
			}
			if got := left(h, "a"); got != 3 {
				t.Fatalf("after 10 successful logins the key holds %d, want 3: they cost nothing", got)
			}
			failed := &upstream{status: http.StatusUnauthorized, returned: returned}
			for i := range 3 {
				if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), failed); status(err) == http.StatusTooManyRequests {
					t.Fatalf("failed login %d refused: %v", i+1, err)
				}
			}
			w, err := serveThrough(h, weightedRequest("/", "X-Key: a"), failed)
			if status(err) != http.StatusTooManyRequests || failed.hits != 3 {
				t.Fatalf("4th failed login: %v after %d upstream hits, want a 429 before the upstream (3 hits)", err, failed.hits)
			}
			if got := w.Header().Get("RateLimit"); !strings.Contains(got, "r=0") {
				t.Errorf("RateLimit %q, want r=0", got)
			}
			if _, err := serveThrough(h, weightedRequest("/", "X-Key: b"), failed); status(err) == http.StatusTooManyRequests || failed.hits != 4 {
				t.Errorf("another key's failed login: %v, want it to reach the upstream", err)
			}
		})
	}
}

// Requests in flight when a key's budget is spent were all admitted with
// room: the key is charged each as its status is known, into debt up to one
// burst below empty (limiter.Buckets.Charge), which the next request waits
// out.
func TestResponseStatusOvershootIsWhatWasInFlight(t *testing.T) {
	h, clock := keyedHandler(t, "logins_in_flight", zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Minute), Burst: 1}, func(z *Zone) {
		z.WeightResponseStatus = []string{"4xx"}
	})
	// Three requests admitted before any has answered: each nests the
	// next inside it, so all three pass the zone before the first 401.
	var serve func(depth int) caddyhttp.Handler
	admitted := 0
	serve = func(depth int) caddyhttp.Handler {
		return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			admitted++
			if depth < 3 {
				if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), serve(depth+1)); status(err) != http.StatusUnauthorized {
					t.Errorf("request %d admitted while %d in flight: %v", depth+1, depth, err)
				}
			}
			return caddyhttp.Error(http.StatusUnauthorized, io.EOF)
		})
	}
	if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), serve(1)); status(err) != http.StatusUnauthorized {
		t.Fatal(err)
	}
	if admitted != 3 {
		t.Fatalf("%d admitted, want 3", admitted)
	}
	if got := left(h, "a"); got != 0 {
		t.Errorf("key holds %d after 3 failures on a budget of 1, want 0 (and debt behind it)", got)
	}
	// Three charged on a budget of 1: a debt of 1 below empty (one
	// burst), which the key refills at 1 a minute: refused for two
	// minutes less a moment, not more.
	clock.Advance(2*time.Minute - time.Second)
	if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), &upstream{status: 200}); status(err) != http.StatusTooManyRequests {
		t.Errorf("after 1m59s: %v, want a 429 (the overshoot is owed)", err)
	}
	clock.Advance(time.Second)
	if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), &upstream{status: 200}); err != nil {
		t.Errorf("after 2m: %v, want it served", err)
	}
}

// A dry run (action log) of response_status is charged as the zone would be
// if it enforced, for the requests it would let through; those it would deny
// pass, logged, and are charged nothing, as for every weight.
func TestResponseStatusDryRunChargesWhatItWouldLetThrough(t *testing.T) {
	h, clock := keyedHandler(t, "logins_dry_run", zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(time.Hour), Burst: 2}, func(z *Zone) {
		z.WeightResponseStatus = []string{"401"}
		z.Action = "log"
	})
	failed := &upstream{status: http.StatusUnauthorized}
	for i := range 5 {
		if _, err := serveThrough(h, weightedRequest("/", "X-Key: a"), failed); err != nil {
			t.Fatalf("failed login %d in a dry run: %v, want it to pass", i+1, err)
		}
	}
	if failed.hits != 5 {
		t.Errorf("%d upstream hits, want 5: a dry run refuses nothing", failed.hits)
	}
	// Charged 2, not 5: half an hour brings one back.
	clock.Advance(30 * time.Minute)
	if got := left(h, "a"); got != 1 {
		t.Errorf("half an hour after 2 charged and 3 logged: %d left, want 1", got)
	}
}

// With action delay, a request of a spent key waits for its budget and then
// goes on; its weight is reserved while it waits, and its status charges
// nothing more.
func TestResponseStatusWithDelayHoldsASpentKey(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour))
	h := newTestHandler(t, clock, map[string]*Zone{"logins_delay": {
		Limit:                zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Second), Burst: 1},
		WeightResponseStatus: []string{"401"},
		Action:               "delay",
		MaxDelay:             caddy.Duration(250 * time.Millisecond),
	}})
	held := &heldClock{clock: clock}
	h.sleep = held.sleep
	failed := &upstream{status: http.StatusUnauthorized}
	for i := range 3 {
		if _, err := serveThrough(h, weightedRequest("/"), failed); status(err) == http.StatusTooManyRequests {
			t.Fatalf("failed login %d: %v, want it held, then served", i+1, err)
		}
	}
	// One back every 100 ms, burst 1: the first is charged at its 401,
	// the next two wait for a token each.
	if w := held.held(); len(w) != 2 || w[0] <= 0 || w[0] > 100*time.Millisecond || w[1] <= 0 || w[1] > 100*time.Millisecond {
		t.Errorf("waits %v, want two of at most 100ms", w)
	}
	if failed.hits != 3 {
		t.Errorf("%d upstream hits, want 3", failed.hits)
	}
}

// A request held by another zone (action delay) passes a response_status
// zone's quota as it passes its rate: checked, not charged, since only a
// matching status charges. Before, the hold charged the quota at admission:
// three successful logins held by a gate spent three of the quota's five.
func TestAHoldElsewhereChargesNoQuotaOfAStatusZone(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour))
	h := newTestHandler(t, clock, map[string]*Zone{
		"a_gate": {
			Key:      "{http.request.header.X-Key}",
			Limit:    zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Second), Burst: 1, Memory: 4096},
			Action:   "delay",
			MaxDelay: caddy.Duration(250 * time.Millisecond),
		},
		"b_logins": {
			Key:                  "{http.request.header.X-Key}",
			Limit:                zoneconf.Limit{MaxEvents: 100, Window: caddy.Duration(time.Minute), Burst: 100, Memory: 4096},
			Quotas:               []Quota{{MaxEvents: 5, Window: caddy.Duration(time.Hour)}},
			WeightResponseStatus: []string{"401"},
		},
	})
	held := &heldClock{clock: clock}
	h.sleep = held.sleep
	ok := &upstream{status: http.StatusOK}
	for i := range 3 {
		if _, err := serveThrough(h, weightedRequest("/", "X-Key: carol"), ok); err != nil {
			t.Fatalf("successful login %d: %v", i+1, err)
		}
	}
	if w := held.held(); len(w) != 2 {
		t.Fatalf("held %v, want the 2nd and 3rd held by the gate", w)
	}
	var logins *zone
	for _, z := range h.zones {
		if z.name == "b_logins" {
			logins = z
		}
	}
	key := keyOf(logins, "192.0.2.1:1", "", map[string]string{"X-Key": "carol"})
	if d := logins.quotas[0].PeekHash(key, 1, clock.Now()); d.Remaining != 5 {
		t.Errorf("after 3 successful logins, 2 of them held by another zone, the quota of 5 failed logins has %d left, want all 5", d.Remaining)
	}
}

// A connection upgraded to a WebSocket (reverse_proxy writes 101 Switching
// Protocols, hijacks the connection and returns nil when the socket closes)
// is charged as a 101, not as a 200. Were 101 taken for an interim status, as
// the other 1xx are, no status would be seen and Done(nil) would report 200:
// `weight response_status 2xx` (or 200) would charge every WebSocket session,
// although Caddy's access log records it as 101 and the docs say the status
// charged is the one the access log records.
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
