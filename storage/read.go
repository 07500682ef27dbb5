package storage

import (
	"context"
	"errors"
	"io/fs"
	"math"
	"path"
	"time"

	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Read replaces the Cluster's peers' sum with the sum of every other
// instance's latest snapshot of the zone as at now: from the zone's
// aggregate when there is a fresh one it can use (aggregate.go), else from
// the snapshots themselves. Reading those, snapshots older than the purge
// age are deleted, and entries that are not well-formed snapshots are
// skipped and counted; the aggregator then publishes their aggregate, and
// an instance that found none fresh tries to become the aggregator
// (aggregator.elect). If listing fails the previous sum is kept: its
// counts age out with their windows, so a storage outage degrades to
// local limiting.
//
// Key resets that a snapshot lists and this instance does not know yet are
// applied to its own counts, and the sum is built of each snapshot less
// its counts of the keys of known resets that it does not list (see
// resets.go). Each snapshot is added as it is loaded, so a read holds one
// peer's snapshot at a time (at most about 6 bytes per sketch cell, usually
// much less); a read on which a snapshot lists a reset learned after
// others were added is done again holding them all (sumSnapshots).
func (s *Syncer) Read(ctx context.Context, now time.Time) {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	defer func() { clear(s.snaps) }() // no snapshot outlives its read
	s.lifted = s.lifted[:0]
	s.followStep(now)
	found := aggregateNone
	defer func() { s.lastRead = found }()
	if !s.agg.aggregating {
		found = s.readAggregate(ctx, now)
		if found != aggregateNone {
			s.agg.seen() // a fresh aggregate: somebody aggregates
		}
		if found == aggregateUsed {
			s.ok(OpRead, now)
			return
		}
	}
	dir := Dir(c.shape.Zone)
	own := s.proc.name(s.instance)
	keys, err := s.st.List(ctx, dir, false)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.readFailed(now, err)
		return
	}
	sum, mine, seq, ok := s.sumSnapshots(ctx, now, keys, true)
	if ok && sum == nil {
		// A snapshot listed a reset that this instance learned only after
		// it had added others, which may count the key: read again, holding
		// them all until every reset they list is known.
		sum, mine, seq, ok = s.sumSnapshots(ctx, now, keys, false)
	}
	if !ok {
		return
	}
	added := s.snaps
	// The instances live now (sight), this one's rank among them by
	// name, and how late they publish, for the shares.
	live, rank := 1, 0
	for _, snap := range added {
		if s.sight(now, snap.instance, snap.written.UnixNano(), s.iv.Write+s.iv.Read) {
			live++
			if snap.instance < own {
				rank++
			}
		}
	}
	late := s.endSight(now)
	s.forgetClocks(now)
	if s.agg.elect(ctx, now, live, len(added), found) {
		s.publishAggregate(ctx, now, sum, added, mine)
	}
	s.replaceView(now, sum, live, rank, seq, added, 0, late)
	s.ok(OpRead, now)
}

