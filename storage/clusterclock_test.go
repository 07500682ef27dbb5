package storage

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/limiter"
)

// steppedWall is the wall clock of instance x stepped by step (an NTP
// step, not a slew) at real time at; the others' run on real time. real
// is the real time of x's latest reading: what x's monotonic clock read
// then (its cluster clock's hook), which a time stepped back cannot tell.
type steppedWall struct {
	x        *node
	step     time.Duration
	at, real time.Time
}

// clock gives n's wall clock at real time real (every time x is given
// must come from it).
func (w *steppedWall) clock(n *node, real time.Time) time.Time {
	if n != w.x {
		return real
	}
	w.real = real
	if !real.Before(w.at) {
		return real.Add(w.step)
	}
	return real
}

// install has x's cluster clock read its monotonic clock from w: after x
// has synced on real time (its clock anchored there).
func (w *steppedWall) install() { w.x.c.clock.mono = func(time.Time) time.Time { return w.real } }

// A window zone keeps its bound (1.1 × events + 1 in any span of the
// window, in real time) when an instance's own wall clock is stepped after
// it granted the key: it counts on its cluster clock, which the step does
// not move (clusterClock), so that the cluster grants the key what it
// grants with no step, to the request. Two instances on one clock; b takes
// a burst of 30 requests (15 granted: its share), or a does and the key
// goes to b from the burst on; b's wall clock is stepped before the
// burst's window is out (2 s before, or 200 ms after the burst), then the
// key is sent every 100 ms, to b or to a, until 5 s past the burst's
// window (and 12 s past the step). On the wall clock, b's own counts moved
// with it: stepped forward by Δ they left b's view Δ early, a moved them Δ
// early too (measuring b's clock from its snapshots), and the shares b
// held for a were released Δ early; stepped back they fell in sub-windows
// b's view did not read yet. Measured before (the key on b / on a / burst
// on a, key on b): 38, 45, 42 / 35, 41, 43 / 31, 34, 30 of 30 in a span
// with b stepped 2, 5, 8 s forward on a 10 s window, and 59, 60, 45 / 30,
// 45, 45 / 40, 43, 31 with 15, 30, 59 s on a 1 m window; stepped back, 43
// on a (8 s, 10 s window), 35 on b (burst on a, 5 s), 45 on a (59 s, 1 m).
func TestWindowZoneOwnCountsKeepTheBoundWhenTheClockSteps(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	for _, c := range []struct{ window, step time.Duration }{
		{10 * time.Second, 2 * time.Second}, {10 * time.Second, 5 * time.Second}, {10 * time.Second, 8 * time.Second},
		{10 * time.Second, -2 * time.Second}, {10 * time.Second, -5 * time.Second}, {10 * time.Second, -8 * time.Second},
		{time.Minute, 15 * time.Second}, {time.Minute, 30 * time.Second}, {time.Minute, 59 * time.Second},
		{time.Minute, -15 * time.Second}, {time.Minute, -30 * time.Second}, {time.Minute, -59 * time.Second},
	} {
		for _, sc := range []struct{ burst, key string }{{"b", "b"}, {"b", "a"}, {"a", "b"}} {
			h := limiter.HashString(fmt.Sprint("k", c.window, sc))
			first, got, worst := ownCountsStep(t, c.window, c.step, c.step.Abs(), sc.burst, sc.key, h)
			t.Logf("window %v, b stepped %v: burst on %s got %d, then %s %d; worst span %d (bound %d)", c.window, c.step, sc.burst, first, sc.key, got, worst, bound)
			if worst > bound || first == 0 || got == 0 {
				t.Errorf("window %v, b stepped %v: burst on %s got %d, then %s %d; worst span %d, want at most %d (and some granted in each)", c.window, c.step, sc.burst, first, sc.key, got, worst, bound)
			}
			if f, g, w := ownCountsStep(t, c.window, 0, c.step.Abs(), sc.burst, sc.key, h); f != first || g != got || w != worst {
				t.Errorf("window %v, b stepped %v: burst on %s got %d, then %s %d, worst span %d; unstepped %d, %d, %d", c.window, c.step, sc.burst, first, sc.key, got, worst, f, g, w)
			}
		}
	}
}

