package storage

import (
	"bytes"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
	"go.uber.org/zap"
)

// readsLoad has the nodes read at now and returns how many entries they
// loaded from st.
func readsLoad(st *memStorage, now time.Time, nodes []*node) int64 {
	st.mu.Lock()
	before := st.loads
	st.mu.Unlock()
	for _, n := range nodes {
		n.s.Read(bg, now)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.loads - before
}

// fullView returns the peers' sum n reads from every snapshot, the
// aggregate aside, in binary form, leaving the storage as it was.
func fullView(t *testing.T, st *memStorage, n *node, now time.Time) []byte {
	t.Helper()
	key := AggregateKey("z/1")
	st.mu.Lock()
	agg := st.data[key]
	delete(st.data, key)
	st.mu.Unlock()
	n.s.Read(bg, now)
	st.mu.Lock()
	st.data[key] = agg
	st.mu.Unlock()
	return n.c.peers.Load().AppendBinary(nil)
}

// Five instances: the first to read finds no aggregate, reads every
// snapshot and becomes the aggregator; each other one loads the aggregate
// alone and is left with exactly the sum it would have read from every
// other snapshot, so all of them deny a key that only the sum of the five
// puts over its limit.
func TestAggregateGivesEachInstanceThePeersSum(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 5)
	now := t0.Add(time.Second)
	for i, n := range nodes {
		n.take("k", i+1, now) // 15 in all, of a limit of 10
		n.take(fmt.Sprint("own", i), 3, now)
	}
	for _, n := range nodes {
		n.s.Write(bg, now)
	}
	nodes[0].s.Read(bg, now)
	if got := aggregators(nodes); len(got) != 1 || got[0] != "a" {
		t.Fatalf("aggregators %v after a's read, want [a]", got)
	}
	loads := readsLoad(st, now, nodes[1:])
	if loads != 4 {
		t.Errorf("4 instances loaded %d entries reading the aggregate, want 4 (one each)", loads)
	}
	for _, n := range nodes[1:] {
		via := n.c.peers.Load().AppendBinary(nil)
		if full := fullView(t, st, n, now); !bytes.Equal(via, full) {
			t.Errorf("%s: the peers' sum from the aggregate differs from the one read from every snapshot", n.s.instance)
		}
	}
	for _, n := range nodes {
		if d := n.c.PeekHash(hk, 1, now); d.Allowed {
			t.Errorf("%s grants a key the five instances have granted 15 times, of a limit of 10: %+v", n.s.instance, d)
		}
		if d := n.c.PeekHash(limiter.HashString("own0"), 1, now); !d.Allowed || d.Remaining != 7 {
			t.Errorf("%s: a key granted 3 times has %+v, want 8 remaining", n.s.instance, d)
		}
	}
}

// An instance whose own snapshot predates a reset that the aggregate lists
// takes that snapshot out of the aggregate as the aggregator added it,
// less the reset key's counts: it is left with the sum it would have read
// from every snapshot, not one short of the other instances' counts of the
// key's cells.
func TestOwnSnapshotBeforeAResetIsTakenOutOfTheAggregateAsAdded(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 5)
	now := t0.Add(time.Second)
	for i, n := range nodes {
		n.take("k", i+1, now)
		n.s.Write(bg, now)
	}
	b := nodes[1]
	b.c.Reset(hk, now) // listed by b's next snapshot only
	b.take("k", 2, now)
	b.s.Write(bg, now)
	nodes[0].s.Read(bg, now)
	if got := aggregators(nodes); len(got) != 1 || got[0] != "a" {
		t.Fatalf("aggregators %v after a's read, want [a]", got)
	}
	for _, n := range nodes[2:] {
		n.s.Read(bg, now)
		via := n.c.peers.Load().AppendBinary(nil)
		if full := fullView(t, st, n, now); !bytes.Equal(via, full) {
			t.Errorf("%s: the peers' sum from the aggregate differs from the one read from every snapshot", n.s.instance)
		}
		// b's 2 since the reset; every count before it forgotten.
		if d := n.c.PeekHash(hk, 1, now); !d.Allowed || d.Remaining != 10-2 {
			t.Errorf("%s: the key after its reset and 2 grants: %+v, want 8 remaining", n.s.instance, d)
		}
	}
}

