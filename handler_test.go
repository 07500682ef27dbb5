package floodgate

import (
	"context"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"
	"unsafe"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// testClocks holds the clock of each handler made by newTestHandler with one;
// serve passes its time to the handler.
var testClocks sync.Map // *Handler → *testclock.Clock

// newTestHandler provisions a handler with the given inline zones (without
// matchers, which need a Caddy context) whose requests, run by serve, happen
// at clock's time (or the real time if clock is nil). Its zones' tables are
// released when the test ends.
func newTestHandler(t testing.TB, clock *testclock.Clock, zones map[string]*Zone) *Handler {
	t.Helper()
	h := &Handler{RateLimits: zones, logger: zap.NewNop(), sleep: sleep, now: time.Now}
	h.meter = &timeMeter{clock: time.Now}
	if clock != nil {
		h.now = clock.Now
		h.meter.clock = clock.Now
		testClocks.Store(h, clock)
		t.Cleanup(func() { testClocks.Delete(h) })
	}
	for _, name := range slices.Sorted(maps.Keys(zones)) {
		z, err := provisionZone(caddy.Context{}, name, zones[name])
		if err != nil {
			t.Fatal(err)
		}
		h.owned = append(h.owned, z)
		h.zones = append(h.zones, z)
	}
	h.setZones(h.zones)
	t.Cleanup(func() { _ = h.Cleanup() })
	return h
}

var okHandler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
})

// serve runs one request through h, at the time of its test clock if it
// has one, and returns the recorder and the error.
func serve(h *Handler, r *http.Request) (*httptest.ResponseRecorder, error) {
	now := time.Now()
	if c, ok := testClocks.Load(h); ok {
		now = c.(*testclock.Clock).Now()
	}
	return serveAt(h, r, now)
}

// serveAt runs one request through h at time now, with a fresh replacer.
func serveAt(h *Handler, r *http.Request, now time.Time) (*httptest.ResponseRecorder, error) {
	return serveNextAt(h, r, okHandler, now)
}

// serveNextAt runs one request through h and on to next at time now, with a
// fresh replacer, and returns the recorder and the error.
func serveNextAt(h *Handler, r *http.Request, next caddyhttp.Handler, now time.Time) (*httptest.ResponseRecorder, error) {
	w := httptest.NewRecorder()
	caddyhttp.NewTestReplacer(r)
	return w, h.serveAt(w, r, next, now)
}

func status(err error) int {
	if err == nil {
		return http.StatusOK
	}
	if he, ok := err.(caddyhttp.HandlerError); ok {
		return he.StatusCode
	}
	return -1
}

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

// withRemote sets r's peer address.
func withRemote(r *http.Request, addr string) *http.Request {
	r.RemoteAddr = addr
	return r
}

func TestLimitsChangeOnlyWhenAConfigGoesLive(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"goes_live": {Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Memory: 4096}}})
	running := h.zones[0]
	events := func() int64 { return running.buckets.Limit().Events }
	oldApp := &App{logger: zap.NewNop(), live: []*zone{running}}
	if err := oldApp.Start(); err != nil {
		t.Fatal(err)
	}

	z, err := provisionZone(caddy.Context{}, "goes_live", &Zone{Limit: zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Hour), Memory: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	defer z.release()
	if z.buckets != running.buckets {
		t.Fatal("same zone and shape got a different table")
	}
	if events() != 3 {
		t.Fatalf("after provisioning events 10: %d in force, want 3 until the config starts", events())
	}

	// A config that starts, then is stopped because another of its apps
	// failed to start, gives the limit back.
	failed := &App{logger: zap.NewNop(), live: []*zone{z}}
	if err := failed.Start(); err != nil {
		t.Fatal(err)
	}
	if events() != 10 {
		t.Fatalf("after Start: events %d, want 10", events())
	}
	if err := failed.Stop(); err != nil {
		t.Fatal(err)
	}
	if events() != 3 {
		t.Fatalf("after the failed config stopped: events %d, want 3 again", events())
	}

	// A config that goes live keeps its limit when the config it replaced
	// is stopped.
	live := &App{logger: zap.NewNop(), live: []*zone{z}}
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	if err := oldApp.Stop(); err != nil {
		t.Fatal(err)
	}
	if events() != 10 {
		t.Errorf("after the replaced config stopped: events %d, want 10", events())
	}

	other, err := provisionZone(caddy.Context{}, "goes_live", &Zone{Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Memory: 8192}})
	if err != nil {
		t.Fatal(err)
	}
	defer other.release()
	if other.buckets == running.buckets {
		t.Error("a zone whose memory changed kept the old table")
	}
}

