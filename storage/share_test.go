package storage

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

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
			granted := burstThroughEarlyReads(nodes, order, now)
			t.Logf("order %v: %d granted of a limit of 10", order, granted)
			if granted < 10 || granted > 10*11/10+1 {
				t.Fatalf("order %v: granted %d to a key of limit 10 hit on 3 instances through reads that predate the others' grants, want 10 to %d", order, granted, 10*11/10+1)
			}
		})
	}
}

// burstThroughEarlyReads has key "burst" hit with 10 requests on each of
// nodes at now, in order, then every node read (re-balancing its share)
// and take 10 more, a quarter of a read interval apart, three times over,
// before the others publish (one more publishes after each round), then
// every node sync and take 10 three times; it returns how many were
// granted.
func burstThroughEarlyReads(nodes []*node, order [3]int, now time.Time) int {
	granted := 0
	for _, i := range order {
		granted += nodes[i].take("burst", 10, now)
	}
	// Each instance reads before any other writes: the peers' snapshots
	// it finds predate the burst.
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
	return granted
}

// lateBurst has a key hit on every instance of size at once, at t0 + 20 s
// (far from a window's edge, after two syncs that show every instance
// publishing), and then the last instance, whose clock is off by skew,
// publish nothing for stalled read intervals while the others
// sync every read interval and the key keeps coming to them; then every
// instance syncs on time for three read intervals more. It returns how
// many were granted.
func lateBurst(t *testing.T, size, stalled int, skew time.Duration) int {
	t.Helper()
	nodes, clock, now := skewedNodes(t, size, skew, t0.Add(18*time.Second), 2)
	others := nodes[:size-1]
	granted := 0
	for _, n := range nodes {
		granted += n.take("burst", 10, clock(n, now))
	}
	if hold := shareHold(testIntervals); time.Duration(stalled)*testIntervals.Read <= hold {
		t.Fatalf("the last stalls %d read intervals, no longer than the hold %v: the test shows nothing", stalled, hold)
	}
	at := now
	for range stalled {
		at = at.Add(testIntervals.Read)
		syncAll(at, others...)
		for _, n := range others {
			granted += n.take("burst", 10, at)
		}
	}
	return granted + takeAfterSyncs(nodes, clock, at, 3)
}

// takeAfterSyncs has every node sync at each of rounds read intervals
// after at, each on its own clock, and take 10 of key "burst" after each
// sync, and returns how many were granted.
func takeAfterSyncs(nodes []*node, clock func(*node, time.Time) time.Time, at time.Time, rounds int) int {
	granted := 0
	for range rounds {
		at = at.Add(testIntervals.Read)
		syncAt(nodes, nodes, clock, at)
		for _, n := range nodes {
			granted += n.take("burst", 10, clock(n, at))
		}
	}
	return granted
}

// burstOnEvery has key "burst" hit with 10 requests on every node at once
// at at, and again after each of three syncs, and returns how many were
// granted and how many instances each node then counts live.
func burstOnEvery(nodes []*node, clock func(*node, time.Time) time.Time, at time.Time) (granted int, live []int64) {
	for _, n := range nodes {
		granted += n.take("burst", 10, clock(n, at))
	}
	granted += takeAfterSyncs(nodes, clock, at, 3)
	for _, n := range nodes {
		live = append(live, n.c.live.Load())
	}
	return granted, live
}

// skewedNodes returns size nodes of a fresh storage, bursts split, the
// last one's clock off by skew (clock gives a node's time at a real time),
// synced at now and then every read interval for warm read intervals, and
// the real time of their last sync.
func skewedNodes(t *testing.T, size int, skew time.Duration, now time.Time, warm int) ([]*node, func(*node, time.Time) time.Time, time.Time) {
	t.Helper()
	nodes := newNodes(t, newMemStorage(), size)
	last := nodes[size-1]
	clock := func(n *node, at time.Time) time.Time {
		if n == last {
			return at.Add(skew)
		}
		return at
	}
	for _, n := range nodes {
		n.c.SplitBursts(true, testIntervals.Read)
	}
	at := now
	syncAt(nodes, nodes, clock, at)
	for range warm {
		at = at.Add(testIntervals.Read)
		syncAt(nodes, nodes, clock, at)
	}
	return nodes, clock, at
}

// syncAt has every node of syncing write and then read at real time at,
// each on its own clock.
func syncAt(nodes, syncing []*node, clock func(*node, time.Time) time.Time, at time.Time) {
	for _, n := range syncing {
		n.s.Write(bg, clock(n, at))
	}
	for _, n := range syncing {
		n.s.Read(bg, clock(n, at))
	}
}

// soleRounds hits key on nodes[0] alone with 10 requests at real time at
// and then at every read interval while the nodes of syncing sync, and
// returns what it got at once and how many syncs it took to get all 10
// (most, if it never did).
func soleRounds(nodes, syncing []*node, clock func(*node, time.Time) time.Time, at time.Time, key string, most int) (first, rounds int) {
	a := nodes[0]
	first = a.take(key, 10, at)
	got := first
	for got < 10 && rounds < most {
		rounds++
		at = at.Add(testIntervals.Read)
		syncAt(nodes, syncing, clock, at)
		got += a.take(key, 10, at)
	}
	return first, rounds
}

// An instance that publishes late (a loaded machine, a slow storage)
// grants its share of a burst and is not seen to for longer than the
// shares' hold: the others must not hand its share out again meanwhile.
// The last instance stalls for eight read intervals (still live: its last
// snapshot is younger than liveWrites), its clock on time, ahead or behind
// (lateness is measured on the reader's clock). The key gets its limit,
// exactly: every grant here is seen by every instance in time, and the
// late one's shares are not handed out twice (that gave it 12 of 10 with
// three instances, and 11 with four, whose others read the aggregate; a
// lateness measured from the peer's clock gave that again with its clock
// 4 s ahead).
func TestALatePublisherKeepsItsShare(t *testing.T) {
	for _, size := range []int{3, AggregateFrom} {
		for _, skew := range []time.Duration{0, 5 * time.Second, -5 * time.Second} {
			t.Run(fmt.Sprintf("%d instances, clock %v", size, skew), func(t *testing.T) {
				granted := lateBurst(t, size, 8, skew)
				t.Logf("%d instances, the last published 8 read intervals late, its clock off by %v: %d granted of a limit of 10", size, skew, granted)
				if granted != 10 {
					t.Fatalf("granted %d to a key of limit 10 while an instance that granted it published late, want 10", granted)
				}
			})
		}
	}
}

