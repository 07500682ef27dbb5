package storage

import (
	"context"
	"errors"
	"io/fs"
	"time"

	"go.uber.org/zap"
)

// aggregateLockTry is how long an instance waits for the aggregator lock
// before it gives up until its next read.
const aggregateLockTry = 100 * time.Millisecond

// tryAggregator tries to take the zone's aggregator lock without waiting
// for it, and reports whether this instance is the aggregator. Once its
// attempts have failed for orphanLockAge (lockHeldSince), with no
// aggregate and no claim by another seen meanwhile, it aggregates without
// the lock.
func (s *Syncer) tryAggregator(ctx context.Context, now time.Time) bool {
	lctx, cancel := context.WithTimeout(ctx, aggregateLockTry)
	defer cancel()
	err := s.st.Lock(lctx, AggregateKey(s.c.shape.Zone))
	if err != nil {
		// A read that ran out of time, or that Stop ended, failed by
		// no doing of the lock's: the wait goes on as it was.
		if ctx.Err() != nil {
			return false
		}
		if s.lockHeldSince.IsZero() {
			s.lockHeldSince = now
		}
		if now.Sub(s.lockHeldSince) < orphanLockAge(s.iv) {
			return false
		}
		s.log.Warn("the aggregator lock is held, but nobody has aggregated or claimed the role since: this instance aggregates without the lock",
			zap.String("zone", s.c.shape.Zone), zap.Duration("held_for", now.Sub(s.lockHeldSince)), zap.Error(err))
	}
	s.aggregating, s.locked, s.lockHeldSince = true, err == nil, time.Time{}
	s.log.Info("this instance aggregates the zone's cluster state", zap.String("zone", s.c.shape.Zone))
	return true
}

// orphanLockAge is how long an instance tries the aggregator lock in vain,
// finding no aggregate and no claim by another instance at any read
// meanwhile (a read with too few instances live for an aggregate, or a
// failed one, tells nothing either way), before it aggregates without the
// lock. The lock is only the first step
// of the election (the claim settles it, see below), and a storage's lock
// can outlive every holder: in our tests on certmagic's FileStorage, after
// the last aggregator had given the lock up, every instance found its lock
// file fresh for 40 s on end, none holding it (the goroutine that keeps a
// lock file fresh outlives Unlock and freshens whatever file is at that
// path when it wakes), and no instance would have aggregated again. The
// age is twice the longest a lock of a dead holder lasts in the storages
// we know (FileStorage: 10 s; caddy-storage-redis: 5 s), so a dead
// aggregator's lock is taken over through the storage first; an
// aggregator that holds the lock and publishes, every instance reading at
// the zone's one read_interval, keeps it from being reached (its aggregate
// or its claim is fresh at each read). An instance that aggregates
// without the lock never unlocks it (releaseAggregator).
func orphanLockAge(iv Intervals) time.Duration { return max(20*time.Second, 4*iv.Read) }

// releaseAggregator gives up the role, and the aggregator lock if this
// instance took it.
func (s *Syncer) releaseAggregator(ctx context.Context) {
	if !s.aggregating {
		return
	}
	s.aggregating = false
	if s.locked {
		// Only a lock this instance took: file_system's Unlock removes
		// the lock file whoever holds it.
		s.locked = false
		_ = s.st.Unlock(ctx, AggregateKey(s.c.shape.Zone))
	}
}

// dropAggregate deletes the aggregate this instance publishes and its
// claim (unless another instance's claim is there), and gives up the
// lock: at Stop, so that another instance takes over at its next read
// rather than once the aggregate is stale, and when the fleet is too small
// (or too large) for one. It says so, and why, in the log, where the
// aggregator's hand-overs can be followed.
func (s *Syncer) dropAggregate(ctx context.Context, why string, live int) {
	if cl, ok := s.loadClaim(ctx); !ok || s.ownClaim(cl) {
		// Not while another aggregator claims the role: the aggregate
		// is then likely its.
		_ = s.st.Delete(ctx, AggregateKey(s.c.shape.Zone))
		_ = s.st.Delete(ctx, ClaimKey(s.c.shape.Zone))
	}
	s.releaseAggregator(ctx)
	s.gaveUp(why, live)
}