// TestPolicyDescribesTheRate checks that RateLimit-Policy's q/w is the
// sustained rate, or just under it, whatever the burst and window, and q the
// burst when the bucket refills over whole seconds.
func TestPolicyDescribesTheRate(t *testing.T) {
	for _, tc := range []struct {
		l    limiter.Limit
		want string
	}{
		{limiter.Limit{Events: 100, Window: time.Minute}, `"z";q=100;w=60`},
		{limiter.Limit{Events: 100, Window: time.Minute, Burst: 10}, `"z";q=10;w=6`},
		{limiter.Limit{Events: 10, Window: time.Hour, Burst: 2}, `"z";q=2;w=720`},
		{limiter.Limit{Events: 10, Window: time.Minute, Burst: 100}, `"z";q=100;w=600`},
		{limiter.Limit{Events: 40, Window: time.Minute, Burst: 3}, `"z";q=3;w=5`},
		{limiter.Limit{Events: 10, Window: 100 * time.Millisecond}, `"z";q=100;w=1`},
		{limiter.Limit{Events: 3, Window: 1500 * time.Millisecond}, `"z";q=3;w=2`},
		{limiter.Limit{Events: 1_000_000, Window: time.Second, Burst: 1}, `"z";q=1000000;w=1`},
		{limiter.Limit{Events: 1, Window: 365 * 24 * time.Hour, Burst: limiter.MaxBurst}, `"z";q=1048576;w=33067892736000`},
	} {
		if got := policyItem("z", tc.l); got != tc.want {
			t.Errorf("%v: %s, want %s", tc.l, got, tc.want)
		}
	}
}

func TestHeaderFormat(t *testing.T) {
	a := &zone{name: "api", policy: policyItem("api", limiter.Limit{Events: 100, Window: time.Minute}), rateW: time.Minute}
	b := &zone{name: "daily", policy: policyItem("daily", limiter.Limit{Events: 1000, Window: 1500 * time.Millisecond}), rateW: 2 * time.Second}
	hdr := http.Header{}
	new(responseHeaders).setRateLimit(hdr, []verdict{{z: a, d: limiter.Decision{Remaining: 42, Reset: 17100 * time.Millisecond}}}, 0, "")
	if got, want := hdr.Get("RateLimit-Policy"), `"api";q=100;w=60`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("RateLimit"), `"api";r=42;t=18`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	rh := new(responseHeaders)
	rh.setRateLimit(hdr, []verdict{
		{z: a, d: limiter.Decision{Remaining: 0, Reset: time.Minute}},
		{z: b, d: limiter.Decision{Remaining: -1, Reset: 0}},
	}, 0, "")
	rh.setRetryAfter(hdr, 1234567)
	if got, want := hdr.Get("RateLimit-Policy"), `"api";q=100;w=60, "daily";q=1000;w=2`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("RateLimit"), `"api";r=0;t=60, "daily";r=0;t=0`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	if got, want := hdr.Get("Retry-After"), "1234567"; got != want {
		t.Errorf("Retry-After %q, want %q", got, want)
	}
}

// Values longer than the headers' buffer spill to the heap, and every value
// keeps its own text.
func TestHeaderValuesOutgrowingTheBuffer(t *testing.T) {
	var verdicts []verdict
	var wantPolicy, wantLimit []string
	for i := range 6 {
		name := "zone-with-a-long-name-" + strconv.Itoa(i)
		verdicts = append(verdicts, verdict{z: &zone{name: name, policy: policyItem(name, limiter.Limit{Events: 100, Window: time.Minute}), rateW: time.Minute}, d: limiter.Decision{Remaining: int64(i), Reset: time.Second}})
		wantPolicy = append(wantPolicy, `"`+name+`";q=100;w=60`)
		wantLimit = append(wantLimit, `"`+name+`";r=`+strconv.Itoa(i)+`;t=1`)
	}
	hdr := http.Header{}
	rh := new(responseHeaders)
	rh.setRateLimit(hdr, verdicts, 0, "")
	rh.setRetryAfter(hdr, 42)
	if got, want := hdr.Get("RateLimit-Policy"), strings.Join(wantPolicy, ", "); got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("RateLimit"), strings.Join(wantLimit, ", "); got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	if got := hdr.Get("Retry-After"); got != "42" {
		t.Errorf("Retry-After %q, want 42", got)
	}
}

func TestCeilSeconds(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		want int64
	}{
		{0, 0},
		{-time.Second, 0},
		{time.Nanosecond, 1},
		{time.Second, 1},
		{2100 * time.Millisecond, 3},
		{3 * time.Second, 3},
		{limiter.Never, 9223372036},
		{limiter.Never - 1, 9223372036},
	} {
		if got := ceilSeconds(tt.d); got != tt.want {
			t.Errorf("ceilSeconds(%v) = %d, want %d", tt.d, got, tt.want)
		}
	}
}