// Nothing late, a key that only reaches one instance gets its whole limit
// within four syncs (TestSingleInstanceKeyGetsItsWholeLimitAfterTwoSyncs)
// whatever a peer's clock says (within MaxClockSkew), after a peer died
// (it counts as live, and late, for liveWrites write intervals), and
// through an aggregate. A lateness measured from the peer's clock, or
// one that held such keys too, took up to 18 syncs.
func TestLatenessCostsKeysOfOneInstanceNothing(t *testing.T) {
	for _, skew := range []time.Duration{0, 9 * time.Second, -2 * time.Second, -9 * time.Second} {
		t.Run(fmt.Sprint("clock ", skew), func(t *testing.T) {
			nodes, clock, at := skewedNodes(t, 3, skew, t0.Add(10*time.Second), 12)
			first, rounds := soleRounds(nodes, nodes, clock, at, "sticky", 30)
			t.Logf("c's clock off by %v: a key on a alone got %d at once, all 10 after %d syncs", skew, first, rounds)
			if rounds > 4 {
				t.Fatalf("c's clock off by %v: a key on a alone got its whole limit after %d syncs, want at most 4", skew, rounds)
			}
		})
	}
	for _, dead := range []int{0, 1, 5, 8} {
		t.Run(fmt.Sprint("peer dead for ", dead), func(t *testing.T) {
			nodes, clock, at := skewedNodes(t, 3, 0, t0.Add(10*time.Second), 8)
			for range dead {
				at = at.Add(testIntervals.Read)
				syncAll(at, nodes[:2]...)
			}
			first, rounds := soleRounds(nodes, nodes[:2], clock, at, "sticky", 30)
			t.Logf("c dead for %d read intervals: a key on a alone got %d at once, all 10 after %d syncs", dead, first, rounds)
			if rounds > 4 {
				t.Fatalf("c dead for %d read intervals: a key on a alone got its whole limit after %d syncs, want at most 4", dead, rounds)
			}
		})
	}
}

// Through an aggregate, with nobody late, the shares' hold is not
// lengthened: the members' snapshots the aggregate lists are older than a
// direct read's by up to the aggregator's read interval, which the hold
// already allows for. Four instances write at each second, the readers
// read 0.8 s later and the aggregator 0.9 s later, so a reader always
// finds the aggregate of the previous second's snapshots; a member's
// snapshot age then is 1.8 s, which a lateness measured from the
// snapshots' ages took for 0.8 s late.
func TestAnAggregateOnTimeIsNotLate(t *testing.T) {
	now := t0.Add(10 * time.Second)
	nodes := newSplitNodes(t, newMemStorage(), AggregateFrom, now)
	a := nodes[0]
	at := now
	for range 10 {
		at = at.Add(testIntervals.Read)
		for _, n := range nodes {
			n.s.Write(bg, at)
		}
		for _, n := range nodes[1:] {
			n.s.Read(bg, at.Add(800*time.Millisecond))
		}
		a.s.Read(bg, at.Add(900*time.Millisecond))
	}
	d := nodes[3]
	if !a.s.agg.aggregating || d.s.lastRead != aggregateUsed {
		t.Fatalf("a aggregating %v, d's last read %v: want the aggregate read", a.s.agg.aggregating, d.s.lastRead)
	}
	for name, p := range d.s.sighted {
		late := time.Duration(at.Add(800*time.Millisecond).UnixNano()-p.at) - (testIntervals.Write + 2*testIntervals.Read)
		t.Logf("d found %s's newest snapshot %v before its last read", name, time.Duration(at.Add(800*time.Millisecond).UnixNano()-p.at))
		if late > 0 {
			t.Fatalf("d takes %s, on time, for %v late", name, late)
		}
	}
	if len(d.s.sighted) != AggregateFrom-1 {
		t.Fatalf("d found %d peers live, want %d", len(d.s.sighted), AggregateFrom-1)
	}
}

// A peer whose clock runs behind by more than liveWrites write intervals
// (within MaxClockSkew) counts as live once it has been seen to publish:
// a key hit on every instance at once gets its limit, not the share of
// two instances on the others (13 of 10, when its snapshots' ages made it
// dead).
func TestAPeerBehindCountsAsLiveOnceSeenPublishing(t *testing.T) {
	for _, size := range []int{3, AggregateFrom} {
		t.Run(fmt.Sprint(size, " instances"), func(t *testing.T) {
			nodes, clock, at := skewedNodes(t, size, -15*time.Second, t0.Add(10*time.Second), 10)
			granted, live := burstOnEvery(nodes, clock, at)
			t.Logf("%d instances, the last one's clock 15 s behind: %d granted of a limit of 10; live as each sees it: %v", size, granted, live)
			if granted != 10 {
				t.Fatalf("granted %d of a limit of 10 to a key hit on every instance at once, want 10 (live as each sees it: %v)", granted, live)
			}
		})
	}
}