// gaveUp logs that this instance no longer aggregates, and why.
func (s *Syncer) gaveUp(why string, live int, fields ...zap.Field) {
	s.log.Info("this instance no longer aggregates the zone's cluster state",
		append([]zap.Field{zap.String("zone", s.c.shape.Zone), zap.String("why", why), zap.Int("live_instances", live)}, fields...)...)
}

// The aggregator's claim. The storage's lock elects one aggregator, but
// not always only one: certmagic's FileStorage removes a lock file it finds
// stale and creates it again, so two instances that find the dead
// aggregator's lock stale at once can both end up holding it (and its
// Unlock removes the lock file whoever created it); any storage's lock is
// lost during a long enough stall. Two aggregators each publish a true
// sum, but each reads every snapshot, which the aggregate is there to
// save. So an aggregator names itself, before each publish, in a small
// entry under ClaimKey, with the time. A claim is fresh while it is dated
// at most aggregateMaxAge before the reader's clock (and MaxClockSkew
// after), or while the reader has seen it change within that age by its
// own clock between two looks within that age: so instances whose clocks
// disagree by more than the age still see each other's claims. An
// aggregator that finds a fresh claim naming another instance whose id
// sorts before its own gives the role up,
// leaving that one's aggregate and claim; an instance that finds no fresh
// aggregate but a fresh claim by another does not try the lock, which a
// yield may have freed while the claimant aggregates on. So two
// aggregators are down to one within about two read intervals of both
// publishing. An aggregator that stops or finds the fleet too small
// deletes the aggregate and the claim only if the claim is its own.
//
// A claim is an input from a peer like any: size-checked and checksummed.
// Forged claims can make every aggregator give up, which costs each
// instance a read of every snapshot, as without an aggregate, and imposes
// nothing on the counts.

// loadClaim returns the zone's claim, if there is a well-formed one.
func (s *Syncer) loadClaim(ctx context.Context) (claim, bool) {
	key := ClaimKey(s.c.shape.Zone)
	data, err := s.load(ctx, key, int64(maxClaimSize))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) && ctx.Err() == nil {
			s.skipped(key, err)
		}
		return claim{}, false
	}
	cl, err := decodeClaim(data)
	if err != nil {
		s.skipped(key, err)
		return claim{}, false
	}
	return cl, true
}

// ownClaim reports whether cl is this instance's: under the name it
// publishes as, or the last claim it stored, or tried to (under the
// instance id, before it took an alias: identity.go). Any other claim
// under the id is another process's.
func (s *Syncer) ownClaim(cl claim) bool {
	return cl.name == s.proc.name(s.instance) || cl == s.claimStored
}

// otherClaim reads the zone's claim at now and returns the instance it
// names, if that is another one and the claim is fresh: dated at most
// aggregateMaxAge before now and MaxClockSkew after, or seen to change
// within aggregateMaxAge of now by this instance's clock (to an instance
// whose clock runs ahead of the claimant's by more than that age, every
// claim would look stale by its date) since a look within that age. The
// caller holds c.mu.
func (s *Syncer) otherClaim(ctx context.Context, now time.Time) string {
	cl, ok := s.loadClaim(ctx)
	if !ok {
		return ""
	}
	maxAge := aggregateMaxAge(s.iv)
	if s.claimSeen.name != "" && cl != s.claimSeen && now.Sub(s.claimSeenAt) <= maxAge {
		// Changed between two looks close enough together that the
		// claimant lives; after a longer gap only its date can tell.
		s.claimMoved = now
	}
	s.claimSeen, s.claimSeenAt = cl, now
	if s.ownClaim(cl) {
		return ""
	}
	if age := now.Sub(time.Unix(0, cl.at)); age <= maxAge && -age <= MaxClockSkew || !s.claimMoved.IsZero() && now.Sub(s.claimMoved) <= maxAge {
		return cl.name
	}
	return ""
}

// storeClaim names this instance the zone's aggregator as of now. The
// caller holds c.mu.
func (s *Syncer) storeClaim(ctx context.Context, now time.Time) {
	cl := claim{name: s.proc.name(s.instance), at: now.UnixNano()}
	// Known for this instance's before it is stored: a store that fails
	// (times out) may still land.
	s.claimStored = cl
	if err := s.st.Store(ctx, ClaimKey(s.c.shape.Zone), appendClaim(nil, cl.name, now)); err != nil {
		s.failed(OpWrite, now, err)
		return
	}
	s.claimSeen, s.claimSeenAt = cl, now
}
