package storage

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
	"go.uber.org/zap"
)

// aheadNodes returns n window-zone instances of events per window syncing
// through one storage, the one of index ahead with its clock skew ahead of
// the others' (none for ahead < 0), and the clock that gives each its time
// at real time at. They have synced every read interval up to end, seven
// times.
func aheadNodes(t *testing.T, n int, events int64, window time.Duration, ahead int, skew time.Duration, end time.Time) ([]*node, func(*node, time.Time) time.Time) {
	t.Helper()
	return clockedNodes(t, n, events, window, func(i int) time.Duration {
		if i == ahead {
			return skew
		}
		return 0
	}, end)
}

// clockedNodes is aheadNodes with the clock of the instance of index i
// skew(i) ahead of real time (behind for skew(i) < 0).
func clockedNodes(t *testing.T, n int, events int64, window time.Duration, skew func(i int) time.Duration, end time.Time) ([]*node, func(*node, time.Time) time.Time) {
	t.Helper()
	st := newMemStorage()
	var nodes []*node
	for i := range n {
		nodes = append(nodes, newJoiner(t, st, string(rune('a'+i)), events, window, zap.NewNop()))
	}
	clock := func(x *node, at time.Time) time.Time {
		return at.Add(skew(slices.Index(nodes, x)))
	}
	for k := 6; k >= 0; k-- {
		syncAt(nodes, nodes, clock, end.Add(-time.Duration(k)*testIntervals.Read))
	}
	return nodes, clock
}

// A window zone keeps its bound (1.1 × events + 1 in any span of the
// window, in real time) with one instance's clock ahead of the others'
// within MaxClockSkew, in plain traffic without failures. Each instance
// places a peer's snapshot (or the aggregator's sum) on its own clock by
// how far ahead the peer's clock has been seen (clockShift). Before, it
// took a peer's sub-windows for its own: a reader ahead by s (or a writer
// behind) dropped the peer's counts s early and shared out room the key
// had not got back, and what a writer ahead counted after the reader's
// sub-window was dropped outright. Measured before, events 30 (bound 34):
//   - two instances, b ahead; a burst of 30 on a gets 15, then the key goes
//     to b every 100 ms for 10 s: 44 in a span (1 m window, b 30 s ahead
//     from 35 s on, or 59 s ahead from 5 s on), 38 (10 s window, 5 s ahead
//     from 6 s on); 26 without skew;
//   - four instances (an aggregate), a key sent round robin every 50 ms for
//     8 windows, the aggregator or a plain reader ahead: 42 and 38 (10 s
//     window, 5 s ahead), 45 to 59 (1 m window, 15 to 59 s ahead).
func TestWindowZoneClockAheadKeepsTheBound(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	for _, c := range []struct{ window, skew, gap time.Duration }{
		{time.Minute, 0, 35 * time.Second},
		{time.Minute, 30 * time.Second, 35 * time.Second},
		{time.Minute, 59 * time.Second, 5 * time.Second},
		{10 * time.Second, 5 * time.Second, 6 * time.Second},
	} {
		nodes, clock := aheadNodes(t, 2, events, c.window, 1, c.skew, t0.Add(7*testIntervals.Read))
		now := t0.Add(8 * testIntervals.Read) // a read interval after the last sync
		a, b := nodes[0], nodes[1]
		h := limiter.HashString(fmt.Sprint("k", c))
		var log []time.Time
		first := burstOnAll([]*node{a}, h, events, now.Add(100*time.Millisecond), &log)
		next := now.Add(testIntervals.Read)
		got := sendEvery(nodes, clock, b, h, now.Add(c.gap), now.Add(c.gap+10*time.Second), 100*time.Millisecond, &next, &log)
		worst := worstSpan(log, c.window)
		t.Logf("two instances, window %v, b %v ahead: a burst on a got %d, then b from %v on %d: worst span %d (bound %d)", c.window, c.skew, first, c.gap, got, worst, bound)
		if worst > bound || first == 0 || got == 0 {
			t.Errorf("window %v, b %v ahead: a burst on a got %d, then b %d; worst span %d, want at most %d (and some granted on each)", c.window, c.skew, first, got, worst, bound)
		}
	}
	for _, c := range []struct{ window, skew time.Duration }{
		{10 * time.Second, 5 * time.Second},
		{time.Minute, 15 * time.Second},
		{time.Minute, 30 * time.Second},
		{time.Minute, 59 * time.Second},
	} {
		for _, ahead := range []int{0, 3} { // the aggregator, a plain reader
			nodes, clock := aheadNodes(t, 4, events, c.window, ahead, c.skew, t0)
			h := limiter.HashString(fmt.Sprint("four", c, ahead))
			var log []time.Time
			next := t0.Add(testIntervals.Read)
			i := 0
			for at := t0.Add(25 * time.Millisecond); at.Before(t0.Add(8 * c.window)); at = at.Add(50 * time.Millisecond) {
				for !at.Before(next) {
					syncAt(nodes, nodes, clock, next)
					next = next.Add(testIntervals.Read)
				}
				n := nodes[i%4]
				i++
				if d, _ := n.c.TakeHash(h, 1, clock(n, at)); d.Allowed {
					log = append(log, at)
				}
			}
			worst := worstSpan(log, c.window)
			t.Logf("four instances, window %v, node %d %v ahead (aggregators %v): %d granted in 8 windows, worst span %d (bound %d)", c.window, ahead, c.skew, aggregators(nodes), len(log), worst, bound)
			// The stream asks 6 to 40 times the rate: the key should
			// get most of its 8 × 30, not hardly any.
			if worst > bound || len(log) < 6*events {
				t.Errorf("window %v, node %d %v ahead: %d granted in 8 windows, worst span %d; want at most %d in a span, and at least %d in all", c.window, ahead, c.skew, len(log), worst, bound, 6*events)
			}
		}
	}
}

