package storage

import (
	"time"

	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Peers' clocks, for a window zone's sub-windows.
//
// A snapshot counts its grants by sub-window (W/7) of its writer's clock.
// Placed by those numbers on a reader whose clock is ahead by s (or from a
// writer behind by s), its counts leave the reader's view s early, and the
// reader shares out room the key has not got back: in plain steady traffic
// with one instance of four 5 s ahead on a 10 s window, a key got 38 to
// 42 of 30 in a span, 51 to 54 on a 1 m window 59 s ahead. What a writer
// ahead counted after the reader's sub-window was dropped outright. So a
// reader places each peer's snapshot on its own clock: by how far ahead
// of its own clock the peer's has at least been seen (peerClock.ahead),
// every snapshot existing when it is found, to whole sub-windows within
// a tolerance (clockTolerance), and what that leaves of a clock seen
// behind is made up by keeping the counts that much longer into the
// sub-window after they leave the view (limiter.SketchSum.Linger), so
// that they never leave it before they leave the peer's.

// clockSamples is how many of a peer's snapshots, each found new, its
// clock is measured on: the latest few, so that a clock set back or
// slewed is followed within as many write intervals.
const clockSamples = 8

// peerClock is what this instance measured of a peer's clock: the write
// time (on the peer's clock) of its latest snapshot found, and, for each
// of the last clockSamples found new (another than the read before had
// found), its write time less when this instance found it, on its own
// clock. A snapshot exists when it is found, so that is never more than
// how far the peer's clock is ahead of this one's (negative: behind),
// and, found within a read interval of its write, never much less.
type peerClock struct {
	written, seen int64
	samples       [clockSamples]int64
	n             int // samples held, at most clockSamples; the next goes to n % clockSamples
}

// ahead is the most the peer's clock is known ahead of this one's (so
// never more than it is): the largest sample. ok is false while no
// snapshot of it has been found new.
func (p *peerClock) ahead() (d time.Duration, ok bool) {
	if p.n == 0 {
		return 0, false
	}
	most := p.samples[0]
	for _, s := range p.samples[1:min(p.n, clockSamples)] {
		most = max(most, s)
	}
	return time.Duration(most), true
}

// clockShift notes that a read at now found the snapshot (or aggregate)
// of instance name written at written on its clock, and returns by how
// many sub-windows a window zone's reader moves its counts to place them
// on its own clock (limiter.SketchSum.AddBinaryLinger): later for a clock
// behind this one's, earlier for one ahead; 0 for any other zone, and for
// a peer none of whose snapshots has been found new yet (its first, which
// may be old: a dead peer's counts would never age out here), whose
// sub-windows are taken as this one's, as they were before. early is how
// much earlier than the peer's the counts so placed may still leave this
// view, for the reader to keep them that much longer (at most the
// tolerance; 0 for a clock seen ahead, or not measured).
//
// The peer's sub-window k holds grants made before its end, which on this
// clock is at most ahead earlier (ahead: peerClock.ahead). For a clock
// seen ahead it is counted as this one's sub-window k − ⌊ahead/W₇⌋ (W₇
// the sub-window), which ends no earlier: the counts stay up to a
// sub-window longer than W, never less. Moved back further, a peer's
// grants of now would fall in an earlier sub-window than this one's, where
// the shares do not see them use what they left that peer
// (limiter.SketchSum.WithShares), and hold it besides: a 2 s skew on a
// 10 s window halved what a steady stream got. For a clock seen behind it
// is this one's k + ⌈(−ahead − τ)/W₇⌉ (none within the tolerance τ), whose
// end is early = −ahead − that many W₇, at most τ, before that of the
// peer's, however far the clocks are apart within MaxClockSkew; the reader
// counts them early into the sub-window after they leave its view (through
// an aggregate, early plus what the aggregator's placing left: see
// membersEarly). Since the measure never takes a clock as further ahead
// than it is, the counts never leave the view before the peer's.
func (s *Syncer) clockShift(now time.Time, name string, written int64) (shift int64, early time.Duration) {
	if !s.c.shape.Sliding {
		return 0, 0
	}
	if s.clocks == nil {
		s.clocks = make(map[string]*peerClock)
	}
	n := now.UnixNano()
	p := s.clocks[name]
	if p == nil {
		s.clocks[name] = &peerClock{written: written, seen: n}
		return 0, 0
	}
	p.note(written, n)
	p.seen = n
	ahead, ok := p.ahead()
	if !ok {
		return 0, 0
	}
	s.warnAhead(now, name, ahead, clockAgreement(s.c.sketch.Slot()))
	return s.placeClock(ahead)
}

// note takes written, found at n, as the peer's latest write time, and as
// a sample if it is another than the latest.
func (p *peerClock) note(written, n int64) {
	switch {
	case written < p.written:
		// Set back: what was measured before no longer holds.
		p.n = 0
		fallthrough
	case written != p.written:
		p.samples[p.n%clockSamples] = written - n
		p.n++
		if p.n >= 2*clockSamples {
			p.n -= clockSamples
		}
	}
	p.written = written
}

// clockEarly is the early clockShift would return for the same arguments,
// without noting anything: for a reader to weigh an aggregate before it
// takes it (readAggregate).
func (s *Syncer) clockEarly(now time.Time, name string, written int64) time.Duration {
	p := s.clocks[name]
	if !s.c.shape.Sliding || p == nil {
		return 0
	}
	q := *p
	q.note(written, now.UnixNano())
	ahead, ok := q.ahead()
	if !ok {
		return 0
	}
	_, early := s.placeClock(ahead)
	return early
}

// placeClock is clockShift's shift and early for a peer's clock measured
// ahead of this one's by ahead (negative: behind).
func (s *Syncer) placeClock(ahead time.Duration) (shift int64, early time.Duration) {
	sub := s.c.sketch.Slot()
	// Far beyond the ring either way: the limiter clamps it.
	ahead = max(min(ahead, MaxClockSkew+s.iv.PurgeAge), -MaxClockSkew-s.iv.PurgeAge)
	if ahead >= 0 {
		return -limiter.WindowNumber(time.Unix(0, int64(ahead)), sub), 0
	}
	shift = -limiter.WindowNumber(time.Unix(0, int64(min(ahead+clockTolerance(sub), 0))), sub)
	return shift, max(-ahead-time.Duration(shift)*sub, 0)
}

// clockTolerance is how much of a peer's clock seen behind this one's is
// not corrected by moving its counts a sub-window (sub) later
// (clockShift), but by keeping them that much longer (its early): a
// sub-window less a nanosecond, the most a sum lingers
// (limiter.SketchSum.Linger). A snapshot is found up to a read interval
// after its write (more through an aggregate): the measure of a peer's
// clock may take it that much further behind than it is, and nothing read
// from storage tells the two apart. (Reads at drawn gaps, readGap, make
// the delay vary, so that the measure, the most of clockSamples, comes
// near the skew; nothing bounds how near.) Moved a whole
// sub-window, every peer's counts would be kept a sub-window longer than
// W in a cluster whose clocks agree, and the shares would take a peer's
// grants of before a re-balance, moved past it, for use of what they left
// that peer, and hand it out again (with every measured lag moved: up to
// 38 and 40 of 30 in a span, bound 34, in 3 and 12 of the 120 random
// schedules of window_test.go, without and with a joiner). That holds of
// a peer whose clock is behind as much as of the delay, so any tolerance
// short of a sub-window moved what a skew and the delay together pushed
// past it: with a read interval, clocks each within one of the true time
// (so up to two apart), 5 of 80 random schedules on a 1 m window got 35
// to 39 of 30 in a span (window_skew_test.go); with a read interval where
// that is more than half a sub-window (a 10 s window with 1 s reads), the
// readers of an aggregate, finding it up to a read interval after its
// write with its aggregator a few hundred milliseconds ahead, moved it,
// and 5 of 160 schedules with clocks within ±1 s got 35 to 39
// (TestWindowZoneAggregateFoundLateOnAShortWindowKeepsTheBound); with half
// a sub-window elsewhere, clocks within ±4.29 s on a 1 m window (so up to
// a sub-window apart), 36, and 41 once the aggregate was used early in
// its sub-window (TestWindowZonePeerFoundUpToASubWindowBehindKeepsTheBound).
// Kept early longer instead, they cost a peer's lag after its write, less
// than the sub-window moving them costs (with clocks that agree, the
// least delay of the snapshots measured: little, with reads at drawn
// gaps). A reader of an aggregate keeps its counts early plus
// what the aggregator's placing of its members left, each at most the
// tolerance; where the two reach a sub-window, which a sum cannot linger,
// it reads every snapshot instead (readAggregate): with clocks that agree
// that takes reads of half a sub-window or more, W/14 (a quarter of the
// reads on a 10 s window with 1 s reads, as measured in docs/cluster.md). (Reads longer than a sub-window, W/7, may find a
// peer's snapshots late by more, and keep its counts a sub-window longer:
// a request may wait W/7 more there.)
func clockTolerance(sub time.Duration) time.Duration {
	return sub - 1
}

// clockAgreement is how far apart two clocks are expected to be at most
// (docs/cluster.md, Clocks): half a sub-window (sub). The window zone's
// cluster figures were measured true there: no random schedule went over
// the bound, and no request of weight 1 was told to retry early. Further
// apart, within the tolerance (clockTolerance), a Retry-After came up to
// 0.99 s early on a 4 s window (a clock 0.8 of a sub-window behind), a
// steady stream got less than its rate, and before the shares' carry
// compared the view's older sub-windows a few schedules went over. So
// that is where an operator is told (warnAhead), not only past the
// tolerance.
func clockAgreement(sub time.Duration) time.Duration {
	return sub / 2
}

// warnAhead logs, at most once per purge_age, that the peer name's clock
// was seen ahead of this one's by more than within (clockAgreement),
// past which the cluster's figures are no longer sure to hold
// (docs/cluster.md has them). Only a clock ahead is known: the measure of one
// behind may be a snapshot found late (clockTolerance), and the measure
// of one ahead never takes it further ahead than it is, so a warning is
// never a delay taken for a skew. So of two clocks that far apart, the one
// behind says so; which of the two is wrong, nothing here knows (this
// instance's own clock may be the one behind the true time), and the
// message names both.
func (s *Syncer) warnAhead(now time.Time, name string, ahead, within time.Duration) {
	if ahead <= within || now.Sub(s.clockLogged) < s.iv.PurgeAge {
		return
	}
	s.clockLogged = now
	s.log.Warn("this instance's clock and another's disagree by more than a window zone's cluster tolerates; check both against the true time and keep the instances' clocks synchronised",
		zap.String("zone", s.c.shape.Zone), zap.String("this_instance", s.instance), zap.String("instance", name),
		zap.Duration("other_ahead_at_least", ahead), zap.Duration("expected_within", within))
}

// forgetClocks forgets the peers no read has found for purge_age: their
// snapshots are gone, and one that comes back is measured afresh.
func (s *Syncer) forgetClocks(now time.Time) {
	for name, p := range s.clocks {
		if now.UnixNano()-p.seen > int64(s.iv.PurgeAge) {
			delete(s.clocks, name)
		}
	}
}

// followStep corrects what this instance measured of its peers' clocks
// for a step of its own wall clock (an NTP step, not a slew) since its
// last read: by how much more (or less) the wall clock moved than the
// time elapsed (Syncer.elapsed: the monotonic clock time.Now carries). A
// sample is a snapshot's write time less when it was found on this clock;
// after a step forward by Δ that finding reads Δ later, so the sample
// less Δ is still never more than how far the peer's clock is ahead of
// this one's (peerClock), and the peer's counts are placed on the clock
// as it reads now at once, not after clockSamples more snapshots.
// Dropping the samples instead would take the peer's sub-windows for this
// one's until its next snapshot, its counts leaving the view Δ early, as
// the samples left alone did. After a step back by Δ, Δ is added: left
// alone, the samples would keep the peer's counts Δ longer than W until
// its next snapshot (stricter, but a key waits for them). A host's
// monotonic clock stops while it is suspended and its wall clock runs on:
// that reads as a step forward, which takes the peers' clocks as further
// behind than they are and keeps their counts longer, until newer samples
// replace these.
func (s *Syncer) followStep(now time.Time) {
	prev := s.readAt
	s.readAt = now
	if prev.IsZero() || len(s.clocks) == 0 {
		return
	}
	elapsed := now.Sub(prev)
	if s.elapsed != nil {
		elapsed = s.elapsed(prev, now)
	}
	// clockShift places no peer further than most either way: a sample
	// saturates there, so that steps (a clock off by years, set right)
	// never add up past int64, and seen stays no later than now.
	most := int64(MaxClockSkew + s.iv.PurgeAge)
	step := max(min(int64(now.Round(0).Sub(prev.Round(0))-elapsed), most), -most)
	if step == 0 {
		return
	}
	for _, p := range s.clocks {
		for i := range min(p.n, clockSamples) {
			p.samples[i] = max(min(p.samples[i]-step, most), -most)
		}
		p.seen = min(p.seen+step, now.UnixNano())
	}
}
