//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"net/netip"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// BenchmarkProgram measures the program in the kernel, on one core, with
// BPF_PROG_TEST_RUN repeating it on one frame: a SYN from a drained network
// (the flood: dropped), from a network with tokens (a grant per run, on a
// limit too fast to drain), a packet that is not a SYN, and, as the
// baseline in the same run, the Go side's decision for the same key
// (Buckets.Allow).
func BenchmarkProgram(b *testing.B) {
	tb, err := NewTable(testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	if err != nil {
		b.Skipf("BPF: %v", err)
	}
	defer tb.Close()
	fast, err := NewTable(testConfig(limiter.Limit{Events: 1_000_000, Window: time.Second, Burst: 1 << 20}))
	if err != nil {
		b.Fatal(err)
	}
	defer fast.Close()
	for _, t := range []*Table{tb, fast} {
		if err := t.enable([]uint16{443}); err != nil {
			b.Fatal(err)
		}
	}
	src := netip.MustParseAddr("198.51.100.7")
	syn := packet(src, 443, flagSYN)
	run := func(b *testing.B, t *Table, frame []byte, want uint32) {
		ret, per, err := t.objs.Synlimit.Benchmark(frame, b.N, nil)
		if err != nil {
			b.Fatal(err)
		}
		if ret != want {
			b.Fatalf("verdict %d, want %d", ret, want)
		}
		b.ReportMetric(float64(per.Nanoseconds()), "ns/packet")
		b.ReportMetric(1e9/float64(max(per.Nanoseconds(), 1)), "packets/s")
	}
	b.Run("syn_dropped", func(b *testing.B) {
		if ret, _, err := tb.objs.Synlimit.Benchmark(syn, 2, nil); err != nil || ret != xdpDrop {
			b.Fatalf("draining: %d %v", ret, err)
		}
		run(b, tb, syn, xdpDrop)
	})
	b.Run("syn_passed", func(b *testing.B) { run(b, fast, syn, xdpPass) })
	b.Run("not_syn", func(b *testing.B) { run(b, tb, packet(src, 443, flagACK), xdpPass) })
	b.Run("go_allow_denied", func(b *testing.B) {
		key := limiter.NetworkKey(src, 24, 48)
		now := time.Now()
		b.ReportAllocs()
		for range b.N {
			tb.Buckets.Allow(key.Bytes(), 1, now)
		}
	})
}