// ownCountsStep runs a schedule of TestWindowZoneOwnCountsKeepTheBoundWhenTheClockSteps:
// b's wall clock stepped by step, at the time a step by size would be.
func ownCountsStep(t *testing.T, window, step, size time.Duration, burstOn, keyOn string, h uint64) (first, got, worst int) {
	t.Helper()
	const events = 30
	nodes, _ := aheadNodes(t, 2, events, window, -1, 0, t0.Add(7*testIntervals.Read))
	byName := map[string]*node{"a": nodes[0], "b": nodes[1]}
	now := t0.Add(8 * testIntervals.Read)
	burst := now.Add(500 * time.Millisecond)
	w := &steppedWall{x: nodes[1], step: step, at: burst.Add(max(200*time.Millisecond, window-size-2*time.Second))}
	w.install()
	var log []time.Time
	for x := byName[burstOn]; first < events; first++ {
		if d, _ := x.c.TakeHash(h, 1, w.clock(x, burst)); !d.Allowed {
			break
		}
		log = append(log, burst)
	}
	next := now.Add(testIntervals.Read)
	until := burst.Add(window + 5*time.Second)
	if end := w.at.Add(12 * time.Second); end.After(until) {
		until = end
	}
	got = sendEvery(nodes, w.clock, byName[keyOn], h, burst.Add(100*time.Millisecond), until, 100*time.Millisecond, &next, &log)
	return first, got, worstSpan(log, window)
}

