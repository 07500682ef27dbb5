package caddytest

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

func TestZoneMatcherSelectsRequests(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone matchers_post {
			match {
				method POST
			}
			events 1
			window 1h
		}
	}
	respond "ok"`), "caddyfile")

	if got := codes(t, tc, 3, "/"); got != "200 200 200" {
		t.Errorf("GETs (not matched by the zone): %s, want all 200", got)
	}
	post := func() int {
		req, _ := http.NewRequest(http.MethodPost, baseURL+"/", nil)
		code, _, _ := do(t, tc.Client, req)
		return code
	}
	if a, b := post(), post(); a != 200 || b != 429 {
		t.Errorf("POSTs: %d %d, want 200 429", a, b)
	}
}

func TestDistinctZonesAndKeys(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit /a {
		zone keys_a {
			key {http.request.header.X-User}
			events 2
			window 1h
		}
	}
	rate_limit /b {
		zone keys_b {
			key {http.request.header.X-User}
			events 1
			window 1h
		}
	}
	respond "ok"`), "caddyfile")

	if got := codes(t, tc, 3, "/a", "X-User: alice"); got != "200 200 429" {
		t.Errorf("alice on /a: %s", got)
	}
	if got := codes(t, tc, 3, "/a", "X-User: bob"); got != "200 200 429" {
		t.Errorf("bob on /a (own key): %s", got)
	}
	if got := codes(t, tc, 2, "/b", "X-User: alice"); got != "200 429" {
		t.Errorf("alice on /b (own zone): %s", got)
	}
}

func TestHandleErrorsSeesPlaceholdersAndRetryAfter(t *testing.T) {
	tc := newTester(t)
	// The wait counts from a moment between the load, which creates the
	// zone's table, and the first request (see TestRateLimitHeaders).
	start := time.Now()
	tc.InitServer(config("", `
	rate_limit {
		zone errors_zone {
			events 1
			window 100s
		}
	}
	respond "ok"
	handle_errors 429 {
		respond "limited by {http.rate_limit.exceeded.name} zone={http.rate_limit.zone} limit={http.rate_limit.limit} remaining={http.rate_limit.remaining} retry={http.rate_limit.retry_after} status={err.status_code}" 429
	}`), "caddyfile")

	if code, body, _ := get(t, tc, "/"); code != 200 || body != "ok" {
		t.Fatalf("first request: %d %q", code, body)
	}
	code, body, resp := get(t, tc, "/")
	elapsed := time.Since(start)
	// One token returns every 100 s: the wait is 100 s less the time
	// since then, rounded up, in Retry-After and in the retry_after
	// placeholder alike.
	ra := resp.Header.Get("Retry-After")
	checkSeconds(t, "Retry-After", ra, 100*time.Second, elapsed)
	want := "limited by errors_zone zone=errors_zone limit=1 remaining=0 retry=" + ra + " status=429"
	if code != 429 || body != want {
		t.Errorf("denied: %d %q, want 429 %q", code, body, want)
	}
}

