package limiter

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"
)

func newWindowTable(t testing.TB, l Limit, bytes, k int) *Windows {
	t.Helper()
	w, err := newWindows(BucketsConfig{Limit: l, Bytes: bytes, K: k}, clockEpoch)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// caddy-ratelimit's own test, on the table: `events 10 window 1m` allows 10,
// then answers Retry-After 60, half a window later Retry-After 30, and
// allows again once the window is over.
func TestWindowsAllowEventsThenRetryUntilTheWindowEnds(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 10, Window: time.Minute}, 1<<12, 0)
	const h = 42
	for i := range 10 {
		d, _ := w.TakeHash(h, 1, tm(0))
		if !d.Allowed || d.Remaining != int64(9-i) || d.Reset != time.Minute || d.Limit != 10 {
			t.Fatalf("request %d: %+v, want allowed with %d left, reset in 1m", i+1, d, 9-i)
		}
	}
	for _, c := range []struct {
		at, retry time.Duration
	}{{0, time.Minute}, {30 * time.Second, 30 * time.Second}, {59 * time.Second, time.Second}} {
		d, r := w.TakeHash(h, 1, tm(c.at))
		if d.Allowed || r.Charged() || d.RetryAfter != c.retry || d.Reset != c.retry || d.Remaining != 0 {
			t.Fatalf("at %v: %+v, want denied, Retry-After %v", c.at, d, c.retry)
		}
	}
	if got := drain(w, h, tm(time.Minute)); got != 10 {
		t.Fatalf("a window later: %d granted, want 10", got)
	}
	// The new window is anchored at its first request: at 1m.
	if d := w.PeekHash(h, 1, tm(90*time.Second)); d.Allowed || d.RetryAfter != 30*time.Second {
		t.Fatalf("at 1m30s: %+v, want denied for 30s", d)
	}
}

func TestWindowsWeights(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 10, Window: time.Second}, 1<<12, 0)
	const h = 7
	if d, _ := w.TakeHash(h, 11, tm(0)); d.Allowed || d.RetryAfter != Never {
		t.Fatalf("weight above events: %+v, want never", d)
	}
	if d, _ := w.TakeHash(h, 7, tm(0)); !d.Allowed || d.Remaining != 3 {
		t.Fatalf("weight 7: %+v", d)
	}
	if d, _ := w.TakeHash(h, 4, tm(0)); d.Allowed || d.RetryAfter != time.Second {
		t.Fatalf("weight 4 of 3 left: %+v", d)
	}
	if d, _ := w.TakeHash(h, 3, tm(0)); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("weight 3 of 3 left: %+v", d)
	}
	if d, _ := w.TakeHash(h, 0, tm(0)); d.Allowed {
		t.Fatalf("weight 0 counts as 1: %+v", d)
	}
}

// anchored is the reference of a lone key: a window anchored at the first
// request after the previous window ended, in plain nanoseconds.
type anchored struct {
	n, count int64
	w, start int64
	open     bool
}

func (a *anchored) take(ns, wt int64) (bool, int64) {
	if !a.open || ns >= a.start+a.w {
		a.open, a.start, a.count = true, ns, 0
	}
	if a.count+wt > a.n {
		return false, a.start + a.w - ns
	}
	a.count += wt
	return true, 0
}

