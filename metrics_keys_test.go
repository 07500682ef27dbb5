package floodgate

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// caddy_rate_limit_keys_total estimates the keys a table holds state for:
// within 5% from a few keys to ten keys a line (ten times what a table sized
// for its sources holds when they all flood), for both kinds of table.
func TestActiveKeysEstimatesKeysWithState(t *testing.T) {
	now := time.Now()
	for _, windowed := range []bool{false, true} {
		for _, n := range []int{100, 2000, 10000} {
			cfg := limiter.BucketsConfig{Limit: limiter.Limit{Events: 5, Window: time.Hour}, Bytes: 1 << 16}
			var table limiter.Table
			var err error
			if windowed {
				table, err = limiter.NewWindows(cfg)
			} else {
				cfg.Limit.Burst = 5
				table, err = limiter.NewBuckets(cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			for i := range n {
				table.Allow(fmt.Appendf(nil, "key-%d", i), 1, now)
			}
			got := activeKeys(table.Stats(now))
			if math.Abs(got-float64(n)) > 0.05*float64(n) {
				t.Errorf("windows %v, %d keys in %d lines: estimate %v", windowed, n, table.Lines(), got)
			}
		}
	}
	if got := activeKeys(limiter.BucketStats{}); got != 0 {
		t.Errorf("no table: %v", got)
	}
}
