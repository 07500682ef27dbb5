package caddytest

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// fetch sends a GET to url (its port named as withPorts reads it) through c
// and returns "body:status"; it fails the test if there is no answer.
func fetch(t *testing.T, c *http.Client, url string) string {
	t.Helper()
	code, body, _ := do(t, c, mustRequest(t, url))
	return fmt.Sprintf("%s:%d", body, code)
}

// TestSnippetZoneSharedAcrossSites imports one rate_limit snippet into two
// sites: it is one zone, as if defined in the global option, with one
// bucket per client across both sites, one policy and one metric.
func TestSnippetZoneSharedAcrossSites(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(globals("")+`
(limit) {
	rate_limit {
		zone snippet_shared {
			key {client_ip}
			events 3
			window 1h
		}
	}
}
http://a.localhost:HTTP_PORT {
	import limit
	respond "a"
}
http://b.localhost:HTTP_PORT {
	import limit
	respond "b"
}
`, "caddyfile")

	c := clientFrom("127.0.0.1")
	var got []string
	for _, u := range []string{"http://a.localhost:HTTP_PORT/", "http://b.localhost:HTTP_PORT/", "http://a.localhost:HTTP_PORT/", "http://b.localhost:HTTP_PORT/"} {
		got = append(got, fetch(t, c, u))
	}
	if want := "a:200 b:200 a:200 :429"; strings.Join(got, " ") != want {
		t.Errorf("one client across the two sites: %s, want %s", strings.Join(got, " "), want)
	}
	// Another client has its own bucket.
	if got := fetch(t, clientFrom("127.0.0.2"), "http://b.localhost:HTTP_PORT/"); got != "b:200" {
		t.Errorf("another client: %s", got)
	}
	_, _, resp := do(t, clientFrom("127.0.0.3"), mustRequest(t, "http://b.localhost:HTTP_PORT/"))
	if got := resp.Header.Get("RateLimit-Policy"); got != `"snippet_shared";q=3;w=3600` {
		t.Errorf("RateLimit-Policy %q", got)
	}
	body := testcaddy.Metrics(t, adminPort)
	for _, want := range []string{
		`caddy_rate_limit_requests_total{outcome="allowed",zone="snippet_shared"} 5`,
		`caddy_rate_limit_requests_total{outcome="denied",zone="snippet_shared"} 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// mustRequest is a GET of url, its port named as withPorts reads it.
func mustRequest(t *testing.T, url string) *http.Request {
	t.Helper()
	return testcaddy.Request(t, http.MethodGet, withPorts(url))
}

// TestConflictingSnippetZonesNameBothPlaces imports a snippet with an
// argument into two sites, so that the zone is defined twice, differently,
// from the same snippet line: the error tells the two imports apart.
func TestConflictingSnippetZonesNameBothPlaces(t *testing.T) {
	err := validate(t, `(limit) {
	rate_limit {
		zone snippet_conflict {
			events {args[0]}
			window 1m
		}
	}
}
http://a.localhost:HTTP_PORT {
	import limit 10
	respond "a"
}
http://b.localhost:HTTP_PORT {
	import limit 20
	respond "b"
}
`, "caddyfile")
	if err == nil {
		t.Fatal("conflicting definitions loaded")
	}
	for _, want := range []string{
		`zone "snippet_conflict" is defined differently at Caddyfile:3 import chain ['Caddyfile:10 (import limit)'] and at Caddyfile:3 import chain ['Caddyfile:14 (import limit)']`,
		"define it once in the rate_limit global option (rate_limit { zone snippet_conflict { … } }) and use it by name (rate_limit snippet_conflict)",
		"for two limits, give each definition its own name (in a snippet imported with different values, put an argument in the name: zone snippet_conflict_{args[0]})",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
	// The second way out, as the error writes it, is two limits.
	tc := newTester(t)
	tc.InitServer(globals("")+`(limit) {
	rate_limit {
		zone snippet_conflict_{args[0]} {
			events {args[0]}
			window 1h
		}
	}
}
http://localhost:HTTP_PORT {
	handle /a {
		import limit 2
		respond "a"
	}
	handle /b {
		import limit 3
		respond "b"
	}
}
`, "caddyfile")
	if got := codes(t, tc, 3, "/a"); got != "200 200 429" {
		t.Errorf("/a, imported with 2: %s", got)
	}
	if got := codes(t, tc, 4, "/b"); got != "200 200 200 429" {
		t.Errorf("/b, imported with 3: %s", got)
	}
}

// TestSharedZoneDistributedInOnePlaceOnlyFails checks that a zone shared by
// two sites cannot be cluster-wide in one and local in the other: it is one
// zone, and which of the two it became would depend on load order.
func TestSharedZoneDistributedInOnePlaceOnlyFails(t *testing.T) {
	for _, order := range [][2]string{{"distributed", ""}, {"", "distributed"}} {
		site := func(host, dist string) string {
			if dist != "" {
				dist = "distributed"
			}
			return fmt.Sprintf(`http://%s.localhost:HTTP_PORT {
	rate_limit {
		zone shared_dist {
			events 10
			window 1m
		}
		%s
	}
	respond "%s"
}
`, host, dist, host)
		}
		err := validate(t, site("a", order[0])+site("b", order[1]), "caddyfile")
		if err == nil {
			t.Fatalf("%q then %q: loaded", order[0], order[1])
		}
		if want := `zone "shared_dist" is also defined (the same way) where it is`; !strings.Contains(err.Error(), want) {
			t.Errorf("%q then %q: error %q does not contain %q", order[0], order[1], err, want)
		}
	}
}

// TestJSONKeyShorthandIsPerClient checks that a Caddyfile shorthand inside a
// JSON key means what it means in the Caddyfile: "u-{client_ip}" is one
// bucket per client, not the text "u-" for everyone.
func TestJSONKeyShorthandIsPerClient(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(`{
	  "admin": {"listen": "localhost:ADMIN_PORT"},
	  "apps": {"http": {"http_port": HTTP_PORT, "grace_period": 1, "servers": {"srv0": {"listen": [":HTTP_PORT"],
	    "routes": [{"handle": [
	      {"handler": "rate_limit", "rate_limits": {"json_shorthand": {"key": "u-{client_ip}", "max_events": 1, "window": "1h"}}},
	      {"handler": "static_response", "body": "ok"}]}]}}}}}`, "json")
	if got := fetch(t, clientFrom("127.0.0.1"), baseURL) + " " + fetch(t, clientFrom("127.0.0.1"), baseURL); got != "ok:200 :429" {
		t.Errorf("first client: %s", got)
	}
	if got := fetch(t, clientFrom("127.0.0.2"), baseURL); got != "ok:200" {
		t.Errorf("second client: %s (every client shares one bucket)", got)
	}
}

// TestWarningsLoggedOnceAtLoad loads a config with every kind of zone that
// loads but does not limit as meant, with one of them in a snippet imported
// twice, and reads Caddy's log: each warning is there once, naming its zone.
func TestWarningsLoggedOnceAtLoad(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	cfg := globals(testcaddy.JSONLog("", logFile, "level INFO")) + `
(constant) {
	rate_limit {
		zone warn_constant {
			key client_ip
			events 5
			window 1m
		}
	}
}
http://a.localhost:HTTP_PORT {
	import constant
	respond "a"
}
http://b.localhost:HTTP_PORT {
	import constant
	rate_limit /remote {
		zone warn_remote {
			key {remote}
			events 5
			window 1m
		}
	}
	rate_limit /unknown {
		zone warn_unknown {
			key {http.request.heder.X-Key}
			events 5
			window 1m
		}
	}
	rate_limit /memory {
		zone warn_memory {
			key {client_ip}
			events 5
			window 1m
			memory 1KB
		}
	}
	rate_limit /nothing
	respond "b"
}
http://c.localhost:HTTP_PORT {
	map {header.X-API-Key} {org} {
		default anonymous
	}
	rate_limit {
		zone warn_brace {
			key {header.X-API-Key
			events 5
			window 1m
		}
		zone warn_nginx {
			key $http_x_api_key
			events 5
			window 1m
		}
		zone warn_map {
			key {org}
			events 5
			window 1m
		}
		zone warn_big {
			key {client_ip}
			events 5
			window 1m
			memory 300MiB
		}
		zone warn_big2 {
			key {client_ip}
			events 5
			window 1m
			memory 300MiB
		}
		zone warn_big3 {
			key {client_ip}
			events 5
			window 1m
			memory 300MiB
		}
		zone warn_big4 {
			key {client_ip}
			events 5
			window 1m
			memory 300MiB
		}
	}
	respond "c"
}
`
	if err := load(t, cfg, "caddyfile"); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
		var entry struct {
			Level, Msg, Zone string
		}
		if json.Unmarshal([]byte(line), &entry) != nil || entry.Level != "warn" {
			continue
		}
		counts[entry.Zone+" | "+entry.Msg]++
	}
	for _, want := range []struct{ zone, msg string }{
		{"warn_constant", `zone "warn_constant": key "client_ip" has no braces, so it is that text for every request and every client shares one bucket; write the placeholder {client_ip}`},
		{"warn_remote", `zone "warn_remote": key "{http.request.remote}" contains {http.request.remote}, the client's port`},
		{"warn_unknown", `zone "warn_unknown": key "{http.request.heder.X-Key}" contains {http.request.heder.X-Key}, which is not a placeholder of Caddy's HTTP server`},
		{"warn_memory", `zone "warn_memory": memory 1000 B is a table of 15 lines`},
		{"", "this rate_limit handler has no zone, so it limits nothing"},
		{"warn_brace", `zone "warn_brace": key "{header.X-API-Key" has a brace without its pair, so it is no placeholder`},
		{"warn_nginx", `zone "warn_nginx": key "$http_x_api_key" is nginx's variable syntax, which Caddy does not expand`},
		{"warn_big", `zone "warn_big": its table is 300 MiB (from memory 300 MiB), allocated at load, more than the 256 MiB`},
		{"", "the tables of this config's 11 rate_limit zones add up to 1.4 GiB, allocated at load, more than 1.0 GiB (largest: warn_big 300 MiB, warn_big2 300 MiB, warn_big3 300 MiB)"},
	} {
		n := 0
		for k, c := range counts {
			if strings.HasPrefix(k, want.zone+" | "+want.msg) {
				n += c
			}
		}
		if n != 1 {
			t.Errorf("warning %q for zone %q logged %d times, want once; warnings: %v", want.msg, want.zone, n, counts)
		}
	}
	// {org} is set by the map before rate_limit.
	for k := range counts {
		if strings.HasPrefix(k, "warn_map | ") {
			t.Errorf("false warning: %s", k)
		}
	}
}

