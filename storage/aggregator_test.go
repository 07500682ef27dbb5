package storage

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"slices"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// aggregator returns the nodes that hold the aggregator lock.
func aggregators(nodes []*node) []string {
	var names []string
	for _, n := range nodes {
		if n.s.agg.aggregating {
			names = append(names, n.s.instance)
		}
	}
	return names
}

// When the aggregator dies, the others read its last aggregate until it is
// stale, then every snapshot again: the limit holds throughout, and what
// they grant meanwhile reaches each other once it is stale. Once the
// storage expires the dead one's lock, the next instance to read takes it
// over, and the others read its aggregate.
func TestAggregatorDeathIsAbsorbed(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 6)
	a, rest := nodes[0], nodes[1:]
	now := t0.Add(time.Second)
	syncAll(now, nodes...)
	for _, n := range rest {
		n.take("k", 2, now) // 10 granted: the limit
	}
	now = now.Add(testIntervals.Read)
	syncAll(now, nodes...)
	if !a.s.agg.aggregating {
		t.Fatal("a is not the aggregator")
	}
	// a dies: it writes and reads no more, and holds its lock until the
	// storage expires it. Meanwhile b grants a new key its limit.
	late := limiter.HashString("late")
	rest[0].take("late", 10, now)
	stale := false
	for round := 1; round <= 5; round++ {
		at := now.Add(time.Duration(round) * testIntervals.Read)
		syncAll(at, rest...)
		for _, n := range rest {
			if d := n.c.PeekHash(hk, 1, at); d.Allowed {
				t.Fatalf("round %d: %s grants a key at its limit while the aggregator is dead: %+v", round, n.s.instance, d)
			}
		}
		if got := aggregators(rest); len(got) != 0 {
			t.Fatalf("round %d: %v aggregate while the dead aggregator's lock holds", round, got)
		}
		if stale = at.Sub(now) > aggregateMaxAge(testIntervals); stale {
			for _, n := range rest {
				if d := n.c.PeekHash(late, 1, at); d.Allowed {
					t.Fatalf("round %d: %s grants a key b granted its limit after the aggregator died, its aggregate stale: %+v", round, n.s.instance, d)
				}
			}
		}
	}
	if !stale {
		t.Fatal("the rounds never outlived the aggregate")
	}
	st.expire(AggregateKey("z/1"))
	at := now.Add(6 * testIntervals.Read)
	syncAll(at, rest...)
	if got := aggregators(rest); len(got) != 1 || got[0] != "b" {
		t.Fatalf("aggregators %v once the dead one's lock expired, want [b]", got)
	}
	at = at.Add(testIntervals.Read)
	for _, n := range rest {
		n.s.Write(bg, at)
	}
	rest[0].s.Read(bg, at)
	loads := readsLoad(st, at, rest[1:])
	if loads != int64(len(rest)-1) {
		t.Errorf("%d instances loaded %d entries after the failover, want one each", len(rest)-1, loads)
	}
	for _, n := range rest {
		for _, h := range []uint64{hk, late} {
			if d := n.c.PeekHash(h, 1, at); d.Allowed {
				t.Errorf("%s grants a key at its limit after the failover: %+v", n.s.instance, d)
			}
		}
	}
}

// When the fleet shrinks below AggregateFrom, the aggregator deletes its
// aggregate and gives up the lock; when it stops, the same, so that the
// next instance to read takes over at once.
func TestAggregateGoesWithTheFleetOrTheAggregator(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 5)
	now := t0.Add(time.Second)
	syncAll(now, nodes...)
	a := nodes[0]
	if !a.s.agg.aggregating {
		t.Fatal("a is not the aggregator")
	}
	// a stops: b, next to read, takes over at once. (Stop without the
	// goroutine: Start would sync at the wall clock's time.)
	a.s.stop, a.s.done, a.s.cancel = make(chan struct{}), make(chan struct{}), func() {}
	close(a.s.done)
	a.s.Stop()
	if _, err := st.Load(bg, AggregateKey("z/1")); err == nil {
		t.Fatal("the aggregate outlives its aggregator's Stop")
	}
	rest := nodes[1:]
	now = now.Add(testIntervals.Read)
	syncAll(now, rest...)
	if got := aggregators(rest); len(got) != 1 || got[0] != "b" {
		t.Fatalf("aggregators %v at the first sync after the aggregator stopped, want [b]", got)
	}
	// c, d and e stop publishing: b alone is too few.
	at := now.Add(liveWrites*testIntervals.Write + time.Second)
	syncAll(at, rest[0])
	if got := aggregators(rest); len(got) != 0 {
		t.Fatalf("aggregators %v with one live instance", got)
	}
	if _, err := st.Load(bg, AggregateKey("z/1")); err == nil {
		t.Fatal("the aggregate outlives the fleet that needed it")
	}
}