// Blocks and resets go through the aggregate: a key blocked on one
// instance is blocked on every one after a sync, and a reset asked of an
// instance that reads the aggregate lets the key through there at once and
// everywhere after the next sync, the block with it.
func TestAggregateCarriesBlocksAndResets(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 5)
	now := t0.Add(time.Second)
	syncAll(now, nodes...)
	b, e := nodes[1], nodes[4]
	if got := b.take("k", 11, now); got != 10 {
		t.Fatalf("b granted %d of 11, want 10", got)
	}
	at := now.Add(time.Second)
	syncAll(at, nodes...)
	for _, n := range nodes {
		if _, blocked := n.c.blocks.blocked(hk, at.UnixNano()); !blocked {
			t.Errorf("%s: the key b blocked is not blocked after a sync through the aggregate", n.s.instance)
		}
	}
	e.c.Reset(hk, at)
	if d := e.c.PeekHash(hk, 1, at); !d.Allowed {
		t.Fatalf("the key is denied on the instance that reset it: %+v", d)
	}
	at = at.Add(time.Second)
	syncAll(at, nodes...)
	for _, n := range nodes {
		if d := n.c.PeekHash(hk, 1, at); !d.Allowed || d.Remaining != 10 {
			t.Errorf("%s: the key after its reset spread through the aggregate: %+v, want allowed with 10 remaining", n.s.instance, d)
		}
	}
}

// A key hit on five instances at once, bursts split, gets about its limit
// cluster-wide through the aggregate too, even when the aggregator reads
// last, so that the others always read the previous sync's aggregate.
func TestSimultaneousBurstIsSplitThroughTheAggregate(t *testing.T) {
	for _, aggregatorLast := range []bool{false, true} {
		t.Run(fmt.Sprintf("aggregatorLast=%v", aggregatorLast), func(t *testing.T) {
			st := newMemStorage()
			now := t0.Add(time.Second)
			nodes := newSplitNodes(t, st, 5, now)
			if aggregatorLast {
				nodes = append(nodes[1:], nodes[0])
			}
			granted := 0
			for _, n := range nodes {
				granted += n.take("burst", 10, now)
			}
			granted += burstAtEverySync(nodes, now, 6)
			t.Logf("a key hit on 5 instances at once, then at every sync: %d granted of a limit of 10", granted)
			if granted > 10*11/10+1 || granted < 10 {
				t.Fatalf("granted %d of a limit of 10 to a key hit on 5 instances at once, then at 6 syncs: want the limit, hardly more", granted)
			}
		})
	}
}

// However many quiet syncs come before it (the shares' reservations are
// renewed every few syncs), a burst on every instance at once gets about
// the limit through an aggregate that the aggregator publishes last.
func TestBurstAfterQuietSyncsIsSplitThroughTheAggregate(t *testing.T) {
	for quiet := 0; quiet <= 8; quiet++ {
		st := newMemStorage()
		nodes := newNodes(t, st, 5)
		for _, n := range nodes {
			n.c.SplitBursts(true, testIntervals.Read)
			n.take(fmt.Sprint("own", n.s.instance), 1, t0)
		}
		syncAll(t0, nodes...)
		nodes = append(nodes[1:], nodes[0]) // the aggregator reads last
		at := t0
		for range quiet {
			at = at.Add(testIntervals.Read)
			syncAll(at, nodes...)
		}
		granted := 0
		for round := 0; round <= 6; round++ {
			if round > 0 {
				at = at.Add(testIntervals.Read)
				syncAll(at, nodes...)
			}
			for _, n := range nodes {
				granted += n.take("burst", 10, at)
			}
		}
		if granted > 10*11/10+1 || granted < 10 {
			t.Errorf("after %d quiet syncs, a key hit on 5 instances at once, then at 6 syncs, got %d of a limit of 10: want the limit, hardly more", quiet, granted)
		}
	}
}

