package caddytest

import (
	"net/http"
	"testing"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

func TestDenialEmitsRateLimitExceededEvent(t *testing.T) {
	tc := newTester(t)
	testcaddy.Events()
	tc.InitServer(`{
	  "admin": {"listen": "localhost:ADMIN_PORT", "config": {"persist": false}},
	  "apps": {
	    "events": {"subscriptions": [{"events": ["rate_limit_exceeded"], "handlers": [{"handler": "floodgate_test_recorder"}]}]},
	    "http": {"http_port": HTTP_PORT, "grace_period": 1, "servers": {"srv0": {"listen": [":HTTP_PORT"],
	      "routes": [{"handle": [
	        {"handler": "rate_limit", "rate_limits": {"evented": {"max_events": 1, "window": "1h", "key": "{http.request.header.X-User}"}}},
	        {"handler": "static_response", "body": "ok"}]}]}}}}}`, "json")
	if got := codes(t, tc, 3, "/", "X-User: alice"); got != "200 429 429" {
		t.Fatalf("requests: %s", got)
	}
	events := testcaddy.Events()
	if len(events) != 2 {
		t.Fatalf("%d events, want 2 (one per denial): %v", len(events), events)
	}
	e := events[0]
	if e["event"] != "rate_limit_exceeded" || e["zone"] != "evented" || e["client_ip"] != "127.0.0.1" {
		t.Errorf("event %v", e)
	}
	if _, ok := e["key"]; ok {
		t.Errorf("event carries the key without log_key: %v", e)
	}
}

func TestPlaceholdersOnAllowedRequests(t *testing.T) {
	tc := newTester(t)
	body := `respond "zone={http.rate_limit.zone} limit={http.rate_limit.limit} remaining={http.rate_limit.remaining} retry={http.rate_limit.retry_after} key=[{http.rate_limit.key}]"`
	tc.InitServer(config("", `
	rate_limit /plain {
		zone ph_plain {
			key {http.request.header.X-User}
			events 3
			window 1h
		}
	}
	rate_limit /logged {
		zone ph_logged {
			key {http.request.header.X-User}
			events 3
			window 1h
		}
		log_key
	}
	`+body), "caddyfile")

	for _, tt := range []struct{ path, want string }{
		{"/plain", "zone=ph_plain limit=3 remaining=2 retry=0 key=[]"},
		{"/logged", "zone=ph_logged limit=3 remaining=2 retry=0 key=[alice]"},
		// No zone applied: Caddy leaves unknown placeholders as they are.
		{"/other", "zone={http.rate_limit.zone} limit={http.rate_limit.limit} remaining={http.rate_limit.remaining} retry={http.rate_limit.retry_after} key=[{http.rate_limit.key}]"},
	} {
		if code, got, _ := get(t, tc, tt.path, "X-User: alice"); code != http.StatusOK || got != tt.want {
			t.Errorf("%s: %d %q, want %q", tt.path, code, got, tt.want)
		}
	}
}
