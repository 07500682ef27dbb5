package floodgate

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// FuzzRequestAndResponseWeights serves one request whose weight comes from a
// header (weight {http.request.header.X-Cost}) and whose response reports its
// cost (weight response_header X-Resp), both arbitrary text. A weight that is
// not a whole number from 1 to the burst is answered 400 and charges
// nothing; an allowed request leaves the key exactly what its larger cost
// leaves, never less than empty in what it reports, and a debt it can repay
// within two bursts' refill.
func FuzzRequestAndResponseWeights(f *testing.F) {
	for _, s := range [][2]string{{"1", "1"}, {"4", "60"}, {"100", "0"}, {"101", "1"}, {"5", "5000"}, {" 3 ", "-7"}, {"2", "99999999999999999999"}, {"", "7"}, {"x", "y"}} {
		f.Add(s[0], s[1])
	}
	const burst = 100
	cost, err := weight.Parse("{http.request.header.X-Cost}")
	if err != nil {
		f.Fatal(err)
	}
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, reqCost, respCost string) {
		clock := testclock.New(time.Unix(1e9, 0))
		name := "fuzz_cost_" + strconv.FormatInt(n.Add(1), 10)
		h := newTestHandler(t, clock, map[string]*Zone{name: {
			Limit:                zoneconf.Limit{MaxEvents: burst, Window: caddy.Duration(time.Hour), Burst: burst, Memory: 4096},
			Weights:              []*weight.Rule{{Weight: cost}},
			WeightResponseHeader: "X-Resp",
		}})
		r := weightedRequest("/")
		r.Header["X-Cost"] = []string{reqCost}
		w, err := serveAtWith(h, r, clock.Now(), func(w http.ResponseWriter) {
			w.Header()["X-Resp"] = []string{respCost}
			w.WriteHeader(http.StatusOK)
		})
		z := h.zones[0]
		left := z.buckets.PeekHash(limiter.Hash(nil), 1, clock.Now())
		wt, ok := weight.Count(reqCost)
		if !ok || wt > burst {
			if status(err) != http.StatusBadRequest || left.Remaining != burst {
				t.Fatalf("X-Cost %q: status %d, %d left; want 400 and %d left", reqCost, status(err), left.Remaining, burst)
			}
			return
		}
		if err != nil || w.Code != http.StatusOK {
			t.Fatalf("X-Cost %q: %v, %d", reqCost, err, w.Code)
		}
		paid := wt
		if rn, ok := weight.Count(respCost); ok {
			paid = max(paid, rn)
		}
		if want := max(0, burst-paid); left.Remaining != want {
			t.Fatalf("X-Cost %q, X-Resp %q: %d left, want %d", reqCost, respCost, left.Remaining, want)
		}
		if most := 2 * time.Hour; left.RetryAfter > most {
			t.Fatalf("X-Cost %q, X-Resp %q: in debt for %v, more than %v", reqCost, respCost, left.RetryAfter, most)
		}
	})
}

// serveAtWith runs one request through h at time now, answered by respond.
func serveAtWith(h *Handler, r *http.Request, now time.Time, respond func(http.ResponseWriter)) (*httptest.ResponseRecorder, error) {
	return serveNextAt(h, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		respond(w)
		return nil
	}), now)
}
