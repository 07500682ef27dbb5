//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// TestClocksAgree: the program's clock (bpf_ktime_get_ns) is the runtime's
// CLOCK_MONOTONIC, and the table's epoch puts it within Slack of the Go
// side's clock (time.Now's monotonic reading since the table's base).
func TestClocksAgree(t *testing.T) {
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 10, Window: time.Second}))
	if tb.Slack > time.Microsecond {
		t.Errorf("epoch slack %v: the bracketing should pin it within a microsecond", tb.Slack)
	}
	epoch := int64(tb.params.Epoch)
	base := tb.Buckets.Base()
	for i := range 100 {
		m1, g1 := nanotime(), time.Now()
		mono := int64(probe(t, tb, []byte{4, 0, 0, 0, 0}, 0).Mono)
		g2, m2 := time.Now(), nanotime()
		if mono < m1 || mono > m2 {
			t.Fatalf("reading %d: bpf_ktime_get_ns %d outside the runtime's CLOCK_MONOTONIC readings [%d, %d]", i, mono, m1, m2)
		}
		bpfNow := time.Duration(mono - epoch)
		lo, hi := g1.Sub(base)-tb.Slack, g2.Sub(base)+tb.Slack
		if bpfNow < lo || bpfNow > hi {
			t.Fatalf("reading %d: program's table time %v outside Go's [%v, %v]", i, bpfNow, lo, hi)
		}
	}
	// The epoch itself: every time.Now between two nanotime readings is
	// within Slack of them on the table's clock.
	for i := range 1000 {
		m1 := nanotime()
		g := time.Now()
		m2 := nanotime()
		d := int64(g.Sub(base))
		if d < m1-epoch-int64(tb.Slack) || d > m2-epoch+int64(tb.Slack) {
			t.Fatalf("sample %d: time.Now at table time %d, CLOCK_MONOTONIC bracket [%d, %d] ± %v", i, d, m1-epoch, m2-epoch, tb.Slack)
		}
	}
}
