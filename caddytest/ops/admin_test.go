package ops

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/floodgate-rl/floodgate"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// twoZones has a global zone keyed by client IP in /24 networks and an
// inline zone keyed by a header.
func twoZones(prefix string) string {
	return caddyfile(fmt.Sprintf(`rate_limit {
		zone %[1]s_ip {
			key {client_ip}
			events 3
			window 1h
			ipv4_prefix 24
			memory 64KiB
		}
	}`, prefix), fmt.Sprintf(`	rate_limit %[1]s_ip {
		zone %[1]s_user {
			key {http.request.header.X-User}
			events 2
			window 1h
			memory 64KiB
		}
	}
	respond "ok"`, prefix))
}

func zoneByName(zs []floodgate.ZoneInfo, name string) *floodgate.ZoneInfo {
	for i := range zs {
		if zs[i].Name == name {
			return &zs[i]
		}
	}
	return nil
}

func TestZonesListsEveryZoneWithItsCounts(t *testing.T) {
	mustLoad(t, twoZones("list"))
	if got := codes(t, "127.0.3.1", 3, "X-User: ann"); got != "200 200 429" {
		t.Fatalf("ann: %s", got)
	}
	var zs []floodgate.ZoneInfo
	adminJSON(t, http.MethodGet, "/rate_limit/zones", &zs)
	if len(zs) != 2 || zs[0].Name != "list_ip" || zs[1].Name != "list_user" {
		t.Fatalf("zones: %+v, want list_ip and list_user in that order", zs)
	}
	ip, user := zs[0], zs[1]
	if len(ip.Policies) != 1 || ip.Policies[0] != (floodgate.PolicyInfo{Kind: "window", Events: 3, Window: "1h0m0s"}) {
		t.Errorf("list_ip policies: %+v", ip.Policies)
	}
	if strings.Join(ip.Key, " ") != "{http.vars.client_ip}" || ip.IPv4Prefix != 24 || ip.IPv6Prefix != 64 {
		t.Errorf("list_ip key and prefixes: %v %d %d", ip.Key, ip.IPv4Prefix, ip.IPv6Prefix)
	}
	// The third request was denied by list_user; list_ip granted it but was
	// refunded, so it counts it nowhere.
	if want := (floodgate.Outcomes{Allowed: 2}); ip.Requests != want || ip.Weight != want {
		t.Errorf("list_ip counts: requests %+v weight %+v, want %+v", ip.Requests, ip.Weight, want)
	}
	if want := (floodgate.Outcomes{Allowed: 2, Denied: 1}); user.Requests != want || user.Weight != want {
		t.Errorf("list_user counts: requests %+v weight %+v, want %+v", user.Requests, user.Weight, want)
	}
	for _, z := range zs {
		if z.Memory.Bytes <= 0 || z.Memory.Lines*64 != z.Memory.Bytes || z.Memory.K <= 0 {
			t.Errorf("%s memory: %+v", z.Name, z.Memory)
		}
		// A 64 KiB table is measured whole: 1024 lines of 8 counters (a
		// window zone's; a bucket zone's line has 16), of which a key
		// holds K.
		if z.Occupancy <= 0 || z.Occupancy > float64(2*z.Memory.K)/(8*1024) {
			t.Errorf("%s occupancy %v: one or two keys hold a few counters of the table", z.Name, z.Occupancy)
		}
		// One drained key makes a fresh key on its line (1 in 1024) fail
		// with probability 1/C(8, K): 1.7e-5 for K = 3.
		if z.FalseDeny < 0 || z.FalseDeny >= 1e-4 {
			t.Errorf("%s false_deny %v: no key is near its limit's counters", z.Name, z.FalseDeny)
		}
		if z.Connections != nil {
			t.Errorf("%s: connections reported for a zone no layer4 matcher uses", z.Name)
		}
	}
	var one floodgate.ZoneInfo
	adminJSON(t, http.MethodGet, "/rate_limit/zones/list_user", &one)
	if one.Name != "list_user" || one.Requests != user.Requests {
		t.Errorf("one zone: %+v", one)
	}
}

