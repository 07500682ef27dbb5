package caddytest

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// In a distributed zone with action delay, a request the cluster's
// estimate denies is held until the cluster lets it through: requests
// beyond the cluster's limit are spaced out at its rate, not passed at
// once because the local bucket still has tokens. The local bucket here
// (burst 40) never denies; the cluster allows 5 a second.
//
// Whatever the timing, a zone whose every window (of the sliding-window
// estimate) admits at most 5 cannot admit more than 5 × (E/W + 2) in E;
// holding requests makes the 16 take long enough for that, passing them
// at once does not.
func TestDelayInADistributedZoneHoldsForTheCluster(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone delay_cluster {
			events 5
			window 1s
			burst 40
			action delay 3s
		}
		distributed {
			read_interval 1h
			write_interval 1h
		}
	}
	respond "ok"`), "caddyfile")
	const n, quota, window = 16, 5, time.Second
	start := time.Now()
	var got []string
	for range n {
		code, _, _ := get(t, tc, "/")
		got = append(got, fmt.Sprint(code))
	}
	elapsed := time.Since(start)
	if want := strings.Repeat("200 ", n-1) + "200"; strings.Join(got, " ") != want {
		t.Errorf("statuses %s, want every request held and passed: %s", strings.Join(got, " "), want)
	}
	if bound := quota * (elapsed.Seconds()/window.Seconds() + 2); n > bound {
		t.Errorf("%d requests passed in %v, more than the cluster's %.1f: held requests were not held for the cluster", n, elapsed, bound)
	}
}