// A lone key sees exactly an anchored window: the same decisions, and a
// Retry-After never longer and at most a tick (Window/65,536) shorter.
func TestWindowsLoneKeyIsAnAnchoredWindow(t *testing.T) {
	for _, l := range []Limit{{Events: 1, Window: time.Second}, {Events: 5, Window: time.Second}, {Events: 100, Window: 10 * time.Second}, {Events: MaxBurst, Window: time.Hour}} {
		t.Run(l.String(), func(t *testing.T) {
			w := newWindowTable(t, l, 1<<12, 0)
			ref := &anchored{n: l.Events, w: int64(l.Window)}
			tick := time.Duration(w.p.Load().nsPerTick) + 1
			// Requests come on a grid of whole milliseconds, coarser than
			// a tick, or of whole ticks where a tick is coarser (the
			// largest Events): a window's start is then where the
			// reference puts it.
			unit := max(int64(time.Millisecond), int64(tick))
			if tick > time.Millisecond {
				unit = int64(l.Window) / int64(w.p.Load().wt)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			var at int64
			for i := range 20_000 {
				at += rng.Int64N(int64(l.Window)/unit/20 + 1)
				wt := 1 + rng.Int64N(min(l.Events, 3))
				if l.Events == MaxBurst {
					wt = rng.Int64N(l.Events / 3)
				}
				ns := at * unit
				want, retry := ref.take(ns, wt)
				d, _ := w.TakeHash(99, wt, tm(time.Duration(ns)))
				if d.Allowed != want {
					t.Fatalf("request %d (weight %d) at %v: allowed %v, the anchored window says %v", i, wt, time.Duration(ns), d.Allowed, want)
				}
				if !want && (d.RetryAfter > time.Duration(retry) || d.RetryAfter <= time.Duration(retry)-tick) {
					t.Fatalf("request %d at %v: Retry-After %v, want %v less at most a tick (%v)", i, time.Duration(ns), d.RetryAfter, time.Duration(retry), tick)
				}
			}
		})
	}
}

// slidingLog is what caddy-ratelimit enforces: at most n in any interval of
// length w, exactly.
type slidingLog struct {
	n, w  int64
	times []int64 // granted, ascending
}

func (s *slidingLog) allow(ns int64) bool {
	i := 0
	for i < len(s.times) && s.times[i] <= ns-s.w {
		i++
	}
	s.times = s.times[i:]
	if int64(len(s.times)) >= s.n {
		return false
	}
	s.times = append(s.times, ns)
	return true
}

// mostInAnyWindow is the largest number of times (ascending) within any
// interval of length w.
func mostInAnyWindow(times []int64, w int64) int {
	most, j := 0, 0
	for i := range times {
		for times[i]-times[j] >= w {
			j++
		}
		most = max(most, i-j+1)
	}
	return most
}

// The package doc's worst case, measured: a key granted by the table never
// has more than 2·Events − 1 grants within any Window (an exact sliding log
// allows Events), and the adversary of the doc reaches it. On random bursty
// traces the decisions are compared with an exact sliding log's.
func TestWindowsWorstCaseAgainstSlidingLog(t *testing.T) {
	const n = 10
	W := time.Minute
	w := newWindowTable(t, Limit{Events: n, Window: W}, 1<<20, 0)

	// The adversary: one request, Events − 1 just before the window's end,
	// Events as it ends.
	var adv []int64
	take := func(h uint64, at time.Duration) {
		if d, _ := w.TakeHash(h, 1, tm(at)); d.Allowed {
			adv = append(adv, int64(at))
		}
	}
	take(1, 0)
	for range n - 1 {
		take(1, W-time.Millisecond)
	}
	for range n {
		take(1, W)
	}
	if got := mostInAnyWindow(adv, int64(W)); got != 2*n-1 {
		t.Fatalf("adversary: %d grants within a window, want the documented worst case %d", got, 2*n-1)
	}

	// Random traces: 200 keys, bursts of 1 to 3·Events at random times over
	// an hour.
	rng := rand.New(rand.NewPCG(3, 4))
	type req struct {
		at  int64
		key uint64
	}
	var trace []req
	for k := range uint64(200) {
		at := int64(0)
		for at < int64(time.Hour) {
			at += rng.Int64N(int64(2 * W))
			for range 1 + rng.IntN(3*n) {
				trace = append(trace, req{at + rng.Int64N(int64(5*time.Second)), k<<32 | k*0x9e3779b9})
			}
		}
	}
	slices.SortFunc(trace, func(a, b req) int { return cmp.Compare(a.at, b.at) })
	logs := map[uint64]*slidingLog{}
	grants := map[uint64][]int64{}
	differ, total, worst := 0, 0, 0
	for _, r := range trace {
		lg := logs[r.key]
		if lg == nil {
			lg = &slidingLog{n: n, w: int64(W)}
			logs[r.key] = lg
		}
		exact := lg.allow(r.at)
		d, _ := w.TakeHash(Hash(fmt.Appendf(nil, "%d", r.key)), 1, tm(time.Duration(r.at)))
		if d.Allowed {
			grants[r.key] = append(grants[r.key], r.at)
		}
		if d.Allowed != exact {
			differ++
		}
		total++
	}
	for _, g := range grants {
		worst = max(worst, mostInAnyWindow(g, int64(W)))
	}
	if worst > 2*n-1 {
		t.Fatalf("random traces: %d grants of one key within a window, above the documented worst case of %d", worst, 2*n-1)
	}
	t.Logf("adversary: %d grants within one window (events %d); random bursty traces: %d requests, %.2f%% of decisions differ from an exact sliding log, at most %d grants of a key within a window",
		mostInAnyWindow(adv, int64(W)), n, total, 100*float64(differ)/float64(total), worst)
}

func TestWindowsRefundTakesBackFromItsWindowOnly(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 2, Window: time.Second}, 1<<12, 0)
	const h = 5
	_, r1 := w.TakeHash(h, 1, tm(0))
	w.TakeHash(h, 1, tm(0))
	w.RefundAt(r1, tm(0))
	if d := w.PeekHash(h, 1, tm(0)); !d.Allowed || d.Remaining != 1 {
		t.Fatalf("after a refund: %+v, want 1 left", d)
	}
	// A charge of the old window refunded into a new one gives nothing.
	_, r2 := w.TakeHash(h, 1, tm(500*time.Millisecond))
	if got := drain(w, h, tm(1500*time.Millisecond)); got != 2 {
		t.Fatalf("new window: %d, want 2", got)
	}
	w.RefundAt(r2, tm(1500*time.Millisecond))
	if d := w.PeekHash(h, 1, tm(1500*time.Millisecond)); d.Allowed {
		t.Fatalf("a refund of the previous window's charge gave the new window a token: %+v", d)
	}
	// Refunding the only charge of a window empties the counter.
	w2 := newWindowTable(t, Limit{Events: 2, Window: time.Second}, 1<<12, 0)
	_, r := w2.TakeHash(h, 1, tm(0))
	w2.RefundAt(r, tm(0))
	for _, ln := range w2.p.Load().lines {
		if ln != (line{}) {
			t.Fatalf("a window whose only charge was refunded is still stored: %x", ln)
		}
	}
}

