package limiter

import (
	"math/rand/v2"
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
// allows again once the window is over. The table's times are ticks
// (Window/2^17 here), and a grant counts until a window after the end of
// its tick: Retry-After and Reset are the window, and up to a tick more.
func TestWindowsAllowEventsThenRetryUntilTheWindowEnds(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 10, Window: time.Minute}, 1<<12, 0)
	tick := time.Duration(w.p.Load().nsPerTick) + 1
	near := func(got, want time.Duration) bool { return got >= want && got <= want+tick }
	const h = 42
	for i := range 10 {
		d, _ := w.TakeHash(h, 1, tm(0))
		if !d.Allowed || d.Remaining != int64(9-i) || !near(d.Reset, time.Minute) || d.Limit != 10 {
			t.Fatalf("request %d: %+v, want allowed with %d left, reset in 1m", i+1, d, 9-i)
		}
	}
	for _, c := range []struct {
		at, retry time.Duration
	}{{0, time.Minute}, {30 * time.Second, 30 * time.Second}, {59 * time.Second, time.Second}} {
		d, r := w.TakeHash(h, 1, tm(c.at))
		if d.Allowed || r.Charged() || !near(d.RetryAfter, c.retry) || !near(d.Reset, c.retry) || d.Remaining != 0 {
			t.Fatalf("at %v: %+v, want denied, Retry-After %v", c.at, d, c.retry)
		}
	}
	// The grants of 0 count at most a sub-window longer (ExtraWait).
	later := time.Minute + w.ExtraWait()
	if got := drain(w, h, tm(later)); got != 10 {
		t.Fatalf("a window and a sub-window later: %d granted, want 10", got)
	}
	if d := w.PeekHash(h, 1, tm(later+30*time.Second)); d.Allowed || !near(d.RetryAfter, 30*time.Second) {
		t.Fatalf("30 s after that: %+v, want denied for 30s", d)
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
	if d, _ := w.TakeHash(h, 4, tm(0)); d.Allowed || d.RetryAfter < time.Second || d.RetryAfter > time.Second+time.Duration(w.p.Load().nsPerTick)+1 {
		t.Fatalf("weight 4 of 3 left: %+v", d)
	}
	if d, _ := w.TakeHash(h, 3, tm(0)); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("weight 3 of 3 left: %+v", d)
	}
	if d, _ := w.TakeHash(h, 0, tm(0)); d.Allowed {
		t.Fatalf("weight 0 counts as 1: %+v", d)
	}
}

// A refund takes back its charge from the group it went to, and nothing
// once that group no longer counts.
func TestWindowsRefundTakesBackFromItsWindowOnly(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 2, Window: time.Second}, 1<<12, 0)
	const h = 5
	_, r1 := w.TakeHash(h, 1, tm(0))
	w.TakeHash(h, 1, tm(0))
	w.RefundAt(r1, tm(0))
	if d := w.PeekHash(h, 1, tm(0)); !d.Allowed || d.Remaining != 1 {
		t.Fatalf("after a refund: %+v, want 1 left", d)
	}
	// A charge that no longer counts, refunded, gives nothing.
	_, r2 := w.TakeHash(h, 1, tm(500*time.Millisecond))
	if got := drain(w, h, tm(1600*time.Millisecond)); got != 2 {
		t.Fatalf("a window later: %d, want 2", got)
	}
	w.RefundAt(r2, tm(1600*time.Millisecond))
	if d := w.PeekHash(h, 1, tm(1600*time.Millisecond)); d.Allowed {
		t.Fatalf("a refund of a charge a window old gave the key a token: %+v", d)
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

// A cost reported after the response (Charge) counts from the moment it
// is charged, like a grant, and at most 2·Events of it: however large, the
// key is denied for a window after the charge and not a moment longer
// (issue 28: on the fixed windows a charge's excess was carried into the
// next window, about two windows of lockout: 0 granted at 1.1 s).
func TestWindowsAHugeReportedCostLocksOutOneWindow(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 4, Window: time.Second}, 1<<12, 0)
	tick := time.Duration(w.p.Load().nsPerTick) + 1
	const h = 11
	drain(w, h, tm(0))
	d, _ := w.Charge(h, 1_000_000, tm(100*time.Millisecond))
	if d := w.PeekHash(h, 1, tm(1100*time.Millisecond)); d.Allowed {
		t.Fatalf("a window after the charge, less a tick: %+v, want denied", d)
	}
	if d := w.PeekHash(h, 1, tm(1100*time.Millisecond+tick)); !d.Allowed {
		t.Fatalf("a window and a tick after the charge: %+v, want allowed", d)
	}
	if got := drain(w, h, tm(1100*time.Millisecond+w.ExtraWait())); got != 4 {
		t.Fatalf("a window and a sub-window after the charge: %d granted, want 4", got)
	}
	if d.Allowed || d.RetryAfter < time.Second || d.RetryAfter > time.Second+tick {
		t.Fatalf("a charge of a million: %+v, want part dropped and a wait of a window", d)
	}
	// A smaller one counts whole, from its own time.
	w2 := newWindowTable(t, Limit{Events: 4, Window: time.Second}, 1<<12, 0)
	if d, _ := w2.Charge(h, 3, tm(0)); !d.Allowed || d.Remaining != 1 {
		t.Fatalf("a charge of 3: %+v", d)
	}
	if got := drain(w2, h, tm(500*time.Millisecond)); got != 1 {
		t.Fatalf("beside a charge of 3: %d granted, want 1", got)
	}
}