func TestZoneNamesMustNeedNoEscaping(t *testing.T) {
	for _, name := range []string{"", "a b", `a"b`, `a\b`, "é", "tab\t"} {
		if validZoneName(name) == nil {
			t.Errorf("zone name %q accepted", name)
		}
	}
	for _, name := range []string{"api", "per-client_1", "a.b:c/d"} {
		if err := validZoneName(name); err != nil {
			t.Errorf("zone name %q: %v", name, err)
		}
	}
}

// keyOf returns the hash the zone computes for a request from remote with
// the given client IP var (if not empty) and headers.
func keyOf(z *zone, remote, clientIPVar string, headers map[string]string) uint64 {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = remote
	for k, v := range headers {
		r.Header.Set(k, v)
	}
	if clientIPVar != "" {
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: clientIPVar}))
	}
	return z.key(&request{r: r, repl: caddyhttp.NewTestReplacer(r)}).hash
}

func TestKeyExtraction(t *testing.T) {
	v4, v6 := 24, 48
	mk := func(keys ...string) *zone {
		z := &zone{v4: v4, v6: v6}
		for _, k := range keys {
			z.keys = append(z.keys, parseKeySpec(k))
		}
		return z
	}
	client := mk("{http.vars.client_ip}")
	remote := mk("{remote_host}")
	header := mk("{http.request.header.X-Key}", "{http.request.header.X-Other}")
	none := mk()
	hashOf := func(s string) uint64 { return limiter.Hash([]byte(s)) }
	netOf := func(ip string) uint64 {
		k := limiter.NetworkKey(mustAddr(t, ip), v4, v6)
		return limiter.Hash(k.Bytes())
	}
	huge := strings.Repeat("k", 1<<20)

	for _, tt := range []struct {
		name                   string
		z                      *zone
		remote, clientVar, hdr string
		other                  string
		want                   uint64
	}{
		{"client IP from vars, masked", client, "198.51.100.1:5", "192.0.2.200", "", "", netOf("192.0.2.1")},
		{"client IP falls back to the peer", client, "192.0.2.9:5", "", "", "", netOf("192.0.2.1")},
		{"IPv4-mapped client IP is IPv4", client, "", "::ffff:192.0.2.7", "", "", netOf("192.0.2.1")},
		{"IPv6 client grouped by /48", client, "", "2001:db8:1:ffff::1", "", "", netOf("2001:db8:1::")},
		{"remote host ignores vars", remote, "192.0.2.9:5", "203.0.113.1", "", "", netOf("192.0.2.0")},
		{"remote IPv6 with brackets", remote, "[2001:db8:1:2::3]:443", "", "", "", netOf("2001:db8:1::")},
		{"header holding an IP is masked", header, "", "", "10.1.2.3", "", header.keys[0].salted(netOf("10.1.2.99"))},
		{"header holding a name is hashed", header, "", "", "alice", "", header.keys[0].salted(hashOf("alice"))},
		{"empty first key falls back", header, "", "", "", "bob", header.keys[1].salted(hashOf("bob"))},
		{"no key at all is the empty key", header, "192.0.2.1:5", "", "", "", limiter.Hash(nil)},
		{"a zone without keys is one bucket", none, "192.0.2.1:5", "", "", "", limiter.Hash(nil)},
		{"a huge key is hashed by its first 8 KiB", header, "", "", huge, "", header.keys[0].salted(hashOf(huge[:8<<10]))},
	} {
		t.Run(tt.name, func(t *testing.T) {
			hdrs := map[string]string{}
			if tt.hdr != "" {
				hdrs["X-Key"] = tt.hdr
			}
			if tt.other != "" {
				hdrs["X-Other"] = tt.other
			}
			remoteAddr := tt.remote
			if remoteAddr == "" {
				remoteAddr = "127.0.0.1:1"
			}
			if got := keyOf(tt.z, remoteAddr, tt.clientVar, hdrs); got != tt.want {
				t.Errorf("hash %x, want %x", got, tt.want)
			}
		})
	}
}