// An aggregate is an input from a peer: one that is malformed, whose sum
// is not of its own time's window, or stale is skipped (and every snapshot
// read); the blocks of one that lies last at most a window from its write
// and go with it.
func TestHostileAggregateImposesNoMoreThanAPeer(t *testing.T) {
	now := t0.Add(10 * time.Second)
	peer, _ := newCluster(Shape{Zone: "z/1", Window: testWindow, Width: 256}, 10)
	for range 4 {
		peer.TakeHash(hk, 1, now)
	}
	sum := peer.sketch.NewSketchSum(now)
	sk, _ := peer.sketch.AppendSnapshot(nil, now)
	if _, err := sum.AddBinary(sk); err != nil {
		t.Fatal(err)
	}
	good := aggregate{
		snapshot: snapshot{instance: "x", written: now, sketch: sum.AppendBinary(nil),
			blocks: []block{{hash: limiter.HashString("b"), until: now.Add(time.Hour).UnixNano()}}},
		members: []member{{name: "x", w: written{at: now.UnixNano(), sum: 1}}},
	}
	nextWindow := good
	nextWindow.written = now.Add(testWindow)
	corrupt := appendAggregate(nil, &good)
	corrupt[len(corrupt)/2] ^= 1
	for _, tc := range []struct {
		name string
		data []byte
		at   time.Time
		used bool
	}{
		{"well-formed", appendAggregate(nil, &good), now, true},
		{"corrupt", corrupt, now, false},
		{"sum of another window", appendAggregate(nil, &nextWindow), now, false},
		{"stale", appendAggregate(nil, &good), now.Add(aggregateMaxAge(testIntervals) + time.Second), false},
		{"not an aggregate", []byte("junk"), now, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newMemStorage()
			_ = st.Store(bg, AggregateKey("z/1"), tc.data)
			n := newNode(t, st, "n")
			n.s.Read(bg, tc.at)
			used := !n.c.PeekHash(hk, 7, tc.at).Allowed
			if used != tc.used {
				t.Fatalf("the aggregate was used: %v, want %v", used, tc.used)
			}
			until, blocked := n.c.blocks.blocked(limiter.HashString("b"), tc.at.UnixNano())
			if blocked != tc.used {
				t.Fatalf("its block holds: %v, want %v", blocked, tc.used)
			}
			if blocked && until > now.Add(testWindow).UnixNano() {
				t.Fatalf("its block lasts %v past its write, more than a window", time.Duration(until-now.UnixNano()))
			}
			if !tc.used && tc.name != "stale" && n.c.Skipped() == 0 {
				t.Fatal("a bad aggregate was not counted as skipped")
			}
			if tc.used {
				// Gone from the next aggregate, the block goes.
				next := good
				next.blocks = nil
				_ = st.Store(bg, AggregateKey("z/1"), appendAggregate(nil, &next))
				n.s.Read(bg, tc.at)
				if _, blocked := n.c.blocks.blocked(limiter.HashString("b"), tc.at.UnixNano()); blocked {
					t.Fatal("a block the aggregate no longer lists still holds")
				}
			}
		})
	}
}

// An instance that writes more often than the aggregator reads still finds
// its own snapshot among those it remembers, whichever of its writes the
// aggregate summed, and so reads the aggregate alone.
func TestAggregateWithWritesMoreFrequentThanReads(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 5)
	iv := Intervals{Read: 5 * time.Second, Write: time.Second, PurgeAge: time.Minute}
	for _, n := range nodes {
		n.s.iv = iv
	}
	now := t0.Add(time.Second)
	syncAll(now, nodes...)
	for w := 1; w <= 9; w++ { // up to the aggregate's maximum age
		for _, n := range nodes[1:] {
			n.s.Write(bg, now.Add(time.Duration(w)*iv.Write))
		}
	}
	at := now.Add(9 * iv.Write)
	for _, n := range nodes[1:] {
		n.s.Read(bg, at)
		if n.s.lastRead != aggregateUsed {
			t.Errorf("%s, 9 writes after the aggregate: read %v, want the aggregate used", n.s.instance, n.s.lastRead)
		}
	}
}

