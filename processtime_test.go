package floodgate

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// BenchmarkProcessTime measures what caddy-ratelimit's
// caddy_rate_limit_process_time_seconds would cost floodgate: an allowed
// request through ServeHTTP as it is, and the same with a second clock
// reading after the decision and an observation into a histogram of the
// incumbent's buckets, serially and from every core at once (the
// histogram's counters are then shared by all of them). docs/migration.md
// (Dashboards) quotes the ratio, which is why floodgate does not serve
// the series.
func BenchmarkProcessTime(b *testing.B) {
	h := newTestHandler(b, nil, map[string]*Zone{"process_time": {Key: "{http.vars.client_ip}",
		Limit: zoneconf.Limit{MaxEvents: 1_000_000, Burst: 1_000_000, Window: caddy.Duration(time.Second), Memory: 1 << 20}}})
	hist := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "process_time_seconds",
		Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1}})
	request := func() (*httptest.ResponseRecorder, *http.Request) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		caddyhttp.NewTestReplacer(r)
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "192.0.2.1"}))
		return httptest.NewRecorder(), r
	}
	b.Run("observation_alone", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			start := time.Now()
			hist.Observe(time.Since(start).Seconds())
		}
	})
	b.Run("observation_alone_parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				start := time.Now()
				hist.Observe(time.Since(start).Seconds())
			}
		})
	})
	for _, observe := range []bool{false, true} {
		serve := func(w *httptest.ResponseRecorder, r *http.Request) {
			clear(w.HeaderMap)
			start := time.Now()
			if err := h.serveAt(w, r, okHandler, start); err != nil {
				b.Fatal(err)
			}
			if observe {
				hist.Observe(time.Since(start).Seconds())
			}
		}
		name := map[bool]string{false: "as_is", true: "observed"}[observe]
		b.Run(name, func(b *testing.B) {
			w, r := request()
			b.ReportAllocs()
			for b.Loop() {
				serve(w, r)
			}
		})
		b.Run(name+"_parallel", func(b *testing.B) {
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				w, r := request()
				for pb.Next() {
					serve(w, r)
				}
			})
		})
	}
}