func mustAddr(t *testing.T, s string) netip.Addr {
	t.Helper()
	a, err := netip.ParseAddr(s)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// BenchmarkServeHTTP measures the handler's own cost per request, on the
// paths a request takes: allowed (with and without response headers, keyed
// by the client IP, a header or a template) and denied. The replacer and
// request are reused, as the handler's allocations are what it measures.
// Requests are a millisecond apart in the handler's time.
func BenchmarkServeHTTP(b *testing.B) {
	run := func(b *testing.B, h *Handler, wantErr bool) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = "192.0.2.1:1234"
		r.Header.Set("X-Key", "alice")
		r.Header.Set("X-Cost", "3")
		caddyhttp.NewTestReplacer(r)
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "192.0.2.1"}))
		w := httptest.NewRecorder()
		now := time.Now()
		// What the response costs is charged at the handler's time too.
		h.now = func() time.Time { return now }
		_ = h.serveAt(w, r, okHandler, now)
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			clear(w.HeaderMap)
			now = now.Add(time.Millisecond)
			if err := h.serveAt(w, r, okHandler, now); (err != nil) != wantErr {
				b.Fatal(err)
			}
		}
	}
	zone := func(key string, events, burst int64, window time.Duration) map[string]*Zone {
		return map[string]*Zone{"bench" + key: {Key: key, Limit: zoneconf.Limit{MaxEvents: events, Burst: burst, Window: caddy.Duration(window), Memory: 1 << 20}}}
	}
	// One token back per request, with a burst (and so a remaining
	// count) of a realistic size.
	allowAll := func(key string) map[string]*Zone { return zone(key, 1000, 2000, time.Second) }
	b.Run("no_zone", func(b *testing.B) {
		run(b, newTestHandler(b, nil, nil), false)
	})
	b.Run("allowed", func(b *testing.B) {
		run(b, newTestHandler(b, nil, allowAll("{http.vars.client_ip}")), false)
	})
	b.Run("allowed_no_headers", func(b *testing.B) {
		h := newTestHandler(b, nil, allowAll("{http.vars.client_ip}"))
		h.DisableHeaders = true
		run(b, h, false)
	})
	b.Run("allowed_quota", func(b *testing.B) {
		zones := allowAll("{http.vars.client_ip}")
		zones["bench{http.vars.client_ip}"].Quotas = []Quota{{MaxEvents: 1 << 30, Window: caddy.Duration(24 * time.Hour)}}
		run(b, newTestHandler(b, nil, zones), false)
	})
	b.Run("allowed_header_key", func(b *testing.B) {
		run(b, newTestHandler(b, nil, allowAll("{http.request.header.X-Key}")), false)
	})
	b.Run("allowed_template_key", func(b *testing.B) {
		run(b, newTestHandler(b, nil, allowAll("{http.request.method}-{http.request.uri.path}")), false)
	})
	b.Run("denied", func(b *testing.B) {
		h := newTestHandler(b, nil, zone("{http.vars.client_ip}", 1, 0, zoneconf.MaxWindow))
		// Logging at INFO, as Caddy does by default, to nowhere.
		h.logger = zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(io.Discard), zapcore.InfoLevel))
		run(b, h, true)
	})
	// Denied requests from one source, and from 1024 sources in turn (each
	// one a miss in the zone's top-sources sketch).
	for _, sources := range []int{1, 1024} {
		b.Run(fmt.Sprintf("denied_%d_sources", sources), func(b *testing.B) {
			h := newTestHandler(b, nil, map[string]*Zone{"denied": {Key: "{http.vars.client_ip}", Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour), Memory: 1 << 20}}})
			ips := make([]string, sources)
			for i := range ips {
				ips[i] = fmt.Sprintf("198.51.%d.%d", i/256, i%256)
			}
			r := httptest.NewRequest(http.MethodGet, "/", nil)
			vars := map[string]any{}
			ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddyhttp.NewTestReplacer(r))
			r = r.WithContext(context.WithValue(ctx, caddyhttp.VarsCtxKey, vars))
			w := httptest.NewRecorder()
			for _, ip := range ips {
				vars[caddyhttp.ClientIPVarKey] = ip
				_ = h.ServeHTTP(w, r, okHandler) // drain
			}
			b.ReportAllocs()
			b.ResetTimer()
			i := 0
			for b.Loop() {
				vars[caddyhttp.ClientIPVarKey] = ips[i%sources]
				i++
				if err := h.ServeHTTP(w, r, okHandler); status(err) != http.StatusTooManyRequests {
					b.Fatalf("not denied: %v", err)
				}
			}
		})
	}
	// What weights, quotas and response costs add to an allowed request,
	// beside "allowed" (the same zone, plain).
	weighted := func(edit func(*Zone)) map[string]*Zone {
		// Five tokens back per request: what the heaviest weight here takes.
		zones := zone("{http.vars.client_ip}", 5000, 4000, time.Second)
		for _, zc := range zones {
			edit(zc)
		}
		return zones
	}
	b.Run("allowed_weight_static", func(b *testing.B) {
		run(b, newTestHandler(b, nil, weighted(func(zc *Zone) { zc.Weights = []*weight.Rule{{Weight: weight.Static(5)}} })), false)
	})
	b.Run("allowed_weight_placeholder", func(b *testing.B) {
		cost, _ := weight.Parse("{http.request.header.X-Cost}")
		run(b, newTestHandler(b, nil, weighted(func(zc *Zone) { zc.Weights = []*weight.Rule{{Weight: cost}} })), false)
	})
	b.Run("allowed_quota", func(b *testing.B) {
		run(b, newTestHandler(b, nil, weighted(func(zc *Zone) {
			zc.Quotas = []Quota{{MaxEvents: limiter.MaxSketchQuota, Window: caddy.Duration(time.Hour)}}
		})), false)
	})
	b.Run("allowed_response_header", func(b *testing.B) {
		run(b, newTestHandler(b, nil, weighted(func(zc *Zone) { zc.WeightResponseHeader = "X-Query-Cost" })), false)
	})
	b.Run("allowed_response_status", func(b *testing.B) {
		run(b, newTestHandler(b, nil, weighted(func(zc *Zone) { zc.WeightResponseStatus = []string{"401", "403"} })), false)
	})
	b.Run("allowed_response_time", func(b *testing.B) {
		run(b, newTestHandler(b, nil, weighted(func(zc *Zone) { zc.WeightResponseTime = true })), false)
	})
}

