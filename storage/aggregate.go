package storage

import (
	"cmp"
	"context"
	"errors"
	"io/fs"
	"net/url"
	"slices"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// The aggregate: a sync whose cost does not grow with the fleet.
//
// Reading every peer's snapshot costs each instance N − 1 loads per read
// interval, and the cluster N². So once a zone has AggregateFrom live
// instances, one of them, the aggregator, publishes after each of its
// reads the sum of every live snapshot (its own included) as one
// aggregate under AggregateKey, with the union of their blocks, the resets
// the sum has had applied, and the list of the instances it summed (name,
// write time and checksum of the snapshot it took, and for a window zone
// by how many sub-windows it moved its counts onto its own clock,
// clockShift, and how much earlier than their writer's they may leave its
// view as moved; then also what its sum still counts of the sub-window
// before its oldest, which lingers: lingerLost). Every other instance
// then loads that one entry instead of every snapshot, and takes its own
// contribution back out: it keeps the last few snapshots it stored
// (Cluster.own), finds the one the list names, and subtracts it as the
// aggregator added it (moved as listed), so it is left with exactly the
// peers' sum the aggregator read, which it then places on its own clock
// as it places a peer's snapshot. The live instances and this one's rank among them, for
// the burst shares, come from the list. So each instance reads about one
// sketch per interval, bounded by the sketch's size, whatever N; the
// aggregator alone reads every snapshot, as every instance did before.
//
// The aggregator is elected through the storage's own lock and kept the
// only one by its claim (aggregator.go).
//
// The view an aggregate gives is older than a direct read by up to the
// aggregator's read interval: the over-admission bound grows by that
// much, which the burst shares keep in check.
//
// An aggregate is an input from a peer like a snapshot: it is size-checked
// before it is loaded, and skipped when not well-formed, when its sum is
// not of its own time's window, or when it is stale or dated more than
// MaxClockSkew ahead. Its blocks last at most a window from its write and
// go with it; its resets are learned as a snapshot's are. So an aggregator
// can impose no more than a set of valid peers could. It can hide counts
// (publish less than it read), as no single peer can: an instance then
// still limits on its own counts, its token buckets and its own blocks.

// AggregateFrom is the least number of live instances (the aggregator
// included) for which an aggregate is published: below it, reading every
// snapshot costs no more than an aggregate, without its extra lag.
const AggregateFrom = 4

// MaxAggregateMembers bounds the instances an aggregate lists: a fleet
// with more live instances than this has no aggregate, and its instances
// read every snapshot.
const MaxAggregateMembers = 1024

// aggregateMaxAge is the age past which an aggregate is stale: its
// aggregator, which publishes one every read interval, has missed one (it
// is gone, or its storage fails), and the instances read every snapshot
// again. Until then they read its last one: what they grant after the
// aggregator died reaches each other up to this much later than if it
// lived.
func aggregateMaxAge(iv Intervals) time.Duration { return 2 * iv.Read }

// AggregateKey is where a zone's aggregate is published, and the name of
// the lock that elects its aggregator. It is outside the zone's directory,
// which holds only snapshots.
func AggregateKey(zone string) string { return Prefix + "_aggregate/" + url.PathEscape(zone) }

// An ownSnapshot is one this instance stored (or restored), for taking its
// contribution out of an aggregate.
type ownSnapshot struct {
	key string
	w   written
	// landed is set once its store succeeded (or it was restored): the
	// others may not have read one whose store failed (seenSnapshot).
	landed bool
	data   []byte
}

// noteOwnLocked remembers data, stored under key, as one of the last
// snapshots of this Cluster: as many as this Syncer writes while an
// aggregate is fresh and then some (ownKept). The caller holds c.mu.
func (s *Syncer) noteOwnLocked(key string, w written, data []byte, landed bool) {
	c := s.c
	n := ownKept(s.iv)
	var reuse []byte
	if len(c.own) >= n {
		reuse = c.own[len(c.own)-1].data
		c.own = c.own[:n-1]
	}
	c.own = slices.Insert(c.own, 0, ownSnapshot{key: key, w: w, data: append(reuse[:0], data...), landed: landed})
}

// ownKept is how many of its last snapshots an instance remembers: those
// an aggregate that is not stale may have summed (written within its
// maximum age and a write interval before it), and two more for the
// overlap of two configs' syncers during a reload, at most 16 (memory: one
// snapshot each). With a write interval shorter than about an eighth of
// the read interval, an aggregate may list a snapshot the instance no
// longer remembers: it then reads every snapshot instead.
func ownKept(iv Intervals) int {
	return min(16, int((aggregateMaxAge(iv)+iv.Write)/iv.Write)+2)
}

// ownLocked returns the snapshot this Cluster stored under key as w, if it
// still remembers it. The caller holds c.mu.
func (c *Cluster) ownLocked(key string, w written) []byte {
	for _, o := range c.own {
		if o.data != nil && o.key == key && o.w == w {
			return o.data
		}
	}
	return nil
}

// aggregateRead is what readAggregate did.
type aggregateRead uint8

const (
	// aggregateNone: no fresh, well-formed aggregate; read every
	// snapshot, and try to become the aggregator.
	aggregateNone aggregateRead = iota
	// aggregateForeign: a fresh aggregate that lists a snapshot of this
	// process's that it cannot take out (one it no longer remembers), or
	// another process's under this instance's name, or one that may lack
	// counts its members still grant on (lingerLost), or that would
	// linger a sub-window or more on this clock: read every snapshot,
	// which sorts that out.
	aggregateForeign
	// aggregateUsed: the Cluster's view was replaced from the aggregate.
	aggregateUsed
)

// readAggregate replaces the Cluster's view of its peers from the zone's
// aggregate, if there is a fresh one this instance can use. The caller
// holds c.mu.
func (s *Syncer) readAggregate(ctx context.Context, now time.Time) aggregateRead {
	c := s.c
	key := AggregateKey(c.shape.Zone)
	data, err := s.load(ctx, key, maxAggregateSize(c.shape))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) && ctx.Err() == nil {
			s.skipped(key, err)
		}
		return aggregateNone
	}
	a, err := decodeAggregate(data)
	if err != nil {
		s.skipped(key, err)
		return aggregateNone
	}
	if age := now.Sub(a.written); age > aggregateMaxAge(s.iv) || -age > MaxClockSkew {
		return aggregateNone
	}
	var sum *limiter.SketchSum
	if a.tail != nil {
		sum, err = c.sketch.SketchSumOfBinaryAt(a.sketch, a.tail, a.written)
	} else {
		sum, err = c.sketch.SketchSumOfBinary(a.sketch)
	}
	if err == nil && sum.Epoch() != limiter.WindowNumber(a.written, c.sketch.Slot()) {
		err = errors.New("the aggregate's sum is not of its own time's window")
	}
	if err != nil {
		s.skipped(key, err)
		return aggregateNone
	}
	sub := c.sketch.Slot()
	var lingers time.Duration
	if c.shape.Sliding {
		// Only a window zone's sum lingers (clockShift places no
		// other zone's counts).
		lingers = membersEarly(a, sub, clockTolerance(sub))
	}
	if c.shape.Sliding && a.tail == nil && lingerLost(a, sub, clockTolerance(sub)) {
		return aggregateForeign
	}
	if c.shape.Sliding && s.clockEarly(now, a.instance, a.written.UnixNano())+lingers >= sub {
		// Placed on this clock, the sum would linger a sub-window or
		// more, which a sum cannot (limiter.SketchSum.Linger cuts it
		// there): its members' counts could leave this view before
		// they leave their writers'. Each placing is at most the
		// tolerance, a sub-window less a nanosecond (clockTolerance):
		// with clocks that agree, each is at most the delay of a find,
		// a read interval.
		return aggregateForeign
	}
	// Take this instance's own snapshots out, as the aggregator added
	// them: less the keys of the resets the aggregate lists that they do
	// not.
	noteLatests(s.aggLatest, a.resets)
	own := s.proc.name(s.instance)
	live, rank := 1, 0
	for _, m := range a.members {
		k := Key(c.shape.Zone, m.name)
		if data := c.ownLocked(k, m.w); data != nil {
			snap, err := decodeSnapshot(data, MitigationSlots, MaxResets)
			if err != nil {
				return aggregateForeign
			}
			s.forget = appendForgets(s.forget[:0], s.aggLatest, snap.resets, s.listed)
			if _, err := sum.SubtractBinaryLinger(snap.sketch, s.forget, m.shift, m.early); err != nil {
				return aggregateForeign
			}
			continue
		}
		// Under this instance's name, a snapshot it does not hold:
		// another process's, or one it no longer remembers. Under a name
		// it published as before its alias, one it stored: its own past
		// state. The full read sorts out either. Any other snapshot is a
		// peer's, even under a name this process once used: another
		// process's.
		if m.name == own || s.proc.ours(k, m.w) {
			return aggregateForeign
		}
		// A member's new snapshot is in the aggregate within a read
		// interval of its write, and found here within another.
		if s.sight(now, m.name, m.w.at, s.iv.Write+2*s.iv.Read) {
			live++
			if m.name < own {
				rank++
			}
		}
	}
	late := s.endSight(now)
	// The sum is of the aggregator's sub-windows, its members placed on
	// its clock: placed on this one's as a peer's snapshot is.
	shift, early := s.clockShift(now, a.instance, a.written.UnixNano())
	sum = sum.Later(shift, now)
	sum.Linger(early + lingers)
	s.forgetClocks(now)
	srcs := []*snapshot{&a.snapshot}
	seq := s.learnResets(now, srcs)
	// Resets known here that the aggregate does not list: the aggregator
	// had not read them, so no snapshot it summed had had them applied.
	s.forget = appendForgets(s.forget[:0], s.latest, a.resets, s.listed)
	for _, f := range s.forget {
		sum.ForgetHash(f.Hash, f.At)
	}
	s.replaceView(now, sum, live, rank, seq, srcs, s.iv.Read, late)
	return aggregateUsed
}

