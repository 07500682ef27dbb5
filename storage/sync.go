package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	mathbits "math/bits"
	"net/url"
	"path"
	"reflect"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Defaults and bounds of the sync intervals.
const (
	DefaultReadInterval  = 5 * time.Second
	DefaultWriteInterval = 5 * time.Second
	// MinInterval is the shortest read or write interval.
	MinInterval = 10 * time.Millisecond
	// DefaultMinPurgeAge is the least default purge_age; the default is
	// this or two windows, whichever is longer.
	DefaultMinPurgeAge = time.Minute
)

// Prefix is where every zone's snapshots live in the storage.
const Prefix = "rate_limit"

// Dir is the storage directory of a zone's snapshots. The zone name is
// path-escaped, so a name with a slash cannot reach another zone's files.
func Dir(zone string) string { return Prefix + "/" + url.PathEscape(zone) }

// Key is where an instance publishes a zone's snapshot.
func Key(zone, instance string) string { return Dir(zone) + "/" + instance }

// Intervals are a distributed zone's sync settings, all positive.
type Intervals struct {
	// Read is how often the other instances' snapshots are read.
	Read time.Duration
	// Write is how often this instance's snapshot is published.
	Write time.Duration
	// PurgeAge is the age at which another instance's snapshot is
	// ignored and deleted: that instance is gone.
	PurgeAge time.Duration
}

// A Syncer publishes a Cluster's state and reads its peers' through one
// storage, in one background goroutine, until Stop.
type Syncer struct {
	c        *Cluster
	st       certmagic.Storage
	instance string
	proc     *process
	iv       Intervals
	log      *zap.Logger

	// cancel ends the goroutine's context (a sync op in flight) and stop
	// its loop; Stop does both, then waits on done.
	cancel     context.CancelFunc
	stop, done chan struct{}
	// open gives st, which is nil until it has (NewSyncerOpening). Only
	// the goroutine sets st; Stop reads it after the goroutine is done.
	open func(context.Context) (certmagic.Storage, error)
	// after is time.After for waitOpen's waits (a test's clock, if set).
	after func(time.Duration) <-chan time.Time
	// join, if set (Joining), is called with the storage before anything
	// is read or published, until it succeeds, and after every write
	// (rejoin); joined is set once it has succeeded.
	// Only the goroutine sets joined; Stop reads it after the goroutine is
	// done.
	join   func(context.Context, certmagic.Storage) error
	joined bool

	// Used only by the goroutine (or by a test calling Write and Read).
	buf, sk []byte
	blocks  []block
	resets  []reset
	snaps   []*snapshot
	forget  []limiter.Forget
	lifted  []uint64
	// latest and listed map a key hash to its latest reset: known here,
	// and listed by the snapshot at hand.
	latest, listed map[uint64]int64
	// failing and logged implement "log once per interval": the first
	// failure after a success is logged at WARN, then at most one line per
	// interval until storage works again, which is logged at INFO.
	failing map[Op]time.Time
	// counted holds two bitmaps of the cells the own sketch counted, taken
	// at counted[i].at, for the shares (alone).
	counted [2]struct {
		bits []uint64
		at   time.Time
	}
	// skewLogged is when the purge of a snapshot from a clock too far ahead
	// was last logged: at most once per purge_age.
	skewLogged time.Time
	// aggregating is set while this instance aggregates the zone, and
	// locked while it holds the zone's aggregator lock, which it may not
	// (orphanLockAge; aggregate.go); aggregateFrom is the least number of
	// live instances for an aggregate (AggregateFrom; tests change it).
	aggregating, locked bool
	aggregateFrom       int
	// claimSeen is the aggregator's claim as this instance last read or
	// stored it, at claimSeenAt, and claimMoved when (by its clock) it
	// last saw the claim change (aggregate.go).
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
	// aggLatest maps a key hash to its latest reset an aggregate lists.
	aggLatest map[uint64]int64
	// lastRead is what the last Read did with the aggregate.
	lastRead aggregateRead
	// sighted holds, for each peer a read found, the latest snapshot of
	// it and when on this instance's clock (see sight).
	sighted map[string]sighting
}