// BenchmarkServeHTTPZones measures what zones on one route cost an allowed
// request as bench/zones.sh configures them (each keyed by X-Key,
// `events 100000 window 10s`, `quota 10000000 1h`, tables and sketches of
// the default size): one zone, four, and four with parts taken away, to
// say where the time goes. Each request carries one of 2^18 keys in random
// order, so that lines and cells come from memory, as under real traffic
// (every page of the tables and sketches is touched first: the figures
// hold no page faults); hot_key sends one key, all in cache.
func BenchmarkServeHTTPZones(b *testing.B) {
	zones := func(n int, quota bool) map[string]*Zone {
		m := map[string]*Zone{}
		for i := range n {
			zc := &Zone{Key: "{http.request.header.X-Key}", Limit: zoneconf.Limit{MaxEvents: 100000, Window: caddy.Duration(10 * time.Second)}}
			if quota {
				zc.Quotas = []Quota{{MaxEvents: 10000000, Window: caddy.Duration(time.Hour)}}
			}
			m[string(rune('a'+i))] = zc
		}
		return m
	}
	// The keys in random order; each is written into one buffer, as a
	// request's header is fresh in cache when the handler reads it.
	order := rand.New(rand.NewPCG(1, 2)).Perm(1 << 18)
	buf := []byte("user-")
	val := make([]string, 1)
	setKey := func(r *http.Request, i int) {
		buf = strconv.AppendInt(buf[:5], int64(order[i&(len(order)-1)]), 10)
		val[0] = unsafe.String(&buf[0], len(buf))
		r.Header["X-Key"] = val
	}
	run := func(b *testing.B, h *Handler, hot bool) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = "192.0.2.1:1234"
		caddyhttp.NewTestReplacer(r)
		w := httptest.NewRecorder()
		now := time.Now()
		h.now = func() time.Time { return now }
		// Every key sent once: its lines and cells touched, and every
		// page of the tables and sketches with them.
		for i := range order {
			setKey(r, i)
			_ = h.serveAt(w, r, okHandler, now)
		}
		b.ReportAllocs()
		b.ResetTimer()
		cpu0 := cpuTime(b)
		i := 0
		for b.Loop() {
			clear(w.HeaderMap)
			// Within a hot key's rate (100000 per 10 s).
			now = now.Add(200 * time.Microsecond)
			if !hot {
				i++
			}
			setKey(r, i)
			if err := h.serveAt(w, r, okHandler, now); err != nil || w.Code != http.StatusOK {
				b.Fatal(err, w.Code)
			}
		}
		b.ReportMetric(float64(cpuTime(b)-cpu0)/float64(b.N), "cpu-ns/op")
	}
	b.Run("one", func(b *testing.B) { run(b, newTestHandler(b, nil, zones(1, true)), false) })
	b.Run("four", func(b *testing.B) { run(b, newTestHandler(b, nil, zones(4, true)), false) })
	b.Run("four_hot_key", func(b *testing.B) { run(b, newTestHandler(b, nil, zones(4, true)), true) })
	b.Run("four_no_quota", func(b *testing.B) { run(b, newTestHandler(b, nil, zones(4, false)), false) })
	b.Run("four_no_headers", func(b *testing.B) {
		h := newTestHandler(b, nil, zones(4, true))
		h.DisableHeaders = true
		run(b, h, false)
	})
}

// cpuTime is the CPU time the process has used, garbage collection
// included: on a machine shared with other work it says what a benchmark
// cost more steadily than the time it took.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func TestDenialLogNamesZoneAndClientButKeyOnlyWithLogKey(t *testing.T) {
	for _, logKey := range []bool{false, true} {
		core, logs := observer.New(zap.InfoLevel)
		h := newTestHandler(t, nil, map[string]*Zone{
			"logged_" + strconv.FormatBool(logKey): {Key: "{http.request.header.X-Secret}", Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour)}},
		})
		h.logger, h.LogKey = zap.New(core), logKey
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.RemoteAddr = "192.0.2.44:1234"
		req.Header.Set("X-Secret", "hunter2")
		_, _ = serve(h, req)
		if _, err := serve(h, req); status(err) != http.StatusTooManyRequests {
			t.Fatalf("second request: %v", err)
		}
		entries := logs.All()
		if len(entries) != 1 {
			t.Fatalf("log_key %v: %d log lines, want 1", logKey, len(entries))
		}
		fields := entries[0].ContextMap()
		if fields["zone"] != "logged_"+strconv.FormatBool(logKey) || fields["client_ip"] != "192.0.2.44" {
			t.Errorf("log_key %v: fields %v, want zone and client_ip", logKey, fields)
		}
		if key, ok := fields["key"]; ok != logKey || (ok && key != "hunter2") {
			t.Errorf("log_key %v: key field %v (present %v)", logKey, key, ok)
		}
	}
}