func TestAdminErrorsAreJSON(t *testing.T) {
	mustLoad(t, twoZones("errors"))
	for _, c := range []struct{ method, path, want string }{
		{http.MethodGet, "/rate_limit/zones/nope", `404 {"error":"unknown zone \"nope\""}`},
		{http.MethodGet, "/rate_limit/zones/nope/top", `404 {"error":"unknown zone \"nope\""}`},
		{http.MethodGet, "/rate_limit/zones/nope/keys/1.2.3.4", `404 {"error":"unknown zone \"nope\""}`},
		{http.MethodPost, "/rate_limit/zones", `405 {"error":"method POST not allowed; use GET"}`},
		{http.MethodDelete, "/rate_limit/zones/errors_ip", `405 {"error":"method DELETE not allowed; use GET"}`},
		{http.MethodPost, "/rate_limit/zones/errors_ip/top", `405 {"error":"method POST not allowed; use GET"}`},
		{http.MethodPut, "/rate_limit/zones/errors_ip/keys/a", `405 {"error":"method PUT not allowed; use GET, DELETE"}`},
		{http.MethodGet, "/rate_limit/zones/errors_ip/top?n=0", `400 {"error":"n \"0\": must be a whole number from 1 to 64"}`},
	} {
		code, body := adminDo(t, c.method, c.path)
		if got := fmt.Sprintf("%d %s", code, strings.TrimSpace(body)); got != c.want {
			t.Errorf("%s %s: %s, want %s", c.method, c.path, got, c.want)
		}
	}
}

func TestAdminOriginEnforcementStaysInForce(t *testing.T) {
	mustLoad(t, twoZones("origin"))
	code, body := adminDo(t, http.MethodGet, "/rate_limit/zones", "Origin: http://evil.example")
	if code != http.StatusForbidden || !strings.Contains(body, "evil.example") {
		t.Errorf("foreign origin: %d %s, want 403", code, body)
	}
	code, body = adminDo(t, http.MethodDelete, "/rate_limit/zones/origin_ip/keys/127.0.0.1", "Origin: http://evil.example")
	if code != http.StatusForbidden {
		t.Errorf("reset from a foreign origin: %d %s, want 403", code, body)
	}
	if code, _ := adminDo(t, http.MethodGet, "/rate_limit/zones", fmt.Sprintf("Origin: http://localhost:%d", adminPort)); code != http.StatusOK {
		t.Errorf("own origin: %d", code)
	}
}

func TestKeyInspectionChargesNothingAndMasksAddresses(t *testing.T) {
	mustLoad(t, twoZones("inspect"))
	if got := codes(t, "127.0.4.1", 2, "X-User: bea"); got != "200 200" {
		t.Fatalf("bea: %s", got)
	}
	// 127.0.4.99 is in the same /24 as the requests' 127.0.4.1.
	var first, second floodgate.KeyInfo
	for range 5 {
		adminJSON(t, http.MethodGet, "/rate_limit/zones/inspect_ip/keys/127.0.4.99", &first)
	}
	adminJSON(t, http.MethodGet, "/rate_limit/zones/inspect_ip/keys/127.0.4.99", &second)
	if first.Source != "127.0.4.0/24" || !first.Allowed || len(first.Policies) != 1 {
		t.Fatalf("inspect: %+v", first)
	}
	p := first.Policies[0]
	// A zone without burst is a window of an hour, opened by the first
	// request: the key is clear when it ends.
	if p.Policy != "window" || p.Limit != 3 || p.Remaining != 1 || p.RetryAfter != 0 || p.Reset < 3500 || p.Reset > 3600 {
		t.Errorf("policy: %+v, want a window, limit 3, remaining 1, no retry, clear when the hour is over", p)
	}
	if q := second.Policies[0]; q.Limit != p.Limit || q.Remaining != p.Remaining || q.Reset > p.Reset || q.Reset < p.Reset-1 {
		t.Errorf("asked again: %+v, then %+v", p, q)
	}
	// Six inspections charged nothing: the network still has one request.
	if got := codes(t, "127.0.4.2", 2, "X-User: cid"); got != "200 429" {
		t.Errorf("after inspection: %s, want 200 429", got)
	}
	adminJSON(t, http.MethodGet, "/rate_limit/zones/inspect_ip/keys/127.0.4.99", &first)
	if p := first.Policies[0]; first.Allowed || p.Remaining != 0 || p.RetryAfter < 3500 || p.RetryAfter > 3600 {
		t.Errorf("drained network: %+v", first)
	}
	// A header key is hashed, never shown; a key with a slash and a space
	// reaches the API escaped.
	var user floodgate.KeyInfo
	adminJSON(t, http.MethodGet, "/rate_limit/zones/inspect_user/keys/"+url.PathEscape("bea"), &user)
	if !strings.HasPrefix(user.Source, "key:") || user.Policies[0].Remaining != 0 {
		t.Errorf("bea in inspect_user: %+v", user)
	}
	if got := codes(t, "127.0.5.1", 1, "X-User: a/b c"); got != "200" {
		t.Fatalf("a/b c: %s", got)
	}
	adminJSON(t, http.MethodGet, "/rate_limit/zones/inspect_user/keys/"+url.PathEscape("a/b c"), &user)
	if user.Policies[0].Remaining != 1 {
		t.Errorf("a/b c in inspect_user: %+v, want 1 left", user)
	}
}

