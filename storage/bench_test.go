package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"path"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
)

// benchWidth is the sketch width of a zone with the default sizing (100,000
// sources, false_deny 0.005): as many counters per row as its table's
// lines.
var benchWidth = limiter.LinesFor(limiter.DefaultSources, limiter.DefaultFalseDeny, limiter.DefaultK)

// BenchmarkSyncBytes reports the bytes one instance writes per sync and a
// peer reads per sync of it, against the number of keys active in the
// window: they grow with the sketch's nonzero counters and stop at the
// sketch's size, whatever the number of keys.
func BenchmarkSyncBytes(b *testing.B) {
	for _, keys := range []int{1_000, 100_000, 1_000_000} {
		b.Run(fmt.Sprintf("keys=%d", keys), func(b *testing.B) {
			c, err := newCluster(Shape{Zone: "z", Window: time.Minute, Width: benchWidth}, 100)
			if err != nil {
				b.Fatal(err)
			}
			now := t0.Add(30 * time.Second)
			rng := rand.New(rand.NewPCG(1, 2))
			for range keys {
				c.sketch.TakeHashWith(rng.Uint64(), 1, now, nil)
			}
			st := &certmagic.FileStorage{Path: b.TempDir()}
			w := NewSyncer(c, st, "writer", testIntervals, zap.NewNop())
			w.proc = newProcess()
			peer, _ := newCluster(Shape{Zone: "z", Window: time.Minute, Width: benchWidth}, 100)
			r := NewSyncer(peer, st, "reader", testIntervals, zap.NewNop())
			r.proc = newProcess()
			b.ResetTimer()
			for range b.N {
				w.Write(context.Background(), now)
				r.Read(context.Background(), now)
			}
			b.ReportMetric(float64(len(w.buf)), "written-B/sync")
			b.ReportMetric(float64(len(w.buf)), "read-B/sync/peer")
			b.ReportMetric(float64(benchWidth*SketchRows*16), "sketch-B")
		})
	}
}

// discard is a storage that costs nothing, so that BenchmarkDecision
// measures what syncing costs the decisions themselves (CPU and memory
// traffic of encoding, decoding and swapping the peers' sum), not the disk.
// memStorage is an in-memory certmagic.Storage that counts the bytes
// stored and loaded. A lock is held until Unlock, or until expire, or for
// ttl (if not 0) past its holder's last refresh, on the clock setNow sets.
type memStorage struct {
	certmagic.Storage
	mu             sync.Mutex
	data           map[string][]byte
	locks          map[string]time.Time // lock name: taken or last refreshed
	ttl            time.Duration
	now            time.Time
	stored, loaded int64
	loads          int64
}

func newMemStorage() *memStorage {
	return &memStorage{data: map[string][]byte{}, locks: map[string]time.Time{}}
}

// Lock takes the lock name if it is free, else fails at once: as
// certmagic's storages do when their context ends while the lock is held,
// without the wait (which a simulated fleet does not need).
func (d *memStorage) Lock(_ context.Context, name string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if at, held := d.locks[name]; held && (d.ttl == 0 || d.now.Sub(at) <= d.ttl) {
		return errors.New("lock " + name + " is held")
	}
	d.locks[name] = d.now
	return nil
}

func (d *memStorage) Unlock(_ context.Context, name string) error {
	d.expire(name)
	return nil
}

// expire frees the lock name, as a storage does once its holder stopped
// refreshing it.
func (d *memStorage) expire(name string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.locks, name)
}

// refresh keeps the lock name held, as its holder does while it lives.
func (d *memStorage) refresh(name string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, held := d.locks[name]; held {
		d.locks[name] = d.now
	}
}

func (d *memStorage) setNow(now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.now = now
}

func (d *memStorage) Store(_ context.Context, k string, v []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.data[k] = append(d.data[k][:0:0], v...)
	d.stored += int64(len(v))
	return nil
}

func (d *memStorage) Load(_ context.Context, k string) ([]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.data[k]
	if !ok {
		return nil, fs.ErrNotExist
	}
	d.loaded += int64(len(v))
	d.loads++
	return v, nil
}

func (d *memStorage) Stat(_ context.Context, k string) (certmagic.KeyInfo, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.data[k]
	if !ok {
		return certmagic.KeyInfo{}, fs.ErrNotExist
	}
	return certmagic.KeyInfo{Key: k, Size: int64(len(v)), IsTerminal: true}, nil
}

func (d *memStorage) Delete(_ context.Context, k string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.data, k)
	return nil
}

func (d *memStorage) List(_ context.Context, p string, _ bool) ([]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var keys []string
	for k := range d.data {
		if path.Dir(k) == p {
			keys = append(keys, k)
		}
	}
	return keys, nil
}

