package storage

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"path"
	"runtime"
	"runtime/metrics"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	redisstorage "github.com/pberkel/caddy-storage-redis"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/internal/redistest"
	"github.com/floodgate-rl/floodgate/limiter"
)

// fleet is n instances of one zone syncing through one storage, each as a
// process of its own with its own count of what it reads and writes,
// driven in rounds: at each round every instance writes, then every
// instance reads, the aggregator last (so that the others read the
// previous round's aggregate: the most lag an aggregate adds).
type fleet struct {
	zone     string
	mem      *memStorage // nil over redis
	redis    *fleetRedis // nil in memory
	nodes    []*Syncer
	counts   []*countingStorage
	now      time.Time
	interval time.Duration
	parallel bool // writes run at once, then reads (but the aggregator's)
	// realtime, if set, makes the fleet's clock the real one from wall
	// on, at sim: each round is at sim plus the real time since wall.
	realtime *struct{ sim, wall time.Time }
	// probe, if set, is told what each sync call of a round (a read, or
	// a write) took, in time and in bytes allocated (serial rounds only).
	probe func(s *Syncer, read bool, took time.Duration, alloc uint64)
}

// do runs one sync call of s, a read or a write, through the probe if
// there is one.
func (f *fleet) do(s *Syncer, read bool, call func(ctx context.Context, now time.Time)) {
	if f.probe == nil {
		call(context.Background(), f.now)
		return
	}
	sample := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(sample)
	before, start := sample[0].Value.Uint64(), time.Now()
	call(context.Background(), f.now)
	took := time.Since(start)
	metrics.Read(sample)
	f.probe(s, read, took, sample[0].Value.Uint64()-before)
}

// fleetSeq numbers the fleets.
var fleetSeq atomic.Int64

const (
	fleetLimit = 100
	fleetWidth = 4096
	fleetKeys  = 1000 // active keys per instance
	// fleetLockTTL is how long the in-memory storage keeps a lock its
	// holder stopped refreshing: FileStorage's (caddy-storage-redis's is 5 s).
	fleetLockTTL = 10 * time.Second
)

// fleetLoad is what a fleet's instances have counted when the benchmark
// starts: the sketch's width, and the keys instance i of n has hit once
// each (drawn from rng, which the fleet's instances share in order).
type fleetLoad struct {
	width int
	keys  func(rng *rand.Rand, i, n int) []uint64
}

// perInstanceKeys is BenchmarkFleet's load: fleetKeys keys of its own per
// instance, so the cluster's distinct keys grow with N (128,000 at
// N = 128, more than the 4 × 4,096 counters hold apart).
var perInstanceKeys = fleetLoad{width: fleetWidth, keys: ownKeys(fleetKeys)}

// ownKeys returns the keys of a load in which every instance hits keys
// distinct keys of its own.
func ownKeys(keys int) func(*rand.Rand, int, int) []uint64 {
	return func(rng *rand.Rand, _, _ int) []uint64 {
		hs := make([]uint64, keys)
		for k := range hs {
			hs[k] = rng.Uint64()
		}
		return hs
	}
}

// clusterKeys returns the keys of a load in which the cluster hits keys
// distinct keys whatever N (the same keys at every N): key k on instances
// k mod N and k+1 mod N, so each instance hits 2 × keys ÷ N of them and
// the cluster's work (2 × keys hits) is the same at every N.
func clusterKeys(keys int) func(*rand.Rand, int, int) []uint64 {
	all := ownKeys(keys)(rand.New(rand.NewPCG(1, 1)), 0, 0)
	return func(_ *rand.Rand, i, n int) []uint64 {
		var hs []uint64
		for k, h := range all {
			if k%n == i || (k+1)%n == i {
				hs = append(hs, h)
			}
		}
		return hs
	}
}

func newFleet(st certmagic.Storage, n int, interval time.Duration, load fleetLoad) *fleet {
	// A zone of its own, so that fleets that share a redis-server never
	// meet.
	f := &fleet{zone: fmt.Sprintf("fleet-%d", fleetSeq.Add(1)), now: t0.Add(time.Second), interval: interval}
	f.mem, _ = st.(*memStorage)
	if f.mem != nil {
		f.mem.ttl = fleetLockTTL
	}
	rng := rand.New(rand.NewPCG(uint64(n), 7))
	for i := range n {
		c, err := newCluster(Shape{Zone: f.zone, Window: time.Hour, Width: load.width}, fleetLimit)
		if err != nil {
			panic(err)
		}
		c.SplitBursts(true, interval)
		for _, h := range load.keys(rng, i, n) {
			c.TakeHash(h, 1, f.now)
		}
		cs := &countingStorage{Storage: st}
		s := NewSyncer(c, cs, fmt.Sprintf("i%03d", i), Intervals{Read: interval, Write: interval, PurgeAge: time.Hour}, zap.NewNop())
		s.proc = newProcess()
		f.nodes = append(f.nodes, s)
		f.counts = append(f.counts, cs)
	}
	return f
}

