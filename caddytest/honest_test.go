package caddytest

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// What a response says of its limits is true, for every kind of policy a
// zone has: each RateLimit item's t is at most its w, and a 429's
// Retry-After is at most the longest window of the policies that deny it
// and agrees with their t (testcaddy.CheckHonest). Before, a fresh key of
// a zone with `quota 100 1h` was told t=6577: a quota's count lasts into
// the next window, and its t was the time until it no longer counted.
// The cluster's kind is in caddytest/cluster, layer4's in caddytest/layer4.
func TestEveryItemTellsTheTruth(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit /bucket {
		zone honest_bucket {
			key {header.X-Key}
			events 4
			window 1m
			burst 2
		}
	}
	rate_limit /window {
		zone honest_window {
			key {header.X-Key}
			events 3
			window 10s
		}
	}
	rate_limit /quota {
		zone honest_quota {
			key {header.X-Key}
			events 100
			window 1m
			burst 100
			quota 3 1h
			quota 100 24h
		}
	}
	respond "ok"`), "caddyfile")
	for _, path := range []string{"/bucket", "/window", "/quota"} {
		denied := false
		for i := range 6 {
			_, _, resp := get(t, tc, path, "X-Key: honest")
			items, _ := testcaddy.CheckHonest(t, fmt.Sprintf("%s request %d", path, i+1), resp)
			if len(items) == 0 {
				t.Fatalf("%s: no RateLimit items", path)
			}
			denied = denied || resp.StatusCode == http.StatusTooManyRequests
		}
		if !denied {
			t.Errorf("%s: 6 requests, none denied: the denial's headers were not checked", path)
		}
	}
}