// sumSnapshots loads the snapshots under keys (the zone's listing) and
// returns the sum of the peers' ones as at now, less their counts of the
// keys of the resets they do not list (see resets.go), with this
// instance's own stored snapshot (nil if none) and learnResets' sequence
// number; s.snaps holds the snapshots added, without their sketches if
// stream is set. ok is false if the storage failed (the failure is
// handled).
//
// If stream is set, each snapshot is added to the sum as soon as it is
// loaded, so that a read holds one peer's snapshot at a time, however many
// instances there are. A snapshot may list a reset that this instance
// learns from it only after it has added others that may count the key:
// then it returns a nil sum, for Read to read again without stream, which
// loads every snapshot and learns every reset they list before it adds
// any of them up (resets are rare: the admin API's, and the peers').
func (s *Syncer) sumSnapshots(ctx context.Context, now time.Time, keys []string, stream bool) (sum *limiter.SketchSum, mine *snapshot, seq uint64, ok bool) {
	c := s.c
	dir := Dir(c.shape.Zone)
	own := s.proc.name(s.instance)
	s.snaps = s.snaps[:0]
	if stream {
		seq = s.learnResets(now, nil)
		sum = c.sketch.NewSketchSum(now)
	}
	for _, key := range keys {
		name := path.Base(key)
		if path.Dir(key) != dir {
			continue
		}
		if name == own {
			mine = s.checkOwn(ctx, key, now)
			continue
		}
		data, err := s.load(ctx, key, maxSnapshotSize(c.shape))
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				continue // deleted since the listing
			}
			if ctx.Err() != nil {
				s.readFailed(now, err)
				return nil, nil, 0, false
			}
			s.skipped(key, err) // a directory, an unreadable file, one too large
			continue
		}
		snap, err := decodeSnapshot(data, MitigationSlots, MaxResets)
		if err == nil && snap.instance != name {
			err = errors.New("snapshot of instance " + snap.instance + " under another name")
		}
		if err != nil {
			s.skipped(key, err)
			continue
		}
		if s.proc.ours(key, writtenOf(snap.written, data)) {
			continue // this process's state under the name it published as before its alias
		}
		if ahead := snap.written.Sub(now); ahead > MaxClockSkew {
			if err := s.st.Delete(ctx, key); err == nil && now.Sub(s.skewLogged) >= s.iv.PurgeAge {
				s.skewLogged = now
				s.log.Warn("deleted the snapshot of an instance whose clock is ahead by more than the tolerated skew",
					zap.String("zone", c.shape.Zone), zap.String("instance", name), zap.Duration("ahead", ahead),
					zap.Duration("max_clock_skew", MaxClockSkew))
			}
			continue
		}
		if now.Sub(snap.written) > s.iv.PurgeAge {
			// Still a peer to a process none of whose publishes
			// landed (shareRank): its process may be granting
			// unseen, its writes failing as this one's do. So an
			// instance whose own publishes are stale deletes
			// none: in a write outage on every instance (where a
			// delete may yet land: a full disk) the snapshots stay
			// for the processes started during it to find.
			s.oldPeer = true
			if s.publishStale(now) {
				continue
			}
			if err := s.st.Delete(ctx, key); err == nil {
				s.log.Info("deleted the snapshot of an instance gone for longer than purge_age",
					zap.String("zone", c.shape.Zone), zap.String("instance", name), zap.Time("written", snap.written))
			}
			continue
		}
		snap.shift, snap.early = s.clockShift(now, name, snap.written.UnixNano())
		if stream {
			if s.teaches(now, snap) {
				if len(s.snaps) > 0 {
					return nil, nil, 0, true // see Read
				}
				seq = s.learnResets(now, []*snapshot{snap})
			}
			if !s.addTo(sum, snap) {
				continue
			}
			snap.sketch = nil // added: what is kept of it is small
		}
		s.snaps = append(s.snaps, snap)
	}
	if stream {
		return sum, mine, seq, true
	}
	seq = s.learnResets(now, s.snaps)
	sum = c.sketch.NewSketchSum(now)
	added := s.snaps[:0]
	for _, snap := range s.snaps {
		if s.addTo(sum, snap) {
			added = append(added, snap)
		}
	}
	clear(s.snaps[len(added):]) // Read clears only what is left in s.snaps
	s.snaps = added
	return sum, mine, seq, true
}

// addTo adds snap's sketch to sum, less its counts of the keys of the
// resets known here that it does not list, placed on this instance's
// clock (snap.shift), and reports whether it could (a sketch that is not
// well formed is skipped and counted).
func (s *Syncer) addTo(sum *limiter.SketchSum, snap *snapshot) bool {
	s.forget = appendForgets(s.forget[:0], s.latest, snap.resets, s.listed)
	if _, err := sum.AddBinaryLinger(snap.sketch, s.forget, snap.shift, snap.early); err != nil {
		s.skipped(Key(s.c.shape.Zone, snap.instance), err)
		return false
	}
	return true
}

// teaches reports whether snap lists a reset this instance does not know
// and would learn (learnResets).
func (s *Syncer) teaches(now time.Time, snap *snapshot) bool {
	c := s.c
	c.rmu.Lock()
	defer c.rmu.Unlock()
	for _, r := range snap.resets {
		if c.learnableLocked(r, now.UnixNano()) {
			return true
		}
	}
	return false
}

