package limiter

import (
	"math/bits"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// benchKeys is a million distinct IPv4 sources in random order.
var benchKeys = sync.OnceValue(func() []netip.Addr {
	const n = 1_000_000
	keys := make([]netip.Addr, n)
	r := rand.New(rand.NewPCG(5, 6))
	for i, v := range r.Perm(n) {
		u := uint32(v)*2654435761 | 1<<31 // spread over the address space, distinct
		keys[i] = netip.AddrFrom4([4]byte{byte(u >> 24), byte(u >> 16), byte(u >> 8), byte(u)})
	}
	return keys
})

var benchLimit = Limit{Events: 100, Window: time.Second}

// BenchmarkAllow compares one decision of this limiter over a million
// distinct IPv4 keys, reading the clock once as a request does, with what
// most Go middleware does (a mutex-guarded map of x/time/rate limiters) and
// with the floor of the design: hashing the key and one atomic add on a
// random line of a table of the same size (floor_rmw), and the same plus one
// reading of the clock (floor_rmw_clock). A decision's first locked
// instruction waits for its line like the floor's add does, so the two are
// comparable; a read-only floor would let the CPU overlap the misses.
// floor_rmw_k_clock adds an atomic add per word the key's counters occupy.
// floodgate_window is a window zone's decision (limiter.Windows, at its
// default size), floor_rmw_clock_window the floor_rmw_clock of a table of
// that size, and floor_rmw_k_clock_window its floor_rmw_k_clock: an
// atomic add per word of the key's counters in that table.
func BenchmarkAllow(b *testing.B) {
	keys := benchKeys()
	fg, err := NewBuckets(BucketsConfig{Limit: benchLimit})
	if err != nil {
		b.Fatal(err)
	}
	// K = 4 at the same false-deny target, for the choice of DefaultK.
	fg4, err := NewBuckets(BucketsConfig{Limit: benchLimit, K: 4})
	if err != nil {
		b.Fatal(err)
	}
	// The window zone's table at its default size (eight counters to a
	// line, so about 3.4 times the lines), and a floor of the same size.
	win, err := NewWindows(BucketsConfig{Limit: Limit{Events: benchLimit.Events, Window: benchLimit.Window}})
	if err != nil {
		b.Fatal(err)
	}
	// Fault the pages of the tables decided on in, as the floors' are: a
	// table in use is in memory. (Left to the first decisions, the window
	// table's first touches, about 150 ms for its 36 MiB here, went into
	// its serial run, a tenth of it.) A zero word is an unused counter in
	// both kinds of table.
	for _, lines := range [][]line{fg.p.Load().lines, fg4.p.Load().lines, win.p.Load().lines} {
		for i := range lines {
			lines[i][0] = 0
		}
	}
	floor := newLines(fg.Lines()) // same size, same pages
	for i := range floor {
		floor[i][0] = 2
	}
	winFloor := newLines(win.Lines())
	for i := range winFloor {
		winFloor[i][0] = 2
	}
	xr := newXrateMap()
	for _, a := range keys { // warm the map: steady state, not insertion
		xr.allow(a)
	}
	run := func(name string, f func(netip.Addr) bool) {
		// Finish collecting the setup's garbage (a million x/time/rate
		// limiters) first, or its marking competes with whichever
		// sub-benchmark runs next.
		runtime.GC()
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				f(keys[i])
				if i++; i == len(keys) {
					i = 0
				}
			}
		})
		runtime.GC()
		b.Run(name+"_parallel", func(b *testing.B) {
			b.ReportAllocs()
			var start atomic.Int64
			b.RunParallel(func(pb *testing.PB) {
				i := int(start.Add(int64(len(keys)/8))) % len(keys)
				for pb.Next() {
					f(keys[i])
					if i++; i == len(keys) {
						i = 0
					}
				}
			})
		})
	}
	run("floodgate", func(a netip.Addr) bool {
		k := NetworkKey(a, 32, 128)
		d, _ := fg.TakeHash(Hash(k.Bytes()), 1, time.Now())
		return d.Allowed
	})
	run("floodgate_window", func(a netip.Addr) bool {
		k := NetworkKey(a, 32, 128)
		d, _ := win.TakeHash(Hash(k.Bytes()), 1, time.Now())
		return d.Allowed
	})
	run("floodgate_k4", func(a netip.Addr) bool {
		k := NetworkKey(a, 32, 128)
		d, _ := fg4.TakeHash(Hash(k.Bytes()), 1, time.Now())
		return d.Allowed
	})
	run("xrate_map", xr.allow)
	run("floor_rmw", func(a netip.Addr) bool {
		k := NetworkKey(a, 32, 128)
		h := Hash(k.Bytes())
		return atomic.AddUint64(&floor[uint64(uint32(h>>32))*uint64(len(floor))>>32][0], 1) == 1
	})
	run("floor_rmw_clock", func(a netip.Addr) bool {
		now := time.Now()
		k := NetworkKey(a, 32, 128)
		h := Hash(k.Bytes())
		return atomic.AddUint64(&floor[uint64(uint32(h>>32))*uint64(len(floor))>>32][0], uint64(now.Nanosecond()&1)) == 1
	})
	run("floor_rmw_clock_window", func(a netip.Addr) bool {
		now := time.Now()
		k := NetworkKey(a, 32, 128)
		h := Hash(k.Bytes())
		return atomic.AddUint64(&winFloor[uint64(uint32(h>>32))*uint64(len(winFloor))>>32][0], uint64(now.Nanosecond()&1)) == 1
	})
	// The same with one atomic add per word that the key's counters occupy
	// in a table (floodgate's, K = 3: 2.8 on average), as its decisions
	// write them: the floor of any design in which every counter of a key
	// pays.
	kFloor := func(lines []line, subs []subset) func(netip.Addr) bool {
		return func(a netip.Addr) bool {
			now := time.Now()
			k := NetworkKey(a, 32, 128)
			h := Hash(k.Bytes())
			ln := &lines[uint64(uint32(h>>32))*uint64(len(lines))>>32]
			add := uint64(now.Nanosecond() & 1)
			var v uint64
			for m := subs[uint64(uint32(h))*uint64(len(subs))>>32].words; m != 0; m &= m - 1 {
				v += atomic.AddUint64(&ln[bits.TrailingZeros8(m)&7], add)
			}
			return v == 1
		}
	}
	run("floor_rmw_k_clock", kFloor(floor, fg.subs))
	// The same in the window zone's table, where each of the key's K = 3
	// counters is a whole word: three adds.
	run("floor_rmw_k_clock_window", kFloor(winFloor, win.subs))
}