// A peer whose clock is set back (NTP, or a restart under the same name on
// a machine whose clock is behind) publishes snapshots older than the last
// one found of it: they show it publishing all the same. Its clock 30 s
// ahead for six syncs, then right, and 12 syncs later a key hit on every
// instance at once gets its limit (13 of 10 when only newer snapshots
// counted: it looked dead).
func TestAPeerWhoseClockIsSetBackStaysLive(t *testing.T) {
	for _, size := range []int{3, AggregateFrom} {
		t.Run(fmt.Sprint(size, " instances"), func(t *testing.T) {
			skew := 30 * time.Second
			nodes := newNodes(t, newMemStorage(), size)
			for _, n := range nodes {
				n.c.SplitBursts(true, testIntervals.Read)
			}
			last := nodes[size-1]
			clock := func(n *node, at time.Time) time.Time {
				if n == last {
					return at.Add(skew)
				}
				return at
			}
			at := t0.Add(2 * time.Second) // every clock within one window
			for range 6 {
				at = at.Add(testIntervals.Read)
				syncAt(nodes, nodes, clock, at)
			}
			skew = 0
			for range 12 {
				at = at.Add(testIntervals.Read)
				syncAt(nodes, nodes, clock, at)
			}
			granted, live := burstOnEvery(nodes, clock, at)
			t.Logf("%d instances, the last one's clock set back 30 s: %d granted of a limit of 10; live as each sees it: %v", size, granted, live)
			if granted != 10 {
				t.Fatalf("granted %d of a limit of 10 after a peer's clock was set back, want 10 (live as each sees it: %v)", granted, live)
			}
		})
	}
}

// One read that misses a late peer's snapshot (a load that failed, an
// aggregate without it) must not make that snapshot look new at the next:
// the last instance stalls eight read intervals, its snapshot missing for
// the others' third read, and the key still gets its limit (12 of 10 when
// a read that missed a peer forgot it).
func TestAReadThatMissesALatePeerKeepsItsLateness(t *testing.T) {
	for _, size := range []int{3, AggregateFrom} {
		t.Run(fmt.Sprint(size, " instances"), func(t *testing.T) {
			st := newMemStorage()
			now := t0.Add(20 * time.Second)
			nodes := newSplitNodes(t, st, size, now.Add(-2*time.Second))
			syncAll(now.Add(-time.Second), nodes...)
			syncAll(now, nodes...)
			last, others := nodes[size-1], nodes[:size-1]
			key := Key("z/1", last.s.instance)
			granted := 0
			for _, n := range nodes {
				granted += n.take("burst", 10, now)
			}
			at := now
			for i := 1; i <= 8; i++ {
				at = at.Add(testIntervals.Read)
				for _, n := range others {
					n.s.Write(bg, at)
				}
				st.mu.Lock()
				saved, ok := st.data[key]
				if i == 3 {
					delete(st.data, key)
				}
				st.mu.Unlock()
				if !ok {
					t.Fatalf("no snapshot of %s at %q", last.s.instance, key)
				}
				for _, n := range others {
					n.s.Read(bg, at)
				}
				st.mu.Lock()
				st.data[key] = saved
				st.mu.Unlock()
				for _, n := range others {
					granted += n.take("burst", 10, at)
				}
			}
			for range 3 {
				at = at.Add(testIntervals.Read)
				syncAll(at, nodes...)
				for _, n := range nodes {
					granted += n.take("burst", 10, at)
				}
			}
			t.Logf("%d instances, the last stalled 8 read intervals and missing from the others' third read: %d granted of a limit of 10", size, granted)
			if granted != 10 {
				t.Fatalf("granted %d of a limit of 10, want 10", granted)
			}
		})
	}
}

// newJoiner returns a node of a window zone ("w", events per window,
// bursts split) named name that syncs through st, not synced yet.
func newJoiner(t *testing.T, st certmagic.Storage, name string, events int64, window time.Duration, log *zap.Logger) *node {
	t.Helper()
	c, err := newCluster(Shape{Zone: "w", Window: window, Width: 256, Sliding: true}, events)
	if err != nil {
		t.Fatal(err)
	}
	j := &node{c: c}
	j.s = NewSyncer(c, st, name, testIntervals, log)
	j.s.proc = newProcess()
	c.SplitBursts(true, testIntervals.Read)
	return j
}

// Instances that join a window zone's cluster between two of the others'
// reads are not counted by them yet (Syncer.shareRank): the others' shares
// cover all a key has left, and the room a sub-window frees, so a joiner
// grants only its allowance (limiter.UncountedAllowance, A = events/10 + 1,
// at most its share were it counted). A burst on every instance just after
// a burst's sub-window left the view gets one quota (the room that frees
// is the others'), and a fresh key hit on every instance at once gets at
// most N + k × A with k joiners: 1.1 × N + 1 with one. Each joiner grants
// the fresh key min(A, its share) at once. Before the allowance, a joiner
// granted nothing at all until counted (every key of the zone denied for
// write + 2 × read interval, about 20 s by default); before that, each
// took its share besides the others' (37 in a span with one joiner, 51
// with three, 72 with six). A joiner takes its share once the others have
// counted it and published since.
func TestWindowZoneJoinersGrantTheirAllowanceUntilCounted(t *testing.T) {
	const events = 30
	window := 4 * time.Second
	allow := int(limiter.UncountedAllowance(events))
	for _, joining := range []int{1, 3, 6} {
		nodes := newWindowNodesOf(t, 3, events, window, true, sameClock, t0)
		st := nodes[0].s.st
		h := limiter.HashString("k")
		log, at := expiryScene(nodes, h, events, window)
		all := nodes
		for i := range joining {
			j := newJoiner(t, st, fmt.Sprint("joiner-", i), events, window, nodes[0].s.log)
			// It publishes and reads 200 ms after the others' last read:
			// it finds them, they have not found it.
			j.s.Write(bg, at.Add(-110*time.Millisecond))
			j.s.Read(bg, at.Add(-110*time.Millisecond))
			all = append(all, j)
		}
		var per, perFresh []int
		var freshLog []time.Time
		fresh := limiter.HashString("fresh")
		for _, n := range all {
			per = append(per, burstOnAll([]*node{n}, h, events, at, &log))
			perFresh = append(perFresh, burstOnAll([]*node{n}, fresh, events, at, &freshLog))
		}
		slices.SortFunc(log, time.Time.Compare)
		w, wf := worstSpan(log, window), worstSpan(freshLog, window)
		t.Logf("%d joining between reads (live as each sees it: %d and %d): the burst after the expiry got %v, at most %d in a span; a fresh key's burst got %v, %d in all (allowance %d)",
			joining, nodes[0].c.Live(), all[len(all)-1].c.Live(), per, w, perFresh, wf, allow)
		if bound := events*11/10 + 1; w > bound {
			t.Errorf("%d joining: a span held %d grants, over 1.1 × %d + 1 = %d", joining, w, events, bound)
		}
		bound := events + joining*allow
		if joining == 1 && bound != events*11/10+1 {
			t.Fatalf("N + A = %d, not 1.1 × N + 1 = %d", bound, events*11/10+1)
		}
		if wf > bound {
			t.Errorf("%d joining: a fresh key got %d in a span, over N + %d × A = %d", joining, wf, joining, bound)
		}
		for i, n := range all[len(nodes):] {
			if want := min(allow, events/int(n.c.Live())); perFresh[len(nodes)+i] < want {
				t.Errorf("%d joining: joiner %d granted %d of a fresh key at once, want min(A, its share) = %d", joining, i, perFresh[len(nodes)+i], want)
			}
		}
		// Once counted, and what the others granted on their shares of
		// before read here, a joiner takes its share of a fresh key
		// (its reads come on the others' ticks, 200 ms after it joined).
		later := at.Add(joinWait(testIntervals) + testIntervals.Read)
		for s := at.Add(-310 * time.Millisecond).Add(testIntervals.Read); !s.After(later); s = s.Add(testIntervals.Read) {
			syncAll(s, all...)
		}
		j := all[len(all)-1]
		if got := burstOnAll([]*node{j}, limiter.HashString("later"), events, later.Add(time.Millisecond), new([]time.Time)); got < events/len(all) {
			t.Errorf("%d joining: a joiner counted by the others got %d of a fresh key, want its share, %d", joining, got, events/len(all))
		}
	}
}

