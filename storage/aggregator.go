package storage

import (
	"context"
	"errors"
	"io/fs"
	"time"

	"go.uber.org/zap"
)

// The election. A zone's aggregator (aggregate.go) is elected through the
// storage's own lock (certmagic.Locker, on AggregateKey): an instance that
// finds no fresh aggregate reads every snapshot, as without one, and tries
// the lock without waiting for it; it holds the lock while it runs and
// releases it at Stop (or when it yields to another aggregator, below,
// which then runs without the lock while its claim keeps the others from
// it). The storage expires the lock of a dead holder (FileStorage after
// 10 s without its refresh, caddy-storage-redis after 5 s), so when the
// aggregator dies its aggregate goes stale (aggregateMaxAge), every
// instance falls back to reading every snapshot, limiting as before, and
// the first to try the lock once it has expired takes over; a lock that
// nobody is seen to use for orphanLockAge is done without. Two aggregators
// at once (a FileStorage lock taken twice, a lock lost during a stall, one
// that went without the lock) each publish a true sum, and are soon down
// to one through the aggregator's claim (below).

// An aggregator is a Syncer's part in the election of its zone's
// aggregator (aggregate.go): whether this instance aggregates, whether it
// holds the storage's lock to do so, the claims it has seen and stored,
// and how long it has tried the lock in vain. Only the Syncer's goroutine
// (or a test calling Read and Stop) uses it, holding c.mu.
type aggregator struct {
	// s is the Syncer whose storage, names, log and counts the election
	// uses.
	s *Syncer
	// aggregating is set while this instance aggregates the zone, and
	// locked while it holds the zone's aggregator lock, which it may not
	// (orphanLockAge); from is the least number of live instances for an
	// aggregate (AggregateFrom; tests change it).
	aggregating, locked bool
	from                int
	// claimSeen is the aggregator's claim as this instance last read or
	// stored it, at claimSeenAt, and claimMoved when (by its clock) it
	// last saw the claim change.
	claimSeen               claim
	claimSeenAt, claimMoved time.Time
	// claimStored is the last claim this instance stored.
	claimStored claim
	// lockHeldSince is when this instance's lock attempts began to fail,
	// with no aggregate and no claim by another to be seen since: a read
	// that finds either, or takes the lock, ends the wait; one that shows
	// nothing either way (too few instances live for an aggregate, a
	// failed storage) leaves it (see orphanLockAge).
	lockHeldSince time.Time
}

// elect plays this instance's part in the election at the end of a read
// at now of every snapshot, members of them added to the sum, live
// instances live (this one included), found being what the read made of
// the zone's aggregate first. It reports whether this instance is the
// aggregator, which is to publish the read's aggregate.
//
// With at least from live instances and fewer than MaxAggregateMembers
// members, an instance that aggregates, or found no fresh aggregate,
// reads the claim: an aggregator yields to another's fresh claim whose
// name sorts before its own; an instance that another's fresh claim names
// the aggregator leaves the lock alone (a yield may have freed it while
// that one still aggregates); otherwise it aggregates on, or tries the
// lock, and claims the role. Outside those bounds an aggregator drops its
// aggregate.
func (a *aggregator) elect(ctx context.Context, now time.Time, live, members int, found aggregateRead) bool {
	s := a.s
	own := s.proc.name(s.instance)
	switch {
	case live >= a.from && members < MaxAggregateMembers && (a.aggregating || found == aggregateNone):
		other := a.otherClaim(ctx, now)
		if other != "" {
			a.seen() // somebody claims the role
		}
		switch {
		case a.aggregating && other != "" && other < own:
			// Its aggregate and claim stay; this instance reads them
			// from now on.
			a.release(ctx)
			a.gaveUp("another instance aggregates", live, zap.String("aggregator", other))
		case a.aggregating || other == "" && a.take(ctx, now):
			a.storeClaim(ctx, now)
			return true
		}
	case a.aggregating:
		// Too few instances (or too many) for an aggregate: it goes, so
		// that nobody loads a stale one at every read, and so does the
		// lock, for whoever finds the fleet large enough again.
		why := "too few live instances"
		if live >= a.from {
			why = "too many instances for one aggregate"
		}
		a.drop(ctx, why, live)
	}
	return false
}

// seen ends the wait for a lock nobody uses (lockHeldSince): a read found
// a fresh aggregate or another's fresh claim, so somebody aggregates.
func (a *aggregator) seen() { a.lockHeldSince = time.Time{} }

// aggregateLockTry is how long an instance waits for the aggregator lock
// before it gives up until its next read.
const aggregateLockTry = 100 * time.Millisecond

// take tries to take the zone's aggregator lock without waiting for it,
// and reports whether this instance is the aggregator. Once its attempts
// have failed for orphanLockAge (lockHeldSince), with no aggregate and no
// claim by another seen meanwhile, it aggregates without the lock.
func (a *aggregator) take(ctx context.Context, now time.Time) bool {
	s := a.s
	lctx, cancel := context.WithTimeout(ctx, aggregateLockTry)
	defer cancel()
	err := s.st.Lock(lctx, AggregateKey(s.c.shape.Zone))
	if err != nil {
		// A read that ran out of time, or that Stop ended, failed by
		// no doing of the lock's: the wait goes on as it was.
		if ctx.Err() != nil {
			return false
		}
		if a.lockHeldSince.IsZero() {
			a.lockHeldSince = now
		}
		if now.Sub(a.lockHeldSince) < orphanLockAge(s.iv) {
			return false
		}
		s.log.Warn("the aggregator lock is held, but nobody has aggregated or claimed the role since: this instance aggregates without the lock",
			zap.String("zone", s.c.shape.Zone), zap.Duration("held_for", now.Sub(a.lockHeldSince)), zap.Error(err))
	}
	a.aggregating, a.locked, a.lockHeldSince = true, err == nil, time.Time{}
	s.log.Info("this instance aggregates the zone's cluster state", zap.String("zone", s.c.shape.Zone))
	return true
}