// TestHeaderPlaceholdersNeedTheDeferredForm checks what docs/directives.md
// (Placeholders) says about rate_limit placeholders in the header directive: `header` runs before
// rate_limit, so only the deferred form (`>Name`), applied as the response is
// written, sees them.
func TestHeaderPlaceholdersNeedTheDeferredForm(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	header >X-RateLimit-Zone {http.rate_limit.zone}
	header >X-RateLimit-Remaining {http.rate_limit.remaining}
	header X-Too-Early {http.rate_limit.zone}
	rate_limit {
		zone header_deferred {
			key {client_ip}
			events 5
			window 1h
		}
	}
	respond "ok"`), "caddyfile")
	_, _, resp := do(t, clientFrom("127.0.0.1"), mustRequest(t, baseURL))
	if got := resp.Header.Get("X-RateLimit-Zone"); got != "header_deferred" {
		t.Errorf("deferred header: %q", got)
	}
	if got := resp.Header.Get("X-RateLimit-Remaining"); got != "4" {
		t.Errorf("deferred remaining: %q", got)
	}
	// The plain form runs before rate_limit set anything: Caddy leaves the
	// unknown placeholder as written, as docs/directives.md says.
	if got := resp.Header.Get("X-Too-Early"); got != "{http.rate_limit.zone}" {
		t.Errorf("plain header: %q", got)
	}
}

// TestDryRunChangesNothingClientsSee runs a zone with action log beside one
// that enforces: the responses the dry run would deny carry exactly the
// enforcing zone's headers, as they would without the dry run, and no
// Retry-After.
func TestDryRunChangesNothingClientsSee(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone dry_enforced {
			events 100
			window 1h
			burst 100
		}
		zone dry_trial {
			events 1
			window 1h
			action log
		}
	}
	respond "ok"`), "caddyfile")
	for i := range 3 {
		code, body, resp := get(t, tc, "/")
		if code != 200 || body != "ok" {
			t.Fatalf("request %d: %d %q", i+1, code, body)
		}
		if got, want := resp.Header.Get("RateLimit-Policy"), `"dry_enforced";q=100;w=3600`; got != want {
			t.Errorf("request %d: RateLimit-Policy %q, want %q", i+1, got, want)
		}
		if got, want := resp.Header.Get("RateLimit"), fmt.Sprintf(`"dry_enforced";r=%d;t=`, 99-i); !strings.HasPrefix(got, want) || strings.Contains(got, "dry_trial") {
			t.Errorf("request %d: RateLimit %q, want %q… only", i+1, got, want)
		}
		if got := resp.Header.Values("Retry-After"); len(got) > 0 {
			t.Errorf("request %d: Retry-After %q, want none", i+1, got)
		}
	}
}