// An instance the others do not count yet re-balances at each of its
// reads, but its own grants count against its allowance across them: a
// joiner hit with a key's request every 10 ms, reading every 250 ms (and
// writing every write interval) while uncounted, grants the key the
// allowance A once in the window, not A per read. Before the allowance it
// granted nothing.
func TestWindowZoneJoinerReadingOftenGetsItsAllowanceOnce(t *testing.T) {
	const events = 30
	allow := int(limiter.UncountedAllowance(events))
	nodes := newWindowNodesOf(t, 3, events, testWindow, true, sameClock, t0)
	j := newJoiner(t, nodes[0].s.st, "joiner", events, testWindow, nodes[0].s.log)
	start := t0.Add(testIntervals.Read / 2)
	j.s.Write(bg, start)
	counted := start.Add(testIntervals.Write + 2*testIntervals.Read)
	h := limiter.HashString("k")
	var log []time.Time
	reads, next := 0, t0.Add(testIntervals.Read)
	for at := start; at.Before(counted); at = at.Add(10 * time.Millisecond) {
		if !at.Before(next) {
			syncAll(next, nodes...) // the others sync on their ticks
			next = next.Add(testIntervals.Read)
		}
		if at.Sub(start)%(250*time.Millisecond) == 0 {
			if at.Sub(start)%testIntervals.Write == 0 {
				j.s.Write(bg, at)
			}
			j.s.Read(bg, at)
			reads++
		}
		if d, _ := j.c.TakeHash(h, 1, at); d.Allowed {
			log = append(log, at)
		}
	}
	t.Logf("uncounted for %v, %d reads: %d granted (allowance %d), the first %v after its first read", counted.Sub(start), reads, len(log), allow, firstAfter(log, start))
	if len(log) != allow {
		t.Errorf("an uncounted joiner granted a key %d in %v (%d reads), want its allowance %d once", len(log), counted.Sub(start), reads, allow)
	}
}

// firstAfter is how long after start the first of log came, or -1.
func firstAfter(log []time.Time, start time.Time) time.Duration {
	if len(log) == 0 {
		return -1
	}
	return log[0].Sub(start)
}

// A cluster whose instances all start at once (a fresh deploy): each is
// uncounted by the others until they have read it and published since, so
// none takes a share; each grants its allowance, from its first read that
// finds the others on (before it, finding no other, it decides alone), where before every key of the zone was denied on
// every instance for write + 2 × read interval. A request of one key every
// 50 ms on each instance from that read on, for two windows: every
// instance grants it within its first read interval, and a span of the
// window holds at most N + 3 × A (three joining at once).
func TestWindowZoneFreshClusterServesEveryKeyAtOnce(t *testing.T) {
	const events, size = 30, 3
	allow := int(limiter.UncountedAllowance(events))
	window := 4 * time.Second
	st := newMemStorage()
	var nodes []*node
	for i := range size {
		nodes = append(nodes, newJoiner(t, st, string(rune('a'+i)), events, window, zap.NewNop()))
	}
	start := t0
	// Each reads at its start (finding nobody) and publishes first a
	// write interval on, as a Syncer does.
	for _, n := range nodes {
		n.s.Read(bg, start)
	}
	// Before that, each finds no other and decides alone (no shares).
	early := burstOnAll(nodes, limiter.HashString("early"), events, start, new([]time.Time))
	split := start.Add(testIntervals.Write)
	syncAll(split, nodes...)
	for _, n := range nodes {
		if n.c.Live() != size {
			t.Fatalf("at the first read after the first publishes, live %d, want %d", n.c.Live(), size)
		}
	}
	h := limiter.HashString("k")
	var log []time.Time
	firsts := make([]time.Duration, size)
	next := split.Add(testIntervals.Read)
	for at := split; at.Before(split.Add(2 * window)); at = at.Add(50 * time.Millisecond) {
		if !at.Before(next) {
			syncAll(next, nodes...)
			next = next.Add(testIntervals.Read)
		}
		for i, n := range nodes {
			if d, _ := n.c.TakeHash(h, 1, at); d.Allowed {
				log = append(log, at)
				if firsts[i] == 0 {
					firsts[i] = at.Sub(split) + 1 // 1 ns: granted at the split itself
				}
			}
		}
	}
	w := worstSpan(log, window)
	t.Logf("a fresh cluster of %d: a burst of %d on each before any publish got %d; the first grant of each instance %v after the first read that split (+1 ns), %d granted over %v, at most %d in a span of %v (N + 3 × A = %d)",
		size, events, early, firsts, len(log), 2*window, w, window, events+size*allow)
	for i, f := range firsts {
		if f == 0 || f > testIntervals.Read {
			t.Errorf("instance %d: first grant %v after the split, want within a read interval (%v)", i, f, testIntervals.Read)
		}
	}
	if w > events+size*allow {
		t.Errorf("a span of %v held %d grants, over N + 3 × A = %d", window, w, events+size*allow)
	}
	if len(log) < 2*events {
		t.Errorf("%d granted over two windows at 20 requests a second per instance, want at least %d", len(log), 2*events)
	}
}

