package limiter

import (
	"math/rand/v2"
	"net/netip"
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
// distinct IPv4 keys with what most Go middleware does (a mutex-guarded map
// of x/time/rate limiters) and with the floor of the design: hashing the key
// and loading one word from a random line of a table of the same size.
func BenchmarkAllow(b *testing.B) {
	keys := benchKeys()
	fg, err := NewBuckets(BucketsConfig{Limit: benchLimit})
	if err != nil {
		b.Fatal(err)
	}
	floor := newLineTable(fg.Lines(), time.Second).lines // same size, same pages
	for i := range floor {                               // fault the pages in: a table in use is in memory
		floor[i][0] = 2
	}
	xr := newXrateMap()
	for _, a := range keys { // warm the map: steady state, not insertion
		xr.allow(a)
	}
	run := func(name string, f func(netip.Addr) bool) {
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
	run("xrate_map", xr.allow)
	run("floor", func(a netip.Addr) bool {
		k := NetworkKey(a, 32, 128)
		h := Hash(k.Bytes())
		return atomic.LoadUint64(&floor[uint64(uint32(h>>32))*uint64(len(floor))>>32][0]) == 1
	})
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
		l = rate.NewLimiter(rate.Limit(benchLimit.PerSecond()), int(benchLimit.burst()))
		x.m[a] = l
	}
	x.mu.Unlock()
	return l.Allow()
}