// Charge's debt is carried into the next window: a request held for it is
// counted there, and the key gets no more than Events in it.
func TestWindowsChargeCarriesDebtIntoTheNextWindow(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 4, Window: time.Second}, 1<<12, 0)
	const h = 11
	drain(w, h, tm(0))
	d, _ := w.Charge(h, 3, tm(100*time.Millisecond))
	if !d.Allowed || d.RetryAfter != 900*time.Millisecond {
		t.Fatalf("charge into debt: %+v, want to go when the window ends in 900ms", d)
	}
	if d := w.PeekHash(h, 1, tm(999*time.Millisecond)); d.Allowed || d.RetryAfter != time.Millisecond {
		t.Fatalf("in debt: %+v", d)
	}
	if got := drain(w, h, tm(time.Second)); got != 1 {
		t.Fatalf("the next window: %d granted, want 1 (3 of 4 were the debt)", got)
	}
	if got := drain(w, h, tm(2*time.Second)); got != 4 {
		t.Fatalf("the window after: %d granted, want 4", got)
	}
	// The ceiling: two windows' worth; beyond, a charge falls short.
	w2 := newWindowTable(t, Limit{Events: 4, Window: time.Second}, 1<<12, 0)
	if d, _ := w2.Charge(h, 100, tm(0)); !d.Allowed || d.RetryAfter != time.Second || d.Reset != 2*time.Second {
		t.Fatalf("a charge of 100: %+v, want 8 counted, a window of wait", d)
	}
	if d, _ := w2.Charge(h, 1, tm(0)); d.Allowed {
		t.Fatalf("a charge at the ceiling: %+v, want part dropped", d)
	}
	if got := drain(w2, h, tm(2*time.Second)); got != 4 {
		t.Fatalf("after the carried window: %d, want 4", got)
	}
}

