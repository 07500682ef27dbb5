package storage

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
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
	// (rejoin); joined is set once it has succeeded. Only the goroutine
	// sets joined; Stop reads it after the goroutine is done.
	join   func(context.Context, certmagic.Storage) error
	joined bool

	// Used only by the goroutine (or by a test calling Write and Read).
	buf, sk, tail []byte
	blocks        []block
	resets        []reset
	snaps         []*snapshot
	forget        []limiter.Forget
	lifted        []uint64
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
	// countedNow is the bitmap of the cells the own sketch counts at the
	// read at hand (sole), kept for its memory.
	countedNow []uint64
	// skewLogged is when the purge of a snapshot from a clock too far ahead
	// was last logged: at most once per purge_age.
	skewLogged time.Time
	// clockLogged is when a peer's clock ahead past where a window
	// zone's bound holds (clockAgreement) was last logged (warnAhead): at most once per purge_age.
	clockLogged time.Time
	// agg is this instance's part in the election of the zone's
	// aggregator (aggregator.go).
	agg aggregator
	// aggLatest maps a key hash to its latest reset an aggregate lists.
	aggLatest map[uint64]int64
	// lastRead is what the last Read did with the aggregate.
	lastRead aggregateRead
	// sighted holds, for each peer a read found, the latest snapshot of
	// it and when on this instance's clock (see sight).
	sighted map[string]sighting
	// clocks holds what was measured of each peer's clock, for placing
	// its snapshots on this one's (clockShift).
	clocks map[string]*peerClock
	// readAt is the time of the last read, as time.Now gave it (with
	// its monotonic reading), for followStep; elapsed, if set, is how
	// much time passed between two such times, in place of Time.Sub's
	// monotonic difference: a test's clock, whose times carry none.
	readAt  time.Time
	elapsed func(from, to time.Time) time.Duration
	// unsure is set by a read (endSight) that found a peer's snapshot,
	// never seen replaced, that looks dead on this instance's clock but is
	// recent on a clock up to MaxClockSkew behind it (see shareRank).
	unsure bool
	// peerFound is set by a read (endSight) that found a snapshot of
	// another instance, of whatever age (see shareRank); oldPeer by one
	// that found one older than purge_age, which sight does not see.
	peerFound, oldPeer bool
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

// OpenRetry is how long a Syncer made by NewSyncerOpening waits before it
// tries its storage again; the wait doubles after each failure, up to
// MaxOpenRetry (a storage client may log every failed dial).
const (
	OpenRetry    = time.Second
	MaxOpenRetry = 10 * time.Second
)

func newSyncer(c *Cluster, instance string, iv Intervals, log *zap.Logger) *Syncer {
	s := &Syncer{
		c: c, instance: instance, proc: thisProcess, iv: iv, log: log,
		failing:   make(map[Op]time.Time, int(numOps)),
		latest:    make(map[uint64]int64),
		listed:    make(map[uint64]int64),
		aggLatest: make(map[uint64]int64),
	}
	s.agg = aggregator{s: s, from: AggregateFrom}
	return s
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
	if s.agg.aggregating {
		s.agg.drop(ctx, "stopping", 0)
	}
}

func (s *Syncer) run(ctx context.Context) {
	defer close(s.done)
	if (s.st == nil || s.join != nil) && !s.waitOpen(ctx) {
		return
	}
	s.do(ctx, s.iv.Read, s.Read)
	due := time.Now().Add(readGap(s.iv.Read, rand.Int64N))
	rt, wt := time.NewTimer(time.Until(due)), time.NewTicker(s.iv.Write)
	defer rt.Stop()
	defer wt.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-rt.C:
			s.do(ctx, s.iv.Read, s.Read)
			due = nextRead(due, time.Now(), readGap(s.iv.Read, rand.Int64N))
			rt.Reset(time.Until(due)) // at once if due is now

		case <-wt.C:
			s.do(ctx, s.iv.Write, s.Write)
			if s.join != nil {
				s.do(ctx, s.iv.Write, s.rejoin)
			}
		}
	}
}

// readGap is how long after a read is due the next one is: a read interval
// less up to a quarter of it, at random (draw is rand.Int64N, or a test's).
// Reads on a ticker of the write ticker's period find each peer's snapshot
// the same time after its write, read after read, and a window zone
// measures a peer's clock by the snapshots it finds (clockShift): a delay
// that never changes reads as a skew, up to a whole read interval of one,
// and a peer so measured past the tolerance was moved a sub-window later,
// its grants of before a re-balance taken by the shares for use of the
// room left it and handed out again (a cluster of clocks within ±100 ms,
// 35 of 30 in a span of a 10 s window with 1 s reads). With the gaps drawn,
// a reader's phase to each writer's wanders over the interval: some of
// the clockSamples snapshots it measures a peer by are found soon after
// their write, and the measure comes within that of the true skew. Never
// more than a read interval, so that every bound counted in read
// intervals (an aggregate's age, the shares' hold, a peer's sight) holds
// as on a ticker; it costs a seventh more reads, on average.
func readGap(iv time.Duration, draw func(int64) int64) time.Duration {
	return iv - time.Duration(draw(int64(iv/4)+1))
}

// nextRead is when the read after one due at due is due, given that read
// ended at now and the gap drawn (readGap): gap after due, as a ticker
// counts, so that a read that runs late or long delays the next by no
// more than it ran over, never by its whole length (reads at most gap
// apart, as long as each takes less); at once (now) if that has passed.
func nextRead(due, now time.Time, gap time.Duration) time.Time {
	if next := due.Add(gap); next.After(now) {
		return next
	}
	return now
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