func TestResetLetsTheKeyThrough(t *testing.T) {
	mustLoad(t, twoZones("reset"))
	if got := codes(t, "127.0.6.1", 3, "X-User: dan"); got != "200 200 429" {
		t.Fatalf("dan: %s", got)
	}
	var after floodgate.KeyInfo
	adminJSON(t, http.MethodDelete, "/rate_limit/zones/reset_user/keys/dan", &after)
	if !after.Allowed || after.Policies[0].Remaining != 2 || after.Policies[0].Reset != 0 {
		t.Errorf("after reset: %+v, want full", after)
	}
	// From another network: 127.0.6.0/24 has one request left in reset_ip.
	if got := codes(t, "127.0.16.1", 3, "X-User: dan"); got != "200 200 429" {
		t.Errorf("dan after reset: %s, want 200 200 429", got)
	}
	// The empty key is the bucket of requests without the header.
	if got := codes(t, "127.0.7.1", 3); got != "200 200 429" {
		t.Fatalf("no header: %s", got)
	}
	adminJSON(t, http.MethodDelete, "/rate_limit/zones/reset_user/keys/", &after)
	if after.Source != "none" || !after.Allowed {
		t.Errorf("empty key after reset: %+v", after)
	}
	if got := codes(t, "127.0.17.1", 1); got != "200" {
		t.Errorf("no header after reset: %s", got)
	}
}