func TestNoHandleErrorsGivesBare429(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone bare_zone {
			events 1
			window 1h
		}
	}
	respond "ok"`), "caddyfile")
	if got := codes(t, tc, 2, "/"); got != "200 429" {
		t.Errorf("got %s, want 200 429", got)
	}
}

// reloadConfig is a config whose zone reload_<name> allows events per hour;
// tag changes the response body so that every load is a real change.
func reloadConfig(name, events, tag string) string {
	return config("", `
	rate_limit {
		zone reload_`+name+` {
			events `+events+`
			window 1h
		}
	}
	respond "`+tag+`"`)
}

func TestReloadKeepsState(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(reloadConfig("keep", "3", "one"), "caddyfile")
	if got := codes(t, tc, 2, "/"); got != "200 200" {
		t.Fatalf("before reload: %s", got)
	}
	tc.InitServer(reloadConfig("keep", "3", "two"), "caddyfile")
	if code, body, _ := get(t, tc, "/"); code != 200 || body != "two" {
		t.Fatalf("after reload: %d %q, want 200 from the new config", code, body)
	}
	if got := codes(t, tc, 1, "/"); got != "429" {
		t.Errorf("fourth request across a reload: %s, want 429 (3 per hour)", got)
	}
}

func TestRaiseAndLowerApplyAtOnce(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(reloadConfig("change", "3", "a"), "caddyfile")
	if got := codes(t, tc, 4, "/"); got != "200 200 200 429" {
		t.Fatalf("events 3: %s", got)
	}
	// Raising to 5 keeps the 3 used: exactly 2 more.
	tc.InitServer(reloadConfig("change", "5", "b"), "caddyfile")
	if got := codes(t, tc, 3, "/"); got != "200 200 429" {
		t.Errorf("raised to 5: %s, want 200 200 429", got)
	}
	// Lowering to 4 leaves a key that used 5 with nothing.
	tc.InitServer(reloadConfig("change", "4", "c"), "caddyfile")
	if got := codes(t, tc, 1, "/"); got != "429" {
		t.Errorf("lowered to 4: %s, want 429", got)
	}
	// Raising to 7 from 5 used gives 2.
	tc.InitServer(reloadConfig("change", "7", "d"), "caddyfile")
	if got := codes(t, tc, 3, "/"); got != "200 200 429" {
		t.Errorf("raised to 7: %s, want 200 200 429", got)
	}
}

func TestFailedReloadLeavesStateUntouched(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(reloadConfig("failed", "3", "a"), "caddyfile")
	if got := codes(t, tc, 2, "/"); got != "200 200" {
		t.Fatalf("before: %s", got)
	}
	// A config that raises the zone to 10 and then fails to provision: the
	// second handler names a global zone that does not exist. The first
	// handler is provisioned (and acquires the zone's table) before the
	// failure.
	bad := `{
	  "admin": {"listen": "localhost:ADMIN_PORT"},
	  "apps": {"http": {"http_port": HTTP_PORT, "servers": {"srv0": {"listen": [":HTTP_PORT"], "routes": [
	    {"handle": [{"handler": "rate_limit", "rate_limits": {"reload_failed": {"max_events": 10, "window": "1h"}}}]},
	    {"handle": [{"handler": "rate_limit", "zones": ["no_such_zone"]}]},
	    {"handle": [{"handler": "static_response", "body": "bad"}]}
	  ]}}}}}`
	err := load(t, bad, "json")
	if err == nil || !strings.Contains(err.Error(), `zone \"no_such_zone\" is not defined`) {
		t.Fatalf("loading the bad config: %v, want an error about no_such_zone", err)
	}
	// The running config still answers, with its limit of 3 and its count.
	code, body, _ := get(t, tc, "/")
	if code != 200 || body != "a" {
		t.Errorf("third request: %d %q, want 200 \"a\"", code, body)
	}
	if got := codes(t, tc, 1, "/"); got != "429" {
		t.Errorf("fourth request: %s, want 429: the failed load must not raise the limit", got)
	}
}