// BenchmarkDecision compares a decision's latency beside three instances'
// snapshots, without and with their sync running (every second, 5 times the
// default rate), in the same run, over 100,000 active keys per instance.
func BenchmarkDecision(b *testing.B) {
	for _, syncing := range []bool{false, true} {
		b.Run(fmt.Sprintf("sync=%v", syncing), func(b *testing.B) {
			shape := Shape{Zone: "z", Window: time.Minute, Width: benchWidth}
			st := newMemStorage()
			now := time.Now()
			rng := rand.New(rand.NewPCG(3, 4))
			var c *Cluster
			var syncers []*Syncer
			for i := range 3 {
				cl, _ := newCluster(shape, 1<<20)
				for range 100_000 {
					cl.sketch.TakeHashWith(rng.Uint64(), 1, now, nil)
				}
				s := NewSyncer(cl, st, fmt.Sprint("i", i), testIntervals, zap.NewNop())
				s.proc = newProcess()
				s.Write(context.Background(), now)
				syncers = append(syncers, s)
				if i == 0 {
					c = cl
				}
			}
			syncers[0].Read(context.Background(), now)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			if syncing {
				wg.Add(1)
				go func() {
					defer wg.Done()
					tick := time.NewTicker(time.Second)
					defer tick.Stop()
					for {
						select {
						case <-stop:
							return
						case <-tick.C:
						}
						for _, s := range syncers {
							s.Write(context.Background(), time.Now())
							s.Read(context.Background(), time.Now())
						}
					}
				}()
			}
			keys := make([]uint64, 1<<16)
			for i := range keys {
				keys[i] = rng.Uint64()
			}
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := rand.IntN(len(keys))
				for pb.Next() {
					i = (i + 1) & (len(keys) - 1)
					c.TakeHash(keys[i], 1, now)
				}
			})
			b.StopTimer()
			close(stop)
			wg.Wait()
		})
	}
}

// BenchmarkSyncCPU reports the time one instance spends per write and per
// read of a sync (each a single goroutine's CPU: the storage is in memory),
// against the keys active in the window on each instance, at the default
// sketch size, with bursts split (the default): three instances, which
// read every snapshot, and five (inst=5), of which four read the
// aggregate the fifth publishes (the mean includes the aggregator's
// read). A sync's cost should follow the keys active, not the sketch's
// size.
func BenchmarkSyncCPU(b *testing.B) {
	for _, inst := range []int{3, 5} {
		for _, keys := range []int{0, 1_000, 100_000} {
			name := fmt.Sprintf("keys=%d", keys)
			if inst != 3 {
				name = fmt.Sprintf("inst=%d/%s", inst, name)
			}
			b.Run(name, func(b *testing.B) { benchSyncCPU(b, inst, keys) })
		}
	}
}

func benchSyncCPU(b *testing.B, inst, keys int) {
	st := newMemStorage()
	now := t0.Add(30 * time.Second)
	var syncers []*Syncer
	for i := range inst {
		c, err := newCluster(Shape{Zone: "z", Window: time.Minute, Width: benchWidth}, 100)
		if err != nil {
			b.Fatal(err)
		}
		c.SplitBursts(true, testIntervals.Read)
		rng := rand.New(rand.NewPCG(uint64(i), 7))
		for range keys {
			c.sketch.TakeHashWith(rng.Uint64(), 1, now, nil)
		}
		s := NewSyncer(c, st, fmt.Sprintf("i%d", i), testIntervals, zap.NewNop())
		s.proc = newProcess()
		syncers = append(syncers, s)
	}
	ctx := context.Background()
	for _, s := range syncers { // the restores and first reads
		s.Write(ctx, now)
		s.Read(ctx, now)
	}
	var write, read time.Duration
	b.ResetTimer()
	for n := range b.N {
		at := now.Add(time.Duration(n+1) * testIntervals.Read)
		for i, s := range syncers {
			// A few requests between syncs, as live traffic makes.
			s.c.sketch.TakeHashWith(uint64(n*3+i)*0x9e3779b97f4a7c15, 1, at, nil)
			start := time.Now()
			s.Write(ctx, at)
			write += time.Since(start)
		}
		for _, s := range syncers {
			start := time.Now()
			s.Read(ctx, at)
			read += time.Since(start)
		}
	}
	ops := float64(b.N * len(syncers))
	b.ReportMetric(float64(write.Microseconds())/ops, "µs/write")
	b.ReportMetric(float64(read.Microseconds())/ops, "µs/read")
	b.ReportMetric(float64(benchWidth*SketchRows*16), "sketch-B")
	if inst >= AggregateFrom {
		aggregating := 0
		for _, s := range syncers {
			if s.agg.aggregating {
				aggregating++
			}
		}
		b.ReportMetric(float64(aggregating), "aggregators")
	}
}
