package storage

import (
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/limiter"
)

// slidingUnderTest is whether the window zone's nodes below count sliding:
// false runs the test on the weighted counts window zones' clusters had
// before, to see it fail.
const slidingUnderTest = true

// newWindowNodes returns n nodes of a window zone ("w", events per
// testWindow), bursts split, syncing through a fresh storage, each on the
// clock clock gives it, published and read once at now.
func newWindowNodes(t *testing.T, n int, events int64, clock func(*node, time.Time) time.Time, now time.Time) []*node {
	t.Helper()
	return newWindowNodesOf(t, n, events, testWindow, slidingUnderTest, clock, now)
}

// newWindowNodesOf is newWindowNodes for a window and kind of sketch of
// the caller's.
func newWindowNodesOf(t *testing.T, n int, events int64, window time.Duration, sliding bool, clock func(*node, time.Time) time.Time, now time.Time) []*node {
	t.Helper()
	st := newMemStorage()
	nodes := make([]*node, n)
	for i := range nodes {
		c, err := newCluster(Shape{Zone: "w", Window: window, Width: 256, Sliding: sliding}, events)
		if err != nil {
			t.Fatal(err)
		}
		core, logs := observer.New(zap.InfoLevel)
		nodes[i] = &node{c: c, logs: logs}
		nodes[i].s = NewSyncer(c, st, string(rune('a'+i)), testIntervals, zap.New(core))
		nodes[i].s.proc = newProcess()
		c.SplitBursts(true, testIntervals.Read)
	}
	syncAt(nodes, nodes, clock, now)
	return nodes
}

// A window zone's key is hit on three instances that sync every read
// interval (and on five, which read an aggregate), its clock a little off
// on one: late in one of the windows a
// weighted sketch aligns to Unix time, then at five times its rate across
// the edge and two windows beyond. No span of the window may hold more
// than the split bursts' bound, 1.1 × events + 1, where the weighted
// estimate let through up to twice events.
func TestWindowZoneClusterHoldsItsLimitInEverySpan(t *testing.T) {
	const events = 10
	for _, c := range []struct {
		size int
		skew time.Duration
	}{{3, 0}, {3, 300 * time.Millisecond}, {3, -700 * time.Millisecond}, {5, 0}, {5, -700 * time.Millisecond}} {
		skew := c.skew
		last := (*node)(nil)
		clock := func(n *node, at time.Time) time.Time {
			if n == last {
				return at.Add(skew)
			}
			return at
		}
		// An edge of the aligned windows, and the key's first request
		// 5 s before it.
		edge := time.Unix(0, (t0.UnixNano()/int64(testWindow)+2)*int64(testWindow))
		start := edge.Add(-5 * time.Second)
		nodes := newWindowNodes(t, c.size, events, clock, start.Add(-testIntervals.Read))
		last = nodes[len(nodes)-1]
		var log []time.Time // every grant, by the true time
		h := limiter.HashString("login")
		step := testWindow / (5 * events)
		next := start.Add(testIntervals.Read)
		for k, at := 0, start; at.Before(edge.Add(2 * testWindow)); k, at = k+1, at.Add(step) {
			for !next.After(at) {
				syncAt(nodes, nodes, clock, next)
				next = next.Add(testIntervals.Read)
			}
			n := nodes[k%len(nodes)]
			if k < 3*len(nodes) {
				// The first requests come as a burst on each.
				for range events {
					if d, _ := n.c.TakeHash(h, 1, clock(n, at)); d.Allowed {
						log = append(log, at)
					}
				}
				continue
			}
			if d, _ := n.c.TakeHash(h, 1, clock(n, at)); d.Allowed {
				log = append(log, at)
			}
		}
		most, end := 0, time.Time{}
		for i, g := range log {
			in := 0
			for j := i; j >= 0 && g.Sub(log[j]) < testWindow; j-- {
				in++
			}
			if in > most {
				most, end = in, g
			}
		}
		t.Logf("%d instances, skew %v: %d granted over %v, at most %d in a span of %v (ending %v after the edge); aggregators %v",
			c.size, skew, len(log), edge.Add(2*testWindow).Sub(start), most, testWindow, end.Sub(edge), aggregators(nodes))
		if bound := events*11/10 + 1; most > bound {
			t.Errorf("%d instances, skew %v: a span of %v held %d grants, over 1.1 × %d + 1 = %d", c.size, skew, testWindow, most, events, bound)
		}
		if len(log) < 2*events {
			t.Errorf("%d instances, skew %v: %d granted over two windows and more at five times the rate, want at least %d", c.size, skew, len(log), 2*events)
		}
	}
}