// NewSyncer returns a Syncer of c's state through st as instance; Start
// runs it.
func NewSyncer(c *Cluster, st certmagic.Storage, instance string, iv Intervals, log *zap.Logger) *Syncer {
	s := newSyncer(c, instance, iv, log)
	s.st = st
	return s
}

// NewSyncerOpening is NewSyncer for a storage that does not answer yet
// (a zone's own Redis down when the config loads): until open returns it,
// the Cluster decides on this instance's counts alone and nothing is read
// or published. Start tries open at once and then again after OpenRetry,
// doubling up to MaxOpenRetry, until it succeeds, counting each failure as
// a failed read; Restore and Stop do nothing before.
func NewSyncerOpening(c *Cluster, open func(context.Context) (certmagic.Storage, error), instance string, iv Intervals, log *zap.Logger) *Syncer {
	s := newSyncer(c, instance, iv, log)
	s.open = open
	return s
}

// shareHold is how long a share this instance left the others, and has
// not seen them use, stays theirs (limiter.SketchSum.WithShares): long
// enough for an instance that granted it to publish that and for this one
// to read it, twice over for a write or read that runs late.
func shareHold(iv Intervals) time.Duration { return 2 * (iv.Write + iv.Read) }

// sight notes the snapshot of peer name, written at written (on the
// peer's clock), that a read found at now, and returns whether the peer is
// live. every is the longest a peer on time takes between two snapshots
// this instance finds: a write interval and one or two read intervals
// (endSight).
//
// A peer is live while another snapshot of it (newer, or written after
// its clock was set back), found within the last liveWrites write
// intervals (on this instance's clock), shows it publishing; one found for
// the first time and not replaced since is judged by its age (on the
// peer's clock): at most liveWrites write intervals. So once a peer has
// been seen to publish, its clock, ahead or behind within MaxClockSkew,
// neither keeps it live when it stops nor makes it dead while it
// publishes; before (this instance's first reads, a peer that joins), a
// peer's clock behind may make it look dead, and one ahead, live.
//
// The caller holds c.mu, and ends the read with endSight.
func (s *Syncer) sight(now time.Time, name string, written int64, every time.Duration) bool {
	p, ok := s.sighted[name]
	switch {
	case !ok:
		p = sighting{written: written, at: now.UnixNano()}
	case written != p.written:
		// Another snapshot: a newer one, or one written after the
		// peer's clock was set back.
		p = sighting{written: written, at: now.UnixNano(), replaced: true}
	}
	p.found, p.every = now.UnixNano(), every
	if s.sighted == nil {
		s.sighted = make(map[string]sighting)
	}
	s.sighted[name] = p
	return p.live(now.UnixNano(), liveWrites*s.iv.Write)
}

// live is whether the peer of p is live at now (sight), most being
// liveWrites write intervals.
func (p sighting) live(now int64, most time.Duration) bool {
	if p.replaced {
		return time.Duration(now-p.at) <= most
	}
	return time.Duration(now-p.written) <= most
}

// endSight ends a read: it forgets the peers no read has found for
// liveWrites write intervals (gone), and returns how late the live peers
// publish, seen from here: the most that this instance found a live
// peer's latest snapshot longer ago than every, at most liveWrites write
// intervals. A peer a read missed (a load that failed, an aggregate
// without it) is remembered, late as it was, so that its old snapshot does
// not look new at the next read. The lateness is added, twice, to the
// shares' hold: a grant of a peer that publishes late becomes visible
// late, and a share released before it does would be granted twice. A
// cluster that publishes on time keeps the configured hold.
func (s *Syncer) endSight(now time.Time) time.Duration {
	most := liveWrites * s.iv.Write
	n := now.UnixNano()
	var late time.Duration
	for name, p := range s.sighted {
		if time.Duration(n-p.found) > most {
			delete(s.sighted, name)
			continue
		}
		if p.live(n, most) {
			late = max(late, min(time.Duration(n-p.at)-p.every, most))
		}
	}
	return late
}

type sighting struct {
	written, at, found int64
	every              time.Duration
	replaced           bool
}