// expandedKeyHash is how a key template was charged before keys were
// compiled: the replacer's full expansion, an IP address masked to its
// network, anything else hashed (now up to maxKeyHashed bytes).
func expandedKeyHash(z *zone, tmpl string, r *http.Request, repl *caddy.Replacer) uint64 {
	s := repl.ReplaceAll(tmpl, "")
	if s == "" {
		return limiter.Hash(nil)
	}
	// An address is at most maxIPText bytes, zone included: a longer
	// text is a key like any other, though netip would parse it (a zone
	// may be of any length).
	if a, err := netip.ParseAddr(s); err == nil && len(s) <= maxIPText {
		nk := limiter.NetworkKey(a.WithZone(""), z.v4, z.v6)
		return z.keys[0].salted(limiter.Hash(nk.Bytes()))
	}
	return z.keys[0].salted(limiter.HashString(s[:min(len(s), maxKeyHashed)]))
}

func TestCompiledKeysHashWhatTheReplacerExpands(t *testing.T) {
	long := strings.Repeat("0123456789", 2000)
	for _, tmpl := range []string{
		"{http.request.header.X-Key}",
		"{http.request.header.x-key}",
		"{http.request.header.X-Multi}",
		"{http.request.header.X-Long}",
		"{http.request.header.X-Absent}",
		"{header.X-Key}", // a Caddyfile shorthand, unknown in JSON
		"{http.request.method}-{http.request.uri.path}",
		"{http.request.uri.query.ip}",
		"{http.request.uri.query.a}.{http.request.uri.query.b}",
		"{http.request.header.X-Long}{http.request.header.X-Long}",
		`a\{b}{http.request.method}`,
		"{unclosed {http.request.method}",
		"literal",
		"{http.request.header.X-Multi}:{http.request.method}",
	} {
		t.Run(tmpl, func(t *testing.T) {
			z := &zone{v4: 24, v6: 48, keys: []keySpec{parseKeySpec(tmpl)}}
			r := httptest.NewRequest(http.MethodGet, "/p/q?ip=2001:db8::1&a=10.1&b=2.3", nil)
			r.Header.Set("X-Key", "alice")
			r.Header.Add("X-Multi", "one")
			r.Header.Add("X-Multi", "two")
			r.Header.Set("X-Long", long)
			repl := caddyhttp.NewTestReplacer(r)
			got := z.key(&request{r: r, repl: repl})
			if want := expandedKeyHash(z, tmpl, r, repl); got.hash != want {
				t.Errorf("hash %x, want %x (of %.40q)", got.hash, want, repl.ReplaceAll(tmpl, ""))
			}
		})
	}
}

// A key template reads a client's header without copying it: a 1 MB header
// costs no more memory per request than a short one.
func TestHugeKeysAreNotCopied(t *testing.T) {
	for _, tmpl := range []string{"{http.request.header.X-Key}", "{http.request.header.X-Key}-{http.request.method}"} {
		h := newTestHandler(t, nil, map[string]*Zone{
			"huge_" + strconv.Itoa(len(tmpl)): {Key: tmpl, Limit: zoneconf.Limit{MaxEvents: zoneconf.MaxPerSecond, Window: caddy.Duration(time.Second), Memory: 4096}},
		})
		h.DisableHeaders = true
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Key", strings.Repeat("k", 1<<20))
		caddyhttp.NewTestReplacer(r)
		w := httptest.NewRecorder()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		const n = 20
		for range n {
			if err := h.serveAt(w, r, okHandler, time.Now()); err != nil {
				t.Fatal(err)
			}
		}
		runtime.ReadMemStats(&after)
		if perRequest := (after.TotalAlloc - before.TotalAlloc) / n; perRequest > 4<<10 {
			t.Errorf("%s: %d bytes allocated per request with a 1 MB header, want under 4 KiB", tmpl, perRequest)
		}
	}
}

func TestShownKeysAreCut(t *testing.T) {
	if got := shownKey("short"); got != "short" {
		t.Errorf("shownKey(short) = %q", got)
	}
	for _, s := range []string{strings.Repeat("k", 900<<10), strings.Repeat("é", 200)} {
		got := shownKey(s)
		if len(got) > maxShownKey || !strings.HasSuffix(got, "…") || !utf8.ValidString(got) || !strings.HasPrefix(s, strings.TrimSuffix(got, "…")) {
			t.Errorf("shownKey of %d bytes = %d bytes %.20q…, want a valid prefix of at most %d bytes ending in …", len(s), len(got), got, maxShownKey)
		}
	}
}

