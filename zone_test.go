package floodgate

import (
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// TestPolicyDescribesTheRate checks that RateLimit-Policy's q/w is the
// sustained rate, or just under it, whatever the burst and window, and q the
// burst when the bucket refills over whole seconds.
func TestPolicyDescribesTheRate(t *testing.T) {
	for _, tc := range []struct {
		l    limiter.Limit
		want string
	}{
		{limiter.Limit{Events: 100, Window: time.Minute}, `"z";q=100;w=60`},
		{limiter.Limit{Events: 100, Window: time.Minute, Burst: 10}, `"z";q=10;w=6`},
		{limiter.Limit{Events: 10, Window: time.Hour, Burst: 2}, `"z";q=2;w=720`},
		{limiter.Limit{Events: 10, Window: time.Minute, Burst: 100}, `"z";q=100;w=600`},
		{limiter.Limit{Events: 40, Window: time.Minute, Burst: 3}, `"z";q=3;w=5`},
		{limiter.Limit{Events: 10, Window: 100 * time.Millisecond}, `"z";q=100;w=1`},
		{limiter.Limit{Events: 3, Window: 1500 * time.Millisecond}, `"z";q=3;w=2`},
		{limiter.Limit{Events: 1_000_000, Window: time.Second, Burst: 1}, `"z";q=1000000;w=1`},
		{limiter.Limit{Events: 1, Window: 365 * 24 * time.Hour, Burst: limiter.MaxBurst}, `"z";q=1048576;w=33067892736000`},
	} {
		if got := policyItem("z", tc.l); got != tc.want {
			t.Errorf("%v: %s, want %s", tc.l, got, tc.want)
		}
	}
}

func TestCeilSeconds(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		want int64
	}{
		{0, 0},
		{-time.Second, 0},
		{time.Nanosecond, 1},
		{time.Second, 1},
		{2100 * time.Millisecond, 3},
		{3 * time.Second, 3},
		{limiter.Never, 9223372036},
		{limiter.Never - 1, 9223372036},
	} {
		if got := ceilSeconds(tt.d); got != tt.want {
			t.Errorf("ceilSeconds(%v) = %d, want %d", tt.d, got, tt.want)
		}
	}
}

func TestZoneNamesMustNeedNoEscaping(t *testing.T) {
	for _, name := range []string{"", "a b", `a"b`, `a\b`, "é", "tab\t"} {
		if validZoneName(name) == nil {
			t.Errorf("zone name %q accepted", name)
		}
	}
	for _, name := range []string{"api", "per-client_1", "a.b:c/d"} {
		if err := validZoneName(name); err != nil {
			t.Errorf("zone name %q: %v", name, err)
		}
	}
}