// noteLatests fills latest with each key's latest reset in rs.
func noteLatests(latest map[uint64]int64, rs []reset) {
	clear(latest)
	for _, r := range rs {
		noteLatest(latest, r)
	}
}

// publishAggregate stores the aggregate of a full read at now: sum, the
// peers' snapshots as added (added), plus this instance's own stored
// snapshot mine (nil if none yet), with the blocks and resets that go with
// them. The caller holds c.mu and has learned the read's resets.
func (s *Syncer) publishAggregate(ctx context.Context, now time.Time, sum *limiter.SketchSum, added []*snapshot, mine *snapshot) {
	c := s.c
	n := now.UnixNano()
	agg := sum.Clone()
	a := aggregate{snapshot: snapshot{instance: s.proc.name(s.instance), written: now}}
	untils := make(map[uint64]int64)
	note := func(snap *snapshot) {
		a.members = append(a.members, member{name: snap.instance, w: written{at: snap.written.UnixNano(), sum: snap.sum}, shift: snap.shift, early: snap.early})
		s.forget = appendForgets(s.forget[:0], s.latest, snap.resets, s.listed)
		for _, b := range snap.blocks {
			if !forgotten(s.forget, b.hash) {
				untils[b.hash] = max(untils[b.hash], peerBlockUntil(b.until, snap.written.UnixNano(), n, c.shape.Window))
			}
		}
	}
	for _, snap := range added {
		note(snap)
	}
	if mine != nil {
		note(mine)
		if _, err := agg.AddBinaryForgetting(mine.sketch, s.forget); err != nil {
			return
		}
	}
	for _, b := range c.blocks.appendOwn(s.blocks[:0], n) {
		untils[b.hash] = max(untils[b.hash], b.until)
	}
	for h, until := range untils {
		a.blocks = append(a.blocks, block{hash: h, until: until})
	}
	if len(a.blocks) > MitigationSlots {
		// Those that last longest; the others' counts still deny them.
		slices.SortFunc(a.blocks, func(x, y block) int { return cmp.Compare(y.until, x.until) })
		a.blocks = a.blocks[:MitigationSlots]
	}
	for h, at := range s.latest {
		a.resets = append(a.resets, reset{hash: h, at: at})
	}
	slices.SortFunc(a.resets, func(x, y reset) int { return cmp.Compare(x.hash, y.hash) })
	a.sketch = agg.AppendBinary(s.sk[:0])
	if sub := c.sketch.Slot(); c.shape.Sliding && lingerLost(&a, sub, clockTolerance(sub)) {
		// What the sum still lingers of the sub-window before its
		// oldest, which the older forms cannot carry.
		a.tail = agg.AppendTail(s.tail[:0])
		s.tail = a.tail
	}
	s.buf = appendAggregate(s.buf[:0], &a)
	s.sk = a.sketch
	if err := s.st.Store(ctx, AggregateKey(c.shape.Zone), s.buf); err != nil {
		s.failed(OpWrite, now, err)
	}
}