func TestSourceNamesWhatWasCharged(t *testing.T) {
	z := &zone{v4: 24, v6: 48}
	for _, tt := range []struct {
		c    charge
		want string
	}{
		{charge{addr: mustAddr(t, "203.0.113.77")}, "203.0.113.0/24"},
		{charge{addr: mustAddr(t, "2001:db8:1:2::3")}, "2001:db8:1::/48"},
		{charge{hash: 0xab, key: 0}, "key:00000000000000ab"},
		{charge{key: -1}, "none"},
	} {
		if got := z.source(tt.c); got != tt.want {
			t.Errorf("source(%+v) = %q, want %q", tt.c, got, tt.want)
		}
	}
}

// deniedHandler returns a handler whose zone denies every request after a
// client's first, logging to an observer at level.
func deniedHandler(t *testing.T, name, key string, level zapcore.Level) (*Handler, *observer.ObservedLogs) {
	return limitedHandler(t, name, key, 1, level)
}

// limitedHandler returns a handler with one zone allowing events per hour,
// grouping IPv4 clients by /24, logging to an observer at level.
func limitedHandler(t *testing.T, name, key string, events int64, level zapcore.Level) (*Handler, *observer.ObservedLogs) {
	core, logs := observer.New(level)
	v4 := 24
	h := newTestHandler(t, nil, map[string]*Zone{
		name: {Key: key, Limit: zoneconf.Limit{MaxEvents: events, Window: caddy.Duration(time.Hour), IPv4Prefix: &v4}},
	})
	h.logger = zap.New(core)
	return h, logs
}

func requestFrom(remote string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = remote
	return r
}

func TestDenialLogIsOneInfoLinePerSourceAndInterval(t *testing.T) {
	h, logs := deniedHandler(t, "flooded", "{remote_host}", zapcore.DebugLevel)
	t0 := time.Unix(1_700_000_000, 0).Truncate(denialLogInterval)
	flood := func(remote string, n int, at time.Time) {
		t.Helper()
		for range n {
			if _, err := serveAt(h, requestFrom(remote), at); status(err) != http.StatusTooManyRequests {
				t.Fatalf("%s: %v, want a denial", remote, err)
			}
		}
	}
	debugs := 0
	infos := func() (info []observer.LoggedEntry) {
		debugs = 0
		for _, e := range logs.TakeAll() {
			if e.Level == zapcore.InfoLevel {
				info = append(info, e)
			} else {
				debugs++
			}
		}
		return info
	}
	// Each source's first request is allowed.
	for _, src := range []string{"192.0.2.1:1", "198.51.100.1:1", "203.0.113.1:1"} {
		if _, err := serveAt(h, requestFrom(src), t0); err != nil {
			t.Fatal(err)
		}
	}

	flood("192.0.2.1:1", 500, t0)
	got := infos()
	if len(got) != 1 {
		t.Fatalf("500 denials of one source: %d INFO lines, want 1", len(got))
	}
	f := got[0].ContextMap()
	if got[0].Message != "rate limit exceeded" || f["zone"] != "flooded" || f["client_ip"] != "192.0.2.1" ||
		f["source"] != "192.0.2.0/24" || f["retry_after"] != int64(3600) || f["suppressed"] != int64(0) {
		t.Errorf("first INFO line: %q %v", got[0].Message, f)
	}
	if _, ok := f["key"]; ok {
		t.Errorf("key logged without log_key: %v", f)
	}
	if n := debugs; n != 499 {
		t.Errorf("%d DEBUG lines, want the other 499 denials", n)
	}

	// Another address of the same /24 is the same source.
	flood("192.0.2.99:1", 10, t0.Add(9*time.Second))
	if got := infos(); len(got) != 0 {
		t.Errorf("same network, same interval: %d INFO lines, want 0", len(got))
	}

	// Two more sources: one line each.
	flood("198.51.100.1:1", 50, t0.Add(time.Second))
	flood("203.0.113.1:1", 50, t0.Add(2*time.Second))
	got = infos()
	if len(got) != 2 || got[0].ContextMap()["source"] != "198.51.100.0/24" || got[1].ContextMap()["source"] != "203.0.113.0/24" {
		t.Errorf("two more sources: %d INFO lines %v, want one per source", len(got), got)
	}

	// The next interval: one line per source again, counting what the
	// previous one suppressed.
	flood("192.0.2.1:1", 3, t0.Add(denialLogInterval))
	got = infos()
	if len(got) != 1 || got[0].ContextMap()["suppressed"] != int64(499+10) {
		t.Fatalf("next interval: %v, want 1 INFO line with suppressed 509", got)
	}
	flood("192.0.2.1:1", 1, t0.Add(3*denialLogInterval))
	got = infos()
	if len(got) != 1 || got[0].ContextMap()["suppressed"] != int64(2) {
		t.Errorf("two intervals later: %v, want 1 INFO line with suppressed 2", got)
	}
}