// aggregatingLog is what an instance logs when it becomes the aggregator.
const aggregatingLog = "this instance aggregates the zone's cluster state"

// The aggregator publishes a sum of its own time's window: read after a
// window's edge that it published before, it is of the previous window,
// for up to a read interval each window. A token-bucket zone's readers
// (a weighted count) share on it as of their own window, as a window
// zone's do: a fresh key hit on all four instances each second across an
// edge gets at most 1.1 × N + 1. Before, the copy of another window was
// the sum itself, without shares: 98 of 30 in the second after the edge.
func TestAggregateOfThePreviousWindowKeepsTheShares(t *testing.T) {
	const events = 30
	window := time.Minute
	for _, sliding := range []bool{false, true} {
		edge := time.Unix(0, (t0.UnixNano()/int64(window)+2)*int64(window))
		start := edge.Add(-5 * time.Second)
		nodes := newWindowNodesOf(t, 4, events, window, sliding, sameClock, start)
		var bursts []int
		for k, at := 0, start.Add(testIntervals.Read); at.Before(edge.Add(3 * time.Second)); k, at = k+1, at.Add(testIntervals.Read) {
			// The aggregator syncs half a read interval before the others.
			syncAt(nodes[:1], nodes[:1], sameClock, at.Add(-testIntervals.Read/2))
			syncAt(nodes[1:], nodes[1:], sameClock, at)
			bursts = append(bursts, burstOnAll(nodes, limiter.HashString(fmt.Sprint("fresh", k)), events, at.Add(100*time.Millisecond), new([]time.Time)))
		}
		t.Logf("sliding %v, aggregators %v: a fresh key hit on all 4 each second across a window's edge: %v", sliding, aggregators(nodes), bursts)
		if got := aggregators(nodes); len(got) != 1 || got[0] != nodes[0].s.instance {
			t.Fatalf("aggregators %v, want %s", got, nodes[0].s.instance)
		}
		for k, got := range bursts {
			if bound := events*11/10 + 1; got > bound {
				t.Errorf("sliding %v, second %d: a fresh key got %d of %d at once, over 1.1 × N + 1 = %d", sliding, k, got, events, bound)
			}
		}
	}
}

// An aggregate lists by how many sub-windows its aggregator moved each
// member's counts onto its clock (clockShift), for the member to take its
// own snapshot out as it was added. One that moved none is written in
// version 1, which an instance of an older version still reads; either
// version decodes to what was written.
func TestAggregateListsItsMembersShifts(t *testing.T) {
	base := aggregate{snapshot: snapshot{instance: "x", written: t0}}
	for _, c := range []struct {
		shifts  []int64
		version byte
	}{{[]int64{0, 0}, 1}, {[]int64{0, -3}, 2}, {[]int64{2, 0}, 2}} {
		a := base
		for i, sh := range c.shifts {
			a.members = append(a.members, member{name: fmt.Sprint("m", i), w: written{at: int64(i), sum: 7}, shift: sh})
		}
		data := appendAggregate(nil, &a)
		if v := data[len(aggregateMagic)]; v != c.version {
			t.Errorf("shifts %v: written in version %d, want %d", c.shifts, v, c.version)
		}
		got, err := decodeAggregate(data)
		if err != nil {
			t.Fatalf("shifts %v: %v", c.shifts, err)
		}
		if !slices.Equal(got.members, a.members) || got.tail != nil {
			t.Errorf("shifts %v: decoded members %+v, tail %x, want %+v and none", c.shifts, got.members, got.tail, a.members)
		}
	}
}