func TestWindowsSetLimitKeepsStartAndCount(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 3, Window: time.Minute}, 1<<12, 0)
	const h = 3
	drain(w, h, tm(0))
	if err := w.SetLimit(Limit{Events: 5, Window: 10 * time.Minute}, tm(30*time.Second)); err != nil {
		t.Fatal(err)
	}
	d := w.PeekHash(h, 1, tm(30*time.Second))
	if !d.Allowed || d.Remaining != 2 || d.Reset != 9*time.Minute+30*time.Second {
		t.Fatalf("after raising the limit: %+v, want 2 left until 10m after the first request", d)
	}
	if got := drain(w, h, tm(30*time.Second)); got != 2 {
		t.Fatalf("drained %d, want 2", got)
	}
	if err := w.SetLimit(Limit{Events: 1, Window: 20 * time.Second}, tm(40*time.Second)); err != nil {
		t.Fatal(err)
	}
	if got := drain(w, h, tm(40*time.Second)); got != 1 {
		t.Fatalf("a window now longer than the new one is over: %d granted, want 1", got)
	}
	if err := w.SetLimit(Limit{Events: 1, Window: time.Second, Burst: 2}, tm(0)); err == nil {
		t.Fatal("a window took a burst")
	}
}

// A window is cleared by Sweep long before its start could wrap round and
// read as running; without sweeps it would (the reason Sweep must run).
func TestWindowsSweepKeepsOldWindowsOver(t *testing.T) {
	l := Limit{Events: MaxBurst, Window: time.Second} // the shortest start field: 10 bits
	w := newWindowTable(t, l, 64, 1)
	p := w.p.Load()
	interval := w.SweepInterval()
	if interval < l.Window {
		t.Fatalf("sweep interval %v below a window", interval)
	}
	wrap := time.Duration(p.nanos(uint64(p.smask) + 1))
	const h = 1
	at := time.Duration(0)
	w.Charge(h, 2*MaxBurst, tm(at))
	for at < 3*wrap {
		at += interval / 2
		w.Sweep(tm(at))
		if d := w.PeekHash(h, MaxBurst, tm(at)); at > 2*l.Window && !d.Allowed {
			t.Fatalf("at %v, %d sweeps in: an old window reads as running: %+v", at, int(at/(interval/2)), d)
		}
	}
	unswept := newWindowTable(t, l, 64, 1)
	unswept.Charge(h, 2*MaxBurst, tm(0))
	if d := unswept.PeekHash(h, MaxBurst, tm(wrap-time.Millisecond)); d.Allowed {
		t.Fatalf("without sweeps the start never wrapped: %+v (the test proves nothing)", d)
	}
}

func TestWindowsDecideWithoutAllocating(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 100, Window: time.Second}, 1<<16, 0)
	var i uint64
	if n := testing.AllocsPerRun(1000, func() {
		i++
		w.TakeHash(i%50, 1, tm(time.Duration(i)*time.Microsecond))
	}); n != 0 {
		t.Fatalf("%v allocations per decision", n)
	}
}