// A lock can elect two aggregators (certmagic's FileStorage: two instances
// that find a dead holder's lock file stale at once both create it). Both
// publish true sums, and through the claim they are down to one, the one
// whose name sorts first, within two syncs, whichever of them read first
// and whichever was the aggregator before; the others then read the
// survivor's aggregate alone.
func TestTwoAggregatorsAreDownToOne(t *testing.T) {
	for _, tc := range []struct {
		first, second int // the aggregator, and the instance that takes its lock too
		backwards     bool
	}{
		{0, 3, false}, {0, 3, true}, {2, 1, false}, {2, 1, true},
	} {
		t.Run(fmt.Sprintf("%d_then_%d_backwards_%v", tc.first, tc.second, tc.backwards), func(t *testing.T) {
			st := newMemStorage()
			nodes := newNodes(t, st, 5)
			now := t0.Add(time.Second)
			for _, n := range nodes {
				n.take("k", 2, now) // 10 granted: the limit
				n.s.Write(bg, now)
			}
			nodes[tc.first].s.Read(bg, now)
			syncAll(now, nodes...)
			want := nodes[min(tc.first, tc.second)].s.instance
			if got := aggregators(nodes); len(got) != 1 || got[0] != nodes[tc.first].s.instance {
				t.Fatalf("aggregators %v, want [%s]", got, nodes[tc.first].s.instance)
			}
			nodes[tc.second].s.agg.aggregating = true // its Lock succeeded too
			order := slices.Clone(nodes)
			if tc.backwards {
				slices.Reverse(order)
			}
			for round := 1; round <= 2; round++ {
				now = now.Add(testIntervals.Read)
				syncAll(now, order...)
			}
			if got := aggregators(nodes); len(got) != 1 || got[0] != want {
				t.Fatalf("aggregators %v two syncs after two took the lock, want [%s]", got, want)
			}
			if cl, err := decodeClaim(st.data[ClaimKey("z/1")]); err != nil || cl.name != want {
				t.Fatalf("the claim names %q (%v), want %s", cl.name, err, want)
			}
			now = now.Add(testIntervals.Read)
			for _, n := range nodes {
				n.s.Write(bg, now)
			}
			var agg *node
			var rest []*node
			for _, n := range nodes {
				if n.s.instance == want {
					agg = n
				} else {
					rest = append(rest, n)
				}
			}
			agg.s.Read(bg, now)
			if loads := readsLoad(st, now, rest); loads != int64(len(rest)) {
				t.Errorf("%d instances loaded %d entries, want one each: the survivor's aggregate", len(rest), loads)
			}
			for _, n := range nodes {
				if d := n.c.PeekHash(hk, 1, now); d.Allowed {
					t.Errorf("%s grants a key at its limit: %+v", n.s.instance, d)
				}
			}
			// The yield freed the lock (memStorage's Unlock, as
			// FileStorage's, removes it whoever took it): an aggregate
			// missing once sends nobody after it while the survivor's
			// claim is fresh.
			became := func() (k int) {
				for _, n := range rest {
					k += n.logs.FilterMessage(aggregatingLog).Len()
				}
				return k
			}
			before := became()
			st.expire(AggregateKey("z/1"))
			delete(st.data, AggregateKey("z/1"))
			now = now.Add(testIntervals.Read)
			syncAll(now, order...)
			if got := aggregators(nodes); len(got) != 1 || got[0] != want || became() != before {
				t.Errorf("aggregators %v, %d more taken, after the survivor's aggregate went missing once, want [%s] and none", got, became()-before, want)
			}
		})
	}
}

// Two aggregators whose clocks disagree by more than an aggregate's age
// (d's runs 3 read intervals ahead) still see each other's claims, by
// their change, and are down to one.
func TestTwoAggregatorsWithSkewedClocksAreDownToOne(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 5)
	skew := 3 * testIntervals.Read
	clock := func(n *node, now time.Time) time.Time {
		if n.s.instance == "d" {
			return now.Add(skew)
		}
		return now
	}
	round := func(now time.Time) {
		for _, n := range nodes {
			n.s.Write(bg, clock(n, now))
		}
		for _, n := range nodes {
			n.s.Read(bg, clock(n, now))
		}
	}
	now := t0.Add(time.Second)
	round(now)
	if got := aggregators(nodes); len(got) != 1 || got[0] != "a" {
		t.Fatalf("aggregators %v, want [a]", got)
	}
	nodes[3].s.agg.aggregating = true // d took the lock too
	for range 3 {
		now = now.Add(testIntervals.Read)
		round(now)
	}
	if got := aggregators(nodes); len(got) != 1 || got[0] != "a" {
		t.Fatalf("aggregators %v three syncs after d, its clock %v ahead, took the lock too, want [a]", got, skew)
	}
}

