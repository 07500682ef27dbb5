package floodgate

import (
	"context"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap/zapcore"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

func TestRetryAfterIsTheCeilingOfTheWait(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour)) // after the tables are made: their clocks start then
	h := newTestHandler(t, clock, map[string]*Zone{
		"retry_ceiling": {Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(3 * time.Second)}},
	})
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	if _, err := serve(h, req); err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		advance time.Duration
		want    string
	}{
		{0, "3"},                       // a 3 s wait says 3
		{800 * time.Millisecond, "3"},  // 2.2 s says 3
		{1600 * time.Millisecond, "1"}, // 0.6 s says 1
	} {
		clock.Advance(step.advance)
		w, err := serve(h, req)
		if status(err) != http.StatusTooManyRequests {
			t.Fatalf("after %v: status %d, want 429", step.advance, status(err))
		}
		if got := w.Header().Get("Retry-After"); got != step.want {
			t.Errorf("after %v more: Retry-After %q, want %q", step.advance, got, step.want)
		}
	}
	// The table's ticks need not line up with the test's clock; the extra
	// millisecond covers a wait that ends inside a tick.
	clock.Advance(600*time.Millisecond + time.Millisecond)
	if _, err := serve(h, req); err != nil {
		t.Errorf("after the full wait: %v", err)
	}
}

// Jitter spreads the Retry-After of denied clients, and never takes it
// past the window of the policy that denied (RateLimit's w): with 2 a
// 20 s window, a key denied 10 s after its first grant waits 10 s, plus
// up to 5 s of jitter; one denied at once waits the whole window, and
// gets none.
func TestJitterAddsAtMostItsFractionAndIsRaceFree(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour)) // after the tables are made: their clocks start then
	h := newTestHandler(t, clock, map[string]*Zone{"jitter": {Limit: zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(20 * time.Second)}}})
	h.Jitter = 0.5
	denials := func(key string) map[int]bool {
		var wg sync.WaitGroup
		results := make([]int, 64)
		for i := range results {
			wg.Go(func() {
				w, _ := serve(h, withRemote(httptest.NewRequest(http.MethodGet, "/", nil), key))
				results[i], _ = strconv.Atoi(w.Header().Get("Retry-After"))
			})
		}
		wg.Wait()
		seen := map[int]bool{}
		for _, n := range results {
			seen[n] = true
		}
		return seen
	}
	if _, err := serve(h, withRemote(httptest.NewRequest(http.MethodGet, "/", nil), "192.0.2.1:1")); err != nil {
		t.Fatal(err)
	}
	clock.Advance(10 * time.Second)
	if _, err := serve(h, withRemote(httptest.NewRequest(http.MethodGet, "/", nil), "192.0.2.1:1")); err != nil {
		t.Fatal(err)
	}
	seen := denials("192.0.2.1:1")
	for n := range seen {
		// The wait is 10 s (a little more if the limiter rounds its tick
		// up); half of it again at most.
		if n < 10 || n > 16 {
			t.Errorf("Retry-After %d, want 10 to 16 (10 s plus up to 50%%)", n)
		}
	}
	// Spread over the 5 s of jitter: 64 draws land on at least 3 of the
	// whole seconds 11 to 15 unless jitter is ignored (all the same).
	if len(seen) < 3 {
		t.Errorf("Retry-After took the values %v over 64 denials, want at least 3 different ones", slices.Sorted(maps.Keys(seen)))
	}
	// A key that took both its grants at once waits the window: jitter
	// has no room below it.
	clock.Advance(30 * time.Second)
	for range 2 {
		if _, err := serve(h, withRemote(httptest.NewRequest(http.MethodGet, "/", nil), "192.0.2.3:1")); err != nil {
			t.Fatal(err)
		}
	}
	if seen := denials("192.0.2.3:1"); len(seen) != 1 || !seen[20] {
		t.Errorf("denied for the whole 20 s window, Retry-After took the values %v, want only 20", slices.Sorted(maps.Keys(seen)))
	}
}

