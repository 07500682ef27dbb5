package storage

import (
	"context"
	"errors"
	"io/fs"
	"time"

	"go.uber.org/zap"
)

// Write publishes the Cluster's sketch and own blocks as at now. Before
// its first write it restores this instance's last published state (see
// Restore); while that fails it publishes nothing.
func (s *Syncer) Write(ctx context.Context, now time.Time) {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.restored {
		if err := s.restoreLocked(ctx, now); err != nil {
			s.failed(OpRestore, now, err)
			return
		}
	}
	// The resets are read before the counts: a snapshot must list only
	// resets its counts have had applied. One applied in between is not
	// listed, so the others forget this snapshot's counts of the key too.
	c.rmu.Lock()
	c.pruneLocked(now.UnixNano())
	s.resets = c.appendResetsLocked(s.resets[:0])
	c.rmu.Unlock()
	s.sk, _ = c.sketch.AppendSnapshot(s.sk[:0], now)
	s.blocks = c.blocks.appendOwn(s.blocks[:0], now.UnixNano())
	name := s.proc.name(s.instance)
	key := Key(c.shape.Zone, name)
	s.buf = appendSnapshot(s.buf[:0], name, now, s.sk, s.blocks, s.resets)
	s.proc.noteWrite(key, now, s.buf, s.iv.PurgeAge)
	s.noteOwnLocked(key, writtenOf(now, s.buf), s.buf, false)
	if err := s.st.Store(ctx, key, s.buf); err != nil {
		s.failed(OpWrite, now, err)
		return
	}
	c.own[0].landed = true
	s.proc.noteLanded(key, writtenOf(now, s.buf))
	s.noteStreak(name, now, now, false)
	s.ok(OpWrite, now)
}

// Restore loads this instance's own last snapshot, if any, into the
// Cluster once per Cluster: a restarted instance keeps what its keys used
// before, so a key exhausted before a restart (or a crash after the last
// write) is still exhausted after it.
func (s *Syncer) Restore(ctx context.Context, now time.Time) error {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	if s.c.restored || s.st == nil {
		return nil
	}
	return s.restoreLocked(ctx, now)
}

func (s *Syncer) restoreLocked(ctx context.Context, now time.Time) error {
	c := s.c
	data, err := s.load(ctx, Key(c.shape.Zone, s.instance), maxSnapshotSize(c.shape))
	if errors.Is(err, fs.ErrNotExist) {
		c.restored = true
		return nil
	}
	if err != nil && !errors.Is(err, errTooLarge) {
		return err
	}
	c.restored = true
	var snap *snapshot
	if err == nil {
		snap, err = decodeSnapshot(data, MitigationSlots, MaxResets)
	}
	if err == nil && snap.instance != s.instance {
		err = errors.New("snapshot of instance " + snap.instance)
	}
	if err == nil {
		// Its counts become this instance's: an aggregate that summed it
		// has them taken out (aggregate.go).
		s.noteOwnLocked(Key(c.shape.Zone, s.instance), writtenOf(snap.written, data), data, true)
		// The others may count this instance live by its last state
		// (if it is recent enough on any clock, see noteStreak).
		s.noteStreak(s.instance, snap.written, now, true)
	}
	n := now.UnixNano()
	if err == nil {
		// Resets applied here before the restore (read from a peer, or
		// asked for) that the restored state predates are left out of it;
		// those it lists were applied to it, and are known from now on.
		c.rmu.Lock()
		c.pruneLocked(n)
		c.latestResetsLocked(s.latest)
		s.forget = appendForgets(s.forget[:0], s.latest, snap.resets, s.listed)
		if err = c.sketch.MergeBinaryForgetting(snap.sketch, now, s.forget); err == nil {
			for _, r := range snap.resets {
				if c.learnableLocked(r, n) {
					c.recordLocked(r)
				}
			}
		}
		c.rmu.Unlock()
	}
	if err != nil {
		// Not ours to trust; it is overwritten by the next write.
		s.skipped(Key(c.shape.Zone, s.instance), err)
		return nil
	}
	for _, b := range snap.blocks {
		if !forgotten(s.forget, b.hash) {
			c.blocks.add(b.hash, peerBlockUntil(b.until, snap.written.UnixNano(), n, c.shape.Window), n)
		}
	}
	s.log.Info("restored this instance's cluster state", zap.String("zone", c.shape.Zone),
		zap.Time("written", snap.written), zap.Int("blocked_keys", len(snap.blocks)))
	return nil
}