// learnResets applies to this instance's counts the resets that the
// sources list and it does not know yet, adding their keys to s.lifted
// (which Read empties when it starts), fills s.latest with every key's
// latest known reset, and returns the reset table's sequence number then.
// The caller holds c.mu.
func (s *Syncer) learnResets(now time.Time, srcs []*snapshot) uint64 {
	c := s.c
	n := now.UnixNano()
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.pruneLocked(n)
	for _, snap := range srcs {
		for _, r := range snap.resets {
			if c.learnableLocked(r, n) {
				c.applyLocked(r, now)
				s.lifted = append(s.lifted, r.hash)
			}
		}
	}
	c.latestResetsLocked(s.latest)
	return c.resets.seq
}

// replaceView makes sum, the peers' sum as read at now, the one decisions
// read, with each key's share of what the cluster has left over the live
// instances (this one ranked rank), and replaces the peers' blocks with
// those of the sources the sum was read from (snapshots, or an
// aggregate). seq is learnResets' sequence number: resets recorded since
// are taken out of the sum here. The caller holds c.mu.
//
// lag is how much older the view is than a direct read of every snapshot
// would be (an aggregate's: up to the aggregator's read interval): what
// the shares assume the others have published and this one has read by a
// time waits that much longer. late is how late the live peers publish
// (sight): what the shares assume the others have published waits
// that much longer too. A key counted by this instance alone is let off
// its share (sole) after lag but not late: a dead peer counts as live,
// and late, for up to liveWrites write intervals, and every key of one
// instance would wait that long for its whole limit.
func (s *Syncer) replaceView(now time.Time, sum *limiter.SketchSum, live, rank int, seq uint64, srcs []*snapshot, lag, late time.Duration) {
	c := s.c
	n := now.UnixNano()
	// Each key's share of what the cluster has left, over the instances
	// live now. The instances are ranked by name, for the remainders of
	// the shares.
	shared, sole := sum, []uint64(nil)
	if c.split.Load() {
		sole = s.sole(now, sum, lag)
		r, of := s.shareRank(now, live, rank, lag)
		shared = sum.WithSharesSole(c.sketch, live, r, of, now, c.shared.Load(), shareHold(s.iv)+2*(lag+late), sole, s.seenSnapshot(now, lag))
	}

	c.rmu.Lock()
	defer c.rmu.Unlock()
	// Resets asked for here while the sum was built: no snapshot lists
	// them.
	for _, e := range c.resets.list {
		if e.seq > seq {
			sum.ForgetHash(e.hash, time.Unix(0, e.at))
			if shared != sum {
				shared.ForgetHash(e.hash, time.Unix(0, e.at))
			}
			s.lifted = append(s.lifted, e.hash)
			s.latest[e.hash] = max(s.latest[e.hash], e.at)
		}
	}
	c.peers.Store(sum)
	c.shared.Store(shared)
	c.live.Store(int64(live))
	c.sole.Store(&sole)
	// The keys' blocks are lifted once neither the own counts nor the sum
	// count them any more (see mitigate); then the peers' blocks are
	// added, but not those of a key from a snapshot that predates its
	// reset.
	for _, h := range s.lifted {
		c.blocks.remove(h, math.MaxInt64)
	}
	// A peer's block lasts at most a window, and only while its snapshot
	// lists it: the blocks no snapshot of this read listed are lifted.
	c.readGen++
	for _, snap := range srcs {
		s.forget = appendForgets(s.forget[:0], s.latest, snap.resets, s.listed)
		for _, b := range snap.blocks {
			if !forgotten(s.forget, b.hash) {
				c.blocks.addPeer(b.hash, peerBlockUntil(b.until, snap.written.UnixNano(), n, c.shape.Window), n, c.readGen)
			}
		}
	}
	c.blocks.dropStalePeers(c.readGen)
}

// readFailed counts and logs a failed read, and drops this instance's
// shares (see SplitBursts): without a view of the others they cannot be
// re-balanced, and the instance limits with its own counts and the peers'
// last ones, as it would without shares. The shares go before the warning
// is logged, so that whoever reads the warning finds the instance on its
// local limit.
func (s *Syncer) readFailed(now time.Time, err error) {
	s.c.rmu.Lock()
	s.c.shared.Store(s.c.peers.Load())
	s.c.rmu.Unlock()
	s.failed(OpRead, now, err)
}
