//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// newTestTable makes a table, or skips the test where this process may not
// load BPF programs.
func newTestTable(t testing.TB, cfg Config) *Table {
	t.Helper()
	tb, err := NewTable(cfg)
	if notPermitted(err) {
		t.Skipf("BPF is not permitted here (needs CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN or root): %v", err)
	}
	if err != nil {
		t.Fatalf("NewTable: %+v", err)
	}
	t.Cleanup(func() { tb.Close() })
	return tb
}

func testConfig(l limiter.Limit) Config {
	return Config{Buckets: limiter.BucketsConfig{Limit: l, Bytes: 64 << 10}, IPv4Prefix: 24, IPv6Prefix: 48}
}

func TestProgramLoads(t *testing.T) {
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 10, Window: time.Second}))
	if tb.Buckets.Lines() != 1024 {
		t.Fatalf("lines = %d, want 1024", tb.Buckets.Lines())
	}
	t.Logf("epoch slack %v", tb.Slack)
}