// A restart is no join when the others surely count it still: an
// instance of a window zone that restores its own last snapshot, written
// at most liveWrites write intervals, less a read interval and
// MaxClockSkew (the old process's clock may be that far off), before,
// takes its share at its first read, as the process before it did. One
// whose snapshot may be older on the others' clocks, as with write
// intervals of a second, and one under a new name, take only their
// allowance until the others count them.
func TestWindowZoneRestartTakesItsShareAtOnce(t *testing.T) {
	const events = 30
	window := time.Minute
	nodes := newWindowNodesOf(t, 3, events, window, true, sameClock, t0)
	long := Intervals{Read: testIntervals.Read, Write: 10 * time.Second, PurgeAge: testIntervals.PurgeAge}
	for _, tc := range []struct {
		name string
		iv   Intervals
		want int
	}{
		{"a", long, events / 3},
		{"a", testIntervals, int(limiter.UncountedAllowance(events))},
		{"new", long, int(limiter.UncountedAllowance(events))},
	} {
		c, err := newCluster(Shape{Zone: "w", Window: window, Width: 256, Sliding: true}, events)
		if err != nil {
			t.Fatal(err)
		}
		n := &node{c: c}
		n.s = NewSyncer(c, nodes[0].s.st, tc.name, tc.iv, nodes[0].s.log)
		n.s.proc = newProcess()
		c.SplitBursts(true, tc.iv.Read)
		at := t0.Add(testIntervals.Read / 2)
		if err := n.s.Restore(bg, at); err != nil {
			t.Fatal(err)
		}
		n.s.Read(bg, at)
		got := burstOnAll([]*node{n}, limiter.HashString("fresh"), events, at, new([]time.Time))
		t.Logf("%q (write interval %v) started %v after the last sync: %d of a fresh key's %d at once (live %d)", tc.name, tc.iv.Write, at.Sub(t0), got, events, c.Live())
		if got != tc.want {
			t.Errorf("%q with a write interval of %v got %d of a fresh key, want %d", tc.name, tc.iv.Write, got, tc.want)
		}
	}
}

// An instance whose writes fail for longer than the others wait for its
// snapshots keeps reading and serving: the others drop it from their live
// count and share a key among one fewer, so it takes only its allowance,
// and takes its share again once its publishes resume and are counted.
func TestWindowInstanceWhoseWritesFailTakesOnlyItsAllowance(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	for _, size := range []int{2, 3, 4} {
		st := newMemStorage()
		down := &failingStorage{Storage: st, writesOnly: true}
		var nodes []*node
		for i := range size {
			var s certmagic.Storage = st
			if i == size-1 {
				s = down
			}
			nodes = append(nodes, newJoiner(t, s, string(rune('a'+i)), events, time.Minute, zap.NewNop()))
		}
		now := t0
		for range 6 {
			syncAll(now, nodes...)
			now = now.Add(testIntervals.Read)
		}
		down.down.Store(true)
		for range 15 {
			syncAll(now, nodes...)
			now = now.Add(testIntervals.Read)
		}
		if l := nodes[0].c.Live(); l != size-1 {
			t.Fatalf("%d instances: the first counts %d live, want %d (the failing one dropped)", size, l, size-1)
		}
		var log []time.Time
		var per []int
		for _, n := range nodes {
			per = append(per, burstOnAll([]*node{n}, limiter.HashString("fresh"), events, now.Add(-testIntervals.Read/2), &log))
		}
		if w := worstSpan(log, time.Minute); w > bound || per[size-1] > int(limiter.UncountedAllowance(events)) {
			t.Errorf("%d instances, the last one's writes failing: grants %v, %d in a span; want at most %d, the failing one its allowance %d", size, per, w, bound, limiter.UncountedAllowance(events))
		}
		// Its writes work again: after a write and two reads it is
		// counted, and takes its share of another key.
		down.down.Store(false)
		for range 4 {
			syncAll(now, nodes...)
			now = now.Add(testIntervals.Read)
		}
		if got, want := burstOnAll(nodes[size-1:], limiter.HashString("later"), events, now.Add(-testIntervals.Read/2), new([]time.Time)), events/size; got != want {
			t.Errorf("%d instances, writes back: the last one grants %d of a fresh key, want its share %d", size, got, want)
		}
	}
}

// withFailingWriter returns three window-zone instances a, b and c
// (events a minute, bursts split) that count each other, c's writes
// failing while down.down is set, and the time of their next sync.
func withFailingWriter(t *testing.T, events int64) (nodes []*node, down *failingStorage, next time.Time) {
	t.Helper()
	st := newMemStorage()
	down = &failingStorage{Storage: st, writesOnly: true}
	nodes = []*node{newJoiner(t, st, "a", events, time.Minute, zap.NewNop()), newJoiner(t, st, "b", events, time.Minute, zap.NewNop()),
		newJoiner(t, down, "c", events, time.Minute, zap.NewNop())}
	next = t0
	for range 6 {
		syncAll(next, nodes...)
		next = next.Add(testIntervals.Read)
	}
	return nodes, down, next
}