// `caddy validate` shows the zone warnings `caddy run` logs: validating
// provisions the config and cleans it up without starting it, and the
// warnings need the whole config (the placeholders its map handlers set).
func TestValidateShowsTheZoneWarnings(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	caddyfile := globals(testcaddy.JSONLog("", logFile, "level INFO")) + `
http://localhost:HTTP_PORT {
	map {header.X-API-Key} {org} {
		default anonymous
	}
	rate_limit {
		zone validate_constant {
			key client_ip
			events 5
			window 1m
		}
		zone validate_map {
			key {org}
			events 5
			window 1m
		}
	}
	respond "ok"
}`
	caddyfile = withPorts(caddyfile)
	adapter := caddyconfig.GetAdapter("caddyfile")
	cfgJSON, _, err := adapter.Adapt([]byte(caddyfile), nil)
	if err != nil {
		t.Fatal(err)
	}
	var cfg caddy.Config
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		t.Fatal(err)
	}
	if err := caddy.Validate(&cfg); err != nil {
		t.Fatalf("validate: %v", err)
	}
	got := testcaddy.LogEntries(t, logFile, `zone "validate_`, "level", "zone")
	if fmt.Sprint(got) != "[info validate_constant warn validate_constant info validate_map]" {
		t.Fatalf("caddy validate logged %q, want what each zone means, and the constant key's warning once (and none for the map's {org})", got)
	}
}