// An aggregate that carries its sum's tail (what it still lingers of the
// sub-window before its oldest) is written in version 3, with each
// member's early, and decodes to what was written, an empty tail
// included; an early out of range is rejected.
func TestAggregateCarriesItsTail(t *testing.T) {
	for _, tail := range [][]byte{{0}, {2, 1, 5, 3, 7}} {
		a := aggregate{snapshot: snapshot{instance: "x", written: t0}, tail: tail}
		a.members = []member{{name: "m0", w: written{at: 1, sum: 7}, shift: 1, early: 300 * time.Millisecond}, {name: "m1", w: written{at: 2, sum: 7}}}
		data := appendAggregate(nil, &a)
		if v := data[len(aggregateMagic)]; v != 3 {
			t.Errorf("tail %x: written in version %d, want 3", tail, v)
		}
		got, err := decodeAggregate(data)
		if err != nil {
			t.Fatalf("tail %x: %v", tail, err)
		}
		if !slices.Equal(got.members, a.members) || !bytes.Equal(got.tail, tail) || got.tail == nil {
			t.Errorf("tail %x: decoded members %+v, tail %x, want %+v, %x", tail, got.members, got.tail, a.members, tail)
		}
		for _, early := range []time.Duration{-1, MaxClockSkew + 1} {
			a.members[1].early = early
			if _, err := decodeAggregate(appendAggregate(nil, &a)); err == nil {
				t.Errorf("an early of %v accepted", early)
			}
		}
	}
}

// A member whose clock is behind the aggregator's (by less than the
// tolerance, so not moved) keeps its counts of a sub-window that long
// into the next one on the aggregator's clock, and so do the readers of
// the aggregate: the aggregator's sum holds them apart (its tail) when it
// reads within that long of its sub-window's start, and its aggregate
// carries them then (version 3), for its readers to use. Here events
// 30 (bound 34), the aggregator a on real time, members b.. behind by δ
// burst 10 ms before their sub-window ends, then the key goes round robin
// every 20 ms, paused around the edge a window later until just after
// the first read past it, q after the edge on a's clock. Before the
// members' counts lingered, the readers of the aggregate dropped them at
// the aggregate's edge, and up to 43 of 30 passed in a span; then the
// aggregate, which did not carry them, was not used that early in its
// sub-window (lingerLost), and every reader read every snapshot at the
// read past the edge. Each reader counts the burst at that read (without
// the shares, which may hold the room anyway): one that dropped the tail
// had 15 left for the key where the burst left 10.
func TestAggregateKeepsItsMembersLingeringCounts(t *testing.T) {
	const events = 30
	bound := events*11/10 + 1
	const window = time.Minute
	L := subWindowOf(window)
	worst := 0
	for _, c := range []struct {
		n, behind int
		delta, q  time.Duration
	}{
		{5, 2, 700 * time.Millisecond, 20 * time.Millisecond},
		{6, 2, 900 * time.Millisecond, 450 * time.Millisecond},
		{6, 3, 900 * time.Millisecond, 450 * time.Millisecond},
		{6, 4, 900 * time.Millisecond, 450 * time.Millisecond},
		{6, 3, 700 * time.Millisecond, 20 * time.Millisecond},
	} {
		B := time.Unix(0, (t0.Add(20*time.Second).UnixNano()/int64(L)+2)*int64(L)) // a sub-window's start
		edge := B.Add(window)
		tick := edge.Add(c.q)                        // a read, q after the edge
		formAt := t0.Add(tick.Sub(t0) % time.Second) // reads every second, one at tick
		nodes, clock := clockedNodes(t, c.n, events, window, func(i int) time.Duration {
			if i >= 1 && i <= c.behind {
				return -c.delta
			}
			return 0
		}, formAt)
		next := formAt.Add(testIntervals.Read)
		sync := func(at time.Time) {
			for ; !at.Before(next); next = next.Add(testIntervals.Read) {
				syncAt(nodes, nodes, clock, next)
			}
		}
		h := limiter.HashString(fmt.Sprint("lingering members", c))
		var log []time.Time
		burst := B.Add(c.delta - 10*time.Millisecond) // 10 ms before the members' sub-window ends
		sync(burst)
		for _, x := range nodes[1 : 1+c.behind] {
			for range events {
				if d, _ := x.c.TakeHash(h, 1, clock(x, burst)); d.Allowed {
					log = append(log, burst)
				}
			}
		}
		burstN := int64(len(log))
		k := 0
		checked := false
		for at := B.Add(c.delta); at.Before(B.Add(window + 20*time.Second)); at = at.Add(20 * time.Millisecond) {
			sync(at)
			if !checked && !at.Before(tick) {
				checked = true // the read at tick, the last one
				for _, x := range nodes[1:] {
					if x.s.lastRead != aggregateUsed {
						t.Errorf("%d instances, %d behind by %v, read %v after the edge: %s read %v there, want the aggregate used", c.n, c.behind, c.delta, c.q, x.s.instance, x.s.lastRead)
					}
					// The burst is still in every span of W ending
					// now, on its writers' clocks: a reader of the
					// aggregate counts it from the tail it carries
					// (its counts and the peers', without the shares,
					// which may hold the room anyway).
					if d := x.c.sketch.PeekHashWith(h, 1, clock(x, at), x.c.peers.Load()); d.Remaining > events-burstN {
						t.Errorf("%d instances, %d behind by %v, read %v after the edge: %s has %d left for the key, want at most %d (the burst's %d still count)", c.n, c.behind, c.delta, c.q, x.s.instance, d.Remaining, events-burstN, burstN)
					}
				}
			}
			if !at.Before(edge.Add(-50*time.Millisecond)) && at.Before(tick.Add(5*time.Millisecond)) {
				continue
			}
			x := nodes[k%c.n]
			k++
			if d, _ := x.c.TakeHash(h, 1, clock(x, at)); d.Allowed {
				log = append(log, at)
			}
		}
		if !nodes[0].s.agg.aggregating {
			t.Fatalf("%+v: a does not aggregate", c)
		}
		ws := worstSpan(log, window)
		worst = max(worst, ws)
		if ws > bound || len(log) <= events {
			t.Errorf("%d instances, %d behind by %v, read %v after the edge: worst span %d of %d (bound %d), %d granted", c.n, c.behind, c.delta, c.q, ws, events, bound, len(log))
		}
	}
	t.Logf("worst span %d (bound %d)", worst, bound)
}