// A window zone's cluster count moves to a new sub-window every W/7: a
// burst that outlasts a sync just before a sub-window's end, every
// instance reading (re-balancing its share) in the next one while the
// others have granted the key but not yet published it, must not hand an
// instance the shares it left the others, as
// TestReadsDuringABurstKeepTheOthersShares checks within one window: the
// reservations are carried across sub-windows (see
// limiter.SketchSum.WithShares).
func TestWindowZoneBurstIsSplitAcrossSubWindows(t *testing.T) {
	same := func(_ *node, at time.Time) time.Time { return at }
	sub := testWindow / limiter.SketchSubWindows
	orders := [][3]int{{0, 1, 2}, {1, 2, 0}, {2, 1, 0}}
	for _, order := range orders {
		edge := time.Unix(0, (t0.UnixNano()/int64(sub)+3)*int64(sub))
		now := edge.Add(-testIntervals.Read / 8)
		nodes := newWindowNodes(t, 3, 10, same, now.Add(-testIntervals.Read))
		granted := burstThroughEarlyReads(nodes, order, now)
		t.Logf("order %v, a burst %v before a sub-window's end: %d granted of a limit of 10", order, edge.Sub(now), granted)
		if granted < 10 || granted > 10*11/10+1 {
			t.Errorf("order %v: granted %d to a key of limit 10 hit on 3 instances through reads that predate the others' grants, want 10 to %d", order, granted, 10*11/10+1)
		}
	}
}

// sameClock is the clock of instances that agree on the time.
func sameClock(_ *node, at time.Time) time.Time { return at }

// worstSpan returns the most grants of log (their times, in order) within
// any span of w.
func worstSpan(log []time.Time, w time.Duration) int {
	most := 0
	for i := range log {
		in := 0
		for j := i; j >= 0 && log[i].Sub(log[j]) < w; j-- {
			in++
		}
		most = max(most, in)
	}
	return most
}

// burstOnAll sends events requests of the key with hash h to each of the
// nodes at at, appends the grants' times to log, and returns how many were
// granted.
func burstOnAll(nodes []*node, h uint64, events int, at time.Time, log *[]time.Time) int {
	g := 0
	for _, n := range nodes {
		for range events {
			if d, _ := n.c.TakeHash(h, 1, at); d.Allowed {
				*log = append(*log, at)
				g++
			}
		}
	}
	return g
}