func TestTopShowsTheFloodFirst(t *testing.T) {
	mustLoad(t, caddyfile("", `	rate_limit {
		zone top_ip {
			key {client_ip}
			events 5
			window 1h
		}
		zone top_user {
			key {http.request.header.X-User}
			events 2
			window 1h
			match path /user*
		}
	}
	rate_limit /logged* {
		zone top_logged {
			key {http.request.header.X-User}
			events 1
			window 1h
		}
		log_key
	}
	respond "ok"`))
	// 40 light sources, two requests each: never denied.
	for i := range 40 {
		if got := codes(t, fmt.Sprintf("127.0.8.%d", i+1), 2); got != "200 200" {
			t.Fatalf("light source %d: %s", i, got)
		}
	}
	flood := strings.Repeat("429 ", 55)
	if got := codes(t, "127.0.9.200", 60); got != "200 200 200 200 200 "+strings.TrimSpace(flood) {
		t.Fatalf("flood: %s", got)
	}
	if got := codes(t, "127.0.9.201", 8); got != "200 200 200 200 200 429 429 429" {
		t.Fatalf("moderate: %s", got)
	}
	var top floodgate.TopInfo
	adminJSON(t, http.MethodGet, "/rate_limit/zones/top_ip/top", &top)
	want := []floodgate.TopSource{{Source: "127.0.9.200/32", Denied: 55}, {Source: "127.0.9.201/32", Denied: 3}}
	if fmt.Sprint(top.Sources) != fmt.Sprint(want) || top.Since.IsZero() {
		t.Errorf("top: %+v since %v, want %+v", top.Sources, top.Since, want)
	}
	adminJSON(t, http.MethodGet, "/rate_limit/zones/top_ip/top?n=1", &top)
	if len(top.Sources) != 1 {
		t.Errorf("n=1: %+v", top.Sources)
	}

	// A key that is not an address is shown by its hash, never as itself,
	// unless the handler has log_key.
	secret := "sk_live_top_secret_4242"
	req := func(path string, n int) {
		c := from("127.0.10.1")
		for range n {
			r, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://localhost:%d%s", httpPort, path), nil)
			r.Header.Set("X-User", secret)
			send(t, c, r)
		}
	}
	req("/user", 4)
	req("/logged", 3)
	code, body := adminDo(t, http.MethodGet, "/rate_limit/zones/top_user/top")
	if code != 200 || strings.Contains(body, secret) || !strings.Contains(body, `"source": "key:`) || !strings.Contains(body, `"denied": 2`) {
		t.Errorf("top_user without log_key: %d %s", code, body)
	}
	adminJSON(t, http.MethodGet, "/rate_limit/zones/top_logged/top", &top)
	if fmt.Sprint(top.Sources) != fmt.Sprint([]floodgate.TopSource{{Source: secret, Denied: 2}}) {
		t.Errorf("top_logged with log_key: %+v", top.Sources)
	}
}

func TestFailedStartKeepsThePreviousZonesListed(t *testing.T) {
	mustLoad(t, twoZones("kept"))
	// The new config's rate_limit app lists its zone kept_new once it has
	// started; then its start fails. Whether the rate_limit app starts
	// before the failing app is up to Caddy's map order, so load it until
	// the failing app's probe of the admin API saw kept_new listed: then
	// only the undo can list the running config's zones again.
	bad := fmt.Sprintf(`{
	  "admin": {"listen": "localhost:%[1]d", "config": {"persist": false}},
	  "apps": {
	    "floodgate_test_start_failure": {"probe": "http://localhost:%[1]d/rate_limit/zones"},
	    "http": {"servers": {"srv0": {"listen": [":%[2]d"], "routes": [{"handle": [
	      {"handler": "rate_limit", "rate_limits": {"kept_new": {"max_events": 1, "window": "1h"}}},
	      {"handler": "static_response", "body": "bad"}]}]}}}}}`, adminPort, httpPort)
	for i := 1; ; i++ {
		if err := load(t, bad, "json"); err == nil || !strings.Contains(err.Error(), testcaddy.StartFailureError) {
			t.Fatalf("loading the config that fails to start: %v, want the test app's error", err)
		}
		var zs []floodgate.ZoneInfo
		adminJSON(t, http.MethodGet, "/rate_limit/zones", &zs)
		if len(zs) != 2 || zs[0].Name != "kept_ip" || zs[1].Name != "kept_user" {
			t.Fatalf("after a failed start: %+v, want the running config's kept_ip and kept_user", zs)
		}
		p := testcaddy.Probed()
		if p.Err != nil {
			t.Fatalf("attempt %d: probe: %v", i, p.Err)
		}
		if strings.Contains(p.Body, `"kept_new"`) {
			t.Logf("kept_new was listed while the config was failing, at attempt %d", i)
			break
		}
		if !strings.Contains(p.Body, `"kept_ip"`) {
			t.Fatalf("attempt %d: the probe saw %s, want kept_ip (not started yet) or kept_new", i, p.Body)
		}
		if i == 100 {
			t.Fatal("in 100 loads, the rate_limit app never started before the failing app")
		}
	}
	// A config without any zone: the API lists none.
	mustLoad(t, caddyfile("", `respond "no zones"`))
	code, body := adminDo(t, http.MethodGet, "/rate_limit/zones")
	if code != 200 || strings.TrimSpace(body) != "[]" {
		t.Errorf("no zones: %d %s", code, body)
	}
}