// A peer's clock behind the reader's by less than the tolerance clockShift
// leaves uncorrected (a read interval, at most a sub-window) still keeps
// the bound: a's counts of a sub-window stay in b's view until the
// sub-window's end is W old on a's clock, not on b's. Two instances, b
// ahead of a by skew; a burst of 30 on a 10 ms before a sub-window of a's
// clock ends (15 granted: a's share), then the key sent to b every 20 ms
// for W + 10 s. Before, b dropped a's counts at its own sub-window's edge,
// skew before a did, while the burst was still within W of it, and
// granted the key again: 38 in a span of a 1 m window with 1 s intervals
// and b 200 to 700 ms ahead, and with 5 s intervals and b 0.9 to 30 s
// ahead (the skews past the tolerance are moved by whole sub-windows, and
// left as much short of it); 38 on a 10 s window.
func TestWindowZoneBurstAtASubWindowsEndOnAClockBehindKeepsTheBound(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	old := testIntervals
	defer func() { testIntervals = old }()
	for _, c := range []struct {
		window, interval time.Duration
		skews            []time.Duration
	}{
		{time.Minute, time.Second, []time.Duration{200 * time.Millisecond, 500 * time.Millisecond, 700 * time.Millisecond}},
		{time.Minute, 5 * time.Second, []time.Duration{900 * time.Millisecond, 4 * time.Second, 13 * time.Second}},
		{10 * time.Second, time.Second, []time.Duration{300 * time.Millisecond, 900 * time.Millisecond}},
	} {
		testIntervals = Intervals{Read: c.interval, Write: c.interval, PurgeAge: 2 * time.Minute}
		L := int64(subWindowOf(c.window))
		for _, skew := range c.skews {
			nodes, clock := aheadNodes(t, 2, events, c.window, 1, skew, t0)
			a, b := nodes[0], nodes[1]
			// 10 ms before a's sub-window ends, on a's clock.
			burst := time.Unix(0, (t0.UnixNano()/L+1)*L).Add(-10 * time.Millisecond)
			if burst.Sub(t0) < 50*time.Millisecond {
				burst = burst.Add(time.Duration(L))
			}
			h := limiter.HashString(fmt.Sprint("edge", c.window, c.interval, skew))
			var log []time.Time
			first := burstOnAll([]*node{a}, h, events, burst, &log)
			next := t0.Add(testIntervals.Read)
			got := sendEvery(nodes, clock, b, h, burst, burst.Add(c.window+10*time.Second), 20*time.Millisecond, &next, &log)
			worst := worstSpan(log, c.window)
			t.Logf("window %v, intervals %v, b %v ahead: a burst on a got %d, then b %d: worst span %d (bound %d)", c.window, c.interval, skew, first, got, worst, bound)
			if worst > bound || first == 0 || got == 0 {
				t.Errorf("window %v, intervals %v, b %v ahead: a burst on a got %d, then b %d; worst span %d, want at most %d (and some granted on each)", c.window, c.interval, skew, first, got, worst, bound)
			}
		}
	}
}