// An aggregate written within its members' linger of its sub-window's
// start carries what its sum lingers (version 3), so its readers use it
// whatever the members' lags: five instances writing and reading at
// staggered phases of 1 s intervals on a 1 m window, two of them 3 s
// behind, or one dead (it stops writing, and is listed until purged).
// Before, the aggregate did not carry it and was not used that early
// (lingerLost), and 45 % and 50 % of the other instances' reads read every
// snapshot; the most lagging member, a dead one by its age, set it.
func TestAggregateIsUsedWhateverItsMembersLag(t *testing.T) {
	const window, iv, n = time.Minute, time.Second, 5
	old := testIntervals
	defer func() { testIntervals = old }()
	testIntervals = Intervals{Read: iv, Write: iv, PurgeAge: 5 * time.Minute}
	for _, c := range []struct {
		behind time.Duration
		dead   bool
	}{{3 * time.Second, false}, {0, true}} {
		nodes, clock := clockedNodes(t, n, 30, window, func(i int) time.Duration {
			if i == 1 || i == 2 {
				return -c.behind
			}
			return 0
		}, t0)
		reads, full := 0, 0
		for at := t0.Add(iv); at.Before(t0.Add(3 * window)); at = at.Add(iv / n) {
			k := int(at.Sub(t0) / (iv / n) % n)
			x := nodes[k]
			if c.dead && k == n-1 && at.After(t0.Add(window/2)) {
				continue
			}
			x.s.Write(bg, clock(x, at))
			x.s.Read(bg, clock(x, at))
			if !x.s.agg.aggregating && at.After(t0.Add(window)) {
				reads++
				if x.s.lastRead != aggregateUsed {
					full++
				}
			}
		}
		if reads == 0 || full > 0 {
			t.Errorf("two members %v behind, one dead %v: %d of %d reads read every snapshot, want none", c.behind, c.dead, full, reads)
		}
	}
}