// withWritersFailing returns size window-zone instances (events a
// window, bursts split) that count each other, each one's writes failing
// while its storage's down is set, and the time of their next sync.
func withWritersFailing(t *testing.T, size int, events int64, window time.Duration) (nodes []*node, downs []*failingStorage, next time.Time) {
	t.Helper()
	st := newMemStorage()
	for i := range size {
		d := &failingStorage{Storage: st, writesOnly: true}
		downs = append(downs, d)
		nodes = append(nodes, newJoiner(t, d, string(rune('a'+i)), events, window, zap.NewNop()))
	}
	next = t0
	for range 6 {
		syncAll(next, nodes...)
		next = next.Add(testIntervals.Read)
	}
	return nodes, downs, next
}

// An instance whose writes fail for a few write intervals, fewer than
// the others wait for its snapshots, is still one instance: it does not
// take the snapshot it stored before the failures, which it tried to
// overwrite since, for another process's, so it neither moves to an alias
// nor counts its own past state as a live peer, and a key is shared among
// three, not four, once its writes work again. Before, its fourth failed
// write pushed the stored snapshot out of what the process remembered
// storing: it counted 4 live, published under an alias, and the others
// counted 4 too (its old snapshot and the alias's): a fresh key got 7, 8
// and 4 on the three, 19 of 30.
func TestWindowInstanceWhoseWritesFailCountsItselfOnce(t *testing.T) {
	const events = 30
	nodes, down, now := withFailingWriter(t, events)
	var lives []string
	var per []int
	for s := range 12 {
		down.down.Store(s < 8)
		syncAll(now, nodes...)
		lives = append(lives, fmt.Sprintf("%d/%d/%d", nodes[0].c.Live(), nodes[1].c.Live(), nodes[2].c.Live()))
		if s == 9 { // its writes have worked again for a second
			for _, n := range nodes {
				per = append(per, burstOnAll([]*node{n}, limiter.HashString("fresh"), events, now.Add(testIntervals.Read/2), new([]time.Time)))
			}
		}
		now = now.Add(testIntervals.Read)
	}
	t.Logf("c's writes failing 8 s: live on a, b, c each second %v; conflicts %d; then a fresh key on all: %v", lives, nodes[2].c.Conflicts(), per)
	for s, l := range lives {
		if l != "3/3/3" {
			t.Errorf("second %d: live %s on a/b/c, want 3/3/3", s, l)
		}
	}
	if nodes[2].c.Conflicts() != 0 || nodes[2].s.proc.name("c") != "c" {
		t.Errorf("c took its own snapshot for another process's: %d conflicts, publishing as %q", nodes[2].c.Conflicts(), nodes[2].s.proc.name("c"))
	}
	if want := []int{10, 10, 10}; !slices.Equal(per, want) {
		t.Errorf("a fresh key on all three once c's writes work again: %v, want %v", per, want)
	}
}

// A joiner whose clock is ahead of the others' by more than the ten write
// intervals they publish within (but within the tolerated skew) finds
// their snapshots, at its first read, older than a live peer's: it counts
// no other live, yet takes only its allowance, as the others may be live
// (Syncer.shareRank). Before, it decided alone: 30 of a fresh key beside
// the others' 15 and 15, 60 of 30 at once.
func TestWindowJoinerWithItsClockAheadTakesItsAllowance(t *testing.T) {
	const events = 30
	allow := int(limiter.UncountedAllowance(events))
	for _, skew := range []time.Duration{11 * time.Second, 59 * time.Second} {
		st := newMemStorage()
		nodes := []*node{newJoiner(t, st, "a", events, time.Minute, zap.NewNop()), newJoiner(t, st, "b", events, time.Minute, zap.NewNop())}
		now := t0
		for range 6 {
			syncAll(now, nodes...)
			now = now.Add(testIntervals.Read)
		}
		j := newJoiner(t, st, "c", events, time.Minute, zap.NewNop())
		clock := func(n *node, at time.Time) time.Time {
			if n == j {
				return at.Add(skew)
			}
			return at
		}
		nodes = append(nodes, j)
		syncAt(nodes, nodes, clock, now)
		var per []int
		var log []time.Time
		for _, n := range nodes {
			per = append(per, burstOnAll([]*node{n}, limiter.HashString("fresh"), events, clock(n, now.Add(testIntervals.Read/2)), &log))
		}
		t.Logf("a joiner %v ahead, at its first read (live %d): a fresh key on a, b and it: %v", skew, j.c.Live(), per)
		if j.c.Live() != 1 {
			t.Fatalf("a joiner %v ahead counts %d live at its first read, want 1 (the others' snapshots look old on its clock)", skew, j.c.Live())
		}
		if got := per[0] + per[1] + per[2]; got > events*11/10+1 || per[2] > allow {
			t.Errorf("a joiner %v ahead: %v, %d of %d at once; want at most %d, the joiner its allowance %d", skew, per, got, events, events*11/10+1, allow)
		}
	}
}