// sendEvery sends the key with hash h to x every step of real time from
// from until to, on x's clock, the nodes syncing at every read interval
// from *next on (which it moves on); it appends the grants' real times to
// log and returns how many there were.
func sendEvery(nodes []*node, clock func(*node, time.Time) time.Time, x *node, h uint64, from, to time.Time, step time.Duration, next *time.Time, log *[]time.Time) int {
	got := 0
	for at := from; at.Before(to); at = at.Add(step) {
		for !at.Before(*next) {
			syncAt(nodes, nodes, clock, *next)
			*next = next.Add(testIntervals.Read)
		}
		if d, _ := x.c.TakeHash(h, 1, clock(x, at)); d.Allowed {
			*log = append(*log, at)
			got++
		}
	}
	return got
}

// A key sent to an instance b whose clock is behind the others' by less
// than the tolerance lingers in their views that long after its
// sub-window leaves them (Linger), and a request denied there is told to
// retry when it leaves, not at the end of the sub-window: so the key waits
// no longer than an exact sliding log of the same grants would have it
// wait, plus the documented 8L − W (L the sub-window) and a read
// interval. Here events 30 on a 1 m window, the key sent to b every 100 ms
// through one of its sub-windows, then to the others every 20 ms; every
// denial's wait to the next grant is measured where an exact log of the
// grants held fewer than 30 in the window before it. Before, the denials
// in the linger were given a Retry-After to the end of the sub-window,
// the key was blocked that long (Cluster.mitigate), and it waited 16.74 s
// (b 300 ms behind) and 16.34 s (700 ms) where the bound is 9.57 s.
func TestWindowZoneKeyOnAClockBehindWaitsNoLongerThanItsLinger(t *testing.T) {
	const events = 30
	const window = time.Minute
	L := subWindowOf(window)
	most := 8*L - window + testIntervals.Read
	for _, n := range []int{2, 4} {
		for _, delta := range []time.Duration{0, 300 * time.Millisecond, 700 * time.Millisecond} {
			B := time.Unix(0, (t0.Add(20*time.Second).UnixNano()/int64(L)+2)*int64(L)) // a sub-window's start
			formAt := t0.Add(300 * time.Millisecond)
			nodes, clock := clockedNodes(t, n, events, window, func(i int) time.Duration {
				if i == 1 {
					return -delta
				}
				return 0
			}, formAt)
			next := formAt.Add(testIntervals.Read)
			h := limiter.HashString(fmt.Sprint("linger wait", n, delta))
			var log, denied []time.Time
			send := func(x *node, at time.Time) {
				for ; !at.Before(next); next = next.Add(testIntervals.Read) {
					syncAt(nodes, nodes, clock, next)
				}
				if d, _ := x.c.TakeHash(h, 1, clock(x, at)); d.Allowed {
					log = append(log, at)
				} else {
					denied = append(denied, at)
				}
			}
			for at := B.Add(-L + 100*time.Millisecond); at.Before(B.Add(-10 * time.Millisecond)); at = at.Add(100 * time.Millisecond) {
				send(nodes[1], at.Add(delta)) // through one of b's sub-windows
			}
			others := slices.Delete(slices.Clone(nodes), 1, 2)
			k := 0
			for at := B.Add(delta); at.Before(B.Add(window + 20*time.Second)); at = at.Add(20 * time.Millisecond) {
				send(others[k%len(others)], at)
				k++
			}
			wait, from := waitOverLog(log, denied, events, window)
			t.Logf("%d instances, b %v behind: %d granted, worst span %d; longest wait where an exact log allowed the key %v (from B+%v)", n, delta, len(log), worstSpan(log, window), wait, from.Sub(B))
			if wait > most || len(log) <= events {
				t.Errorf("%d instances, b %v behind: %d granted; waited %v where an exact log allowed the key, want at most 8L − W + a read interval = %v", n, delta, len(log), wait, most)
			}
		}
	}
}

// burstBehind has two instances a and b of a window zone of events per
// window, a's clock skew behind b's, synced at every read interval from
// t0 on, and a burst of events for the key with hash h on a 10 ms before
// a's sub-window ends. It returns b, the instances' clock, the burst's
// real time, and sync, which syncs them at every read interval up to a
// real time.
func burstBehind(t *testing.T, events int64, window, skew time.Duration, h uint64) (b *node, clock func(*node, time.Time) time.Time, burst time.Time, sync func(time.Time)) {
	t.Helper()
	L := subWindowOf(window)
	nodes, clock := clockedNodes(t, 2, events, window, func(i int) time.Duration {
		if i == 0 {
			return -skew
		}
		return 0
	}, t0)
	a := nodes[0]
	edge := time.Unix(0, (clock(a, t0).UnixNano()/int64(L)+2)*int64(L)).Add(-10 * time.Millisecond)
	burst = edge.Add(skew) // real time
	next := t0.Add(testIntervals.Read)
	sync = func(at time.Time) {
		for ; !at.Before(next); next = next.Add(testIntervals.Read) {
			syncAt(nodes, nodes, clock, next)
		}
	}
	sync(burst)
	for range events {
		a.c.TakeHash(h, 1, clock(a, burst))
	}
	return nodes[1], clock, burst, sync
}