// A second aggregator that stops (or finds the fleet too small) before it
// has yielded leaves the first one's aggregate and claim where they are.
func TestASecondAggregatorStoppingLeavesTheFirstOnesAggregate(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 5)
	now := t0.Add(time.Second)
	syncAll(now, nodes...)
	if got := aggregators(nodes); len(got) != 1 || got[0] != "a" {
		t.Fatalf("aggregators %v, want [a]", got)
	}
	d := nodes[3]
	d.s.agg.aggregating = true // it took the lock too, and stops at once
	d.s.stop, d.s.done, d.s.cancel = make(chan struct{}), make(chan struct{}), func() {}
	close(d.s.done)
	d.s.Stop()
	if _, err := st.Load(bg, AggregateKey("z/1")); err != nil {
		t.Errorf("a's aggregate is gone after d stopped: %v", err)
	}
	if cl, err := decodeClaim(st.data[ClaimKey("z/1")]); err != nil || cl.name != "a" {
		t.Errorf("the claim names %q (%v) after d stopped, want a", cl.name, err)
	}
}

// A claim is an input from a peer: one that is not well-formed, or dated
// further ahead than the tolerated skew, is no claim (the malformed one
// counted as skipped) and the aggregator publishes over it; a forged claim
// for a name that sorts first makes the aggregator give up, which costs
// reads and leaves the counts whole.
func TestAggregatorClaimsAreCheckedLikeAnyPeerInput(t *testing.T) {
	good := appendClaim(nil, "0", t0)
	if cl, err := decodeClaim(good); err != nil || cl != (claim{name: "0", at: t0.UnixNano()}) {
		t.Fatalf("a claim decodes as %+v %v", cl, err)
	}
	bad := map[string][]byte{
		"empty":     nil,
		"magic":     append([]byte("FGAX"), good[4:]...),
		"version":   append([]byte("FGAC\x02"), good[5:]...),
		"checksum":  append(slices.Clone(good[:len(good)-1]), good[len(good)-1]^1),
		"truncated": good[:len(good)-3],
		"no name":   appendClaim(nil, "", t0),
		"long name": appendClaim(nil, string(make([]byte, maxInstanceLen+1)), t0),
		"trailing": func() []byte {
			b := slices.Clone(good[:len(good)-4])
			b = append(b, 0)
			return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
		}(),
	}
	for what, data := range bad {
		if _, err := decodeClaim(data); err == nil {
			t.Errorf("%s: a claim decoded", what)
		}
	}
	if len(appendClaim(nil, string(make([]byte, maxInstanceLen)), time.Unix(0, -1<<63))) > maxClaimSize {
		t.Error("the largest claim is over maxClaimSize")
	}

	for _, tc := range []struct {
		what    string
		claim   []byte
		gives   bool
		skipped uint64
	}{
		{"malformed", []byte("FGAC\x01junk"), false, 1},
		{"from the future", appendClaim(nil, "0", t0.Add(time.Second+MaxClockSkew+time.Second)), false, 0},
		{"stale", appendClaim(nil, "0", t0.Add(time.Second-aggregateMaxAge(testIntervals)-time.Nanosecond)), false, 0},
		{"forged, fresh", appendClaim(nil, "0", t0.Add(time.Second)), true, 0},
	} {
		t.Run(tc.what, func(t *testing.T) {
			st := newMemStorage()
			nodes := newNodes(t, st, 4)
			now := t0.Add(time.Second)
			st.data[ClaimKey("z/1")] = tc.claim
			for _, n := range nodes {
				n.take("k", 3, now) // 12 of a limit of 10
			}
			syncAll(now, nodes...)
			if got := aggregators(nodes); (len(got) == 0) != tc.gives {
				t.Errorf("aggregators %v with a %s claim", got, tc.what)
			}
			if got := nodes[0].c.Skipped(); got != tc.skipped {
				t.Errorf("the aggregator skipped %d entries, want %d", got, tc.skipped)
			}
			for _, n := range nodes {
				if d := n.c.PeekHash(hk, 1, now); d.Allowed {
					t.Errorf("%s grants a key over its limit: %+v", n.s.instance, d)
				}
			}
		})
	}
}