// Every instance's writes fail at once, their reads working: each soon
// finds no other live (no snapshot is replaced), and each, its publishes
// stale, keeps to its share of the quota among the instances it counted
// when it was last counted itself (limiter.UncountedShare, 10 of 30 for
// each of three), since the others may be granting unseen as it does
// (Syncer.shareRank). A fresh key hit on all three every second gets its
// quota before the outage, the three shares, 30, for as long as it lasts
// past ten write intervals, and the quota again once the writes work and
// the instances count each other (their allowances, 3 × A = 12, while the
// others may count one dead, and while the new streaks are not counted).
// Before, each decided alone from about ten write intervals into the
// outage: 90 of 30; then each took its allowance only, 12, and a fair
// stream got a tenth of what it asked (TestWindowFairStreamThroughAWriteOutage).
// A cluster of one whose writes fail keeps its limit: it was alone when
// its publishes last worked.
func TestWindowClusterWhoseWritesAllFailKeepsEachToItsShare(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	for _, size := range []int{3, 1} {
		nodes, downs, now := withWritersFailing(t, size, events, time.Minute)
		var line []int
		for s := range 48 {
			for _, d := range downs {
				d.down.Store(s < 40)
			}
			syncAll(now, nodes...)
			got := burstOnAll(nodes, limiter.HashString(fmt.Sprint("fresh", s)), events, now.Add(testIntervals.Read/2), new([]time.Time))
			line = append(line, got)
			now = now.Add(testIntervals.Read)
		}
		t.Logf("%d instances, every one's writes failing for 40 s: a fresh key on all, each second: %v", size, line)
		for s, got := range line {
			switch {
			case got > bound || s >= 10 && s < 40 && got > events:
				t.Errorf("%d instances, second %d of the outage: %d of %d, over 1.1 × N + 1 = %d (or N, past ten write intervals)", size, s, got, events, bound)
			case size == 1 && got != events:
				t.Errorf("one instance, second %d of the outage: %d of %d, want its whole limit", s, got, events)
			}
		}
		if size > 1 && line[39] != events {
			t.Errorf("%d instances, late in the outage: %d, want each one's share, %d in all", size, line[39], events)
		}
		if size > 1 && line[47] != events {
			t.Errorf("%d instances, writes back: %d, want the quota %d", size, line[47], events)
		}
	}
}

// A stream of a key at exactly its rate (N/W), sent through a write
// outage on every instance (reads working: a full disk, a read-only
// replica), from 20 s into it for five windows: spread round robin over
// the three, it gets about what it gets with the writes working (about
// 80 %), pinned to one, at least that instance's share then (a third),
// and never more than N in a span. Before, each instance kept to its
// allowance, A = N/10 + 1, for the whole outage: 21 % and 16 % spread,
// 10.7 % and 5.3 % pinned, with a 10 s and a 1 min window.
func TestWindowFairStreamThroughAWriteOutage(t *testing.T) {
	const events, size = 30, 3
	for _, window := range []time.Duration{10 * time.Second, time.Minute} {
		for _, spread := range []bool{false, true} {
			nodes, downs, now := withWritersFailing(t, size, events, window)
			for _, d := range downs {
				d.down.Store(true)
			}
			start, next := now, now
			h := limiter.HashString("fair")
			step := window / events
			var log []time.Time
			sent := 0
			for i, at := 0, start.Add(step/2); at.Before(start.Add(20*time.Second + 5*window)); i, at = i+1, at.Add(step) {
				for !at.Before(next) {
					syncAll(next, nodes...)
					next = next.Add(testIntervals.Read)
				}
				n := nodes[0]
				if spread {
					n = nodes[i%size]
				}
				d, _ := n.c.TakeHash(h, 1, at)
				if at.Sub(start) >= 20*time.Second {
					sent++
					if d.Allowed {
						log = append(log, at)
					}
				}
			}
			got := float64(len(log)) / float64(sent)
			t.Logf("window %v, spread %v, every write failing: %d of %d (%.1f%%), worst span %d", window, spread, len(log), sent, 100*got, worstSpan(log, window))
			if w := worstSpan(log, window); w > events {
				t.Errorf("window %v, spread %v: %d in a span, over the shares' sum %d", window, spread, w, events)
			}
			if want := map[bool]float64{false: 0.25, true: 0.75}[spread]; got < want {
				t.Errorf("window %v, spread %v: %.1f%% of a stream at the rate, want at least %.0f%%", window, spread, 100*got, 100*want)
			}
		}
	}
}

// A partial write outage that becomes full: the last instance's writes
// fail from second 0, the others' from second p. The others drop it ten
// write intervals on and, counted themselves until their own writes fail,
// keep their shares among one fewer; the last one saw them publish after
// its own publishes stopped, so may have been dropped, and takes its
// allowance, not its share among all (Syncer.shareRank). A fresh key hit
// on every instance each second gets at most 1.1 × N + 1 throughout: with
// three, 15 + 15 + 4 = 34 once every write fails. Before, the last one
// kept its share among three and the others theirs among two: 15 + 15 +
// 10 = 40 of 30 (37 with four), for as long as the outage lasted.
func TestWindowPartialWriteOutageBecomingFullKeepsTheBound(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	allow := int(limiter.UncountedAllowance(events))
	for _, size := range []int{3, 4} {
		for _, p := range []int{5, 20} {
			nodes, downs, now := withWritersFailing(t, size, events, time.Minute)
			var line [][]int
			for s := range 60 {
				for i, d := range downs {
					d.down.Store(i == size-1 || s >= p)
				}
				syncAll(now, nodes...)
				per := make([]int, size)
				for i, n := range nodes {
					per[i] = burstOnAll([]*node{n}, limiter.HashString(fmt.Sprint("fresh", s)), events, now.Add(testIntervals.Read/2), new([]time.Time))
				}
				line = append(line, per)
				now = now.Add(testIntervals.Read)
			}
			t.Logf("%d instances, the last one's writes failing from 0, the others' from %d s: a fresh key on each, each second: %v", size, p, line)
			for s, per := range line {
				got := 0
				for _, g := range per {
					got += g
				}
				if got > bound {
					t.Errorf("%d instances, writes failing from %d s, second %d: %v, %d of %d, over 1.1 × N + 1 = %d", size, p, s, per, got, events, bound)
				}
				if s >= p+12 && per[size-1] != allow {
					t.Errorf("%d instances, writes failing from %d s, second %d: the first to fail granted %d, want its allowance %d", size, p, s, per[size-1], allow)
				}
			}
		}
	}
}

