package storage

import (
	mathbits "math/bits"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

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
//
// It also notes (unsure) whether the read found a peer, never seen
// publishing another snapshot, that looks dead here but whose snapshot is
// at most liveWrites write intervals old on a clock MaxClockSkew behind
// this one's: this instance's clock may be ahead, and the peer live.
func (s *Syncer) endSight(now time.Time) time.Duration {
	most := liveWrites * s.iv.Write
	n := now.UnixNano()
	var late time.Duration
	s.unsure, s.peerFound, s.oldPeer = false, s.oldPeer, false
	for name, p := range s.sighted {
		if time.Duration(n-p.found) > most {
			delete(s.sighted, name)
			continue
		}
		s.peerFound = s.peerFound || p.found == n
		if p.live(n, most) {
			late = max(late, min(time.Duration(n-p.at)-p.every, most))
		} else if p.found == n && !p.replaced && p.live(n, most+MaxClockSkew) {
			s.unsure = true
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

// sole returns the bitmap of the cells that this instance counted at least
// a write and a read interval (and lag, see replaceView) ago, by counts
// that still count now, and that sum, the peers' as read now, does not
// count: any other instance's counts of them from then on have been
// published and read since, so they are this instance's alone. (A cell
// whose counts of then have aged out is not: every peer's may have too,
// and every instance would find it its own.) A key all of whose cells are
// is let off its share
// (Cluster.TakeHash). It is nil while no bitmap of the own counts is that
// old yet. A new one is taken once the newest is that old, so a key that
// only reaches this instance is known as such within two such ages and a
// read interval after each (reads come on their own ticks):
// 2 × (write + 2 × read + lag). Only reads that fall exactly on the ages,
// as a test's clock makes them, save the read intervals. A peer that
// publishes late (sight) is not waited for, unlike in the shares' hold: a
// key it counts unseen may be let off its share here meanwhile, where
// waiting would hold every key of one instance for up to liveWrites write
// intervals after any peer died (replaceView).
func (s *Syncer) sole(now time.Time, sum *limiter.SketchSum, lag time.Duration) []uint64 {
	age := s.iv.Write + s.iv.Read + lag
	newest, other := &s.counted[0], &s.counted[1]
	if other.at.After(newest.at) {
		newest, other = other, newest
	}
	var bits []uint64
	var at time.Time
	switch {
	case newest.bits != nil && now.Sub(newest.at) >= age:
		bits, at = newest.bits, newest.at
	case other.bits != nil && now.Sub(other.at) >= age:
		bits, at = other.bits, other.at
	}
	var sole []uint64
	if bits != nil {
		// Only the cells whose counts of then still count now: once
		// they have aged out, so may every peer's counts of the key,
		// and a burst on every instance at once would find the key
		// each one's own alone (its new counts counted, the others'
		// not yet read) and grant it the whole quota on each.
		s.countedNow = s.c.sketch.AppendCountedSince(s.countedNow, at, now)
		sole = make([]uint64, len(bits))
		for w, b := range bits {
			b &= s.countedNow[w]
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
	s.c.counted.Store(int64(8 * (len(s.counted[0].bits) + len(s.counted[1].bits) + len(s.countedNow))))
	return sole
}

// A streak is a run of this instance's snapshots under one name, each
// written within liveWrites write intervals of the last: while it lasts,
// the others count the instance live (sight), from their first read after
// its first snapshot on (since), or for as long as this process can tell
// (counted: a streak it took over at a restart).
type streak struct {
	name        string
	since, last time.Time
	counted     bool
}

// noteStreak notes that this instance's snapshot under name, written at
// written, is in the storage at now: a published one, or, restored, its
// last one found at a start. A snapshot after a gap the others may take it
// for dead in (streakGap), or under another name (identity.go), begins a
// new streak; a restored one continues the streak of the process that
// published it, which the others count already, only while they surely
// still do: written on another host's clock, up to MaxClockSkew off this
// one's, it must be at most streakGap − MaxClockSkew old here and not
// dated ahead. Otherwise it begins no streak, and this instance takes its
// allowance until its own published streak is counted. The caller holds
// c.mu.
func (s *Syncer) noteStreak(name string, written, now time.Time, restored bool) {
	k := &s.c.streak
	gap := s.streakGap()
	switch {
	case restored:
		if age := now.Sub(written); age < 0 || age > gap-MaxClockSkew {
			*k = streak{}
			return
		}
		*k = streak{name: name, counted: true}
	case k.name != name || k.last.IsZero() || written.Sub(k.last) > gap:
		*k = streak{name: name, since: written}
	}
	k.last = written
}

// streakGap is the longest this instance may go without a published
// snapshot and still be sure the others count it live until its next read:
// they drop a peer whose latest snapshot they found liveWrites write
// intervals ago (sight), and found it no sooner than it was written; its
// shares taken at a read stand for a read interval.
func (s *Syncer) streakGap() time.Duration { return liveWrites*s.iv.Write - s.iv.Read }

// publishStale is whether this instance's last published snapshot (of
// its streak) is older than streakGap at now, or none landed: the others
// may count it dead before its next read. The caller holds c.mu.
func (s *Syncer) publishStale(now time.Time) bool {
	k := s.c.streak
	return k.last.IsZero() || now.Sub(k.last) > s.streakGap()
}

// publishedSince is whether a read found a snapshot of a peer, a new one
// or one it had not found before, later than at (on this instance's
// clock), as far as the peers it remembers (sight) tell. The caller holds
// c.mu.
func (s *Syncer) publishedSince(at time.Time) bool {
	for _, p := range s.sighted {
		if p.at > at.UnixNano() {
			return true
		}
	}
	return false
}

// shareRank is the rank this instance takes in the shares
// (limiter.SketchSum.WithShares) at a read at now, ranked rank among the
// live instances it finds: for a window zone, limiter.Uncounted(rank)
// while the others may not count it yet (token-bucket zones and quotas
// keep their rank: their bound is the weighted estimate's). Their shares
// then cover all a key has left, and a share taken besides, or of the room
// a sub-window frees, would be granted on top of the quota: by every
// instance that joins at once. The others count it from their first read
// of its first snapshot of the streak on, a read interval after it (plus
// lag, an aggregate's, see replaceView), and what they granted on the
// shares of before is published at their next write and read here at the
// next read: until then (a write and two read intervals, plus lag) it
// grants a key no more than its allowance (limiter.UncountedAllowance,
// events/10 + 1, and at most its share were it counted) in any span of
// the window, counted over its own counts however often it reads, so k
// instances joining at once add at most k allowances to a key's bound;
// then it carries what a counted copy would have left them. So too while
// its last published snapshot is older than streakGap (its writes fail,
// its reads do not): the others may have dropped it from their live count
// and share among one fewer, and it takes its share again only as a new
// streak, once its publishes resume and the others have counted them.
//
// An uncounted instance that finds no other live (live < 2) takes its
// allowance all the same while another may be granting unseen: a peer
// never seen publishing that looks dead only on a clock ahead (unsure,
// endSight: a joiner whose clock is ahead by more than liveWrites write
// intervals took the whole quota beside the others'), or, while its
// publishes are stale, any instance it found live at its last read before
// they were, or, while no publish of this process has ever landed, any
// peer whose snapshot a read finds (peerFound: of whatever age; one older
// than purge_age is deleted only by an instance whose own publishes land,
// see sumSnapshots, so in an outage on every instance the snapshots stay,
// while the old processes keep their shares for as long as it lasts). It
// cannot tell those others dead from failing as it does.
//
// Every instance's writes failing, each soon finds no other live, as each
// is found dead by the others (90 of 30 in a span on three when each
// decided alone). One that was counted at its last read before its
// publishes went stale, among of ≥ 2 instances then (streakShared), takes
// its share of the quota among them (limiter.UncountedShare: events/of,
// or its allowance if more) in place of the allowance, counted over its
// own counts as the allowance is, until its publishes resume; unless,
// stale, it finds a peer's snapshot later than a read interval after its
// own last publish (publishedSince): then it takes its allowance until a
// new streak is counted. A peer that dropped it did so at a read at least
// liveWrites write intervals after its last publish (it found that no
// sooner than it was written), and kept its share among the rest only
// while its own last publish was at most streakGap old, so published
// more than a read interval after this one's last; this one, reading,
// finds that (or a later one) by its first stale read, whose sight still
// remembers it. Without this, an instance whose writes failed first kept
// its share among three, and the others, failing later, theirs among
// two: 40 of 30. So those keeping shares counted each other, at least
// of of them for each of, and grant a key at most events between them
// from then on (or of allowances, if more), as each grant
// counts the instance's own grants of the key in the span, and each
// leaves what the peers' last snapshots count of it to them. Its share
// then, not the allowance: a stream of a key at the rate got a tenth of
// it spread over three, for the whole outage. Instances started since
// (none of whose publishes landed) take their allowances on top, as
// joiners do. One that was alone then, and finds nobody now, is taken to
// be alone and decides alone: a cluster of one whose writes fail keeps
// its limit, not its allowance.
// The caller holds c.mu.
func (s *Syncer) shareRank(now time.Time, live, rank int, lag time.Duration) (r, of int) {
	c := s.c
	k := c.streak
	if !c.shape.Sliding {
		return rank, 0
	}
	// Its publishes fail (or never began): the others may count it dead
	// before its next read, and share among one fewer.
	stale := s.publishStale(now)
	counted := !stale && (k.counted || now.Sub(k.since) >= s.iv.Write+2*s.iv.Read+lag)
	if !stale {
		c.streakLive, c.streakShared = live, 0
		if counted {
			c.streakShared = live
		}
	} else if s.publishedSince(k.last.Add(s.iv.Read)) {
		// A peer published after it may have dropped this one from
		// the count it keeps its share by: this one's share among
		// more would be granted beside that peer's among fewer.
		c.streakShared = 0
	}
	switch {
	case counted:
		return rank, 0
	case stale && live < 2 && c.streakShared >= 2:
		return limiter.Uncounted(rank), c.streakShared
	case live >= 2 || s.unsure || stale && c.streakLive >= 2 || k.last.IsZero() && s.peerFound:
		return limiter.Uncounted(rank), 0
	}
	return rank, 0 // alone, as far as it can tell
}

// seenSnapshot returns this instance's newest snapshot that every other
// instance has read since it was published, by a read at now (a read
// interval on, plus lag, an aggregate's: see replaceView), or nil: what
// the others' shares of a key only this instance counts are computed on
// (limiter.SketchSum.WithSharesSole). Only one whose store succeeded:
// taking one whose store failed for seen, an instance whose writes failed
// counted its unpublished grants of a key pinned to it as the others'
// knowledge, took its share of what was left over them at every read, and
// a burst on the others then got their shares of what they saw left
// besides (38 of 30 in a span, its writes failing for 7 s). The caller
// holds c.mu.
func (s *Syncer) seenSnapshot(now time.Time, lag time.Duration) []byte {
	by := now.Add(-s.iv.Read - lag).UnixNano()
	for _, o := range s.c.own {
		if o.w.at <= by && o.landed {
			if snap, err := decodeSnapshot(o.data, MitigationSlots, MaxResets); err == nil {
				return snap.sketch
			}
			return nil
		}
	}
	return nil
}
