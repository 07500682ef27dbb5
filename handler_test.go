package floodgate

import (
	"context"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// fakeClock is a clock tests move by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// newTestHandler provisions a handler with the given inline zones (without
// matchers, which need a Caddy context) on tables driven by clock. Its
// zones' tables are released when the test ends.
func newTestHandler(t testing.TB, clock *fakeClock, zones map[string]*Zone) *Handler {
	t.Helper()
	if clock != nil {
		testNow = clock.now
		t.Cleanup(func() { testNow = nil })
	}
	h := &Handler{RateLimits: zones, logger: zap.NewNop()}
	for _, name := range slices.Sorted(maps.Keys(zones)) {
		z, err := provisionZone(caddy.Context{}, name, zones[name])
		if err != nil {
			t.Fatal(err)
		}
		h.owned = append(h.owned, z)
		h.zones = append(h.zones, z)
	}
	t.Cleanup(func() { _ = h.Cleanup() })
	return h
}

var okHandler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
})

// serve runs one request through h and returns the recorder and the error.
func serve(h *Handler, r *http.Request) (*httptest.ResponseRecorder, error) {
	w := httptest.NewRecorder()
	repl := caddyhttp.NewTestReplacer(r)
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	return w, h.ServeHTTP(w, r, okHandler)
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
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
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
		{900 * time.Millisecond, "3"},  // 2.1 s says 3
		{1600 * time.Millisecond, "1"}, // 0.5 s says 1
	} {
		clock.advance(step.advance)
		w, err := serve(h, req)
		if status(err) != http.StatusTooManyRequests {
			t.Fatalf("after %v: status %d, want 429", step.advance, status(err))
		}
		if got := w.Header().Get("Retry-After"); got != step.want {
			t.Errorf("after %v more: Retry-After %q, want %q", step.advance, got, step.want)
		}
	}
	clock.advance(500 * time.Millisecond)
	if _, err := serve(h, req); err != nil {
		t.Errorf("after the full wait: %v", err)
	}
}

func TestDenialIsAnUnwrappedHandlerError(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"unwrapped": {Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour)}}})
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	_, _ = serve(h, req)
	_, err := serve(h, req)
	if _, ok := err.(caddyhttp.HandlerError); !ok {
		t.Fatalf("error %T %v, want a caddyhttp.HandlerError itself", err, err)
	}
}

func TestJitterAddsAtMostItsFractionAndIsRaceFree(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
	h := newTestHandler(t, clock, map[string]*Zone{"jitter": {Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(10 * time.Second)}}})
	h.Jitter = 0.5
	if _, err := serve(h, httptest.NewRequest(http.MethodGet, "/", nil)); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	results := make([]string, 64)
	for i := range results {
		wg.Go(func() {
			w, _ := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
			results[i] = w.Header().Get("Retry-After")
		})
	}
	wg.Wait()
	for _, ra := range results {
		n, err := strconv.Atoi(ra)
		if err != nil || n < 10 || n > 15 {
			t.Errorf("Retry-After %q, want 10 to 15 (10 s plus up to 50%%)", ra)
		}
	}
}

func TestLimitsChangeOnlyWhenAConfigGoesLive(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"goes_live": {Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Memory: 4096}}})
	running := h.zones[0]
	events := func() int64 { return running.buckets.Limit().Events }
	oldApp := &App{live: []*zone{running}}
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
	failed := &App{live: []*zone{z}}
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
	live := &App{live: []*zone{z}}
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

func TestHeaderFormat(t *testing.T) {
	a := &zone{name: "api", policy: policyItem("api", 100, time.Minute)}
	b := &zone{name: "daily", policy: policyItem("daily", 1000, 1500*time.Millisecond)}
	hdr := http.Header{}
	setHeaders(hdr, []verdict{{z: a, rate: limiter.Decision{Remaining: 42, Reset: 17100 * time.Millisecond}}})
	if got, want := hdr.Get("RateLimit-Policy"), `"api";q=100;w=60`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("RateLimit"), `"api";r=42;t=18`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	setHeaders(hdr, []verdict{
		{z: a, rate: limiter.Decision{Remaining: 0, Reset: time.Minute}},
		{z: b, rate: limiter.Decision{Remaining: -1, Reset: 0}},
	})
	if got, want := hdr.Get("RateLimit-Policy"), `"api";q=100;w=60, "daily";q=1000;w=2`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("RateLimit"), `"api";r=0;t=60, "daily";r=0;t=0`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
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
	h, _, _ := z.key(r, caddyhttp.NewTestReplacer(r))
	return h
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
		{"header holding an IP is masked", header, "", "", "10.1.2.3", "", netOf("10.1.2.99")},
		{"header holding a name is hashed", header, "", "", "alice", "", hashOf("alice")},
		{"empty first key falls back", header, "", "", "", "bob", hashOf("bob")},
		{"no key at all is the empty key", header, "192.0.2.1:5", "", "", "", limiter.Hash(nil)},
		{"a zone without keys is one bucket", none, "192.0.2.1:5", "", "", "", limiter.Hash(nil)},
		{"a huge key is hashed", header, "", "", huge, "", hashOf(huge)},
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

func BenchmarkServeHTTP(b *testing.B) {
	run := func(b *testing.B, h *Handler, remote string) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = remote
		repl := caddyhttp.NewTestReplacer(r)
		ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
		ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "192.0.2.1"})
		r = r.WithContext(ctx)
		w := httptest.NewRecorder()
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			if err := h.ServeHTTP(w, r, okHandler); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("no_zone", func(b *testing.B) {
		run(b, newTestHandler(b, nil, nil), "192.0.2.1:1234")
	})
	allowAll := func(key string) map[string]*Zone {
		return map[string]*Zone{"bench" + key: {Key: key, Limit: zoneconf.Limit{MaxEvents: 1 << 20, Window: caddy.Duration(time.Millisecond), Memory: 1 << 20}}}
	}
	b.Run("client_ip_zone", func(b *testing.B) {
		run(b, newTestHandler(b, nil, allowAll("{http.vars.client_ip}")), "192.0.2.1:1234")
	})
	b.Run("client_ip_zone_no_headers", func(b *testing.B) {
		h := newTestHandler(b, nil, allowAll("{remote_host}"))
		h.DisableHeaders = true
		run(b, h, "192.0.2.1:1234")
	})
	b.Run("template_zone", func(b *testing.B) {
		run(b, newTestHandler(b, nil, allowAll("{http.request.method}-{http.request.uri.path}")), "192.0.2.1:1234")
	})
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
