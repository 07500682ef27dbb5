package caddytest

import (
	"testing"
)

// A request that fails in a later zone is not served, so the zones before
// it charge nothing: a matcher that errors (a 500) and a weight the zone
// refuses (a 400) each give back what the zones already charged, as a
// denial does. Each failing request here would otherwise take one of the
// first zone's 3, and the request after them would be a 429.
func TestARequestThatFailsInALaterZoneChargesNone(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit /matched* {
		zone rollback_first {
			key {client_ip}
			events 3
			window 1h
		}
		zone rollback_matcher {
			key {client_ip}
			events 3
			window 1h
			match {
				expression `+"`int({http.request.header.X-N}) > 0`"+`
			}
		}
	}
	rate_limit /dry* {
		zone rollback_dry {
			key {client_ip}
			events 3
			window 1h
			action log
			match {
				expression `+"`int({http.request.header.X-N}) > 0`"+`
			}
		}
	}
	rate_limit /weighed* {
		zone rollback_first_w {
			key {client_ip}
			events 3
			window 1h
		}
		zone rollback_weight {
			key {client_ip}
			events 100
			window 1h
			weight {http.request.header.X-Cost}
		}
	}
	respond "ok"`), "caddyfile")

	if got := codes(t, tc, 3, "/matched", "X-N: not a number"); got != "500 500 500" {
		t.Fatalf("a matcher that errors: %s, want 500 500 500", got)
	}
	if got := codes(t, tc, 4, "/matched", "X-N: 1"); got != "200 200 200 429" {
		t.Errorf("after three 500s: %s, want the first zone's 3 and a 429", got)
	}

	// A dry run's matcher that errors changes nothing clients see.
	if got := codes(t, tc, 2, "/dry", "X-N: not a number"); got != "200 200" {
		t.Errorf("a dry-run zone whose matcher errors: %s, want 200 200", got)
	}

	if got := codes(t, tc, 3, "/weighed", "X-Cost: -5"); got != "400 400 400" {
		t.Fatalf("a weight the zone refuses: %s, want 400 400 400", got)
	}
	if got := codes(t, tc, 4, "/weighed", "X-Cost: 1"); got != "200 200 200 429" {
		t.Errorf("after three 400s: %s, want the first zone's 3 and a 429", got)
	}
}