// liveWrites is how many write intervals may pass without a new snapshot
// of an instance for it to count as live in the shares (SplitBursts, see
// sight): a loaded instance may publish late, and one counted live while
// dead only makes the others' shares smaller, and their holds longer, for
// that long.
const liveWrites = 10

// OpenRetry is how long a Syncer made by NewSyncerOpening waits before it
// tries its storage again; the wait doubles after each failure, up to
// MaxOpenRetry (a storage client may log every failed dial).
const (
	OpenRetry    = time.Second
	MaxOpenRetry = 10 * time.Second
)

func newSyncer(c *Cluster, instance string, iv Intervals, log *zap.Logger) *Syncer {
	return &Syncer{
		c: c, instance: instance, proc: thisProcess, iv: iv, log: log,
		failing:       make(map[Op]time.Time, int(numOps)),
		latest:        make(map[uint64]int64),
		listed:        make(map[uint64]int64),
		aggLatest:     make(map[uint64]int64),
		aggregateFrom: AggregateFrom,
	}
}

// Joining makes the Syncer call join with its storage once it has one,
// before it reads or publishes anything, and again after each failure (as
// an open fails: NewSyncerOpening) until join succeeds. A distributed zone
// learns the cluster's hash secret so (Secret): what it counted before
// would be in other keys' cells. Call it before Start.
func (s *Syncer) Joining(join func(context.Context, certmagic.Storage) error) { s.join = join }

// Start runs the read and write loops in a goroutine until Stop.
func (s *Syncer) Start() {
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel, s.stop, s.done = cancel, make(chan struct{}), make(chan struct{})
	go s.run(ctx)
}

// Stop ends the loops, publishes a last snapshot (within one write
// interval, at most 5 s) so that a restart finds the latest state, gives
// up the aggregator lock if it holds it, and returns when the goroutine is
// done.
func (s *Syncer) Stop() {
	if s.stop == nil {
		return
	}
	s.cancel()
	close(s.stop)
	<-s.done
	s.stop = nil
	if s.st == nil || (s.join != nil && !s.joined) {
		return // the storage never answered: nothing to publish to
	}
	ctx, cancel := context.WithTimeout(context.Background(), min(s.iv.Write, 5*time.Second))
	defer cancel()
	s.Write(ctx, time.Now())
	if s.aggregating {
		s.dropAggregate(ctx, "stopping", 0)
	}
}

func (s *Syncer) run(ctx context.Context) {
	defer close(s.done)
	if (s.st == nil || s.join != nil) && !s.waitOpen(ctx) {
		return
	}
	s.do(ctx, s.iv.Read, s.Read)
	rt, wt := time.NewTicker(s.iv.Read), time.NewTicker(s.iv.Write)
	defer rt.Stop()
	defer wt.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-rt.C:
			s.do(ctx, s.iv.Read, s.Read)
		case <-wt.C:
			s.do(ctx, s.iv.Write, s.Write)
			if s.join != nil {
				s.do(ctx, s.iv.Write, s.rejoin)
			}
		}
	}
}

// waitOpen tries open (if the storage is not open yet) and join (if set)
// until both succeed, and reports false if the Syncer was stopped first.
func (s *Syncer) waitOpen(ctx context.Context) bool {
	wait := OpenRetry
	for {
		octx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := s.openAndJoin(octx)
		cancel()
		if err == nil {
			return true
		}
		if errors.Is(err, errCannotHold) {
			// Not a fault that a retry mends: the zone stays on
			// this instance's counts, and says why.
			s.c.failed[OpRead].Add(1)
			s.log.Error("cluster storage cannot hold this zone: this instance limits on its own counts",
				zap.String("zone", s.c.shape.Zone), zap.Error(err))
			return false
		}
		if s.st != nil {
			s.failed(OpRead, time.Now(), err)
		} else {
			s.c.failed[OpRead].Add(1) // the storage module logged why once
		}
		after := s.after
		if after == nil {
			after = time.After
		}
		select {
		case <-s.stop:
			return false
		case <-after(wait):
		}
		wait = min(2*wait, MaxOpenRetry)
	}
}

