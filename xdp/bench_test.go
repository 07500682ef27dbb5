//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// BenchmarkProgram measures the program in the kernel, on one core, with
// BPF_PROG_TEST_RUN repeating it on one frame: a SYN from a drained network
// (the flood: dropped), from a network with tokens (a grant per run), a
// packet that is not a SYN, a QUIC Initial of a new connection from a
// drained network (the Initial flood: dropped, after a miss in the map of
// connections charged), a QUIC Initial of a connection charged already
// (passed on a hit there, in runs of the 16 its entry lets pass free, the
// client's latest after the first), a client's Handshake packet (passed,
// ending the pass of its latest: a hit in the map latest, a miss deleting
// from initials),
// and, as the baseline in the same run, the Go
// side's decision for the same key (Buckets.Allow).
//
// The program grants several million SYNs a second, faster than any limit
// refills (limiter.MaxRate is a million a second), so syn_passed runs in
// chunks of half the burst on a table refilled before each (and before a
// run the kernel interrupted and cilium/ebpf starts again): every run is a
// grant. Before, one long run drained the key after about a million grants
// and went on measuring a mix of grants and drops, and failed when its last
// run happened to be a drop.
//
// It skips where the tests do (BPF not permitted: newTestTable) and fails
// where they fail; it skipped on any error, a verifier's rejection of the
// program included.
func BenchmarkProgram(b *testing.B) {
	tb := newTestTable(b, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	fast := newTestTable(b, testConfig(limiter.Limit{Events: limiter.MaxRate, Window: time.Second, Burst: limiter.MaxBurst}))
	for _, t := range []*Table{tb, fast} {
		if err := t.enable(Ports{TCP: []uint16{443}, QUIC: []uint16{443}}); err != nil {
			b.Fatal(err)
		}
	}
	src := netip.MustParseAddr("198.51.100.7")
	syn := packet(src, 443, flagSYN)
	// run runs the program on frame b.N times, in chunks of at most chunk
	// runs, after reset (if not nil) before each chunk and each restart.
	run := func(b *testing.B, t *Table, frame []byte, want uint32, chunk int, reset func()) {
		var total time.Duration
		for done := 0; done < b.N; {
			n := min(chunk, b.N-done)
			if reset != nil {
				reset()
			}
			ret, per, err := t.objs.Synlimit.Benchmark(frame, n, reset)
			if err != nil {
				b.Fatal(err)
			}
			if ret != want {
				b.Fatalf("verdict %d, want %d, after %d runs", ret, want, done+n)
			}
			total += per * time.Duration(n)
			done += n
		}
		per := float64(total.Nanoseconds()) / float64(b.N)
		b.ReportMetric(per, "ns/packet")
		b.ReportMetric(1e9/max(per, 1), "packets/s")
	}
	b.Run("syn_dropped", func(b *testing.B) {
		if ret, _, err := tb.objs.Synlimit.Benchmark(syn, 2, nil); err != nil || ret != xdpDrop {
			b.Fatalf("draining: %d %v", ret, err)
		}
		run(b, tb, syn, xdpDrop, b.N, nil)
	})
	b.Run("syn_passed", func(b *testing.B) {
		run(b, fast, syn, xdpPass, limiter.MaxBurst/2, func() { clear(fast.mem) })
	})
	b.Run("not_syn", func(b *testing.B) { run(b, tb, packet(src, 443, flagACK), xdpPass, b.N, nil) })
	b.Run("quic_initial_dropped", func(b *testing.B) {
		// The network is drained by the SYNs above or here; a dropped
		// Initial is not remembered, so each run is a new connection's.
		initial := v1Initial(dcid(8, 1)...).frame(src, shape{})
		if ret, _, err := tb.objs.Synlimit.Benchmark(initial, 2, nil); err != nil || ret != xdpDrop {
			b.Fatalf("draining: %d %v", ret, err)
		}
		run(b, tb, initial, xdpDrop, b.N, nil)
	})
	b.Run("quic_initial_charged_already", func(b *testing.B) {
		other := netip.MustParseAddr("192.0.2.99")
		initial := v1Initial(dcid(8, 1)...).frame(other, shape{})
		// The connection's entry (put there, as the program puts one when
		// it charges a connection) lets 16 Initials pass free: runs of 16,
		// its count reset before each.
		id := synlimitInitialId{Saddr: other.As16(), DcidLen: 8}
		binary.BigEndian.PutUint16(id.Sport[:], 50000)
		binary.BigEndian.PutUint16(id.Dport[:], 443)
		copy(id.Dcid[:], dcid(8, 1))
		run(b, tb, initial, xdpPass, 16, func() {
			if err := tb.initials.Put(&id, synlimitPass{At: passClock(b, tb)}); err != nil {
				b.Fatal(err)
			}
		})
	})
	b.Run("quic_handshake", func(b *testing.B) {
		other := netip.MustParseAddr("192.0.2.99")
		run(b, tb, handshakeBehind(quicV1, 50000).frame(other, shape{}), xdpPass, b.N, nil)
	})
	b.Run("go_allow_denied", func(b *testing.B) {
		key := limiter.NetworkKey(src, 24, 48)
		now := time.Now()
		b.ReportAllocs()
		for range b.N {
			tb.Buckets.Allow(key.Bytes(), 1, now)
		}
	})
}