// membersEarly is how much earlier than their writers' the aggregate a's
// members' counts may leave its aggregator's view, as placed there (sub
// the sub-window, tol the tolerance): in version 3, the most of the
// members' early as the aggregator measured it (clockShift); before, at
// most the most that a member's snapshot was found after its write, less
// what its shift moved it, and never more than tol (clockShift's early),
// which a dead member still listed sets at tol.
func membersEarly(a *aggregate, sub, tol time.Duration) time.Duration {
	var most time.Duration
	for _, m := range a.members {
		if a.tail != nil {
			most = max(most, m.early)
			continue
		}
		most = max(most, min(a.written.Sub(time.Unix(0, m.w.at))-time.Duration(m.shift)*sub, tol))
	}
	return most
}

// lingerLost reports whether the aggregate a, were it written without its
// tail, may lack counts that its members still grant on (sub the
// sub-window, tol the tolerance): written within membersEarly of the start
// of its aggregator's sub-window, where the aggregator's sum still counted
// its members' sub-window before its oldest apart (its tail,
// limiter.SketchSum.AddBinaryLinger), which the binary form of the sum's
// own sub-windows does not carry. A reader of it would drop them up to
// membersEarly before their writers do, in the aggregate's sub-window,
// and one whose clock is behind the aggregator's even in the sub-window
// before (Later moves the sum back a sub-window, with nothing for its
// oldest). Written later into its sub-window, the aggregate drops nothing
// a member still counts: a member's clock is at most membersEarly behind
// the aggregator's as placed, so its counts of that sub-window left its
// own view before the aggregate was written, and every decision on the
// aggregate comes after. So the aggregator writes the tail (version 3)
// where this holds, and only there, so that an instance of an older
// version, which refuses version 3 and reads every snapshot instead, reads
// every other aggregate as before (it read every snapshot at those this
// held of with its tolerance, half a sub-window). A reader of an
// aggregate without a tail (an older aggregator's) reads every snapshot
// where this holds of it, lingering each as the aggregator did: about
// membersEarly / sub of the reads, up to every one with a dead member
// listed (docs/cluster.md has the figures).
func lingerLost(a *aggregate, sub, tol time.Duration) bool {
	start := time.Unix(0, limiter.WindowNumber(a.written, sub)*int64(sub))
	return a.written.Sub(start) < membersEarly(a, sub, tol)
}
