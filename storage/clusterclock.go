package storage

import (
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// The cluster's clock.
//
// A Cluster counts, decides, publishes and reads on a clock of its own
// that does not step: anchored on the first time it is given, it reads
// that time's wall clock plus the monotonic time elapsed since (Time.Sub
// of two time.Now readings, which a step of the wall clock does not move).
// A window zone's sketch counts grants by sub-windows of the time it is
// given; on the wall clock, a step moved what this instance had counted:
// forward by Δ, its grants left its own view Δ early, its peers moved
// them Δ early too (measuring its clock from its snapshots), and its
// shares held for the others were released Δ early; back, its grants fell
// in sub-windows its view did not read yet (docs/cluster.md, Clocks, has
// the figures). On the cluster clock a step of the host's clock changes
// nothing counted: the instance runs skewed from its peers by the step,
// which they measure and place as any skew (clockShift).
//
// Beyond clockStepLimit apart from the wall clock (behind it, beyond
// purge_age less a write and a read interval, if less), the cluster clock
// re-anchors on it at once (a step, logged at WARN by a Syncer's next
// read): its peers refuse the snapshots of a clock more than MaxClockSkew
// ahead of theirs, and delete those older than purge_age as a dead
// instance's; and a suspended host's monotonic clock stops while its wall
// clock runs on, so that its cluster clock would lag by the suspend.

// clockStepLimit is how far the cluster clock may be apart from the wall
// clock: as far as the peers place a clock skewed from theirs
// (MaxClockSkew), beyond which they refuse its snapshots.
const clockStepLimit = MaxClockSkew

// clusterZone is the Location of the times on a cluster clock, so that a
// time converted twice stays the same (clusterClock.at). It reads as UTC.
var clusterZone = time.FixedZone("UTC", 0)

// A clusterClock is a Cluster's clock. It is safe for concurrent use; a
// conversion takes no lock.
type clusterClock struct {
	anchor atomic.Pointer[clockAnchor]
	// logged is the number of re-anchors logged (logStep).
	logged atomic.Int64
	// behind, if positive, is how far behind the wall clock the cluster
	// clock may run, where less than clockStepLimit (setPurge).
	behind atomic.Int64
	// mono, if set, gives the monotonic clock's reading that t (a test's
	// time, which carries none) was taken with: the one hook a test steps
	// an instance's wall clock by. limit, if set, replaces clockStepLimit.
	mono  func(t time.Time) time.Time
	limit time.Duration
}

// A clockAnchor is a time the cluster clock was set to the wall clock's.
type clockAnchor struct {
	// from is the time given then (its monotonic reading, or mono's), at
	// its wall clock's reading in Unix nanoseconds.
	from time.Time
	at   int64
	// stepped is how far the cluster clock has been moved by re-anchors
	// since the first anchor (the sum of their steps, which may wrap
	// around: only differences are read), and steps how many there were.
	stepped int64
	steps   int64
}

// at returns t on the cluster clock. A time it returned is returned as it
// is; so is a time that carries no monotonic reading (mono unset), which
// is not taken on a clock that steps. t is taken with time.Now (or
// derived from such a time by Add).
func (k *clusterClock) at(t time.Time) time.Time {
	if t.Location() == clusterZone {
		return t
	}
	c, _ := k.convert(t)
	return c
}

// convert returns t on the cluster clock, and the anchor it is read from.
func (k *clusterClock) convert(t time.Time) (time.Time, *clockAnchor) {
	a := k.anchor.Load()
	if t.Location() == clusterZone {
		if a == nil {
			// Not given by this clock, but marked: taken as it is.
			a = k.start(t)
		}
		return t, a
	}
	if a == nil {
		a = k.start(t)
	}
	from := t
	if k.mono != nil {
		from = k.mono(t)
	}
	for range 2 { // a concurrent re-anchor at most once more
		e := from.Sub(a.from)
		n := a.at + int64(e)
		d := t.UnixNano() - n
		ahead, behind := k.stepLimits()
		// A time taken before the anchor (on a goroutine that read the
		// clock before another re-anchored it) is read from it as it
		// is: it does not move the clock back.
		if e < 0 || (d <= int64(behind) && d >= -int64(ahead)) {
			return time.Unix(0, n).In(clusterZone), a
		}
		b := &clockAnchor{from: from, at: t.UnixNano(), stepped: a.stepped + d, steps: a.steps + 1}
		if k.anchor.CompareAndSwap(a, b) {
			return time.Unix(0, b.at).In(clusterZone), b
		}
		a = k.anchor.Load()
	}
	return time.Unix(0, a.at+int64(from.Sub(a.from))).In(clusterZone), a
}

// start anchors the clock on t if nothing has yet, and returns the anchor.
func (k *clusterClock) start(t time.Time) *clockAnchor {
	from := t
	if k.mono != nil && t.Location() != clusterZone {
		from = k.mono(t)
	}
	k.anchor.CompareAndSwap(nil, &clockAnchor{from: from, at: t.UnixNano()})
	return k.anchor.Load()
}

// logStep logs, once per Cluster, each re-anchor of its clock up to a
// (several since the last read in one line).
func (s *Syncer) logStep(a *clockAnchor, step time.Duration) {
	k := &s.c.clock
	for {
		logged := k.logged.Load()
		if a.steps <= logged {
			return
		}
		if k.logged.CompareAndSwap(logged, a.steps) {
			break
		}
	}
	ahead, behind := k.stepLimits()
	limit := behind
	if step < 0 {
		limit = ahead
	}
	s.log.Warn("the host's wall clock and the cluster's came apart by more than the tolerated skew: the cluster's clock is stepped to the wall clock; what this instance counted before may leave its and its peers' view early (stepped forward) or be unseen for a while (back), up to a window",
		zap.String("zone", s.c.shape.Zone), zap.Duration("step", step),
		zap.Duration("limit", limit), zap.Int64("steps", a.steps))
}

// stepLimits are how far the clock may run ahead of and behind the wall
// clock.
func (k *clusterClock) stepLimits() (ahead, behind time.Duration) {
	if k.limit > 0 {
		return k.limit, k.limit
	}
	behind = clockStepLimit
	if b := time.Duration(k.behind.Load()); b > 0 && b < behind {
		behind = b
	}
	return clockStepLimit, behind
}

// setPurge has the clock run behind the wall clock by no more than a
// Syncer of intervals iv lets the peers find its snapshots at before
// they delete them (older than purge_age): a snapshot is up to a write
// and a read interval old when it is read.
func (k *clusterClock) setPurge(iv Intervals) {
	k.behind.Store(int64(max(iv.PurgeAge-iv.Write-iv.Read, time.Nanosecond)))
}

// followStep corrects what this instance measured of its peers' clocks
// (clockShift's samples) for a step of the cluster clock since its last
// read: a re-anchor (anchor a is the one this read's time is taken from).
// A step of the host's wall clock alone reaches nothing: the cluster clock
// does not follow it. A sample is a snapshot's write time less when it was
// found on this clock; after a step forward by Δ that finding reads Δ
// later, so the sample less Δ is still never more than how far the peer's
// clock is ahead of this one's (peerClock), and the peer's counts are
// placed on the clock as it reads now at once, not after clockSamples more
// snapshots. Dropping the samples instead would take the peer's
// sub-windows for this one's until its next snapshot, its counts leaving
// the view Δ early, as the samples left alone did. After a step back by Δ,
// Δ is added: left alone, the samples would keep the peer's counts Δ
// longer than W until its next snapshot (stricter, but a key waits).
func (s *Syncer) followStep(a *clockAnchor) {
	prev := s.stepped
	s.stepped = a.stepped
	step := a.stepped - prev
	if step == 0 {
		return
	}
	s.logStep(a, time.Duration(step))
	if len(s.clocks) == 0 {
		return
	}
	// clockShift places no peer further than most either way: a sample
	// saturates there, so that steps never add up past int64.
	most := int64(MaxClockSkew + s.iv.PurgeAge)
	step = max(min(step, most), -most)
	for _, p := range s.clocks {
		for i := range min(p.n, clockSamples) {
			p.samples[i] = max(min(p.samples[i]-step, most), -most)
		}
		p.seen += step
	}
}
