//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"fmt"
	"math/bits"
	"net/netip"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// firstNanos is the first time, in nanoseconds on a table's clock, that
// reads tick (⌈tick·W/PE⌉, as limiter's clock.nanos).
func firstNanos(g limiter.Geometry, tick uint64) int64 {
	hi, lo := bits.Mul64(tick, g.W)
	q, r := bits.Div64(hi, lo, g.PE)
	if r != 0 {
		q++
	}
	return int64(q)
}

// pairedSource returns a source whose key has both counters of some word
// of its line (so that one charge can write both halves of a word), and
// that word.
func pairedSource(t *testing.T, g limiter.Geometry) (netip.Addr, int) {
	t.Helper()
	for i := range 256 {
		src := netip.AddrFrom4([4]byte{198, 51, byte(i), 7})
		k := limiter.NetworkKey(src, 24, 48)
		h := limiter.Hash(k.Bytes())
		counters := g.Subsets[uint32((uint64(uint32(h))*uint64(len(g.Subsets)))>>32)] & 0xffff
		for w := range 8 {
			if counters>>(2*w)&3 == 3 {
				return src, w
			}
		}
	}
	t.Fatal("no source of 256 has two counters in one word")
	return netip.Addr{}, 0
}

// TestProgramNeverStoresTheFrozenMarker: a SYN whose charge ends a counter
// at 0xFFFFFFFF, at the wrap of the 32-bit tick, stores 1 there as
// limiter does (valid), for every counter of the key and at each tick
// around the boundary: a word of two 0xFFFFFFFF is the frozen marker, on
// which the program drops the key's SYNs for good and Go waits for a
// conversion that is not running. The program's table matches limiter's
// on Go memory word for word after each SYN.
func TestProgramNeverStoresTheFrozenMarker(t *testing.T) {
	for _, l := range []limiter.Limit{
		{Events: 5, Window: time.Second, Burst: 8},
		{Events: 1_000_000, Window: time.Second, Burst: 3},
	} {
		cfg := testConfig(l)
		cfg.Buckets.Bytes = 64
		cfg.Buckets.K = 8
		tb := newTestTable(t, cfg)
		if err := tb.enable(Ports{TCP: []uint16{443}}); err != nil {
			t.Fatal(err)
		}
		g := tb.Buckets.Geometry()
		src, word := pairedSource(t, g)
		key := limiter.NetworkKey(src, 24, 48)
		syn := packet(src, 443, flagSYN)
		// The tick at which a SYN on full counters ends them at 0xFFFFFFFF,
		// then one and two ticks either side.
		edge := uint64(1<<32-1) - uint64(g.Cost)
		for _, tick := range []uint64{edge - 2, edge - 1, edge, edge + 1, edge + 2} {
			for i := range tb.mem {
				tb.mem[i] = 0
			}
			refMem := alignedLines(1)
			ref, err := limiter.NewBucketsOver(cfg.Buckets, refMem, tb.Buckets.Base())
			if err != nil {
				t.Fatal(err)
			}
			ns := firstNanos(g, tick)
			name := fmt.Sprintf("%v at tick %#x", l, tick)
			if v := runAt(t, tb, syn, ns); v != xdpPass {
				t.Fatalf("%s: verdict %d for a SYN on full counters, want pass", name, v)
			}
			if !ref.Allow(key.Bytes(), 1, tb.Buckets.Base().Add(time.Duration(ns))).Allowed {
				t.Fatalf("%s: limiter denied a request on full counters", name)
			}
			w := words(tb.mem)
			for i, v := range w {
				if uint32(v) == 1<<32-1 || uint32(v>>32) == 1<<32-1 {
					t.Fatalf("%s: word %d is %#x: a counter holds 0xFFFFFFFF (the key's paired word is %d)", name, i, v, word)
				}
			}
			if rw := words(refMem); !slicesEqual(w, rw) {
				t.Fatalf("%s: the tables differ:\nxdp   %x\ngo    %x", name, w, rw)
			}
		}
		tb.Close()
	}
}
