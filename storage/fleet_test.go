package storage

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
)

// fleet is n instances of one zone syncing through one in-memory storage,
// each as a process of its own, driven in rounds: at each round every
// instance writes, then every instance reads, at the round's time.
type fleet struct {
	st    *memStorage
	nodes []*Syncer
	now   time.Time
}

const (
	fleetLimit    = 100
	fleetWidth    = 4096
	fleetKeys     = 1000 // active keys per instance
	fleetInterval = time.Second
)

func newFleet(n int, split bool) *fleet {
	f := &fleet{st: newMemStorage(), now: t0.Add(time.Second)}
	rng := rand.New(rand.NewPCG(uint64(n), 7))
	for i := range n {
		c, err := newCluster(Shape{Zone: "fleet", Window: time.Hour, Width: fleetWidth}, fleetLimit)
		if err != nil {
			panic(err)
		}
		c.SplitBursts(split, fleetInterval)
		for range fleetKeys {
			c.TakeHash(rng.Uint64(), 1, f.now)
		}
		s := NewSyncer(c, f.st, fmt.Sprintf("i%03d", i), Intervals{Read: fleetInterval, Write: fleetInterval, PurgeAge: time.Hour}, zap.NewNop())
		s.proc = newProcess()
		f.nodes = append(f.nodes, s)
	}
	return f
}

func (f *fleet) round() {
	f.now = f.now.Add(fleetInterval)
	for _, s := range f.nodes {
		s.Write(context.Background(), f.now)
	}
	for _, s := range f.nodes {
		s.Read(context.Background(), f.now)
	}
}

// request sends each instance per requests of key at the current time and
// returns how many were allowed.
func (f *fleet) request(key uint64, per int) int {
	allowed := 0
	for _, s := range f.nodes {
		for range per {
			if d, _ := s.c.TakeHash(key, 1, f.now); d.Allowed {
				allowed++
			}
		}
	}
	return allowed
}

// BenchmarkFleet simulates fleets of 2 to 128 instances of one distributed
// zone (events 100 per hour, sketch 4 × 4096, 1,000 active keys per
// instance) in one process over an in-memory storage, one sync round (every
// instance writes, then every instance reads) per iteration. It reports,
// per instance and interval, the bytes read and written and the CPU time of
// a sync, and the heap per instance; and, from rounds run before the timer:
// allowed ÷ limit for a key spread over the instances (one request per
// instance per interval) and for a simultaneous burst (the limit sent to
// every instance at once, then again after each of 5 syncs), and the
// intervals until a reset on one instance has taken the key's counts out
// of every instance's view (shares aside).
func BenchmarkFleet(b *testing.B) {
	for _, n := range []int{2, 8, 32, 128} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			f := newFleet(n, true)
			f.round()

			spread := limiter.HashString("spread")
			allowed := 0
			for range 2*fleetLimit/n + 2 {
				allowed += f.request(spread, 1)
				f.round()
			}
			burstKey := limiter.HashString("burst")
			burst := f.request(burstKey, fleetLimit)
			for range 5 {
				f.round()
				burst += f.request(burstKey, fleetLimit)
			}
			f.nodes[0].c.Reset(spread, f.now)
			resetIntervals := 0
			for resetIntervals < 10 {
				pass := true
				for _, s := range f.nodes {
					// The key's counts, without the instance's share.
					pass = pass && s.c.sketch.PeekHashWith(spread, 1, f.now, s.c.peers.Load()).Allowed
				}
				if pass {
					break
				}
				f.round()
				resetIntervals++
			}

			runtime.GC()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			f.st.mu.Lock()
			stored, loaded := f.st.stored, f.st.loaded
			f.st.mu.Unlock()
			b.ResetTimer()
			for range b.N {
				f.round()
			}
			b.StopTimer()
			runtime.ReadMemStats(&after)
			f.st.mu.Lock()
			stored, loaded = f.st.stored-stored, f.st.loaded-loaded
			f.st.mu.Unlock()
			per := float64(b.N) * float64(n)
			b.ReportMetric(float64(loaded)/per, "read-B/inst/interval")
			b.ReportMetric(float64(stored)/per, "written-B/inst/interval")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/per, "ns/inst/sync")
			b.ReportMetric(float64(after.HeapInuse)/float64(n), "heap-B/inst")
			b.ReportMetric(float64(allowed)/fleetLimit, "spread-allowed/limit")
			b.ReportMetric(float64(burst)/fleetLimit, "burst-allowed/limit")
			b.ReportMetric(float64(resetIntervals), "reset-intervals")
			b.ReportMetric(0, "ns/op")
		})
	}
}
