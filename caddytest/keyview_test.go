package caddytest

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/floodgate-rl/floodgate"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// The admin API's key view says a quota's retry_after and reset "as in the
// headers" (docs/operations.md): at most the quota's window, as a 429's
// t says, not the two hours a quota's count can last. Support staff read
// the wait the client is told.
func TestTheKeyViewSaysWhatTheHeadersSay(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone rv_admin {
			key {header.X-Key}
			events 100
			window 1m
			burst 100
			quota 3 1h
		}
	}
	respond "ok"`), "caddyfile")
	var items []testcaddy.Item
	for i := range 4 {
		_, _, resp := get(t, tc, "/", "X-Key: carol")
		items, _ = testcaddy.CheckHonest(t, "request", resp)
		if i == 3 && resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("the 4th of a quota of 3: %d", resp.StatusCode)
		}
	}
	var told int64 = -1
	for _, it := range items {
		if it.Name == "rv_admin/1h" {
			told = it.T
		}
	}
	if told < 0 {
		t.Fatalf("no quota item in %+v", items)
	}
	resp, err := tc.Client.Get(adminURL + "/rate_limit/zones/rv_admin/keys/carol")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var key floodgate.KeyInfo
	if err := json.NewDecoder(resp.Body).Decode(&key); err != nil {
		t.Fatal(err)
	}
	for _, p := range key.Policies {
		if p.Policy != "quota" {
			continue
		}
		if p.Reset > 3600 || p.RetryAfter > 3600 {
			t.Errorf("the key view's quota says retry_after %d, reset %d; the 429's headers said t=%d (w=3600)", p.RetryAfter, p.Reset, told)
		}
		return
	}
	t.Fatalf("no quota policy in the key view: %+v", key)
}