// xrateMap is the usual keyed limiter: a map of x/time/rate limiters under
// one mutex.
type xrateMap struct {
	mu sync.Mutex
	m  map[netip.Addr]*rate.Limiter
}

func newXrateMap() *xrateMap { return &xrateMap{m: make(map[netip.Addr]*rate.Limiter)} }

func (x *xrateMap) allow(a netip.Addr) bool {
	x.mu.Lock()
	l, ok := x.m[a]
	if !ok {
		l = rate.NewLimiter(rate.Limit(perSecond(benchLimit)), int(benchLimit.EffectiveBurst()))
		x.m[a] = l
	}
	x.mu.Unlock()
	return l.Allow()
}

// BenchmarkAdmit is a concurrency zone's request: admitting it and
// releasing its place (limiter.Concurrency), over the million keys of
// BenchmarkAllow, reading the clock once as a request does. Its floor is
// the least any counting table can do: hashing the key and one atomic
// increment and one decrement on a random line of a table of the same size
// (floor_inc_dec), and floor_inc_dec_k the same for each word the key's
// counters occupy.
func BenchmarkAdmit(b *testing.B) {
	keys := benchKeys()
	c, err := NewConcurrency(ConcurrencyConfig{Max: 8})
	if err != nil {
		b.Fatal(err)
	}
	for i := range c.lines { // fault the pages in, as in the floor
		c.lines[i][0] = 0
	}
	floor := newLines(c.Lines())
	for i := range floor {
		floor[i][0] = 2
	}
	subs := c.subs
	run := func(name string, f func(netip.Addr, *Place) bool) {
		runtime.GC()
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			var p Place
			i := 0
			for b.Loop() {
				f(keys[i], &p)
				if i++; i == len(keys) {
					i = 0
				}
			}
		})
		b.Run(name+"_parallel", func(b *testing.B) {
			b.ReportAllocs()
			var start atomic.Int64
			b.RunParallel(func(pb *testing.PB) {
				var p Place
				i := int(start.Add(int64(len(keys)/8))) % len(keys)
				for pb.Next() {
					f(keys[i], &p)
					if i++; i == len(keys) {
						i = 0
					}
				}
			})
		})
	}
	run("floodgate_concurrent", func(a netip.Addr, p *Place) bool {
		_ = time.Now()
		k := NetworkKey(a, 32, 128)
		ok := c.AdmitHash(Hash(k.Bytes()), p).Allowed
		p.Release()
		return ok
	})
	run("floor_inc_dec", func(a netip.Addr, _ *Place) bool {
		now := time.Now()
		k := NetworkKey(a, 32, 128)
		h := Hash(k.Bytes())
		w := &floor[uint64(uint32(h>>32))*uint64(len(floor))>>32][0]
		ok := atomic.AddUint64(w, uint64(now.Nanosecond()&1)|1) > 0
		atomic.AddUint64(w, ^uint64(0))
		return ok
	})
	run("floor_inc_dec_k", func(a netip.Addr, _ *Place) bool {
		now := time.Now()
		k := NetworkKey(a, 32, 128)
		h := Hash(k.Bytes())
		ln := &floor[uint64(uint32(h>>32))*uint64(len(floor))>>32]
		sub := subs[uint64(uint32(h))*uint64(len(subs))>>32].words
		var v uint64
		for m := sub; m != 0; m &= m - 1 {
			v += atomic.AddUint64(&ln[bits.TrailingZeros8(m)&7], uint64(now.Nanosecond()&1)|1)
		}
		for m := sub; m != 0; m &= m - 1 {
			atomic.AddUint64(&ln[bits.TrailingZeros8(m)&7], ^uint64(0))
		}
		return v > 0
	})
}
