package storage

import (
	"fmt"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"

	"github.com/floodgate-rl/floodgate/limiter"
)

// newSplitNodes returns n nodes of st, bursts split, that have published
// and read each other once at now: each knows n − 1 live peers.
func newSplitNodes(t *testing.T, st certmagic.Storage, n int, now time.Time) []*node {
	t.Helper()
	nodes := newNodes(t, st, n)
	for _, n := range nodes {
		n.c.SplitBursts(true, testIntervals.Read)
	}
	syncAll(now, nodes...)
	return nodes
}

// burstAtEverySync has every node sync and then take 10 of key "burst" at
// each of rounds read intervals after now, and returns how many were
// granted.
func burstAtEverySync(nodes []*node, now time.Time, rounds int) int {
	granted := 0
	for round := 1; round <= rounds; round++ {
		at := now.Add(time.Duration(round) * testIntervals.Read)
		syncAll(at, nodes...)
		for _, n := range nodes {
			granted += n.take("burst", 10, at)
		}
	}
	return granted
}

// A key hit on every instance at the same instant gets at most its limit
// (10) cluster-wide, not one limit per instance; the instances' syncs then
// keep it there.
func TestSimultaneousBurstIsSplit(t *testing.T) {
	now := t0.Add(time.Second)
	st, _ := fileStorage(t)
	nodes := newSplitNodes(t, st, 3, now)
	granted := 0
	for _, n := range nodes {
		granted += n.take("burst", 10, now)
	}
	// a syncs before the others publish: the key looks like a's alone,
	// but a counted it too recently to know.
	early := now.Add(testIntervals.Read / 2)
	a := nodes[0]
	a.s.Write(bg, early)
	a.s.Read(bg, early)
	granted += a.take("burst", 10, early)
	granted += burstAtEverySync(nodes, now, 5)
	t.Logf("a key hit on 3 instances at once, then at every sync: %d granted of a limit of 10", granted)
	if granted > 10*11/10+1 || granted < 10 {
		t.Fatalf("granted %d of a limit of 10 to a key hit on 3 instances at once, then at 5 syncs: want the limit, hardly more", granted)
	}
	// Denied by its share only, a key is not blocked: the others may
	// still grant it, and its wait is until the next read.
	fresh := nodes[0]
	fresh.take("other", 10, now)
	d := fresh.c.PeekHash(hk, 1, now)
	if _, blocked := fresh.c.blocks.blocked(hk, now.UnixNano()); blocked || !d.Allowed {
		t.Fatalf("a key never requested: %+v, blocked %v", d, blocked)
	}
	if d, _ := fresh.c.TakeHash(limiter.HashString("other"), 1, now); d.Allowed || d.RetryAfter > testIntervals.Read {
		t.Fatalf("past its share: %+v, want denied with a wait of at most the read interval", d)
	}
	if _, blocked := fresh.c.blocks.blocked(limiter.HashString("other"), now.UnixNano()); blocked {
		t.Fatal("a key denied by this instance's share alone was blocked cluster-wide")
	}
}

// A key that only ever reaches one instance gets its whole limit within
// two write and two read intervals (the intervals are equal here, so the
// reads fall on the ages, see Syncer.sole): its first requests are held to the
// instance's share, and a read that finds it counted here long enough ago
// and nowhere else leaves it all.
func TestSingleInstanceKeyGetsItsWholeLimitAfterTwoSyncs(t *testing.T) {
	now := t0.Add(time.Second)
	st, _ := fileStorage(t)
	nodes := newSplitNodes(t, st, 3, now)
	a := nodes[0]
	first := a.take("sticky", 10, now)
	got, rounds := first, 0
	for got < 10 && rounds < 4 {
		rounds++
		at := now.Add(time.Duration(rounds) * testIntervals.Read)
		syncAll(at, nodes...)
		got += a.take("sticky", 10, at)
	}
	t.Logf("one instance: %d granted at once, all 10 after %d syncs", first, rounds)
	if first < 1 || got != 10 || rounds > 4 {
		t.Fatalf("granted %d at once and %d after %d syncs, want the whole limit of 10", first, got, rounds)
	}
	if a.take("sticky", 1, now.Add(time.Duration(rounds)*testIntervals.Read)) != 0 {
		t.Fatal("granted more than the limit")
	}
}

// A fresh key is held to its share even where some of its cells are used
// by this instance's other keys alone: a key is let off its share only
// when all of its cells are this instance's alone, since a decision passes
// on any row that fits. (A fresh key whose every cell is used by this
// instance's keys alone is still let off: with 30 keys per instance in 4
// rows of 256 cells, about one key in 10,000.)
func TestFreshKeyBesideOwnKeysIsSplit(t *testing.T) {
	now := t0.Add(time.Second)
	st, _ := fileStorage(t)
	nodes := newSplitNodes(t, st, 2, now)
	for i, n := range nodes {
		for k := range 30 {
			n.take(fmt.Sprintf("own-%d-%d", i, k), 1, now)
		}
	}
	at := now
	for range 4 {
		at = at.Add(testIntervals.Read)
		syncAll(at, nodes...)
	}
	worst, least := 0, 10
	for k := range 30 {
		key := fmt.Sprint("fresh-", k)
		granted := 0
		for _, n := range nodes {
			granted += n.take(key, 10, at)
		}
		worst, least = max(worst, granted), min(least, granted)
	}
	t.Logf("30 fresh keys, 10 requests each on 2 instances at once: %d to %d granted of a limit of 10", least, worst)
	if worst > 10*11/10+1 {
		t.Fatalf("a fresh key hit on 2 instances at once got %d of a limit of 10", worst)
	}
	// Each instance's share of what is left, less what the other keys
	// count in the fresh key's cells: nearly the limit, not nothing.
	if least < 8 {
		t.Fatalf("a fresh key hit on 2 instances at once got %d of a limit of 10: the shares left it next to nothing", least)
	}
}