// However many sources flood, a zone writes at most maxInfoPerInterval INFO
// lines per interval, and its bookkeeping stays the same fixed table.
func TestDenialLogIsBoundedUnderManySources(t *testing.T) {
	h, logs := deniedHandler(t, "many", "{http.request.header.X-Key}", zapcore.InfoLevel)
	t0 := time.Unix(1_700_000_000, 0).Truncate(denialLogInterval)
	const sources = 3000
	for i := range sources {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Key", "k"+strconv.Itoa(i))
		for range 3 {
			_, _ = serveAt(h, r, t0)
		}
	}
	if n := logs.Len(); n != maxInfoPerInterval {
		t.Errorf("%d sources denied twice each: %d INFO lines, want the bound %d", sources, n, maxInfoPerInterval)
	}
	if src := logs.All()[0].ContextMap()["source"]; !strings.HasPrefix(src.(string), "key:") || len(src.(string)) != len("key:")+16 {
		t.Errorf("source of a header key %q, want key:<16 hex digits>", src)
	}
}

func TestDenialLogKeyIsCutWithLogKey(t *testing.T) {
	h, logs := deniedHandler(t, "longkey", "{http.request.header.X-Key}", zapcore.InfoLevel)
	h.LogKey = true
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Key", strings.Repeat("s", 900<<10))
	_, _ = serve(h, r)
	if _, err := serve(h, r); status(err) != http.StatusTooManyRequests {
		t.Fatalf("second request: %v", err)
	}
	key, _ := logs.All()[0].ContextMap()["key"].(string)
	if len(key) > maxShownKey || !strings.HasPrefix(key, "sss") {
		t.Errorf("logged key of %d bytes, want at most %d", len(key), maxShownKey)
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

// recordingEmitter stands for Caddy's events app.
type recordingEmitter struct {
	listening bool
	events    []map[string]any
}

func (e *recordingEmitter) ShouldEmit(string) bool { return e.listening }

func (e *recordingEmitter) Emit(_ caddy.Context, name string, data map[string]any) caddy.Event {
	e.events = append(e.events, data)
	return caddy.Event{}
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

// The RateLimit-Policy value made once for a handler is the one made per
// request from its zones (a dry run's left out), and is used only when
// every zone applied.
func TestHandlerPolicyIsItsZonesJoined(t *testing.T) {
	limit := zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Minute), Memory: 1 << 16}
	h := newTestHandler(t, nil, map[string]*Zone{
		"a": {Limit: limit, Quotas: []Quota{{MaxEvents: 100, Window: caddy.Duration(time.Hour)}}},
		"b": {Limit: limit, Action: "log"},
		"c": {Limit: limit},
	})
	var all []verdict
	for _, z := range h.zones {
		all = append(all, verdict{z: z})
	}
	if want := `"a";q=10;w=60, "a/1h";q=100;w=3600, "c";q=10;w=60`; h.policy != want || h.policyOf(all) != want {
		t.Errorf("handler's policy %q, for every zone %q, want %q", h.policy, h.policyOf(all), want)
	}
	for _, vs := range [][]verdict{all, all[:2], all[1:], {all[0], all[2]}} {
		hdr := http.Header{}
		new(responseHeaders).setRateLimit(hdr, vs, 0, "")
		made := hdr.Get("RateLimit-Policy")
		new(responseHeaders).setRateLimit(hdr, vs, 0, h.policyOf(vs))
		if got := hdr.Get("RateLimit-Policy"); got != made || len(vs) < len(all) && h.policyOf(vs) != "" {
			t.Errorf("%d of %d zones: policy %q, made per request %q (given %q)", len(vs), len(all), got, made, h.policyOf(vs))
		}
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

// Only text that can be an address is given to netip.ParseAddr (whose error
// allocates); every address still is.
func TestIPLike(t *testing.T) {
	for _, s := range []string{"192.0.2.1", "::1", "2001:db8::1", "::ffff:192.0.2.7", "fe80::1%eth0"} {
		if !ipLike(s) || !parseIP(s).IsValid() {
			t.Errorf("%q: not taken for an address", s)
		}
	}
	for _, s := range []string{"", "alice", "deadbeef", "GET-/", "%eth0", "1.2.3.4.example", strings.Repeat("1.", 40)} {
		if ipLike(s) || parseIP(s).IsValid() {
			t.Errorf("%q taken for an address", s)
		}
	}
	if a := parseIP("fe80::1%eth0"); a.Zone() != "" {
		t.Errorf("zone kept: %v", a)
	}
}