func TestDeniedRequestChargesNoZone(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone noburn_wide {
			key static
			events 3
			window 1h
		}
		zone noburn_user {
			key {http.request.header.X-User}
			events 1
			window 1h
		}
	}
	respond "ok"`), "caddyfile")

	if got := codes(t, tc, 6, "/", "X-User: alice"); got != "200 429 429 429 429 429" {
		t.Fatalf("alice: %s", got)
	}
	// alice's five denials (by noburn_user) took nothing from noburn_wide:
	// it still has 2 of 3 for others.
	if got := codes(t, tc, 1, "/", "X-User: bob"); got != "200" {
		t.Errorf("bob: %s", got)
	}
	if got := codes(t, tc, 1, "/", "X-User: carol"); got != "200" {
		t.Errorf("carol: %s", got)
	}
	if got := codes(t, tc, 1, "/", "X-User: dave"); got != "429" {
		t.Errorf("dave: %s, want 429 (noburn_wide exhausted by 3 allowed requests)", got)
	}
}

func TestRateLimitHeaders(t *testing.T) {
	tc := newTester(t)
	// A zone's table counts time in ticks from when the load creates it,
	// so a t= or Retry-After counts down from a moment between the load and
	// the request that took the token: elapsed times run from before the
	// load. Only hdr_one's window is short enough for a token to return
	// within a stalled test, and checkSeconds fails the test if the stall
	// was that long.
	start := time.Now()
	tc.InitServer(config("", `
	rate_limit /one {
		zone hdr_one {
			events 4
			window 1m
			burst 4
		}
	}
	rate_limit /two {
		zone hdr_a {
			events 4
			window 1h
			burst 4
		}
		zone hdr_b {
			events 10
			window 1h
			burst 2
		}
	}
	rate_limit /off {
		zone hdr_off {
			events 4
			window 1m
		}
		headers off
	}
	respond "ok"`), "caddyfile")

	_, _, resp := get(t, tc, "/one")
	if got, want := resp.Header.Get("RateLimit-Policy"), `"hdr_one";q=4;w=60`; got != want {
		t.Errorf("/one RateLimit-Policy = %q, want %q", got, want)
	}
	// One of 4 used, one token per 15 s: full again 15 s after the token
	// was taken.
	checkRateLimit(t, "/one", resp, time.Since(start), rateLimitWant{"hdr_one", 3, 15 * time.Second})

	_, _, resp = get(t, tc, "/two")
	if got, want := resp.Header.Get("RateLimit-Policy"), `"hdr_a";q=4;w=3600, "hdr_b";q=2;w=720`; got != want {
		t.Errorf("/two RateLimit-Policy = %q, want %q", got, want)
	}
	checkRateLimit(t, "/two", resp, time.Since(start),
		rateLimitWant{"hdr_a", 3, 900 * time.Second}, rateLimitWant{"hdr_b", 1, 360 * time.Second})
	get(t, tc, "/two")
	code, _, resp := get(t, tc, "/two")
	elapsed := time.Since(start)
	if code != 429 {
		t.Fatalf("/two third request: %d, want 429 from hdr_b", code)
	}
	// Denied: hdr_b is empty, full 720 s and one token 360 s after the
	// first /two request; hdr_a was refunded, so it shows 2 left.
	tt := checkRateLimit(t, "/two denied", resp, elapsed,
		rateLimitWant{"hdr_a", 2, 1800 * time.Second}, rateLimitWant{"hdr_b", 0, 720 * time.Second})
	ra := checkSeconds(t, "/two Retry-After", resp.Header.Get("Retry-After"), 360*time.Second, elapsed)
	// hdr_b's t= and Retry-After count from the same instants.
	if len(tt) == 2 && tt[1] != ra+360 {
		t.Errorf("/two denied: Retry-After %d and hdr_b t=%d, want t=%d", ra, tt[1], ra+360)
	}

	_, _, resp = get(t, tc, "/off")
	for _, name := range []string{"RateLimit-Policy", "RateLimit"} {
		if got := resp.Header.Get(name); got != "" {
			t.Errorf("/off with headers off: %s = %q", name, got)
		}
	}
}

// rateLimitWant is what a RateLimit item should say: the zone, its remaining
// count r, and the time after which t= counts a bucket full again, measured
// from the moment the counting began.
type rateLimitWant struct {
	zone string
	r    int64
	full time.Duration
}

// checkRateLimit checks resp's RateLimit header, a list of
// `"zone";r=<int>;t=<int>`: one item per want, in order, with the zone and r
// wanted and t within what elapsed allows (checkSeconds). It returns the t
// values.
func checkRateLimit(t *testing.T, what string, resp *http.Response, elapsed time.Duration, want ...rateLimitWant) []int64 {
	t.Helper()
	header := resp.Header.Get("RateLimit")
	items := strings.Split(header, ", ")
	if len(items) != len(want) {
		t.Errorf("%s: RateLimit %q, want %d items", what, header, len(want))
		return nil
	}
	var ts []int64
	for i, item := range items {
		zone, r, tv := parseRateLimitItem(item)
		if zone != want[i].zone || r != fmt.Sprint(want[i].r) {
			t.Errorf("%s: RateLimit %q: item %d is %q, want zone %s with r=%d", what, header, i+1, item, want[i].zone, want[i].r)
			continue
		}
		ts = append(ts, checkSeconds(t, what+" "+zone+" t", tv, want[i].full, elapsed))
	}
	return ts
}

// parseRateLimitItem splits `"zone";r=<r>;t=<t>` into its parts; a part it
// cannot find is empty.
func parseRateLimitItem(item string) (zone, r, t string) {
	quoted, params, _ := strings.Cut(item, ";r=")
	r, t, _ = strings.Cut(params, ";t=")
	if len(quoted) >= 2 && quoted[0] == '"' && quoted[len(quoted)-1] == '"' {
		zone = quoted[1 : len(quoted)-1]
	}
	return zone, r, t
}

func TestTrustedProxiesClientIP(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config(`servers {
		trusted_proxies static 127.0.0.0/8
	}`, `
	rate_limit {
		zone proxied {
			key {client_ip}
			events 1
			window 1h
		}
	}
	respond "{client_ip}"`), "caddyfile")

	code, body, _ := get(t, tc, "/", "X-Forwarded-For: 203.0.113.9")
	if code != 200 || body != "203.0.113.9" {
		t.Fatalf("first: %d %q", code, body)
	}
	if got := codes(t, tc, 1, "/", "X-Forwarded-For: 203.0.113.9"); got != "429" {
		t.Errorf("same forwarded client: %s, want 429", got)
	}
	if got := codes(t, tc, 1, "/", "X-Forwarded-For: 203.0.113.10"); got != "200" {
		t.Errorf("another forwarded client through the same proxy: %s, want 200", got)
	}
}

func TestPrefixesGroupRealSourceAddresses(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone prefix_v4 {
			key {remote_host}
			events 2
			window 1h
			ipv4_prefix 24
		}
	}
	respond "ok"`), "caddyfile")

	for _, step := range []struct {
		from string
		want int
	}{
		{"127.0.5.1", 200},
		{"127.0.5.2", 200}, // same /24: the second of 2
		{"127.0.5.3", 429}, // same /24: exhausted
		{"127.0.6.1", 200}, // another /24
		{"127.0.5.1", 429},
	} {
		req, _ := http.NewRequest(http.MethodGet, baseURL+"/", nil)
		if code, _, _ := do(t, clientFrom(step.from), req); code != step.want {
			t.Errorf("from %s: %d, want %d", step.from, code, step.want)
		}
	}
}

