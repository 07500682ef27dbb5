package floodgate

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

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