// The placeholders of a denial describe the denying zone, even when an
// earlier rate_limit handler of the same request set them for its own
// (allowed) zone.
func TestDenialPlaceholdersReplaceAnEarlierHandlers(t *testing.T) {
	first := newTestHandler(t, nil, map[string]*Zone{"outer": {Limit: zoneconf.Limit{MaxEvents: 100, Window: caddy.Duration(time.Hour)}}})
	second := newTestHandler(t, nil, map[string]*Zone{"inner": {Limit: zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(time.Hour), Burst: 1}}})
	second.LogKey = true
	const text = "{http.rate_limit.exceeded.name} {http.rate_limit.zone} {http.rate_limit.limit} {http.rate_limit.remaining} {http.rate_limit.retry_after} [{http.rate_limit.key}]"
	var got []string
	now := time.Now()
	for range 2 {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		repl := caddyhttp.NewTestReplacer(r)
		w := httptest.NewRecorder()
		chain := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			return second.serveAt(w, r, okHandler, now)
		})
		err := first.serveAt(w, r, chain, now)
		got = append(got, strconv.Itoa(status(err))+" "+repl.ReplaceKnown(text, ""))
	}
	want := []string{
		"200 {http.rate_limit.exceeded.name} inner 1 0 0 []",
		"429 inner inner 1 0 1800 []",
	}
	if !slices.Equal(got, want) {
		t.Errorf("placeholders:\n got %q\nwant %q", got, want)
	}
}

// A denial returns a caddyhttp.HandlerError itself (not wrapped: Caddy's
// server finds it by type assertion), made once per zone.
func TestDenialIsOneUnwrappedHandlerErrorPerZone(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"once": {Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour)}}})
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	_, _ = serve(h, req)
	_, err1 := serve(h, req)
	_, err2 := serve(h, req)
	he, ok := err1.(caddyhttp.HandlerError)
	if !ok || he.StatusCode != http.StatusTooManyRequests || he.Err == nil || he.Err.Error() != `rate limit exceeded in zone "once"` {
		t.Fatalf("error %T %#v, want a caddyhttp.HandlerError 429 naming the zone", err1, err1)
	}
	if err1 != err2 {
		t.Errorf("two denials returned different errors: %v, %v", err1, err2)
	}
}

func TestEventOnlyWhenSomethingListens(t *testing.T) {
	for _, listening := range []bool{false, true} {
		h, _ := deniedHandler(t, "evented_"+strconv.FormatBool(listening), "{remote_host}", zapcore.InfoLevel)
		ev := &recordingEmitter{listening: listening}
		h.events = ev
		r := requestFrom("203.0.113.9:4")
		now := time.Now()
		for range 3 {
			_, _ = serveAt(h, r, now)
		}
		if !listening {
			if len(ev.events) != 0 {
				t.Errorf("nothing listens: %d events emitted", len(ev.events))
			}
			continue
		}
		if len(ev.events) != 2 {
			t.Fatalf("%d events for 2 denials, want 2", len(ev.events))
		}
		e := ev.events[0]
		if e["zone"] != h.zones[0].name || e["client_ip"] != "203.0.113.9" || e["source"] != "203.0.113.0/24" || e["retry_after"] != int64(3600) {
			t.Errorf("event data %v", e)
		}
		if _, ok := e["key"]; ok {
			t.Errorf("event carries the key without log_key: %v", e)
		}
	}
}

// What a request costs in allocations, in the handler itself: the response
// headers are one allocation, placeholders none; a denial adds its
// placeholder provider, and builds no log line, event or error.
func TestHandlerAllocations(t *testing.T) {
	for _, tt := range []struct {
		name    string
		key     string
		headers bool
		denied  bool
		want    float64
	}{
		{"allowed", "{http.vars.client_ip}", true, false, 1},
		{"allowed_no_headers", "{http.vars.client_ip}", false, false, 0},
		{"allowed_header_key", "{http.request.header.X-Key}", true, false, 1},
		{"denied", "{http.vars.client_ip}", true, true, 2},
		{"denied_no_headers", "{http.vars.client_ip}", false, true, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			events := int64(1000)
			if tt.denied {
				events = 1
			}
			h, _ := limitedHandler(t, "allocs_"+tt.name, tt.key, events, zapcore.InfoLevel)
			h.DisableHeaders = !tt.headers
			h.events = &recordingEmitter{}
			r := requestFrom("192.0.2.1:1234")
			r.Header.Set("X-Key", "alice")
			caddyhttp.NewTestReplacer(r)
			r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "192.0.2.1"}))
			w := httptest.NewRecorder()
			now := time.Now()
			serveOnce := func() {
				clear(w.HeaderMap)
				_ = h.serveAt(w, r, okHandler, now)
			}
			serveOnce() // the first denial is logged at INFO
			serveOnce()
			if got := testing.AllocsPerRun(200, serveOnce); got > tt.want {
				t.Errorf("%v allocations per request, want at most %v", got, tt.want)
			}
		})
	}
}