// rejoin calls join again after a write: what it ensures (the cluster's
// hash secret stored) must be there as long as the snapshots are, and a
// storage can lose both (a Redis without persistence restarting empty).
// The snapshots come back with the next write; join puts back what it
// keeps, or follows what another instance stored meanwhile.
func (s *Syncer) rejoin(ctx context.Context, now time.Time) {
	if err := s.join(ctx, s.st); err != nil {
		s.failed(OpWrite, now, fmt.Errorf("keeping the cluster's hash secret: %w", err))
	}
}

// errCannotHold marks a storage that cannot hold the zone (CheckStorage).
var errCannotHold = errors.New("storage cannot hold the zone")

func (s *Syncer) openAndJoin(ctx context.Context) error {
	if s.st == nil {
		st, err := s.open(ctx)
		if err != nil {
			return err
		}
		if err := CheckStorage(st, s.c.shape); err != nil {
			return fmt.Errorf("%w: %w", errCannotHold, err)
		}
		s.st = st
		s.log.Info("cluster storage answers: this instance joins the cluster", zap.String("zone", s.c.shape.Zone))
	}
	if s.join != nil && !s.joined {
		if err := s.join(ctx, s.st); err != nil {
			return fmt.Errorf("joining the cluster: %w", err)
		}
		s.joined = true
	}
	return nil
}

// do runs one sync op with a deadline: a storage that hangs (Redis
// unreachable) delays the next sync, never a request.
func (s *Syncer) do(ctx context.Context, interval time.Duration, op func(context.Context, time.Time)) {
	ctx, cancel := context.WithTimeout(ctx, min(max(2*interval, time.Second), 10*time.Second))
	defer cancel()
	op(ctx, time.Now())
}

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
	s.proc.noteWrite(key, now, s.buf)
	s.noteOwnLocked(key, writtenOf(now, s.buf), s.buf)
	if err := s.st.Store(ctx, key, s.buf); err != nil {
		s.failed(OpWrite, now, err)
		return
	}
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
		s.noteOwnLocked(Key(c.shape.Zone, s.instance), writtenOf(snap.written, data), data)
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