// A reader keeps an aggregate's counts its own placing of the aggregator's
// clock (clockShift's early) plus what the aggregator's placing of its
// members left (membersEarly) into the sub-window after they leave its
// view; a sum lingers less than a sub-window, so where the two reach one
// the reader reads every snapshot instead. Here a 10 s window (sub-windows
// of 1.43 s): the reader finds the aggregator's aggregates 0.9 s after
// their writes, and the aggregate lists a member written 0.3 s or 0.6 s
// before it (or, in version 3, that it measured that early). Before, the
// reader used the aggregate with 1.5 s, cut at the sub-window: the
// member's counts could leave its view 0.07 s before their writer's.
func TestAggregateThatWouldLingerASubWindowIsNotUsed(t *testing.T) {
	const window = 10 * time.Second
	sub := subWindowOf(window)
	for _, c := range []struct {
		member time.Duration // how long before the aggregate its member was written
		tail   bool
		used   bool
	}{
		{300 * time.Millisecond, false, true},
		{600 * time.Millisecond, false, false},
		{300 * time.Millisecond, true, true},
		{600 * time.Millisecond, true, false},
	} {
		st := newMemStorage()
		n := newJoiner(t, st, "n", 30, window, zap.NewNop())
		agg := newJoiner(t, st, "x", 30, window, zap.NewNop())
		_ = agg
		// Written 1.2 s into their sub-window, after the member's linger.
		start := time.Unix(0, (t0.UnixNano()/int64(sub)+1)*int64(sub))
		for k, at := range []time.Time{start.Add(1200 * time.Millisecond), start.Add(sub + 1200*time.Millisecond)} {
			a := aggregate{
				snapshot: snapshot{instance: "x", written: at, sketch: agg.c.sketch.NewSketchSum(at).AppendBinary(nil)},
				members:  []member{{name: "m", w: written{at: at.Add(-c.member).UnixNano(), sum: 1}, early: c.member}},
			}
			if c.tail {
				a.tail = []byte{0}
			}
			if err := st.Store(bg, AggregateKey("w"), appendAggregate(nil, &a)); err != nil {
				t.Fatal(err)
			}
			n.s.Read(bg, at.Add(900*time.Millisecond))
			if used := n.s.lastRead == aggregateUsed; k == 1 && used != c.used {
				t.Errorf("a member written %v before the aggregate, tail %v: used %v, want %v", c.member, c.tail, used, c.used)
			}
		}
	}
}

// A token-bucket zone's aggregate is never written in version 3, nor skipped
// for a linger: only a window zone's sum lingers. Before, its aggregator
// wrote version 3 (which an older instance refuses) on reads just after a
// window's start (1 of the 30 here).
func TestATokenBucketZonesAggregateNeverCarriesALinger(t *testing.T) {
	st := newMemStorage()
	var nodes []*node
	for _, name := range []string{"a", "b", "c", "d", "e"} {
		nodes = append(nodes, newNode(t, st, name))
	}
	start := time.Unix(0, (t0.UnixNano()/int64(testWindow)+1)*int64(testWindow))
	versions := map[byte]int{}
	full := 0
	for at := start.Add(-10 * time.Second); at.Before(start.Add(20 * time.Second)); at = at.Add(time.Second) {
		for i, x := range nodes {
			x.s.Write(bg, at.Add(time.Duration(i)*150*time.Millisecond-500*time.Millisecond))
		}
		for i, x := range nodes {
			x.s.Read(bg, at.Add(time.Duration(i)*150*time.Millisecond+50*time.Millisecond))
			if !x.s.agg.aggregating && x.s.lastRead != aggregateUsed {
				full++
			}
		}
		if data, err := st.Load(bg, AggregateKey("z/1")); err == nil {
			versions[data[len(aggregateMagic)]]++
		}
	}
	t.Logf("aggregate versions written: %v; reads of every snapshot by the others: %d", versions, full)
	if versions[3] != 0 || versions[1] == 0 {
		t.Errorf("aggregate versions written %v, want version 1 only", versions)
	}
}
