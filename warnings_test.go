package floodgate

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// TestZoneWarnings lists every configuration that loads but does not limit
// the way its operator most likely means, with the warning it gets, and
// configurations that look alike but are fine.
func TestZoneWarnings(t *testing.T) {
	limit := zoneconf.Limit{MaxEvents: 5, Window: 60e9}
	withMemory := func(n int64) zoneconf.Limit { l := limit; l.Memory = n; return l }
	costly := func(rules ...*weight.Rule) Zone { return Zone{Key: "{client_ip}", Limit: limit, Weights: rules} }
	bucket := func(events, burst int64, window time.Duration) zoneconf.Limit {
		return zoneconf.Limit{MaxEvents: events, Burst: burst, Window: caddy.Duration(window)}
	}
	for _, tc := range []struct {
		name      string
		zc        Zone
		incumbent bool     // the config has caddy-ratelimit's sweep_interval
		want      []string // one substring per warning, in order; none for a good zone
	}{
		{"client IP", Zone{Key: "{http.vars.client_ip}", Limit: limit}, false, nil},
		{"client IP shorthand in JSON", Zone{Key: "u-{client_ip}", Limit: limit}, false, nil},
		{"header and fallback", Zone{Key: "{http.request.header.X-API-Key}", FallbackKeys: []string{"{remote_host}"}, Limit: limit}, false, nil},
		{"constant key", Zone{Key: "static", Limit: limit}, false, nil},
		{"vars set by another handler", Zone{Key: "{http.vars.user}", Limit: limit}, false, nil},
		{"escaped brace", Zone{Key: `\{client}`, Limit: limit}, false, nil},
		{"no key, tiny table", Zone{Limit: withMemory(64)}, false, nil},
		{"keyed, default table", Zone{Key: "{client_ip}", Limit: limit}, false, nil},
		{"keyed, 64 KiB", Zone{Key: "{client_ip}", Limit: withMemory(64 << 10)}, false, nil},
		{"keyed, 256 MiB", Zone{Key: "{client_ip}", Limit: withMemory(256 << 20)}, false, nil},
		{"set by map", Zone{Key: "{org}", Limit: limit}, false, nil},
		{"vars shorthand", Zone{Key: "{vars.org}", Limit: limit}, false, nil},
		{"dollar in a constant", Zone{Key: "plan$1", Limit: limit}, false, nil},

		{"fixed weight", costly(&weight.Rule{Weight: weight.Static(2)}), false, nil},
		{"placeholder weight for the requests with it", costly(&weight.Rule{Weight: mustWeight(t, "{http.request.header.X-Cost}"), MatcherSetsRaw: caddyhttp.RawMatcherSets{{"header": []byte(`{"X-Cost":["*"]}`)}}}), false, nil},
		{"a bucket with a burst above its events", Zone{Key: "{client_ip}", Limit: bucket(10, 20, time.Second)}, true, nil},
		{"a fast bucket with a burst below its events", Zone{Key: "{client_ip}", Limit: bucket(100, 10, time.Second)}, false, nil},
		{"the bucket docs/limits.md recommends", Zone{Key: "{client_ip}", Limit: bucket(100, 10, time.Minute)}, false, nil},

		{"placeholder weight for every request", costly(&weight.Rule{Weight: mustWeight(t, "{http.request.header.X-Cost}")}), false,
			[]string{"its weight rule {http.request.header.X-Cost} prices every request, so a request without it (or with anything but a whole number of at least 1) is answered 400; to charge such a request 1 instead, give the weight a matcher block"}},
		{"burst in a caddy-ratelimit config", Zone{Key: "{client_ip}", Limit: bucket(10, 5, time.Second)}, true,
			[]string{"burst 5 makes events 10 window 1s a token bucket: 5 at once, then one every 100ms; caddy-ratelimit has no burst and allows 10 in any second"}},
		{"burst a tenth of a long window's events in a caddy-ratelimit config", Zone{Key: "{client_ip}", Limit: bucket(1000, 100, 300*time.Second)}, true,
			[]string{"burst 100 makes events 1000 window 5m0s a token bucket: 100 at once, then one every 300ms; caddy-ratelimit has no burst and allows 1000 in any 5 minutes: if this zone comes from it, remove burst"}},

		{"client_ip without braces", Zone{Key: "client_ip", Limit: limit}, false,
			[]string{`key "client_ip" has no braces, so it is that text for every request and every client shares one bucket; write the placeholder {client_ip}`}},
		{"long placeholder without braces", Zone{Key: "http.request.header.X-Key", Limit: limit}, false,
			[]string{`key "http.request.header.X-Key" has no braces`}},
		{"remote with the port", Zone{Key: "{remote}", Limit: limit}, false,
			[]string{`key "{http.request.remote}" contains {http.request.remote}, the client's port: every new connection is a new key`}},
		{"remote port in a fallback", Zone{Key: "{client_ip}", FallbackKeys: []string{"{http.request.remote.port}"}, Limit: limit}, false,
			[]string{`contains {http.request.remote.port}`}},
		{"unknown placeholder", Zone{Key: "{http.request.heder.X-Key}", Limit: limit}, false,
			[]string{`key "{http.request.heder.X-Key}" contains {http.request.heder.X-Key}, which is not a placeholder of Caddy's HTTP server`}},
		{"unknown shorthand", Zone{Key: "{clientip}", Limit: limit}, false,
			[]string{`contains {clientip}, which is not a placeholder`}},
		{"one line", Zone{Key: "{client_ip}", Limit: withMemory(64)}, false,
			[]string{"memory 64 B is a table of 1 lines: from 1 keys over their limit at once, other keys are denied more than 0.5% of the time"}},
		{"sixteen lines", Zone{Key: "{client_ip}", Limit: withMemory(1000)}, false,
			[]string{"memory 1000 B is a table of 15 lines: from 3 keys over their limit"}},
		{"closing brace missing", Zone{Key: "{header.X-API-Key", Limit: limit}, false,
			[]string{`key "{header.X-API-Key" has a brace without its pair, so it is no placeholder: it is that text for every request and every client shares one bucket; write the placeholder {header.X-API-Key}`}},
		{"opening brace missing", Zone{Key: "u-client_ip}", Limit: limit}, false,
			[]string{`key "u-client_ip}" has a brace without its pair`}},
		{"nginx header variable", Zone{Key: "$http_x_api_key", Limit: limit}, false,
			[]string{`key "$http_x_api_key" is nginx's variable syntax, which Caddy does not expand, so it is that text for every request and every client shares one bucket; write the placeholder {header.X-Api-Key}`}},
		{"nginx address variable", Zone{Key: "$binary_remote_addr", Limit: limit}, false,
			[]string{`write the placeholder {client_ip}`}},
		{"a hundred million sources", Zone{Key: "{client_ip}", Limit: zoneconf.Limit{MaxEvents: 5, Window: 60e9, Sources: 100_000_000}}, false,
			[]string{"its table is 32 GiB (from sources 100000000 and false_deny 0.005 (the default)), allocated at load, more than the 256 MiB beyond which"}},
		{"a gibibyte of memory", Zone{Key: "{client_ip}", Limit: withMemory(1 << 30)}, false,
			[]string{"its table is 1.0 GiB (from memory 1.0 GiB)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.zc.warnings(map[string]bool{"org": true}, tc.incumbent)
			if len(got) != len(tc.want) {
				t.Fatalf("warnings %q, want %d", got, len(tc.want))
			}
			for i, w := range tc.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("warning %q does not contain %q", got[i], w)
				}
			}
		})
	}
}