// A burst that outlasts a sync: every instance reads (re-balancing its
// share) while the others have granted the key but not yet published it,
// in every order of the three, and the key is hit again after each read.
// A re-balance must not hand an instance the shares it left to the others
// and cannot yet see them use: the key still gets at most 1.1× its limit
// (+1) over the rounds, and then the whole cluster denies it.
func TestReadsDuringABurstKeepTheOthersShares(t *testing.T) {
	orders := [][3]int{{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}}
	for _, order := range orders {
		t.Run(fmt.Sprint(order), func(t *testing.T) {
			now := t0.Add(time.Second)
			st, _ := fileStorage(t)
			nodes := newSplitNodes(t, st, 3, now)
			granted := 0
			for _, i := range order {
				granted += nodes[i].take("burst", 10, now)
			}
			// Each instance reads before any other writes: the peers'
			// snapshots it finds predate the burst.
			at := now
			for round := range 3 {
				for _, i := range order {
					at = at.Add(testIntervals.Read / 4)
					nodes[i].s.Read(bg, at)
					granted += nodes[i].take("burst", 10, at)
				}
				// Then one instance publishes, the others not yet.
				nodes[order[round]].s.Write(bg, at)
			}
			for range 3 {
				at = at.Add(testIntervals.Read)
				syncAll(at, nodes...)
				for _, n := range nodes {
					granted += n.take("burst", 10, at)
				}
			}
			t.Logf("order %v: %d granted of a limit of 10", order, granted)
			if granted < 10 || granted > 10*11/10+1 {
				t.Fatalf("order %v: granted %d to a key of limit 10 hit on 3 instances through reads that predate the others' grants, want 10 to %d", order, granted, 10*11/10+1)
			}
		})
	}
}

// An instance that publishes late (a loaded machine, a slow storage)
// grants its share of a burst and is not seen to for longer than the
// shares' hold: the others must not hand its share out again meanwhile.
// A key hit on every instance at once; the last then publishes nothing for
// six write intervals (still live: its last snapshot is younger than
// liveWrites) while the others sync every read interval and the key keeps
// coming to them. The key gets its limit, exactly: every grant here is
// seen by every instance in time, and the late one's shares are not handed
// out twice (that gave it 12 of 10 with three instances, and 11 with four,
// whose others read the aggregate).
func TestALatePublisherKeepsItsShare(t *testing.T) {
	for _, size := range []int{3, AggregateFrom} {
		t.Run(fmt.Sprint(size, " instances"), func(t *testing.T) {
			now := t0.Add(time.Second)
			nodes := newSplitNodes(t, newMemStorage(), size, now)
			others := nodes[:size-1]
			granted := 0
			for _, n := range nodes {
				granted += n.take("burst", 10, now)
			}
			stalled := 8
			at := now
			for range stalled {
				at = at.Add(testIntervals.Read)
				syncAll(at, others...)
				for _, n := range others {
					granted += n.take("burst", 10, at)
				}
			}
			if hold := shareHold(testIntervals); time.Duration(stalled)*testIntervals.Read <= hold {
				t.Fatalf("the last stalls %d read intervals, no longer than the hold %v: the test shows nothing", stalled, hold)
			}
			aggregated := others[0].s.lastRead == aggregateUsed || others[1].s.lastRead == aggregateUsed
			for range 3 {
				at = at.Add(testIntervals.Read)
				syncAll(at, nodes...)
				for _, n := range nodes {
					granted += n.take("burst", 10, at)
				}
			}
			t.Logf("%d instances, the last published %d read intervals late (aggregate read: %v): %d granted of a limit of 10",
				size, stalled, aggregated, granted)
			if aggregated != (size >= AggregateFrom) {
				t.Fatalf("%d instances: an aggregate read %v", size, aggregated)
			}
			if granted != 10 {
				t.Fatalf("granted %d to a key of limit 10 while an instance that granted it published late, want 10", granted)
			}
		})
	}
}

// A peer that stops publishing for good lengthens the others' holds only
// while it still counts as live: once it is not (liveWrites), a key that
// reaches one instance alone gets its whole limit within four syncs again,
// as in a cluster that never had it (TestSingleInstanceKeyGetsItsWholeLimitAfterTwoSyncs).
func TestADeadPeerStopsLengtheningTheHold(t *testing.T) {
	now := t0.Add(time.Second)
	st, _ := fileStorage(t)
	nodes := newSplitNodes(t, st, 3, now)
	a, b := nodes[0], nodes[1] // and c, which is gone from now on
	at := now
	for range liveWrites + 1 {
		at = at.Add(testIntervals.Read)
		syncAll(at, a, b)
	}
	first := a.take("sticky", 10, at)
	got, rounds := first, 0
	for got < 10 && rounds < 8 {
		rounds++
		syncAll(at.Add(time.Duration(rounds)*testIntervals.Read), a, b)
		got += a.take("sticky", 10, at.Add(time.Duration(rounds)*testIntervals.Read))
	}
	t.Logf("c gone for %d write intervals: a key on a alone got %d at once, %d after %d syncs", liveWrites+1, first, got, rounds)
	if got != 10 || rounds > 4 {
		t.Fatalf("c gone: a key on one instance got %d of its limit 10 after %d syncs, want all of it within 4", got, rounds)
	}
}