// Many goroutines on one key: the window grants exactly Events, whatever
// the scheduler does (the interleaving test below proves it step by step).
func TestWindowsConcurrentGrantsAreExact(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 1000, Window: time.Hour}, 1<<12, 3)
	var granted atomic.Int64
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 400 {
				var txn Txn
				if txn.Take(w, 77, 1, tm(time.Duration(g*400+i))).Allowed {
					if i%3 == 0 {
						txn.RollbackAt(tm(time.Duration(g*400 + i)))
						continue
					}
					granted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if got := granted.Load(); got != 1000 {
		t.Fatalf("%d granted and kept, want exactly 1000", got)
	}
}

// windowRace is two or three requests of one key, run through every
// interleaving of their atomic steps on a one-line table whose key's window
// was used up at t=0, and then a drain at end, inside the window the racers
// open. Every schedule must grant 2·Events in all: more is a grant no
// window held, fewer a token lost.
type windowRace struct {
	name string
	k    int
	reqs []raceReq
	end  time.Duration
}

func TestWindowsEveryInterleavingIsExact(t *testing.T) {
	ms := time.Millisecond
	l := Limit{Events: 2, Window: time.Second}
	for _, rc := range []windowRace{
		{"two take the last place", 3, []raceReq{{500 * ms, 0, false}, {500 * ms, 0, false}}, 1200 * ms},
		{"two open the next window", 3, []raceReq{{1000 * ms, 1, false}, {1000 * ms, 2, false}}, 1200 * ms},
		{"across the window's end", 3, []raceReq{{990 * ms, 1, false}, {1010 * ms, 1, false}}, 1200 * ms},
		{"three across the end, one counter", 1, []raceReq{{990 * ms, 1, false}, {1010 * ms, 1, false}, {1010 * ms, 1, false}}, 1200 * ms},
		{"a rollback opens the window", 2, []raceReq{{1010 * ms, 1, true}, {1020 * ms, 1, false}}, 1300 * ms},
	} {
		if raceEnabled && len(rc.reqs) > 2 || raceEnabled && rc.k > 1 && rc.reqs[0].rollback {
			// Tens of thousands of schedules, ten times slower under the
			// race detector: the plain run proves them.
			t.Logf("%s: skipped under the race detector", rc.name)
			continue
		}
		want := 2 * l.Events
		const h = 0x1234_5678_9abc_def0
		schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
			w := newWindowTable(t, l, 64, rc.k)
			denier := newTable(t, Limit{Events: 1, Window: time.Hour}, 64)
			denier.Charge(h, 2, tm(0))
			setup := int64(drain(w, h, tm(0)))
			got := make([]int64, len(rc.reqs))
			var fs []func()
			for i, r := range rc.reqs {
				wt := max(r.w, 1)
				fs = append(fs, func() {
					if r.rollback {
						var txn Txn
						txn.Take(w, h, wt, tm(r.at))
						txn.Take(denier, h, 1, tm(r.at))
						return
					}
					if d, _ := w.TakeHash(h, wt, tm(r.at)); d.Allowed {
						got[i] = wt
					}
				})
			}
			return watchLines(&w.p.Load().lines[0]), fs, func(schedule string) {
				var reqs int64
				for _, g := range got {
					reqs += g
				}
				if total := setup + reqs + int64(drain(w, h, tm(rc.end))); total != want {
					t.Errorf("%s, schedule %s: %d granted (%v by the racers), want %d", rc.name, schedule, total, got, want)
				}
			}
		})
		t.Logf("%s: %d schedules", rc.name, schedules)
	}
}

func BenchmarkWindowsTake(b *testing.B) {
	w := newWindowTable(b, Limit{Events: 100, Window: time.Second}, 11<<20, 0)
	bk := newTable(b, Limit{Events: 100, Window: time.Second}, 11<<20)
	b.Run("windows", func(b *testing.B) {
		b.ReportAllocs()
		for i := range b.N {
			w.TakeHash(uint64(i)*0x9e3779b97f4a7c15, 1, tm(time.Duration(i)))
		}
	})
	b.Run("buckets", func(b *testing.B) {
		b.ReportAllocs()
		for i := range b.N {
			bk.TakeHash(uint64(i)*0x9e3779b97f4a7c15, 1, tm(time.Duration(i)))
		}
	})
}