// A claim seen to change counts as fresh only between two looks close
// together: an instance that last looked long ago (it read an aggregate
// all along) and now finds a claim that changed since, but whose date is
// stale, takes it for a dead aggregator's and may try the lock.
func TestAClaimChangedAfterALongGapIsJudgedByItsDate(t *testing.T) {
	st := newMemStorage()
	b := newNode(t, st, "b")
	st.data[ClaimKey("z/1")] = appendClaim(nil, "a", t0)
	if got := b.s.agg.otherClaim(bg, t0); got != "a" {
		t.Fatalf("a fresh claim by a: %q", got)
	}
	later := t0.Add(time.Hour)
	st.data[ClaimKey("z/1")] = appendClaim(nil, "0", later.Add(-time.Minute))
	if got := b.s.agg.otherClaim(bg, later); got != "" {
		t.Fatalf("a claim dated a minute back, changed since a look an hour ago, taken for fresh: %q", got)
	}
	// Between two looks one read interval apart, a change is fresh
	// whatever its date (the claimant's clock may run behind).
	next := later.Add(testIntervals.Read)
	st.data[ClaimKey("z/1")] = appendClaim(nil, "0", later.Add(-time.Minute+time.Nanosecond))
	if got := b.s.agg.otherClaim(bg, next); got != "0" {
		t.Fatalf("a claim changed since a look one read interval ago: %q", got)
	}
}

// A lock that nobody is seen to use does not stop the fleet from
// aggregating for good. A ghost holds the aggregator lock (as a lock file
// kept fresh after its holder let it go does) and publishes nothing. The
// instances try the lock at every read in vain; while the ghost names
// itself in a fresh claim they leave it alone, and the wait starts again;
// once it does not, after orphanLockAge of failed attempts, the first to
// read aggregates without the lock (not on a read its context ended), and
// the others read its aggregate. Giving the role up, it leaves the lock
// to its holder.
func TestALockNobodyUsesIsAggregatedWithout(t *testing.T) {
	st := newMemStorage()
	nodes := newNodes(t, st, 5)
	if err := st.Lock(bg, AggregateKey("z/1")); err != nil {
		t.Fatal(err)
	}
	before := t0.Add(time.Second)
	age := orphanLockAge(testIntervals)
	for at := before; at.Sub(before) < age*3/4; at = at.Add(testIntervals.Read) {
		syncAll(at, nodes...)
		if got := aggregators(nodes); len(got) != 0 {
			t.Fatalf("aggregators %v %v after the lock was first found held, want none before %v", got, at.Sub(before), age)
		}
	}
	now := before.Add(age)
	for at := now; at.Sub(now) <= 2*age; at = at.Add(testIntervals.Read) {
		if err := st.Store(bg, ClaimKey("z/1"), appendClaim(nil, "ghost", at)); err != nil {
			t.Fatal(err)
		}
		syncAll(at, nodes...)
		if got := aggregators(nodes); len(got) != 0 {
			t.Fatalf("aggregators %v %v after the ghost's fresh claim began, want none", got, at.Sub(now))
		}
	}
	if err := st.Delete(bg, ClaimKey("z/1")); err != nil {
		t.Fatal(err)
	}
	start := now.Add(2*age + testIntervals.Read)
	for at := start; ; at = at.Add(testIntervals.Read) {
		if at.Sub(start) >= age {
			// A read ended by its context (Stop) neither aggregates
			// without the lock nor ends the wait.
			ctx, cancel := context.WithCancel(bg)
			cancel()
			nodes[0].s.Read(ctx, at)
			if got := aggregators(nodes); len(got) != 0 {
				t.Fatalf("aggregators %v after a read whose context had ended", got)
			}
		}
		if at.Sub(start) == age/2 {
			// One sync with too few instances live for an aggregate
			// (late writes on a loaded machine): it tells nothing of
			// the lock, and the wait goes on.
			for _, n := range nodes {
				n.s.agg.from = len(nodes) + 1
			}
			syncAll(at, nodes...)
			for _, n := range nodes {
				n.s.agg.from = AggregateFrom
			}
		}
		syncAll(at, nodes...)
		got := aggregators(nodes)
		if at.Sub(start) < age {
			if len(got) != 0 {
				t.Fatalf("aggregators %v %v after the lock was first found held, want none before %v", got, at.Sub(start), age)
			}
			continue
		}
		if len(got) != 1 || got[0] != "a" {
			t.Fatalf("aggregators %v %v after the lock was first found held, want [a]", got, at.Sub(start))
		}
		for _, n := range nodes[1:] {
			if n.s.lastRead != aggregateUsed {
				t.Errorf("%s did not read a's aggregate", n.s.instance)
			}
		}
		// Giving the role up, a leaves the lock it never took to its
		// holder (file_system's Unlock would remove the holder's file).
		nodes[0].s.agg.drop(bg, "stopping", 0)
		if err := st.Lock(bg, AggregateKey("z/1")); err == nil {
			t.Fatal("the instance that aggregated without the lock freed it when it gave the role up")
		}
		// The others' waits ended as they read a's aggregate: with it
		// gone, none goes without the lock before a whole age again.
		syncAll(at.Add(testIntervals.Read), nodes...)
		if got := aggregators(nodes); len(got) != 0 {
			t.Fatalf("aggregators %v a read after a gave the role up, want none: reading its aggregate ends the wait", got)
		}
		break
	}
}