// SetLimit keeps every grant's time, and counts it under the new limit: a
// key that used 3 of "events 3 window 1m" has 2 left under "events 5
// window 10m" until 10m after its grants, and under "events 1 window 20s"
// it waits until its latest grant is 20 s old.
func TestWindowsSetLimitKeepsEveryGrantsTime(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 3, Window: time.Minute}, 1<<12, 0)
	const h = 3
	drain(w, h, tm(0))
	if err := w.SetLimit(Limit{Events: 5, Window: 10 * time.Minute}, tm(30*time.Second)); err != nil {
		t.Fatal(err)
	}
	tick := time.Duration(w.p.Load().nsPerTick) + 1
	d := w.PeekHash(h, 1, tm(30*time.Second))
	if !d.Allowed || d.Remaining != 2 || d.Reset < 9*time.Minute+30*time.Second || d.Reset > 9*time.Minute+30*time.Second+tick {
		t.Fatalf("after raising the limit: %+v, want 2 left until 10m after the grants", d)
	}
	if got := drain(w, h, tm(30*time.Second)); got != 2 {
		t.Fatalf("drained %d, want 2", got)
	}
	if err := w.SetLimit(Limit{Events: 1, Window: 20 * time.Second}, tm(40*time.Second)); err != nil {
		t.Fatal(err)
	}
	if got := drain(w, h, tm(50*time.Second)); got != 0 {
		t.Fatalf("20 s after the latest grant, less a tick: %d granted, want 0", got)
	}
	if got := drain(w, h, tm(50*time.Second+w.ExtraWait())); got != 1 {
		t.Fatalf("20 s and a sub-window after the latest grant: %d granted, want 1", got)
	}
	if err := w.SetLimit(Limit{Events: 1, Window: time.Second, Burst: 2}, tm(0)); err == nil {
		t.Fatal("a window took a burst")
	}
}

// Lowering events carries no debt (issue 28): a key that used 100 of
// "events 100 window 1h" is denied under "events 10" until its grants are
// an hour old, as the sliding log would (and a sub-window more at most),
// and then gets 10. The fixed windows capped its count at twice the new
// limit and carried the excess into the next window: locked out for an
// extra hour (0 granted at 1 h 10 min).
func TestWindowsLoweringEventsCarriesNoDebt(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 100, Window: time.Hour}, 1<<12, 0)
	const h = 21
	if got := drain(w, h, tm(0)); got != 100 {
		t.Fatalf("drained %d, want 100", got)
	}
	// The grants' time is known to the old table's tick, and counts to the
	// end of the new tick that holds it.
	tick := time.Duration(w.p.Load().nsPerTick) + 1
	noErr(t, w.SetLimit(Limit{Events: 10, Window: time.Hour}, tm(30*time.Minute)))
	tick += time.Duration(w.p.Load().nsPerTick) + 1
	if d := w.PeekHash(h, 1, tm(30*time.Minute)); d.Allowed || d.RetryAfter < 30*time.Minute || d.RetryAfter > 30*time.Minute+tick {
		t.Fatalf("after lowering: %+v, want denied until the grants are an hour old", d)
	}
	if got := drain(w, h, tm(time.Hour+w.ExtraWait())); got != 10 {
		t.Fatalf("an hour and a sub-window (%v) after the grants: %d granted, want 10", w.ExtraWait(), got)
	}
}