func TestPlaceholders(t *testing.T) {
	for in, want := range map[string]string{
		"":                      "",
		"static":                "",
		"u-{a}-{b.c}":           "a|b.c",
		`\{x} {y}`:              "y",
		"{unclosed":             "",
		"{http.vars.client_ip}": "http.vars.client_ip",
	} {
		if got := strings.Join(placeholders(in), "|"); got != want {
			t.Errorf("placeholders(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestZonesThatAddUpToMoreThanAGibibyteWarn(t *testing.T) {
	zones := func(n int, memory int64) []*zone {
		var zs []*zone
		for i := range n {
			zs = append(zs, &zone{name: fmt.Sprintf("z%d", i), conf: &Zone{Limit: zoneconf.Limit{MaxEvents: 1, Window: 60e9, Memory: memory}}})
		}
		return zs
	}
	if w := totalSizeWarning(zones(4, 256<<20)); w != "" {
		t.Errorf("4 zones of 256 MiB: %q, want none", w)
	}
	want := "the tables of this config's 97 rate_limit zones add up to 1.0 GiB, allocated at load, more than 1.0 GiB (largest: z0 11 MiB, z1 11 MiB, z2 11 MiB)"
	if w := totalSizeWarning(zones(97, 11<<20)); !strings.HasPrefix(w, want) {
		t.Errorf("97 zones of 11 MiB: %q, want %q", w, want)
	}
}

func mustWeight(t *testing.T, s string) weight.Value {
	t.Helper()
	v, err := weight.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