// A route with four zones, each with a quota, allocates what a route with
// one does: the response headers' one allocation holds the RateLimit items
// of all of them, and the RateLimit-Policy value is the handler's, made
// once.
func TestFourZonesWithQuotasAllocateAsOne(t *testing.T) {
	zones := func(names ...string) map[string]*Zone {
		m := map[string]*Zone{}
		for _, name := range names {
			m[name] = &Zone{
				Key:    "{http.request.header.X-Key}",
				Limit:  zoneconf.Limit{MaxEvents: 1000, Window: caddy.Duration(10 * time.Second), Memory: 1 << 16},
				Quotas: []Quota{{MaxEvents: 10000000, Window: caddy.Duration(time.Hour)}},
			}
		}
		return m
	}
	allocs := func(h *Handler) (float64, http.Header) {
		r := requestFrom("192.0.2.1:1234")
		r.Header.Set("X-Key", "alice")
		caddyhttp.NewTestReplacer(r)
		w := httptest.NewRecorder()
		now := time.Now()
		serveOnce := func() {
			clear(w.HeaderMap)
			now = now.Add(100 * time.Millisecond)
			if err := h.serveAt(w, r, okHandler, now); err != nil {
				t.Fatal(err)
			}
		}
		serveOnce()
		return testing.AllocsPerRun(200, serveOnce), w.Header()
	}
	one, _ := allocs(newTestHandler(t, nil, zones("one")))
	four, hdr := allocs(newTestHandler(t, nil, zones("a", "b", "c", "d")))
	if one > 1 {
		t.Errorf("one zone: %v allocations per request, want at most 1", one)
	}
	if four != one {
		t.Errorf("four zones: %v allocations per request, one zone %v", four, one)
	}
	if got := strings.Count(hdr.Get("RateLimit"), ";r="); got != 8 {
		t.Errorf("RateLimit %q: %d items, want 8", hdr.Get("RateLimit"), got)
	}
	if got := strings.Count(hdr.Get("RateLimit-Policy"), ";q="); got != 8 {
		t.Errorf("RateLimit-Policy %q: %d items, want 8", hdr.Get("RateLimit-Policy"), got)
	}
}

// Each zone of a handler charges its own key, whether its key is read
// before any zone decides (a header, an address: touchAll) or in its turn
// (a template): a request that changes every key but one zone's is denied
// by that zone alone.
func TestEveryZoneChargesItsOwnKey(t *testing.T) {
	one := zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour), Memory: 1 << 16}
	h := newTestHandler(t, nil, map[string]*Zone{
		"a": {Key: "{http.request.header.X-A}", Limit: one},
		"b": {Key: "{http.request.header.X-B}/{http.request.method}", Limit: one},
		"c": {Key: "{remote_host}", Limit: one},
		"d": {Key: "{http.request.header.X-D}", Limit: one},
	})
	now := time.Now()
	send := func(a, b, remote, d string) error {
		r := requestFrom(remote + ":1234")
		r.Header.Set("X-A", a)
		r.Header.Set("X-B", b)
		r.Header.Set("X-D", d)
		caddyhttp.NewTestReplacer(r)
		return h.serveAt(httptest.NewRecorder(), r, okHandler, now)
	}
	if err := send("a0", "b0", "192.0.2.1", "d0"); err != nil {
		t.Fatal(err)
	}
	for i, tt := range [][4]string{
		{"a0", "b1", "192.0.2.2", "d1"},
		{"a2", "b0", "192.0.2.3", "d2"},
		{"a3", "b3", "192.0.2.1", "d3"},
		{"a4", "b4", "192.0.2.4", "d0"},
	} {
		err := send(tt[0], tt[1], tt[2], tt[3])
		zone := string(rune('a' + i))
		if status(err) != http.StatusTooManyRequests || !strings.Contains(err.Error(), `"`+zone+`"`) {
			t.Errorf("keys %v, all new but zone %s's: %v, want a denial by zone %s", tt, zone, err, zone)
		}
	}
}