// A counter is cleared by Sweep long before its T could wrap round and
// read as ahead; without sweeps it would (the reason Sweep must run).
func TestWindowsSweepKeepsOldWindowsOver(t *testing.T) {
	l := Limit{Events: MaxBurst, Window: time.Second} // the shortest T field: 19 bits
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
		t.Fatalf("without sweeps T never wrapped: %+v (the test proves nothing)", d)
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
// interleaving of their atomic steps on a one-line table whose key used up
// its Events at t=0, and then a drain at end, a window after 0 and less
// than a window after the racers. A racer granted less than a window after
// 0 is a grant beyond the bound; racers and drain must grant Events in all
// (more is a grant no window held, fewer a token lost).
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
		{"two as the grants expire", 3, []raceReq{{1001 * ms, 1, false}, {1001 * ms, 2, false}}, 1200 * ms},
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
		const h = 0x1234_5678_9abc_def0
		schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
			w := newWindowTable(t, l, 64, rc.k)
			denier := newTable(t, Limit{Events: 1, Window: time.Hour}, 64)
			denier.Charge(h, 2, tm(0))
			if setup := drain(w, h, tm(0)); setup != int(l.Events) {
				t.Fatalf("setup: %d granted", setup)
			}
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
				for i, g := range got {
					if g != 0 && rc.reqs[i].at < l.Window {
						t.Errorf("%s, schedule %s: racer %d granted at %v, within a window of Events at 0", rc.name, schedule, i, rc.reqs[i].at)
					}
					reqs += g
				}
				if total := reqs + int64(drain(w, h, tm(rc.end))); total != l.Events {
					t.Errorf("%s, schedule %s: %d granted in the window ending at %v (%v by the racers), want %d", rc.name, schedule, total, rc.end, got, l.Events)
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

// A grant counts for a whole window from its own time, not from the start
// of its tick (issue 28): with a coarse tick (a million events a minute:
// the old table's 234 ms), a grant made at the last nanosecond of a tick
// still counts a nanosecond less than a window later, and Retry-After says
// so. On the old table the window closed at the tick's start plus a
// window, and a second grant passed within the window.
func TestWindowsAGrantCountsAWholeWindowFromItsOwnTime(t *testing.T) {
	for _, l := range []Limit{{Events: MaxBurst, Window: time.Minute}, {Events: 1, Window: time.Second}} {
		w := newWindowTable(t, l, 1<<12, 0)
		const h = 17
		at := time.Duration(w.p.Load().nanos(1) - 1) // the last nanosecond of tick 0
		if d, _ := w.TakeHash(h, l.Events, tm(at)); !d.Allowed {
			t.Fatalf("%v: the first grant was denied: %+v", l, d)
		}
		d, _ := w.TakeHash(h, 1, tm(at+l.Window-1))
		if d.Allowed || d.RetryAfter < 1 {
			t.Fatalf("%v: a window less a nanosecond after a grant of all of it: %+v, want denied for at least a nanosecond", l, d)
		}
	}
}

// Fill (the admin API's reset) clears the key's counters, every one of
// its words, whatever K: the key counts nothing, and nothing of it is left
// in the line.
func TestWindowsFillClearsTheKey(t *testing.T) {
	for _, k := range []int{1, 3, 8} {
		w := newWindowTable(t, Limit{Events: 5, Window: time.Minute}, 64, k)
		const h = 29
		if got := drain(w, h, tm(0)); got != 5 {
			t.Fatalf("K %d: drained %d, want 5", k, got)
		}
		w.Fill(h)
		if ln := w.p.Load().lines[0]; ln != (line{}) {
			t.Fatalf("K %d: after Fill the line is %x", k, ln)
		}
		if got := drain(w, h, tm(time.Second)); got != 5 {
			t.Fatalf("K %d: after Fill, %d granted, want 5", k, got)
		}
	}
}

// TestWindowsARefundDatedBeforeItsChargeGivesItAllBack: as for buckets, a
// refund's time read before its charge's counts as the charge's, also when
// it falls in an earlier window.
func TestWindowsARefundDatedBeforeItsChargeGivesItAllBack(t *testing.T) {
	for _, back := range []time.Duration{300 * time.Millisecond, 2 * time.Second} {
		w := newWindowTable(t, Limit{Events: 10, Window: time.Second}, 1<<16, 3)
		h := Hash([]byte("k"))
		now := clockEpoch.Add(5 * time.Second)
		_, r := w.TakeHash(h, 10, now)
		w.RefundAt(r, now.Add(-back))
		if d := w.PeekHash(h, 1, now); d.Remaining != 10 {
			t.Errorf("after refunding all 10, dated %v before the charge: %d remaining, want 10", back, d.Remaining)
		}
	}
}

// sumGroups is sum group by group: the reference of the one multiplication
// that replaces it.
func (p *windowParams) sumGroups(v uint64, n int) uint64 {
	var u uint64
	for i := range n {
		u += p.count(v, i)
	}
	return u
}

// Every counter a table can hold (its groups adding up to at most 2·Events)
// sums and charges as the group-by-group references do (sumGroups, and
// dropOldest for look's one add), for layouts of every number of groups
// and widths from 2 to 31 bits.
func TestWindowsSumAndCapAgreeWithTheGroupByGroupReference(t *testing.T) {
	r := rand.New(rand.NewPCG(29, 1))
	checked := 0
	for _, events := range []int64{1, 2, 3, 5, 10, 31, 100, 128, 511, 512, 8191, 8192, MaxBurst} {
		p := windowParamsFor(Limit{Events: events, Window: time.Minute}, 1)
		for range 2000 {
			// Random groups, the newest first, within ceil in all.
			var f uint64
			left := p.ceil
			for i := range int(p.g) {
				c := min(left, r.Uint64N(p.ceil+1)>>r.UintN(uint(p.cb)+1))
				left -= c
				f |= c << (uint(i) * uint(p.cb))
			}
			T := r.Uint64() & p.smask
			v := T<<p.tshift | f
			for n := range int(p.g) + 1 {
				if got, want := p.sum(v, n), p.sumGroups(v, n); got != want {
					t.Fatalf("events %d: sum(%#x, %d) = %d, want %d", events, v, n, got, want)
				}
			}
			cost := 1 + r.Uint64N(p.ceil)
			// At T itself every group counts and none moves: look's one
			// add where nothing is dropped.
			if used, nv := p.look(v, T, cost); nv != p.dropOldest(T, f, cost) || used != p.sumGroups(v, int(p.g)) {
				t.Fatalf("events %d: look(%#x, %#x, %d) = %d, %#x, want %d, %#x", events, v, T, cost, used, nv, p.sumGroups(v, int(p.g)), p.dropOldest(T, f, cost))
			}
			checked++
		}
	}
	t.Logf("%d counters checked", checked)
}

// A reservation (a held request's place) counts only within a counter's
// ceiling of 2·Events, so it never drops the window's grants as Charge
// may: once given back, the key is where its grants left it. With Charge,
// reserving 8 on a full window of 4 dropped the 4 grants, and refunding
// the 8 left the key with its whole limit again.
func TestWindowsReserveNeverDropsAGrant(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 4, Window: time.Minute}, 1<<12, 0)
	const h = 42
	if got := drain(w, h, tm(0)); got != 4 {
		t.Fatalf("granted %d of 4", got)
	}
	var held []Reservation
	for i := range 4 {
		d, r := w.Reserve(h, 1, tm(time.Second))
		if !d.Allowed || !r.Charged() {
			t.Fatalf("reservation %d of the 4 a ceiling of 8 leaves: %+v", i+1, d)
		}
		held = append(held, r)
	}
	if d, r := w.Reserve(h, 1, tm(time.Second)); d.Allowed || r.Charged() {
		t.Fatalf("a fifth reservation beyond the ceiling was counted: %+v", d)
	}
	if d, r := w.Reserve(h, 9, tm(time.Second)); d.Allowed || r.Charged() {
		t.Fatalf("a reservation above the ceiling was counted: %+v", d)
	}
	for _, r := range held {
		w.RefundAt(r, tm(2*time.Second))
	}
	if d := w.PeekHash(h, 1, tm(2*time.Second)); d.Allowed {
		t.Fatalf("the reservations given back, the key's 4 grants of 0 s no longer count: %+v", d)
	}
	if got := drain(w, h, tm(time.Minute+w.ExtraWait())); got != 4 {
		t.Fatalf("a window later: %d granted, want 4", got)
	}
}