// A sliding sketch's sub-window leaves every instance's view at the same
// instant, between two reads: a key hit on all three instances at once,
// then again 10 ms after that burst's sub-window stops counting (before
// the next read), again and again, must get about its quota each time, not
// the freed room once per instance. Each instance takes only its share of
// the counts that left its view since its last read
// (limiter.SketchSum.WithShares). The weighted sketch is hit at the same
// moments. Before, the sliding zone granted [30 90 90 90 90 90].
func TestWindowZoneBurstAtSubWindowExpiryGetsOneQuota(t *testing.T) {
	const events = 30
	for _, window := range []time.Duration{4 * time.Second, time.Minute, 10 * time.Minute} {
		for _, sliding := range []bool{false, true} {
			L := time.Duration((int64(window) + 6) / 7)
			nodes := newWindowNodesOf(t, 3, events, window, sliding, sameClock, t0.Add(-testIntervals.Read))
			h := limiter.HashString("login")
			var log []time.Time
			var bursts []int
			next := t0.Add(300 * time.Millisecond)
			for s := t0; s.Before(t0.Add(6 * window)); s = s.Add(testIntervals.Read) {
				syncAll(s, nodes...)
				if next.Before(s) || !next.Before(s.Add(testIntervals.Read)) {
					continue
				}
				bursts = append(bursts, burstOnAll(nodes, h, events, next, &log))
				// The burst's sub-window stops counting at the end of
				// the seventh after it: hit again 10 ms later.
				sub := next.UnixNano() / int64(L)
				next = time.Unix(0, (sub+8)*int64(L)).Add(10 * time.Millisecond)
			}
			w := worstSpan(log, window)
			t.Logf("window %v sliding %v: bursts of %d on each of 3: granted %v, at most %d in a span of the window", window, sliding, events, bursts, w)
			if len(bursts) < 5 {
				t.Fatalf("window %v sliding %v: only %d bursts", window, sliding, len(bursts))
			}
			if bound := events*11/10 + 1; w > bound {
				t.Errorf("window %v sliding %v: a span of the window held %d grants, over 1.1 × %d + 1 = %d", window, sliding, w, events, bound)
			}
			if bursts[0] < events {
				t.Errorf("window %v sliding %v: the first burst got %d, want the quota %d", window, sliding, bursts[0], events)
			}
		}
	}
}

// A key hit on every instance at once, again and again, each burst once
// the last one's counts have aged out everywhere (the instances sync every
// read interval throughout): no instance counts the key then, and none may
// take it for a key of its own alone (Syncer.sole), deciding without the
// shares: each burst gets about the quota, not one per instance. Before,
// the worst span held 90 grants for events 30, weighted and sliding alike.
func TestWindowZonePeriodicBurstsAfterAgingOutGetOneQuota(t *testing.T) {
	const events = 30
	window := time.Minute
	for _, sliding := range []bool{false, true} {
		period := window + window/7 + 1500*time.Millisecond
		if !sliding {
			period = 2*window + 1500*time.Millisecond
		}
		nodes := newWindowNodesOf(t, 3, events, window, sliding, sameClock, t0.Add(-testIntervals.Read))
		h := limiter.HashString("k")
		var log []time.Time
		var bursts []int
		next := t0.Add(100 * time.Millisecond)
		for s := t0; s.Before(t0.Add(10 * time.Minute)); s = s.Add(testIntervals.Read) {
			syncAll(s, nodes...)
			if !next.After(s) || !next.Before(s.Add(testIntervals.Read)) {
				continue
			}
			bursts = append(bursts, burstOnAll(nodes, h, events, next, &log))
			next = next.Add(period)
		}
		w := worstSpan(log, window)
		t.Logf("sliding %v: bursts of %d on each of 3 every %v: granted %v, at most %d in a span of %v", sliding, events, period, bursts, w, window)
		if bound := events*11/10 + 1; w > bound {
			t.Errorf("sliding %v: a span of %v held %d grants, over 1.1 × %d + 1 = %d", sliding, window, w, events, bound)
		}
		for i, g := range bursts {
			if g < events*9/10 {
				t.Errorf("sliding %v: burst %d, after the last one aged out, got %d, want about the quota %d", sliding, i, g, events)
			}
		}
	}
}