// The cluster clock reads a time given twice, or a time it gave, the same;
// it never goes back for a later time, whatever the wall clock does
// within the limit (stepped back and forth); a time taken before the last
// re-anchor is read from that anchor, not taken for a step back. On the
// monotonic clock of time.Now, read by goroutines at once, each one's
// times come out in order and the same when given again.
func TestClusterClockIsIdempotentAndNeverGoesBack(t *testing.T) {
	var k clusterClock
	var off time.Duration // the wall clock less real time
	k.mono = func(wall time.Time) time.Time { return wall.Add(-off) }
	var last time.Time
	// The wall clock against real time: stepped +20 s, -50 s, +45 s, all
	// within the 60 s limit of the clock.
	offset := func(i int) time.Duration {
		switch {
		case i < 100:
			return 0
		case i < 200:
			return 20 * time.Second
		case i < 300:
			return -30 * time.Second
		default:
			return 15 * time.Second
		}
	}
	for i := range 400 {
		real := t0.Add(time.Duration(i) * 100 * time.Millisecond)
		off = offset(i)
		wall := real.Add(off)
		got := k.at(wall)
		if again := k.at(got); !again.Equal(got) {
			t.Fatalf("reading %d (wall %v off): %v converted again is %v", i, offset(i), got, again)
		}
		if again := k.at(wall); !again.Equal(got) {
			t.Fatalf("reading %d (wall %v off): given twice, %v then %v", i, offset(i), got, again)
		}
		if !got.Equal(real) {
			t.Fatalf("reading %d (wall %v off): %v, want the real time %v (the clock anchored on it, never stepped)", i, offset(i), got, real)
		}
		if got.Before(last) {
			t.Fatalf("reading %d (wall %v off): %v, before the last %v", i, offset(i), got, last)
		}
		last = got
	}
	if a := k.anchor.Load(); a.steps != 0 {
		t.Errorf("re-anchored %d times within the limit", a.steps)
	}

	// time.Now's monotonic readings, on several goroutines at once.
	var m clusterClock
	var wg sync.WaitGroup
	errs := make(chan string, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var last time.Time
			for range 2000 {
				got := m.at(time.Now())
				if again := m.at(got); !again.Equal(got) {
					errs <- fmt.Sprintf("%v converted again is %v", got, again)
					return
				}
				if got.Before(last) {
					errs <- fmt.Sprintf("%v after %v on one goroutine", got, last)
					return
				}
				last = got
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// A wall clock that comes apart from the cluster clock by more than the
// limit (clockStepLimit: beyond it the peers refuse the instance's
// snapshots) re-anchors the cluster clock on it at once: a step, logged
// at WARN at the next read, once for the Cluster (two syncers overlap in a
// reload), with the step. Within the limit nothing steps; a time taken
// before the re-anchor (another goroutine's) does not step it back.
func TestClusterClockReanchorsBeyondTheLimit(t *testing.T) {
	st := newMemStorage()
	core, logs := observer.New(zapcore.WarnLevel)
	x := newJoiner(t, st, "b", 30, 10*time.Second, zap.New(core))
	other := NewSyncer(x.c, st, "b", testIntervals, zap.New(core)) // a reload's
	other.proc = x.s.proc
	var real time.Time
	var off time.Duration
	x.c.clock.mono = func(time.Time) time.Time { return real }
	at := func(r time.Time) time.Time { real = r; return x.c.clock.at(r.Add(off)) }
	read := func(r time.Time) {
		real = r
		x.s.Read(bg, r.Add(off))
		other.Read(bg, r.Add(off))
	}
	read(t0)
	for _, off = range []time.Duration{clockStepLimit, -clockStepLimit} { // within: nothing steps
		if got := at(t0.Add(time.Second)); !got.Equal(t0.Add(time.Second)) {
			t.Errorf("wall clock %v off: cluster clock at %v, want %v", off, got, t0.Add(time.Second))
		}
		read(t0.Add(time.Second))
	}
	if n := logs.Len(); n != 0 {
		t.Errorf("%d warnings within the limit: %v", n, logs.All())
	}
	before := t0.Add(2 * time.Second) // a reading taken before the step, converted after it
	off = 90 * time.Second
	wall := t0.Add(3 * time.Second).Add(off)
	if got := at(t0.Add(3 * time.Second)); !got.Equal(wall) {
		t.Errorf("wall clock %v off: cluster clock at %v, want it re-anchored on the wall clock, %v", off, got, wall)
	}
	real = before
	if got := x.c.clock.at(before); !got.Equal(wall.Add(-time.Second)) {
		t.Errorf("a reading taken before the re-anchor: %v, want %v (read from the new anchor, not a step back)", got, wall.Add(-time.Second))
	}
	if a := x.c.clock.anchor.Load(); a.steps != 1 || time.Duration(a.stepped) != 90*time.Second {
		t.Errorf("anchor after a 90 s step: %d steps, stepped %v; want 1, 90s", a.steps, time.Duration(a.stepped))
	}
	read(t0.Add(4 * time.Second))
	read(t0.Add(5 * time.Second))
	warned := logs.FilterMessageSnippet("stepped to the wall clock").All()
	if len(warned) != 1 || logs.Len() != 1 {
		t.Fatalf("want one warning of the step, got %d of %d: %v", len(warned), logs.Len(), logs.All())
	}
	if f := warned[0].ContextMap(); f["step"] != 90*time.Second || f["zone"] != "w" || f["steps"] != int64(1) {
		t.Errorf("the warning says %v; want the zone, the 90 s step and 1 step so far", f)
	}
}

// Behind the wall clock (the host's clock stepped forward, or a suspend),
// the cluster clock runs no further than its peers find its snapshots
// before they delete them as a dead instance's: purge_age less a write and
// a read interval, where that is less than clockStepLimit. Ahead, the
// limit stays clockStepLimit.
func TestClusterClockRunsBehindNoFurtherThanPurgeAgeLets(t *testing.T) {
	iv := Intervals{Read: time.Second, Write: time.Second, PurgeAge: 30 * time.Second}
	for _, c := range []struct {
		off   time.Duration // the wall clock's step
		steps int64
	}{{27 * time.Second, 0}, {29 * time.Second, 1}, {-59 * time.Second, 0}, {-61 * time.Second, 1}} {
		x := newJoiner(t, newMemStorage(), "b", 30, 10*time.Second, zap.NewNop())
		NewSyncer(x.c, newMemStorage(), "b", iv, zap.NewNop())
		var real time.Time
		x.c.clock.mono = func(time.Time) time.Time { return real }
		real = t0
		x.c.clock.at(t0)
		real = t0.Add(time.Second)
		x.c.clock.at(real.Add(c.off))
		if a := x.c.clock.anchor.Load(); a.steps != c.steps {
			t.Errorf("purge_age %v, wall clock stepped %v: %d re-anchors, want %d", iv.PurgeAge, c.off, a.steps, c.steps)
		}
	}
}

// Two readings past the limit at once re-anchor the clock once: the one
// that loaded the anchor before the other re-anchored it reads from the
// new anchor. The interleaving is forced through the test's monotonic
// clock, which a conversion reads between loading the anchor and
// re-anchoring it: there the other reading converts first.
func TestClusterClockReanchoredByTwoReadingsAtOnceStepsOnce(t *testing.T) {
	var k clusterClock
	var off time.Duration
	var other time.Time // the other reading's conversion, made inside the first's
	k.mono = func(wall time.Time) time.Time {
		if off != 0 && other.IsZero() {
			other = time.Unix(0, 1)
			other = k.at(wall.Add(time.Millisecond))
		}
		return wall.Add(-off)
	}
	k.at(t0)
	off = 90 * time.Second
	wall := t0.Add(time.Second).Add(off)
	got := k.at(wall)
	a := k.anchor.Load()
	t.Logf("after a %v step: %v and %v (wall clock %v), %d re-anchors", off, got, other, wall, a.steps)
	if !got.Equal(wall) || !other.Equal(wall.Add(time.Millisecond)) || a.steps != 1 {
		t.Errorf("after a %v step: readings %v and %v, want %v and %v; %d re-anchors, want 1", off, got, other, wall, wall.Add(time.Millisecond), a.steps)
	}
}

// BenchmarkClusterClockAt is what taking a decision's time on the cluster
// clock adds to it (BenchmarkDecision's spread on a shared machine is
// wider than this).
func BenchmarkClusterClockAt(b *testing.B) {
	var k clusterClock
	now := time.Now()
	k.at(now)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			k.at(now)
		}
	})
}