func TestGlobalZoneSharedByTwoSites(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(globals(`rate_limit {
		zone global_shared {
			key {remote_host}
			events 3
			window 1h
		}
	}`)+`
http://a.localhost:HTTP_PORT {
	rate_limit global_shared
	respond "a"
}
http://b.localhost:HTTP_PORT {
	rate_limit /api/* {
		zone global_shared
	}
	respond "b"
}
`, "caddyfile")

	var got []string
	for _, u := range []string{"http://a.localhost:HTTP_PORT/", "http://b.localhost:HTTP_PORT/api/x", "http://a.localhost:HTTP_PORT/", "http://b.localhost:HTTP_PORT/api/y", "http://b.localhost:HTTP_PORT/free"} {
		req := mustRequest(t, u)
		code, body, _ := do(t, tc.Client, req)
		got = append(got, body+":"+http.StatusText(code))
	}
	want := []string{"a:OK", "b:OK", "a:OK", ":Too Many Requests", "b:OK"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("got %v, want %v", got, want)
	}
}

func TestMissingKeySharesTheEmptyKey(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone missing_key {
			key {http.request.header.X-API-Key} {http.request.header.X-Session}
			events 1
			window 1h
		}
	}
	respond "ok"`), "caddyfile")

	// Without either header, requests share one bucket: omitting the
	// header is no way around the limit.
	if got := codes(t, tc, 2, "/"); got != "200 429" {
		t.Errorf("no key: %s", got)
	}
	// The second key is used when the first is absent.
	if got := codes(t, tc, 2, "/", "X-Session: s1"); got != "200 429" {
		t.Errorf("fallback key: %s", got)
	}
	if got := codes(t, tc, 1, "/", "X-API-Key: k1"); got != "200" {
		t.Errorf("first key: %s", got)
	}
}

func TestJSONConfig(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(`{
	  "admin": {"listen": "localhost:ADMIN_PORT"},
	  "apps": {
	    "rate_limit": {"zones": {"json_global": {"max_events": 1, "window": "1h", "key": "{http.request.header.X-User}"}}},
	    "http": {"http_port": HTTP_PORT, "grace_period": 1, "servers": {"srv0": {"listen": [":HTTP_PORT"],
	      "routes": [{"handle": [
	        {"handler": "rate_limit", "zones": ["json_global"]},
	        {"handler": "static_response", "body": "json ok"}]}]}}}}}`, "json")
	if got := codes(t, tc, 2, "/", "X-User: alice"); got != "200 429" {
		t.Errorf("alice: %s", got)
	}
	if got := codes(t, tc, 1, "/", "X-User: bob"); got != "200" {
		t.Errorf("bob: %s", got)
	}
}

func TestMetricsCountByZoneAndOutcome(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone metrics_zone {
			events 2
			window 1h
		}
	}
	respond "ok"`), "caddyfile")
	if got := codes(t, tc, 3, "/"); got != "200 200 429" {
		t.Fatalf("requests: %s", got)
	}
	body := testcaddy.Metrics(t, adminPort)
	for _, want := range []string{
		"\n" + `caddy_rate_limit_requests_total{outcome="allowed",zone="metrics_zone"} 2` + "\n",
		"\n" + `caddy_rate_limit_requests_total{outcome="denied",zone="metrics_zone"} 1` + "\n",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// A reload that fails to start after its rate_limit app has put a raised
// limit in force puts the previous limit back.
func TestReloadThatFailsToStartPutsPreviousLimitsBack(t *testing.T) {
	tc := newTester(t)
	zone := func(events int) string {
		return fmt.Sprintf(`{"handler": "rate_limit", "rate_limits": {"undo_start": {"max_events": %d, "window": "1h", "key": "{http.request.header.X-User}"}}}`, events)
	}
	tc.InitServer(`{
	  "admin": {"listen": "localhost:ADMIN_PORT", "config": {"persist": false}},
	  "apps": {"http": {"http_port": HTTP_PORT, "grace_period": 1, "servers": {"srv0": {"listen": [":HTTP_PORT"], "routes": [{"handle": [
	    `+zone(3)+`, {"handler": "static_response", "body": "a"}]}]}}}}}`, "json")
	if got := codes(t, tc, 2, "/", "X-User: alice"); got != "200 200" {
		t.Fatalf("alice before: %s", got)
	}
	// The new config raises the zone to 10 and then fails to start. Whether
	// its rate_limit app starts before the failing app is up to Caddy's map
	// order, so load it until the probe shows that the raised limit was in
	// force: then only the undo can bring the limit back to 3.
	for i := 1; ; i++ {
		bad := fmt.Sprintf(`{
		  "admin": {"listen": "localhost:ADMIN_PORT", "config": {"persist": false}},
		  "apps": {
		    "floodgate_test_start_failure": {"probe": "http://127.0.0.1:HTTP_PORT/", "header": {"X-User": "probe%d"}},
		    "http": {"http_port": HTTP_PORT, "grace_period": 1, "servers": {"srv0": {"listen": [":HTTP_PORT"], "routes": [{"handle": [
		      %s, {"handler": "static_response", "body": "bad"}]}]}}}}}`, i, zone(10))
		if err := load(t, bad, "json"); err == nil || !strings.Contains(err.Error(), testcaddy.StartFailureError) {
			t.Fatalf("loading the config that fails to start: %v, want the test app's error", err)
		}
		probe := testcaddy.Probed()
		if probe.Err != nil {
			t.Fatalf("attempt %d: probe: %v", i, probe.Err)
		}
		header := probe.Header.Get("RateLimit")
		// A new key after one request has 9 left at 10 per hour, 2 at 3.
		zone, r, _ := parseRateLimitItem(header)
		if zone == "undo_start" && r == "9" {
			t.Logf("the raised limit was in force when the config failed, at attempt %d", i)
			break
		}
		if zone != "undo_start" || r != "2" {
			t.Fatalf("attempt %d: the probe saw RateLimit %q, want r=9 (raised) or r=2 for undo_start", i, header)
		}
		if i == 100 {
			t.Fatal("in 100 loads, the rate_limit app never started before the failing app")
		}
	}
	code, body, _ := get(t, tc, "/", "X-User: alice")
	if code != 200 || body != "a" {
		t.Errorf("alice's third request: %d %q, want 200 \"a\" from the running config", code, body)
	}
	if got := codes(t, tc, 1, "/", "X-User: alice"); got != "429" {
		t.Errorf("alice's fourth request: %s, want 429: the failed start must give the limit of 3 back", got)
	}
	if got := codes(t, tc, 4, "/", "X-User: carol"); got != "200 200 200 429" {
		t.Errorf("carol, a new key: %s, want 3 allowed", got)
	}
}