func (f *fleet) round() {
	if f.realtime != nil {
		f.now = f.realtime.sim.Add(time.Since(f.realtime.wall))
	} else {
		f.now = f.now.Add(f.interval)
	}
	if f.mem != nil {
		f.mem.setNow(f.now)
	}
	var wg sync.WaitGroup
	for _, s := range f.nodes {
		if f.parallel {
			wg.Go(func() { s.Write(context.Background(), f.now) })
			continue
		}
		f.do(s, false, s.Write)
	}
	wg.Wait()
	var last []*Syncer
	for _, s := range f.nodes {
		if s.agg.aggregating {
			last = append(last, s)
			continue
		}
		if f.parallel {
			// As instances do, each on its own: over Redis a read that
			// fails to take the aggregator lock waits for it a while.
			wg.Go(func() { s.Read(context.Background(), f.now) })
			continue
		}
		f.do(s, true, s.Read)
	}
	wg.Wait()
	for _, s := range last {
		f.do(s, true, s.Read)
		if f.mem != nil {
			f.mem.refresh(AggregateKey(f.zone)) // a live holder keeps its lock
		}
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

// aggregated reports whether exactly one instance aggregates and every
// other one read its aggregate at the last round.
func (f *fleet) aggregated() bool {
	aggs := 0
	for _, s := range f.nodes {
		switch {
		case s.agg.aggregating:
			aggs++
		case s.lastRead != aggregateUsed:
			return false
		}
	}
	return aggs == 1
}

// BenchmarkFleet simulates fleets of 2 to 128 instances of one distributed
// zone (events 100 per hour, sketch 4 × 4096, 1,000 active keys per
// instance, bursts split), in one process, over an in-memory storage and
// over a real redis-server (started on a free port; skipped if there is
// no redis-server), with sync intervals of 1 s and 5 s, one sync round per
// iteration. Per instance and interval, it reports the bytes read (the
// mean, and the most any instance read: the aggregator's) and written,
// the time a sync took (ns/inst/sync, the round's wall clock) and the
// process's CPU time on every core, garbage collection included
// (cpu-ns/inst/sync); the aggregator's read timed alone; the heap per
// instance after a collection, and the most one sync call allocated.
// From rounds run before the timer: allowed ÷ limit for a key spread over
// the instances (one request per instance per second) and for a
// simultaneous burst (the limit sent to every instance at once, then again
// after each of 5 syncs); the spread key's count-min estimate before its
// first request (the other keys' counts in its cells, which it is denied
// early by); the intervals until a reset on one instance has taken the
// key's counts out of every instance's view; and the seconds from the
// aggregator's death until another one publishes and every instance reads
// it again, and what the fleet granted meanwhile of a key already at its
// limit: in memory with the lock expiring as FileStorage's does (10 s
// after its last refresh, on the fleet's clock), over Redis as
// caddy-storage-redis's does (5 s, in real time: those rounds keep to the
// clock, one interval apart, each instance syncing on its own), where the
// simulation can keep up (see killAggregator).
func BenchmarkFleet(b *testing.B) {
	// One redis-server for every fleet, started before any of them, so
	// that its client's log is not in a benchmark's line.
	redis, noRedis := startRedis(b)
	for _, store := range []string{"memory", "redis"} {
		for _, interval := range []time.Duration{time.Second, 5 * time.Second} {
			for _, n := range []int{2, 8, 32, 128} {
				b.Run(fmt.Sprintf("N=%d/interval=%v/storage=%s", n, interval, store), func(b *testing.B) {
					var st certmagic.Storage = newMemStorage()
					if store == "redis" {
						if redis == nil {
							b.Skip(noRedis)
						}
						st = redis.storage
					}
					f := newFleet(st, n, interval, perInstanceKeys)
					if store == "redis" {
						f.redis = redis
					}
					benchFleet(b, f)
				})
			}
		}
	}
}

// BenchmarkFleetKeys separates what BenchmarkFleet's read cost grows with:
// the number of instances, or the cluster's distinct active keys (which
// grow with N there, 1,000 per instance) and how full they leave the
// sketch. The same fleet and metrics, in memory with a sync interval of
// 1 s, under four loads: BenchmarkFleet's own (keys=inst1000/width=4096,
// the baseline of the run); 8,192 distinct keys in the whole cluster
// whatever N, each hit on two instances (keys=cluster8192, see
// clusterKeys), on BenchmarkFleet's 4 × 4,096 sketch, which they fill most
// of, and on the default 4 × 16,384, which they leave mostly empty; and
// 1,000 keys per instance on a 4 × 32,768 sketch, which 128,000 keys do
// not fill, so that its aggregate grows with the keys it holds. Its names
// do not begin with BenchmarkFleet/N=, so bench/perf.sh, which runs every
// Fleet benchmark, leaves its lines out of its table.
func BenchmarkFleetKeys(b *testing.B) {
	loads := []struct {
		name string
		load fleetLoad
	}{
		{"keys=inst1000/width=4096", perInstanceKeys},
		{"keys=cluster8192/width=4096", fleetLoad{width: fleetWidth, keys: clusterKeys(8192)}},
		{"keys=cluster8192/width=16384", fleetLoad{width: 16384, keys: clusterKeys(8192)}},
		{"keys=inst1000/width=32768", fleetLoad{width: 32768, keys: ownKeys(fleetKeys)}},
	}
	for _, l := range loads {
		for _, n := range []int{2, 8, 32, 128} {
			b.Run(fmt.Sprintf("%s/N=%d", l.name, n), func(b *testing.B) {
				benchFleet(b, newFleet(newMemStorage(), n, time.Second, l.load))
			})
		}
	}
}

func benchFleet(b *testing.B, f *fleet) {
	n := len(f.nodes)
	f.round()

	spread := limiter.HashString("spread")
	// What the other keys count in the spread key's cells, without shares.
	noise := fleetLimit - f.nodes[0].c.sketch.PeekHashWith(spread, 1, f.now, f.nodes[0].c.peers.Load()).Remaining
	per := max(1, int(f.interval/time.Second))
	allowed := 0
	for range 2*fleetLimit/(n*per) + 2 {
		allowed += f.request(spread, per)
		f.round()
	}
	burstKey := limiter.HashString("burst")
	burst := f.request(burstKey, fleetLimit)
	for range 5 {
		f.round()
		burst += f.request(burstKey, fleetLimit)
	}
	f.nodes[n-1].c.Reset(spread, f.now)
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

	for _, c := range f.counts {
		c.reset()
	}
	cpu0, cpuOK := processCPU()
	b.ResetTimer()
	for range b.N {
		f.round()
	}
	b.StopTimer()
	cpu1, _ := processCPU()
	var loaded, stored, most int64
	for _, c := range f.counts {
		l, s := c.totals()
		loaded, stored, most = loaded+l, stored+s, max(most, l)
	}
	perInst := float64(b.N) * float64(n)
	b.ReportMetric(float64(loaded)/perInst, "read-B/inst/interval")
	b.ReportMetric(float64(most)/float64(b.N), "max-read-B/inst/interval")
	b.ReportMetric(float64(stored)/perInst, "written-B/inst/interval")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/perInst, "ns/inst/sync")
	if cpuOK {
		b.ReportMetric(float64((cpu1-cpu0).Nanoseconds())/perInst, "cpu-ns/inst/sync")
	}

	// Memory: what the instances hold between syncs (the heap after a
	// collection, over N: it includes the in-memory storage's copy of
	// the snapshots, about one per instance), and the most one sync call
	// allocated (the aggregator's read, where there is one): an
	// instance's peak is at most the one plus the other. The aggregator's
	// read, timed alone, is the CPU the aggregate costs its instance.
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	b.ReportMetric(float64(ms.HeapInuse)/float64(n), "retained-B/inst")
	var maxAlloc uint64
	var aggTook time.Duration
	aggReads := 0
	f.probe = func(s *Syncer, read bool, took time.Duration, alloc uint64) {
		maxAlloc = max(maxAlloc, alloc)
		if read && s.agg.aggregating {
			aggTook += took
			aggReads++
		}
	}
	for range 3 {
		f.round()
	}
	f.probe = nil
	b.ReportMetric(float64(maxAlloc), "max-sync-alloc-B")
	if aggReads > 0 {
		b.ReportMetric(float64(aggTook.Nanoseconds())/float64(aggReads), "aggregator-read-ns")
	}
	b.ReportMetric(float64(allowed)/fleetLimit, "spread-allowed/limit")
	b.ReportMetric(float64(noise)/fleetLimit, "spread-noise/limit")
	b.ReportMetric(float64(burst)/fleetLimit, "burst-allowed/limit")
	b.ReportMetric(float64(resetIntervals), "reset-intervals")
	if n >= AggregateFrom {
		if secs, granted, ok := f.killAggregator(); ok {
			b.ReportMetric(secs, "failover-s")
			b.ReportMetric(float64(granted), "failover-granted")
		}
	}
	b.ReportMetric(0, "ns/op")
	for _, s := range f.nodes {
		s.agg.release(context.Background())
	}
}

// killAggregator grants a key its limit across the fleet, then stops the
// aggregator (it writes, reads and refreshes its lock no more), and runs
// rounds until another aggregates and every instance reads its aggregate,
// each instance asking for the key once per round. It returns the time
// that took and how many of those requests were granted, or false if the
// fleet did not settle within 100 rounds, or over Redis within a minute:
// one process on a couple of cores cannot keep up with a large fleet's
// rounds in real time while every instance reads every snapshot (as each
// does while there is no fresh aggregate), and once a round outlasts two
// intervals every aggregate is stale when it is read.
func (f *fleet) killAggregator() (secs float64, granted int, ok bool) {
	key := limiter.HashString("failover")
	for left := fleetLimit; left > 0; {
		got := 0
		for _, s := range f.nodes {
			if d, _ := s.c.TakeHash(key, 1, f.now); d.Allowed && left > 0 {
				got++
				left--
			}
		}
		f.round()
		if got == 0 {
			break
		}
	}
	alive := f.nodes[:0:0]
	for _, s := range f.nodes {
		if !s.agg.aggregating {
			alive = append(alive, s)
		}
	}
	f.nodes = alive
	start, wall := f.now, time.Now()
	if f.redis != nil {
		f.redis.die(f.zone)
		// Redis expires the lock in real time: the fleet's clock is the
		// real one, its rounds one interval apart (or back to back, if
		// one takes longer), each instance reading on its own.
		f.parallel, f.realtime = true, &struct{ sim, wall time.Time }{start, wall}
		defer func() { f.parallel, f.realtime = false, nil }()
	}
	for k := 1; k <= 100; k++ {
		if f.redis != nil {
			time.Sleep(time.Until(wall.Add(time.Duration(k) * f.interval)))
		}
		f.round()
		granted += f.request(key, 1)
		if f.aggregated() {
			return f.now.Sub(start).Seconds(), granted, true
		}
		if f.redis != nil && time.Since(wall) > time.Minute {
			break
		}
	}
	return 0, granted, false
}

// fleetRedis is the redis-server a fleet's storage is on, for what the
// storage's API cannot do: let an aggregator die without releasing its
// lock.
type fleetRedis struct {
	storage *redisstorage.RedisStorage
	server  *redistest.Server
	prefix  string // the storage's key prefix
}

// die leaves the zone's aggregator lock as its holder's death would:
// refreshed last now, to expire when caddy-storage-redis's locks do (5 s
// after their last refresh). Its holder's refresher, finding the lock no
// longer its own, stops at its next refresh without releasing it.
func (r *fleetRedis) die(zone string) {
	key := path.Join(r.prefix, "locks", AggregateKey(zone))
	if _, err := r.server.Do("SET", key, "dead", "PX", "5000", "XX"); err != nil {
		panic(fmt.Sprintf("the aggregator lock %s: %v", key, err))
	}
}

// countingStorage counts what one instance loads and stores through a
// storage.
type countingStorage struct {
	certmagic.Storage
	mu             sync.Mutex
	loaded, stored int64
}

func (c *countingStorage) Load(ctx context.Context, k string) ([]byte, error) {
	v, err := c.Storage.Load(ctx, k)
	c.mu.Lock()
	c.loaded += int64(len(v))
	c.mu.Unlock()
	return v, err
}

func (c *countingStorage) Store(ctx context.Context, k string, v []byte) error {
	c.mu.Lock()
	c.stored += int64(len(v))
	c.mu.Unlock()
	return c.Storage.Store(ctx, k, v)
}

func (c *countingStorage) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.loaded, c.stored = 0, 0
}

func (c *countingStorage) totals() (loaded, stored int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.loaded, c.stored
}

// startRedis starts a redis-server on a free port for a test or benchmark
// and returns it with a caddy-storage-redis storage of it, or nil and why
// if there is no redis-server.
func startRedis(b testing.TB) (*fleetRedis, string) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	r, err := redistest.New(b, port)
	if err != nil {
		return nil, fmt.Sprintf("%v: the fleet over Redis is not measured", err)
	}
	r.Start()
	rs := redisstorage.New()
	rs.Port = []string{strconv.Itoa(port)}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	b.Cleanup(cancel)
	if err := rs.Provision(ctx); err != nil {
		b.Fatal(err)
	}
	return &fleetRedis{storage: rs, server: r, prefix: rs.KeyPrefix}, ""
}