// A long window's shares measure time in coarse units (a sliding sketch's
// sub-window >> 16: 5.6 s at 30 days, longer than the hold of 4 s): the
// hold of what an instance left the others must not round down to
// nothing, or a burst on every instance that outlasts a few reads gets
// back the shares the others used but have not published yet. Before,
// sliding windows of 30 and 365 days granted 122 to 140 of 100.
func TestWindowZoneLongWindowBurstKeepsTheOthersShares(t *testing.T) {
	const events = 100
	for _, size := range []int{3, 5} {
		for _, window := range []time.Duration{time.Minute, 30 * 24 * time.Hour, 365 * 24 * time.Hour} {
			for _, sliding := range []bool{false, true} {
				now := t0.Add(time.Second)
				nodes := newWindowNodesOf(t, size, events, window, sliding, sameClock, now.Add(-testIntervals.Read))
				// A burst on each, then each reads (a quarter read
				// interval apart) and bursts again while one writes
				// per round, then all sync.
				granted := 0
				for _, n := range nodes {
					granted += n.take("burst", events, now)
				}
				at := now
				for round := range len(nodes) {
					for _, n := range nodes {
						at = at.Add(testIntervals.Read / 4)
						n.s.Read(bg, at)
						granted += n.take("burst", events, at)
					}
					nodes[round].s.Write(bg, at)
				}
				for range 3 {
					at = at.Add(testIntervals.Read)
					syncAll(at, nodes...)
					for _, n := range nodes {
						granted += n.take("burst", events, at)
					}
				}
				t.Logf("%d instances, window %v, sliding %v: %d granted of %d", size, window, sliding, granted, events)
				if bound := events*11/10 + 1; granted > bound || granted < events {
					t.Errorf("%d instances, window %v, sliding %v: granted %d, want %d to 1.1 × %d + 1 = %d", size, window, sliding, granted, events, events, bound)
				}
			}
		}
	}
}

// The same with the instances syncing at their own thirds of a second (as
// real instances do, each on its own ticker): a key hit on every instance,
// quiet until its counts have aged out, then hit on every instance at once
// again, and every 350 ms after. An instance whose bitmap of its own
// counts shows the key, and that counts the key again (its new burst) while
// the others' new counts are not read yet, must not take the key for its
// own alone (Syncer.sole): its counts of then no longer count, so the
// others' may have aged out too. Before, the worst span held 40 of 30 (4 s)
// and 50 (1 and 10 minutes): one instance granted the key's whole quota.
func TestWindowZoneBurstAfterQuietWithStaggeredSyncsGetsOneQuota(t *testing.T) {
	const events = 30
	for _, window := range []time.Duration{4 * time.Second, time.Minute, 10 * time.Minute} {
		for _, late := range []time.Duration{50 * time.Millisecond, 300 * time.Millisecond, 700 * time.Millisecond} {
			nodes := newWindowNodesOf(t, 3, events, window, true, sameClock, t0.Add(-time.Second))
			h := limiter.HashString("k")
			L := (int64(window) + 6) / 7
			first := t0.Add(100 * time.Millisecond)
			// The first burst's sub-window stops counting at the end of
			// the seventh after it.
			second := time.Unix(0, (first.UnixNano()/L+8)*L).Add(late)
			type event struct {
				at   time.Time
				node int // -1: a burst on every instance
			}
			var schedule []event
			end := second.Add(3 * time.Second)
			for i := range nodes {
				for s := t0.Add(time.Duration(i) * time.Second / 3); s.Before(end); s = s.Add(time.Second) {
					schedule = append(schedule, event{s, i})
				}
			}
			for _, b := range []time.Time{first, second, second.Add(350 * time.Millisecond), second.Add(700 * time.Millisecond), second.Add(1050 * time.Millisecond)} {
				schedule = append(schedule, event{b, -1})
			}
			slices.SortStableFunc(schedule, func(a, b event) int { return a.at.Compare(b.at) })
			var log []time.Time
			var bursts []int
			for _, e := range schedule {
				if e.node >= 0 {
					nodes[e.node].s.Write(bg, e.at)
					nodes[e.node].s.Read(bg, e.at)
					continue
				}
				bursts = append(bursts, burstOnAll(nodes, h, events, e.at, &log))
			}
			slices.SortFunc(log, time.Time.Compare)
			w := worstSpan(log, window)
			t.Logf("window %v: a burst on all 3, then %v after its sub-window stopped counting and every 350 ms: granted %v, at most %d in a span", window, late, bursts, w)
			if bound := events*11/10 + 1; w > bound {
				t.Errorf("window %v, %v late: a span held %d grants, over 1.1 × %d + 1 = %d", window, late, w, events, bound)
			}
			if bursts[1] == 0 {
				t.Errorf("window %v, %v late: the burst after the quiet spell got nothing", window, late)
			}
		}
	}
}