// Every instance's writes fail, and from second 80 of the outage (past
// the ten write intervals and the minute a peer's snapshot may look live
// on a clock behind) the instances are restarted one every 5 s, a new
// process each, their writes failing from the start: a new one finds
// every peer's snapshot dead (never replaced), and counted nobody before,
// yet takes only its allowance, as its peers may be granting unseen
// (Syncer.shareRank), beside the old processes' shares of before. A fresh
// key hit on all three every second gets 30 (the shares), then 10 + 10 +
// 4, 10 + 4 + 4 and 3 × A = 12 as they restart. Before, each new process
// decided alone: 38, 64 and 90 of 30. So too with a purge_age (1 min)
// shorter than the outage so far: the peers' snapshots, older than it,
// are not read, but they are still there (nobody's delete of them lands
// either) and still peers to a process none of whose publishes landed.
// Before, each new process decided alone there: 50, 70 and 90 of 30.
func TestWindowRestartDuringAWriteOutageTakesTheAllowance(t *testing.T) {
	const events = 30
	allow := int(limiter.UncountedAllowance(events))
	for _, purge := range []time.Duration{testIntervals.PurgeAge, time.Minute} {
		nodes, downs, now := withWritersFailing(t, 3, events, time.Minute)
		for _, n := range nodes {
			n.s.iv.PurgeAge = purge
		}
		for _, d := range downs {
			d.down.Store(true)
		}
		var line []int
		for s := range 100 {
			if r := (s - 80) / 5; s >= 80 && (s-80)%5 == 0 && r < 3 {
				i := 2 - r
				nodes[i] = newJoiner(t, downs[i], string(rune('a'+i)), events, time.Minute, zap.NewNop())
				nodes[i].s.iv.PurgeAge = purge
			}
			syncAll(now, nodes...)
			line = append(line, burstOnAll(nodes, limiter.HashString(fmt.Sprint("fresh", s)), events, now.Add(testIntervals.Read/2), new([]time.Time)))
			now = now.Add(testIntervals.Read)
		}
		t.Logf("purge_age %v, writes failing on all three, restarted one every 5 s from second 80: a fresh key on all each second from 78: %v", purge, line[78:])
		for s, got := range line[78:] {
			want := events // the shares of before
			if s >= 2 {
				restarted := min((s-2)/5+1, 3)
				want = (3-restarted)*events/3 + restarted*allow
			}
			if got != want {
				t.Errorf("purge_age %v, second %d of the outage: a fresh key got %d of %d, want %d", purge, 78+s, got, events, want)
			}
		}
	}
}

// A key pinned to one instance is shared on the own counts the others
// have read (Syncer.seenSnapshot): while that instance's writes fail (for
// less than the others wait for its snapshots), its grants since its last
// publish are not theirs to know, and it must not take them for known.
// Ten requests a second of the key on it alone, its writes failing from
// the third second, then a burst on the two others: at most 1.1 × N + 1 in
// a span. Before, it took its failed snapshots for seen and its share of
// what was left over them at every read (the whole quota within a few
// reads), and the others their shares of what they saw left besides: 35
// and 38 of 30 with its writes failing 5 and 7 s.
func TestWindowPinnedKeyWhileItsWritesFailKeepsTheBound(t *testing.T) {
	const events = 30
	for _, failFor := range []int{5, 7} {
		nodes, down, now := withFailingWriter(t, events)
		h := limiter.HashString("pinned")
		var log []time.Time
		pinned, burst := 0, 0
		for s := range 12 {
			down.down.Store(s >= 2 && s < 2+failFor)
			syncAll(now, nodes...)
			for k := range 10 {
				pinned += burstOnAll(nodes[2:], h, 1, now.Add(time.Duration(k)*100*time.Millisecond), &log)
			}
			if s == 1+failFor {
				burst = burstOnAll(nodes[:2], h, events, now.Add(950*time.Millisecond), &log)
			}
			now = now.Add(testIntervals.Read)
		}
		w := worstSpan(log, time.Minute)
		t.Logf("c's writes failing %d s: c granted the key pinned to it %d, a and b %d in a burst at the end: %d in a span", failFor, pinned, burst, w)
		if bound := events*11/10 + 1; w > bound {
			t.Errorf("c's writes failing %d s: %d in a span, over 1.1 × %d + 1 = %d", failFor, w, events, bound)
		}
		if pinned < events/3 {
			t.Errorf("c's writes failing %d s: c granted the key pinned to it %d, want at least its share %d", failFor, pinned, events/3)
		}
	}
}

// An instance restarted under its name restores a snapshot its old
// process wrote on another host's clock: it is counted at once only when
// the others surely still count it, whatever the two clocks; otherwise it
// takes its allowance until its own streak is counted.
func TestWindowRestartOnSkewedClockTakesOnlyItsAllowance(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	for _, skew := range []time.Duration{0, 3 * time.Second, 30 * time.Second, 55 * time.Second} {
		st := newMemStorage()
		var nodes []*node
		for i := range 3 {
			nodes = append(nodes, newJoiner(t, st, string(rune('a'+i)), events, time.Minute, zap.NewNop()))
		}
		// The old host of c is ahead by skew.
		clock := func(n *node, at time.Time) time.Time {
			if n == nodes[2] {
				return at.Add(skew)
			}
			return at
		}
		now := t0
		for range 6 {
			syncAt(nodes, nodes, clock, now)
			now = now.Add(testIntervals.Read)
		}
		// c is down until the others drop it.
		for range 12 {
			syncAt(nodes[:2], nodes[:2], clock, now)
			now = now.Add(testIntervals.Read)
		}
		c := newJoiner(t, st, "c", events, time.Minute, zap.NewNop())
		if err := c.s.Restore(bg, now); err != nil {
			t.Fatal(err)
		}
		c.s.Read(bg, now)
		var log []time.Time
		var per []int
		for _, n := range []*node{nodes[0], nodes[1], c} {
			per = append(per, burstOnAll([]*node{n}, limiter.HashString("fresh"), events, now.Add(10*time.Millisecond), &log))
		}
		if w := worstSpan(log, time.Minute); w > bound {
			t.Errorf("old host ahead by %v: grants %v, %d in a span, over %d", skew, per, w, bound)
		}
	}
}