// A request denied before a peer's counts begin to linger, on counts
// that must leave for it to pass, is told to retry when the linger ends:
// at its Retry-After the key passes. Two instances, a behind b by 0.3 to
// 0.9 of the clock tolerance (what the correction leaves, lingered), a
// burst of 30 on a 10 ms before its sub-window ends, then the key sent to
// b every 10 ms for a window and 10 s; the first request at or after a
// denial's Retry-After must pass, unless a grant came in between (once b
// has read the burst, two reads after it, and for waits longer than a
// read, which may find the counts placed anew). Before, the denials were
// told to retry at the end of the burst's sub-window, where a's counts
// still lingered: early by 0.91 s (10 s window, 1 s reads, a 900 ms
// behind), 3.87 s (1 m, 1 s reads), 4.51 s (1 m, 5 s reads).
func TestWindowZoneRetryAfterWaitsForTheLinger(t *testing.T) {
	const events = 30
	old := testIntervals
	defer func() { testIntervals = old }()
	for _, c := range []struct{ iv, window time.Duration }{
		{time.Second, 10 * time.Second}, {time.Second, time.Minute}, {5 * time.Second, time.Minute},
	} {
		iv, window := c.iv, c.window
		testIntervals = Intervals{Read: iv, Write: iv, PurgeAge: 5 * time.Minute}
		{
			L := subWindowOf(window)
			tol := clockTolerance(L)
			for _, f := range []float64{0.3, 0.6, 0.9} {
				skew := time.Duration(f * float64(tol))
				h := limiter.HashString(fmt.Sprint("retry after the linger", iv, window, f))
				b, clock, burst, sync := burstBehind(t, events, window, skew, h)
				const step = 10 * time.Millisecond
				known := burst.Add(2*testIntervals.Read + 50*time.Millisecond)
				var due []time.Time // of the denials since the last grant
				checked, early := 0, 0
				var first time.Time
				for at := burst.Add(step); at.Before(burst.Add(window + 10*time.Second)); at = at.Add(step) {
					sync(at)
					d, _ := b.c.TakeHash(h, 1, clock(b, at))
					for _, u := range due {
						if !at.Before(u) && at.Before(u.Add(step)) {
							if checked++; !d.Allowed && early == 0 {
								first = u
							}
							if !d.Allowed {
								early++
							}
						}
					}
					if d.Allowed {
						due = due[:0]
					} else if at.After(known) && d.RetryAfter > testIntervals.Read {
						due = append(due, at.Add(d.RetryAfter))
					}
				}
				if checked == 0 || early > 0 {
					t.Errorf("%v reads, %v window, a %v behind: denied at %d of %d Retry-Afters (the first burst+%v)", iv, window, skew, early, checked, first.Sub(burst))
				}
			}
		}
	}
}

// waitOverLog returns the longest time from a denial (in denied) at which
// an exact sliding log of the grants (log, sorted) held fewer than events
// in the window before it, to the next grant, and that denial's time.
func waitOverLog(log, denied []time.Time, events int, window time.Duration) (most time.Duration, from time.Time) {
	for _, d := range denied {
		in := 0
		for _, g := range log {
			if !g.After(d) && d.Sub(g) < window {
				in++
			}
		}
		if in >= events {
			continue
		}
		if i, _ := slices.BinarySearchFunc(log, d, func(g, d time.Time) int { return g.Compare(d.Add(1)) }); i < len(log) {
			if w := log[i].Sub(d); w > most {
				most, from = w, d
			}
		}
	}
	return most, from
}

