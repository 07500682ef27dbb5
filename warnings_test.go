package floodgate

import (
	"fmt"
	"strings"
	"testing"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// TestZoneWarnings lists every configuration that loads but does not limit
// the way its operator most likely means, with the warning it gets, and
// configurations that look alike but are fine.
func TestZoneWarnings(t *testing.T) {
	limit := zoneconf.Limit{MaxEvents: 5, Window: 60e9}
	withMemory := func(n int64) zoneconf.Limit { l := limit; l.Memory = n; return l }
	for _, tc := range []struct {
		name string
		zc   Zone
		want []string // one substring per warning, in order; none for a good zone
	}{
		{"client IP", Zone{Key: "{http.vars.client_ip}", Limit: limit}, nil},
		{"client IP shorthand in JSON", Zone{Key: "u-{client_ip}", Limit: limit}, nil},
		{"header and fallback", Zone{Key: "{http.request.header.X-API-Key}", FallbackKeys: []string{"{remote_host}"}, Limit: limit}, nil},
		{"constant key", Zone{Key: "static", Limit: limit}, nil},
		{"vars set by another handler", Zone{Key: "{http.vars.user}", Limit: limit}, nil},
		{"escaped brace", Zone{Key: `\{client}`, Limit: limit}, nil},
		{"no key, tiny table", Zone{Limit: withMemory(64)}, nil},
		{"keyed, default table", Zone{Key: "{client_ip}", Limit: limit}, nil},
		{"keyed, 64 KiB", Zone{Key: "{client_ip}", Limit: withMemory(64 << 10)}, nil},
		{"keyed, 256 MiB", Zone{Key: "{client_ip}", Limit: withMemory(256 << 20)}, nil},
		{"set by map", Zone{Key: "{org}", Limit: limit}, nil},
		{"vars shorthand", Zone{Key: "{vars.org}", Limit: limit}, nil},
		{"dollar in a constant", Zone{Key: "plan$1", Limit: limit}, nil},

		{"client_ip without braces", Zone{Key: "client_ip", Limit: limit},
			[]string{`key "client_ip" has no braces, so it is that text for every request and every client shares one bucket; write the placeholder {client_ip}`}},
		{"long placeholder without braces", Zone{Key: "http.request.header.X-Key", Limit: limit},
			[]string{`key "http.request.header.X-Key" has no braces`}},
		{"remote with the port", Zone{Key: "{remote}", Limit: limit},
			[]string{`key "{http.request.remote}" contains {http.request.remote}, the client's port: every new connection is a new key`}},
		{"remote port in a fallback", Zone{Key: "{client_ip}", FallbackKeys: []string{"{http.request.remote.port}"}, Limit: limit},
			[]string{`contains {http.request.remote.port}`}},
		{"unknown placeholder", Zone{Key: "{http.request.heder.X-Key}", Limit: limit},
			[]string{`key "{http.request.heder.X-Key}" contains {http.request.heder.X-Key}, which is not a placeholder of Caddy's HTTP server`}},
		{"unknown shorthand", Zone{Key: "{clientip}", Limit: limit},
			[]string{`contains {clientip}, which is not a placeholder`}},
		{"one line", Zone{Key: "{client_ip}", Limit: withMemory(64)},
			[]string{"memory 64 B is a table of 1 lines: from 1 keys over their limit at once, other keys are denied more than 0.5% of the time"}},
		{"sixteen lines", Zone{Key: "{client_ip}", Limit: withMemory(1000)},
			[]string{"memory 1000 B is a table of 15 lines: from 3 keys over their limit"}},
		{"closing brace missing", Zone{Key: "{header.X-API-Key", Limit: limit},
			[]string{`key "{header.X-API-Key" has a brace without its pair, so it is no placeholder: it is that text for every request and every client shares one bucket; write the placeholder {header.X-API-Key}`}},
		{"opening brace missing", Zone{Key: "u-client_ip}", Limit: limit},
			[]string{`key "u-client_ip}" has a brace without its pair`}},
		{"nginx header variable", Zone{Key: "$http_x_api_key", Limit: limit},
			[]string{`key "$http_x_api_key" is nginx's variable syntax, which Caddy does not expand, so it is that text for every request and every client shares one bucket; write the placeholder {header.X-Api-Key}`}},
		{"nginx address variable", Zone{Key: "$binary_remote_addr", Limit: limit},
			[]string{`write the placeholder {client_ip}`}},
		{"a hundred million sources", Zone{Key: "{client_ip}", Limit: zoneconf.Limit{MaxEvents: 5, Window: 60e9, Sources: 100_000_000}},
			[]string{"its table is 32 GiB (from sources 100000000 and false_deny 0.005 (the default)), allocated at load, more than the 256 MiB beyond which"}},
		{"a gibibyte of memory", Zone{Key: "{client_ip}", Limit: withMemory(1 << 30)},
			[]string{"its table is 1.0 GiB (from memory 1.0 GiB)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.zc.warnings(map[string]bool{"org": true})
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
