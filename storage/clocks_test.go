package storage

import (
	"fmt"
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
	st := newMemStorage()
	var nodes []*node
	for i := range n {
		nodes = append(nodes, newJoiner(t, st, string(rune('a'+i)), events, window, zap.NewNop()))
	}
	clock := func(x *node, at time.Time) time.Time {
		if ahead >= 0 && x == nodes[ahead] {
			return at.Add(skew)
		}
		return at
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
		got := 0
		next := now.Add(testIntervals.Read)
		for at := now.Add(c.gap); at.Before(now.Add(c.gap + 10*time.Second)); at = at.Add(100 * time.Millisecond) {
			for !at.Before(next) {
				syncAt(nodes, nodes, clock, next)
				next = next.Add(testIntervals.Read)
			}
			if d, _ := b.c.TakeHash(h, 1, clock(b, at)); d.Allowed {
				log = append(log, at)
				got++
			}
		}
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
