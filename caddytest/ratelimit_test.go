package integration

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
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

	start := time.Now()
	if code, body, _ := get(t, tc, "/"); code != 200 || body != "ok" {
		t.Fatalf("first request: %d %q", code, body)
	}
	code, body, resp := get(t, tc, "/")
	elapsed := time.Since(start)
	// One token returns every 100 s: the wait is 100 s less the time
	// between the two requests, rounded up, in Retry-After and in the
	// retry_after placeholder alike.
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
	  "admin": {"listen": "localhost:2419"},
	  "apps": {"http": {"http_port": 9480, "servers": {"srv0": {"listen": [":9480"], "routes": [
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
	tc.InitServer(config("", `
	rate_limit /one {
		zone hdr_one {
			events 4
			window 1m
		}
	}
	rate_limit /two {
		zone hdr_a {
			events 4
			window 1m
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
	check := func(path, name, want string) {
		t.Helper()
		if got := resp.Header.Get(name); got != want {
			t.Errorf("%s %s = %q, want %q", path, name, got, want)
		}
	}
	// Values of the request that takes the token are exact: no time
	// passes between taking it and reporting.
	check("/one", "RateLimit-Policy", `"hdr_one";q=4;w=60`)
	// One of 4 used, one token per 15 s: full again in 15 s.
	check("/one", "RateLimit", `"hdr_one";r=3;t=15`)

	start := time.Now()
	_, _, resp = get(t, tc, "/two")
	check("/two", "RateLimit-Policy", `"hdr_a";q=4;w=60, "hdr_b";q=2;w=3600`)
	check("/two", "RateLimit", `"hdr_a";r=3;t=15, "hdr_b";r=1;t=360`)
	get(t, tc, "/two")
	code, _, resp := get(t, tc, "/two")
	elapsed := time.Since(start)
	if code != 429 {
		t.Fatalf("/two third request: %d, want 429 from hdr_b", code)
	}
	// Denied: hdr_b is empty; hdr_a was refunded, so it shows 2 left. The
	// seconds count from the first /two request, some time up to elapsed
	// ago: hdr_b is full 720 s after it and has a token 360 s after it,
	// hdr_a is full 30 s after it.
	items := rateLimitItems(t, resp.Header.Get("RateLimit"))
	if len(items) != 2 || items[0].zone != "hdr_a" || items[0].r != 2 || items[1].zone != "hdr_b" || items[1].r != 0 {
		t.Fatalf("/two denied: RateLimit %q, want hdr_a with r=2 and hdr_b with r=0", resp.Header.Get("RateLimit"))
	}
	ra := checkSeconds(t, "/two Retry-After", resp.Header.Get("Retry-After"), 360*time.Second, elapsed)
	ta := checkSeconds(t, "/two hdr_a t", items[0].t, 30*time.Second, elapsed)
	tb := checkSeconds(t, "/two hdr_b t", items[1].t, 720*time.Second, elapsed)
	// All three are measured from the same two instants.
	if tb != ra+360 || ta != ra-330 {
		t.Errorf("/two denied: Retry-After %d, hdr_a t=%d, hdr_b t=%d; want t=%d and t=%d", ra, ta, tb, ra-330, ra+360)
	}

	_, _, resp = get(t, tc, "/off")
	check("/off", "RateLimit-Policy", "")
	check("/off", "RateLimit", "")
}

// rateLimitItem is one item of a RateLimit header: "zone";r=<r>;t=<t>.
type rateLimitItem struct {
	zone string
	r    int64
	t    string
}

// rateLimitItems parses a RateLimit header, failing the test if it is not a
// list of `"zone";r=<int>;t=<int>`.
func rateLimitItems(t *testing.T, header string) []rateLimitItem {
	t.Helper()
	var items []rateLimitItem
	for item := range strings.SplitSeq(header, ", ") {
		var it rateLimitItem
		quoted, params, ok := strings.Cut(item, ";r=")
		r, tv, ok2 := strings.Cut(params, ";t=")
		n, err := strconv.ParseInt(r, 10, 64)
		if !ok || !ok2 || err != nil || len(quoted) < 2 || quoted[0] != '"' || quoted[len(quoted)-1] != '"' {
			t.Fatalf("RateLimit %q: item %q is not \"zone\";r=N;t=N", header, item)
		}
		it.zone, it.r, it.t = quoted[1:len(quoted)-1], n, tv
		items = append(items, it)
	}
	return items
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
http://a.localhost:9480 {
	rate_limit global_shared
	respond "a"
}
http://b.localhost:9480 {
	rate_limit /api/* {
		zone global_shared
	}
	respond "b"
}
`, "caddyfile")

	var got []string
	for _, u := range []string{"http://a.localhost:9480/", "http://b.localhost:9480/api/x", "http://a.localhost:9480/", "http://b.localhost:9480/api/y", "http://b.localhost:9480/free"} {
		req, _ := http.NewRequest(http.MethodGet, u, nil)
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
	  "admin": {"listen": "localhost:2419"},
	  "apps": {
	    "rate_limit": {"zones": {"json_global": {"max_events": 1, "window": "1h", "key": "{http.request.header.X-User}"}}},
	    "http": {"http_port": 9480, "grace_period": 1, "servers": {"srv0": {"listen": [":9480"],
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
	req, _ := http.NewRequest(http.MethodGet, adminURL+"/metrics", nil)
	_, body, _ := do(t, tc.Client, req)
	for _, want := range []string{
		"\n" + `caddy_rate_limit_requests_total{outcome="allowed",zone="metrics_zone"} 2` + "\n",
		"\n" + `caddy_rate_limit_requests_total{outcome="denied",zone="metrics_zone"} 1` + "\n",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func init() {
	caddy.RegisterModule(startFailure{})
}

// startFailure is an app, for tests only, that fails to start. Before it
// fails it sends Probe one request with the header X-User: Key and keeps the
// response's RateLimit header in probed: a new key's remaining count there
// shows the limit in force at that moment, which is the failing config's if
// its rate_limit app started first (Caddy starts apps in map order).
type startFailure struct {
	Probe string `json:"probe"`
	Key   string `json:"key"`
}

var probed struct {
	sync.Mutex
	header string
}

func (startFailure) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "floodgate_test_start_failure",
		New: func() caddy.Module { return new(startFailure) },
	}
}

func (s startFailure) Start() error {
	header := "no probe"
	req, err := http.NewRequest(http.MethodGet, s.Probe, nil)
	if err == nil {
		req.Header.Set("X-User", s.Key)
		var resp *http.Response
		if resp, err = (&http.Client{Timeout: 10 * time.Second}).Do(req); err == nil {
			header = resp.Header.Get("RateLimit")
			resp.Body.Close()
		}
	}
	if err != nil {
		header = err.Error()
	}
	probed.Lock()
	probed.header = header
	probed.Unlock()
	return errors.New("fails to start, as this test app always does")
}

func (startFailure) Stop() error { return nil }

// A reload that fails to start after its rate_limit app has put a raised
// limit in force puts the previous limit back.
func TestReloadThatFailsToStartPutsPreviousLimitsBack(t *testing.T) {
	tc := newTester(t)
	zone := func(events int) string {
		return fmt.Sprintf(`{"handler": "rate_limit", "rate_limits": {"undo_start": {"max_events": %d, "window": "1h", "key": "{http.request.header.X-User}"}}}`, events)
	}
	tc.InitServer(`{
	  "admin": {"listen": "localhost:2419", "config": {"persist": false}},
	  "apps": {"http": {"http_port": 9480, "grace_period": 1, "servers": {"srv0": {"listen": [":9480"], "routes": [{"handle": [
	    `+zone(3)+`, {"handler": "static_response", "body": "a"}]}]}}}}}`, "json")
	if got := codes(t, tc, 2, "/", "X-User: alice"); got != "200 200" {
		t.Fatalf("alice before: %s", got)
	}
	// The new config raises the zone to 10 and then fails to start. Whether
	// its rate_limit app starts before the failing app is up to Caddy's map
	// order, so load it until the probe shows that the raised limit was in
	// force: then only the undo can bring the limit back to 3.
	const (
		raised   = `"undo_start";r=9;t=360`  // a new key after one request, at 10 per hour
		unraised = `"undo_start";r=2;t=1200` // and at 3 per hour
	)
	for i := 1; ; i++ {
		bad := fmt.Sprintf(`{
		  "admin": {"listen": "localhost:2419", "config": {"persist": false}},
		  "apps": {
		    "floodgate_test_start_failure": {"probe": "http://127.0.0.1:9480/", "key": "probe%d"},
		    "http": {"http_port": 9480, "grace_period": 1, "servers": {"srv0": {"listen": [":9480"], "routes": [{"handle": [
		      %s, {"handler": "static_response", "body": "bad"}]}]}}}}}`, i, zone(10))
		if err := load(t, bad, "json"); err == nil || !strings.Contains(err.Error(), "fails to start, as this test app always does") {
			t.Fatalf("loading the config that fails to start: %v, want the test app's error", err)
		}
		probed.Lock()
		header := probed.header
		probed.Unlock()
		if header == raised {
			t.Logf("the raised limit was in force when the config failed, at attempt %d", i)
			break
		}
		if header != unraised {
			t.Fatalf("attempt %d: the probe saw RateLimit %q, want %q or %q", i, header, raised, unraised)
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