// orphanLockAge is how long an instance tries the aggregator lock in vain,
// finding no aggregate and no claim by another instance at any read
// meanwhile (a read with too few instances live for an aggregate, or a
// failed one, tells nothing either way), before it aggregates without the
// lock. A storage's lock can outlive every holder (docs/design.md, "A lock
// nobody holds"), and the lock is only the first step of the election: the
// claim settles it. The age is twice the longest a lock of a dead holder
// lasts in the storages we know (FileStorage: 10 s; caddy-storage-redis:
// 5 s), so a dead aggregator's lock is taken over through the storage
// first; an aggregator that holds the lock and publishes, every instance
// reading at the zone's one read_interval, keeps it from being reached
// (its aggregate or its claim is fresh at each read). An instance that
// aggregates without the lock never unlocks it (release).
func orphanLockAge(iv Intervals) time.Duration { return max(20*time.Second, 4*iv.Read) }

// release gives up the role, and the aggregator lock if this instance
// took it.
func (a *aggregator) release(ctx context.Context) {
	if !a.aggregating {
		return
	}
	a.aggregating = false
	if a.locked {
		// Only a lock this instance took: file_system's Unlock removes
		// the lock file whoever holds it.
		a.locked = false
		_ = a.s.st.Unlock(ctx, AggregateKey(a.s.c.shape.Zone))
	}
}

// drop deletes the aggregate this instance publishes and its claim (unless
// another instance's claim is there), and gives up the lock: at Stop, so
// that another instance takes over at its next read rather than once the
// aggregate is stale, and when the fleet is too small (or too large) for
// one. It says so, and why, in the log, where the aggregator's hand-overs
// can be followed.
func (a *aggregator) drop(ctx context.Context, why string, live int) {
	s := a.s
	if cl, ok := a.loadClaim(ctx); !ok || a.ownClaim(cl) {
		// Not while another aggregator claims the role: the aggregate
		// is then likely its.
		_ = s.st.Delete(ctx, AggregateKey(s.c.shape.Zone))
		_ = s.st.Delete(ctx, ClaimKey(s.c.shape.Zone))
	}
	a.release(ctx)
	a.gaveUp(why, live)
}

// gaveUp logs that this instance no longer aggregates, and why.
func (a *aggregator) gaveUp(why string, live int, fields ...zap.Field) {
	s := a.s
	s.log.Info("this instance no longer aggregates the zone's cluster state",
		append([]zap.Field{zap.String("zone", s.c.shape.Zone), zap.String("why", why), zap.Int("live_instances", live)}, fields...)...)
}

// The aggregator's claim. The storage's lock elects one aggregator, but
// not always only one: certmagic's FileStorage removes a lock file it
// finds stale and creates it again, so two instances that find the dead
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
// sorts before its own gives the role up, leaving that one's aggregate and
// claim; an instance that finds no fresh aggregate but a fresh claim by
// another does not try the lock, which a yield may have freed while the
// claimant aggregates on. So two aggregators are down to one within about
// two read intervals of both publishing. An aggregator that stops or finds
// the fleet too small deletes the aggregate and the claim only if the
// claim is its own.
//
// A claim is an input from a peer like any: size-checked and checksummed.
// Forged claims can make every aggregator give up, which costs each
// instance a read of every snapshot, as without an aggregate, and imposes
// nothing on the counts.

// loadClaim returns the zone's claim, if there is a well-formed one.
func (a *aggregator) loadClaim(ctx context.Context) (claim, bool) {
	s := a.s
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
func (a *aggregator) ownClaim(cl claim) bool {
	return cl.name == a.s.proc.name(a.s.instance) || cl == a.claimStored
}

// otherClaim reads the zone's claim at now and returns the instance it
// names, if that is another one and the claim is fresh: dated at most
// aggregateMaxAge before now and MaxClockSkew after, or seen to change
// within aggregateMaxAge of now by this instance's clock (to an instance
// whose clock runs ahead of the claimant's by more than that age, every
// claim would look stale by its date) since a look within that age. The
// caller holds c.mu.
func (a *aggregator) otherClaim(ctx context.Context, now time.Time) string {
	cl, ok := a.loadClaim(ctx)
	if !ok {
		return ""
	}
	maxAge := aggregateMaxAge(a.s.iv)
	if a.claimSeen.name != "" && cl != a.claimSeen && now.Sub(a.claimSeenAt) <= maxAge {
		// Changed between two looks close enough together that the
		// claimant lives; after a longer gap only its date can tell.
		a.claimMoved = now
	}
	a.claimSeen, a.claimSeenAt = cl, now
	if a.ownClaim(cl) {
		return ""
	}
	if age := now.Sub(time.Unix(0, cl.at)); age <= maxAge && -age <= MaxClockSkew || !a.claimMoved.IsZero() && now.Sub(a.claimMoved) <= maxAge {
		return cl.name
	}
	return ""
}

// storeClaim names this instance the zone's aggregator as of now. The
// caller holds c.mu.
func (a *aggregator) storeClaim(ctx context.Context, now time.Time) {
	s := a.s
	cl := claim{name: s.proc.name(s.instance), at: now.UnixNano()}
	// Known for this instance's before it is stored: a store that fails
	// (times out) may still land.
	a.claimStored = cl
	if err := s.st.Store(ctx, ClaimKey(s.c.shape.Zone), appendClaim(nil, cl.name, now)); err != nil {
		s.failed(OpWrite, now, err)
		return
	}
	a.claimSeen, a.claimSeenAt = cl, now
}