// A reader whose own wall clock is stepped (an NTP step, not a slew)
// places a peer's counts on its clock as it is after the step at once, as
// a reader whose clock was always that far off does: what it measured of
// the peer's clock (clockShift's samples) is corrected by the step
// (followStep), seen as the wall clock moving more or less than the time
// elapsed. Reads every second find the peer's snapshot of that second;
// the reader's clock is then stepped, and the first read after the step
// finds no new snapshot, the second a new one. Before, a reader stepped
// 5 s forward on a 10 s window kept placing the peer's counts as on its
// own clock (shift 0 where 3 sub-windows later is right), by its samples
// from before the step, for up to clockSamples snapshots: the counts left
// its view up to 5 s early. One stepped back placed them 3 sub-windows
// later than right (kept longer) until the peer's next snapshot.
func TestClockShiftFollowsTheReadersOwnStep(t *testing.T) {
	const window = 10 * time.Second
	for _, step := range []time.Duration{5 * time.Second, -5 * time.Second, 8 * time.Second, 2 * time.Second} {
		st := newMemStorage()
		stepped := newJoiner(t, st, "b", 30, window, zap.NewNop()).s
		always := newJoiner(t, st, "c", 30, window, zap.NewNop()).s
		var jump time.Duration // the step of stepped's clock since its last read
		stepped.elapsed = func(from, to time.Time) time.Duration { return to.Sub(from) - jump }
		// where a read places the peer: by whole sub-windows, and how long
		// its counts linger after that (clockShift).
		type place struct {
			shift int64
			early time.Duration
		}
		read := func(s *Syncer, now, written time.Time) place {
			s.followStep(now)
			shift, early := s.clockShift(now, "a", written.UnixNano())
			return place{shift, early}
		}
		for k := range 10 {
			at := t0.Add(time.Duration(k) * time.Second)
			read(stepped, at, at)
			read(always, at.Add(step), at)
		}
		jump = step
		for k, written := range []time.Duration{9 * time.Second, 11 * time.Second} {
			at := t0.Add(time.Duration(11+k) * time.Second)
			got := read(stepped, at.Add(step), t0.Add(written))
			want := read(always, at.Add(step), t0.Add(written))
			jump = 0
			t.Logf("clock stepped %v, read %d after the step: the peer's counts moved %d sub-windows, lingering %v (as a reader always %v off: %d, %v)", step, k+1, got.shift, got.early, step, want.shift, want.early)
			if got != want {
				t.Errorf("clock stepped %v, read %d after the step: the peer's counts moved %d sub-windows, lingering %v; want %d and %v as on a clock always that far off", step, k+1, got.shift, got.early, want.shift, want.early)
			}
		}
	}
}

// A window zone keeps its bound (1.1 × events + 1 in any span of the
// window, in real time) when a reader's own wall clock is stepped forward
// (an NTP step) just after a burst: its peers' counts are placed on its
// clock as it is after the step (followStep). Two instances on one clock,
// a burst of 30 on a (15 granted), b's clock stepped forward by D before
// the burst's window is out, then the key sent to b every 100 ms for 12 s.
// Before, b kept placing a's counts by samples taken before the step for
// up to clockSamples snapshots, and they left its view up to D early: 42
// in a span with D = 5 s on a 10 s window, 43 with 8 s (34 with 2 s).
func TestWindowZoneReaderClockSteppedForwardKeepsTheBound(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	for _, c := range []struct{ window, step time.Duration }{
		{10 * time.Second, 2 * time.Second},
		{10 * time.Second, 5 * time.Second},
		{10 * time.Second, 8 * time.Second},
		{time.Minute, 30 * time.Second},
	} {
		nodes, _ := aheadNodes(t, 2, events, c.window, -1, 0, t0.Add(7*testIntervals.Read))
		a, b := nodes[0], nodes[1]
		now := t0.Add(8 * testIntervals.Read)
		burst := now.Add(500 * time.Millisecond)
		stepAt := burst.Add(max(200*time.Millisecond, c.window-c.step-2*time.Second))
		clock := func(x *node, at time.Time) time.Time {
			if x == b && !at.Before(stepAt) {
				return at.Add(c.step)
			}
			return at
		}
		// b's monotonic clock runs on real time: its wall time less the
		// step, once stepped.
		unstep := func(wall time.Time) time.Time {
			if !wall.Before(stepAt.Add(c.step)) {
				return wall.Add(-c.step)
			}
			return wall
		}
		b.s.elapsed = func(from, to time.Time) time.Duration { return unstep(to).Sub(unstep(from)) }
		h := limiter.HashString(fmt.Sprint("k", c))
		var log []time.Time
		first := burstOnAll([]*node{a}, h, events, burst, &log)
		next := now.Add(testIntervals.Read)
		got := sendEvery(nodes, clock, b, h, stepAt, stepAt.Add(12*time.Second), 100*time.Millisecond, &next, &log)
		worst := worstSpan(log, c.window)
		t.Logf("window %v, b's clock stepped %v forward %v after a burst on a (%d granted): b granted %d, worst span %d (bound %d)", c.window, c.step, stepAt.Sub(burst), first, got, worst, bound)
		if worst > bound || first == 0 || got == 0 {
			t.Errorf("window %v, b stepped %v: a burst on a got %d, then b %d; worst span %d, want at most %d (and some granted on each)", c.window, c.step, first, got, worst, bound)
		}
	}
}