// Read replaces the Cluster's peers' sum with the sum of every other
// instance's latest snapshot of the zone as at now: from the zone's
// aggregate when there is a fresh one it can use (aggregate.go), else from
// the snapshots themselves. Reading those, snapshots older than the purge
// age are deleted, and entries that are not well-formed snapshots are
// skipped and counted; the aggregator then publishes their aggregate, and
// an instance that found none fresh tries to become the aggregator. If
// listing fails the previous sum is kept: its counts age out with their
// windows, so a storage outage degrades to local limiting.
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
	found := aggregateNone
	defer func() { s.lastRead = found }()
	if !s.aggregating {
		found = s.readAggregate(ctx, now)
		if found != aggregateNone {
			// A fresh aggregate: somebody aggregates.
			s.lockHeldSince = time.Time{}
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
	switch {
	case live >= s.aggregateFrom && len(added) < MaxAggregateMembers && (s.aggregating || found == aggregateNone):
		// An instance that another's fresh claim names the aggregator
		// leaves the lock alone (a yield may have freed it while that
		// one still aggregates); an aggregator yields to it if its id
		// sorts first (aggregate.go).
		other := s.otherClaim(ctx, now)
		if other != "" {
			s.lockHeldSince = time.Time{} // somebody claims the role
		}
		switch {
		case s.aggregating && other != "" && other < own:
			// Its aggregate and claim stay; this instance reads them
			// from now on.
			s.releaseAggregator(ctx)
			s.gaveUp("another instance aggregates", live, zap.String("aggregator", other))
		case s.aggregating || other == "" && s.tryAggregator(ctx, now):
			s.storeClaim(ctx, now)
			s.publishAggregate(ctx, now, sum, added, mine)
		}
	case s.aggregating:
		// Too few instances (or too many) for an aggregate: it goes, so
		// that nobody loads a stale one at every read, and so does the
		// lock, for whoever finds the fleet large enough again.
		why := "too few live instances"
		if live >= s.aggregateFrom {
			why = "too many instances for one aggregate"
		}
		s.dropAggregate(ctx, why, live)
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
			mine = s.checkOwn(ctx, key)
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
			if err := s.st.Delete(ctx, key); err == nil {
				s.log.Info("deleted the snapshot of an instance gone for longer than purge_age",
					zap.String("zone", c.shape.Zone), zap.String("instance", name), zap.Time("written", snap.written))
			}
			continue
		}
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
// resets known here that it does not list, and reports whether it could
// (a sketch that is not well formed is skipped and counted).
func (s *Syncer) addTo(sum *limiter.SketchSum, snap *snapshot) bool {
	s.forget = appendForgets(s.forget[:0], s.latest, snap.resets, s.listed)
	if _, err := sum.AddBinaryForgetting(snap.sketch, s.forget); err != nil {
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
// (which Read empties when it starts),
// fills s.latest with every key's latest known reset, and returns the
// reset table's sequence number then. The caller holds c.mu.
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
		shared = sum.WithShares(c.sketch, live, rank, now, c.shared.Load(), shareHold(s.iv)+2*(lag+late))
		sole = s.sole(now, sum, lag)
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

// errTooLarge is loadBounded's error for an entry larger than what it can
// be (a snapshot or aggregate of the zone, the hash secret).
var errTooLarge = errors.New("larger than the entry can be")

// load loads the entry under key if the storage reports it no larger than
// max, the largest snapshot (or aggregate) of the zone's shape: an entry
// that is not one (a stray file, a peer gone wrong) never costs more
// memory than a real one (loadBounded).
func (s *Syncer) load(ctx context.Context, key string, max int64) ([]byte, error) {
	return loadBounded(ctx, s.st, key, max)
}

// loadBounded loads the entry under key from st if st reports it no larger
// than max bytes, else fails with errTooLarge. A storage whose Stat fetches
// the whole entry (statLoads) is not asked for it: the entry is loaded once
// and refused after, its Stat having held it in memory as well
// (caddy-storage-redis also bounds what it decompresses to 4 MiB).
func loadBounded(ctx context.Context, st certmagic.Storage, key string, max int64) ([]byte, error) {
	if !statLoads(st) {
		info, err := st.Stat(ctx, key)
		if err != nil {
			return nil, err
		}
		if info.Size > max {
			return nil, fmt.Errorf("%w: %d bytes, at most %d", errTooLarge, info.Size, max)
		}
	}
	data, err := st.Load(ctx, key)
	if err == nil && int64(len(data)) > max {
		// It grew between the two calls: refused all the same.
		return nil, fmt.Errorf("%w: %d bytes", errTooLarge, len(data))
	}
	return data, err
}

// statLoads reports whether st's Stat fetches the whole entry to report
// its size, as caddy-storage-redis's does (a GET of the stored value and
// its decoding): asking it before each Load would double what a read
// moves, and guard no memory. Stat is cheap on the file system.
func statLoads(st certmagic.Storage) bool {
	t := reflect.TypeOf(st)
	if t == nil {
		return false
	}
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t.PkgPath() == "github.com/pberkel/caddy-storage-redis"
}

// maxDecompressed is the most caddy-storage-redis decompresses of one
// value when its compression is on: a larger value fails to load.
const maxDecompressed = 4 << 20

// CheckStorage returns an error if st cannot hold a zone of shape s's
// cluster entries: caddy-storage-redis with compression on refuses to load
// a value that decompresses to more than 4 MiB, and an instance would
// skip every snapshot or aggregate over that, counting nothing of it.
// Other storages hold any size.
func CheckStorage(st certmagic.Storage, s Shape) error {
	if !statLoads(st) {
		return nil
	}
	v := reflect.Indirect(reflect.ValueOf(st))
	if v.Kind() != reflect.Struct {
		return nil
	}
	f := v.FieldByName("Compression")
	if !f.IsValid() || f.Kind() != reflect.String || f.String() == "" || f.String() == "false" {
		return nil
	}
	if most := maxAggregateSize(s); most > maxDecompressed { // the largest entry, above any snapshot
		return fmt.Errorf("the Redis storage has compression on (%s), and caddy-storage-redis loads no value that decompresses to more than 4 MiB, "+
			"but this zone's cluster entries can reach %.1f MiB: turn compression off in the storage, or give the zone less memory",
			f.String(), float64(most)/(1<<20))
	}
	return nil
}

// sole returns the bitmap of the cells that this instance counted at
// least a write and a read interval (and lag, see replaceView) ago and
// that sum, the peers' as read now, does not count: any other instance's
// counts of them from then on have been published and read since, so
// they are this instance's alone.
// A key all of whose cells are is let off its share (Cluster.TakeHash).
// It is nil while no bitmap of the own counts is that old yet. A new one
// is taken once the newest is that old, so a key that only reaches this
// instance is known as such within two such ages and a read interval
// after each (reads come on their own ticks): 2 × (write + 2 × read +
// lag). Only reads that fall exactly on the ages, as a test's clock makes
// them, save the read intervals. A peer that publishes late (sight) is
// not waited for, unlike in the shares' hold: a key it counts unseen may
// be let off its share here meanwhile, where waiting would hold every key
// of one instance for up to liveWrites write intervals after any peer
// died (replaceView).
func (s *Syncer) sole(now time.Time, sum *limiter.SketchSum, lag time.Duration) []uint64 {
	age := s.iv.Write + s.iv.Read + lag
	newest, other := &s.counted[0], &s.counted[1]
	if other.at.After(newest.at) {
		newest, other = other, newest
	}
	var bits []uint64
	switch {
	case newest.bits != nil && now.Sub(newest.at) >= age:
		bits = newest.bits
	case other.bits != nil && now.Sub(other.at) >= age:
		bits = other.bits
	}
	var sole []uint64
	if bits != nil {
		sole = make([]uint64, len(bits))
		for w, b := range bits {
			for b != 0 {
				i := w*64 + mathbits.TrailingZeros64(b)
				b &= b - 1
				if sum.CellZero(i) {
					sole[w] |= 1 << (i % 64)
				}
			}
		}
	}
	if newest.bits == nil || now.Sub(newest.at) >= age {
		// The other bitmap, older still, is not the one read above.
		other.bits, other.at = s.c.sketch.AppendCounted(other.bits, now), now
	}
	s.c.counted.Store(int64(8 * (len(s.counted[0].bits) + len(s.counted[1].bits))))
	return sole
}

// readFailed counts and logs a failed read, and drops this instance's
// shares (see SplitBursts): without a view of the others they cannot be
// re-balanced, and the instance limits with its own counts and the peers'
// last ones, as it would without shares.
// The shares go before the warning is logged, so that whoever reads the
// warning finds the instance on its local limit.
func (s *Syncer) readFailed(now time.Time, err error) {
	s.c.rmu.Lock()
	s.c.shared.Store(s.c.peers.Load())
	s.c.rmu.Unlock()
	s.failed(OpRead, now, err)
}

func (s *Syncer) skipped(key string, err error) {
	s.c.skipped.Add(1)
	s.log.Debug("skipped an entry that is not a snapshot of this zone", zap.String("key", key), zap.Error(err))
}

// failed logs a failed op at most once per its interval and counts it.
func (s *Syncer) failed(op Op, now time.Time, err error) {
	s.c.failed[op].Add(1)
	every := s.iv.Write
	if op == OpRead {
		every = s.iv.Read
	}
	if last, ok := s.failing[op]; ok && now.Sub(last) < every {
		return
	}
	s.failing[op] = now
	s.log.Warn("cluster storage failed: limiting with what this instance knows until it works again",
		zap.String("zone", s.c.shape.Zone), zap.Stringer("op", op), zap.Error(err))
}

func (s *Syncer) ok(op Op, now time.Time) {
	s.c.lastOK[op].Store(now.UnixNano())
	if _, ok := s.failing[op]; !ok {
		return
	}
	delete(s.failing, op)
	s.log.Info("cluster storage works again", zap.String("zone", s.c.shape.Zone), zap.Stringer("op", op))
}
