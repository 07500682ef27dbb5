package limiter

import (
	"errors"
	"math"
	"math/bits"
	"slices"
	"time"
)

// WithShares returns a copy of the sum plus, in each cell, what an
// instance deciding on s and the sum must leave to the other n − 1
// instances of a cluster: all but its share of what the cell has left of
// the quota at now (the quota less s's and the sum's estimate of the cell,
// evaluated as a request's is). The shares are what is left divided by n,
// the remainder going one each to the instances of rank 0 to remainder − 1
// (rank is this instance's, from 0 to n − 1; a sliding sketch's ranks turn
// by one each sub-window, see turned), so that they add up to what is
// left; an instance the others do not count yet passes Uncounted(rank)
// and takes no share, only its allowance. So n instances that decide on
// the same counts grant a key at most what the cluster had left for it
// (plus an allowance per uncounted instance), and a key hit on all of them
// at once gets about its quota, not n of them. Every cell gets its
// reservation: a decision passes when any of the key's rows fits, so a
// key is let off its share (a key only this instance counts) by deciding
// on the sum without shares, never cell by cell (KeyCells, CellZero).
//
// The shares are fixed when the copy is made, from the counts of then: an
// instance makes a new one at each read of its peers, so the shares follow
// where a key's requests go. But a read may come before the others have
// published what they granted of the shares they were left: re-balanced
// on those counts, an instance would take back the others' shares, and a
// burst that outlasts a sync would get up to a quota per instance again.
// So prev, the copy this instance made at its previous read (nil for
// none), is carried: what prev left the others in a cell and they have
// not been seen to use since (the sum's count of the cell grew by less)
// stays theirs, if more than their shares now, until hold has passed
// without the sum growing in the cell (by then an instance that granted
// it has published that and been read), counted from the last re-balance
// at which this instance was seen to grant in the cell (the others may
// have granted at that same moment, which a slow view, such as an
// aggregate's, may not show yet). Only then is it shared afresh: a key
// that only reaches this instance, but shares a cell with the others'
// keys, gets the rest of its quota a share per hold once it is denied.
//
// The sum itself, which deciders may be reading, is unchanged. The copy
// allocates as much as NewSketchSum (zeroed by the runtime, the only pass
// over the whole table), plus 16 bytes per cell in use (44 for a sliding
// sketch, whose cells list what leaves the view in each sub-window, 7
// counts, found through an index of 4 bytes per cell). Its work follows
// the cells in use (counted by s or the sum, or holding what the previous
// copy left the others): every other cell counts nothing and is left what
// every such cell is, which is settled once and kept as the copy's
// default, added to a cell's count as it is read, so that no such cell is
// written. A cell that counts nothing and is left that much joins them if
// its hold began no later than theirs (a later one runs from a grant here,
// since refunded): taking theirs lengthens its hold, and the default's
// begins afresh at least once a hold, so quiet cells join within a hold.
// A sliding sketch moves to a new sub-window every W/7, often between two
// reads: its copies carry the reservations across sub-windows (while the
// sum still holds the previous copy's window), what the others used since
// being what the peers' counts grew by in the view's sub-windows but the
// oldest (all of them from an older sum's on; in those older than the
// copy's, only what left them counts against what grew later), so that a
// move of the same grants to another sub-window (a sum of an older
// sub-window holds a peer ahead's grants of a later one in its own; a
// reader may place a peer a sub-window later than at the read before) is
// no grant, and times
// being counted from the window the chain of carrying copies began in;
// a sum of another sub-window (an aggregate's, read late or written on a
// clock ahead) is shifted to now's, what it counts after now counted as
// granted now, as a weighted sum of another window is. A
// weighted sketch's copies carry within one window: its edge is W apart.
// A sub-window's counts leave every instance's view at the same instant,
// between two reads, and that room, taken whole, would be granted once per
// instance to a key hit on all of them at once: so a sliding copy used in a
// later sub-window than it was made in leaves the others all but this
// instance's share of the counts, own and the peers', that have left its
// view since (freedAt, added as the key's cells are read: no allocation,
// no lock), and the next copy carries that as a reservation (carry).
// Counts may leave the sum before they leave the view: a peer whose clock
// is ahead of this one's drops its oldest sub-window at its own
// sub-window's end, and every reader still in the sub-window before finds
// them gone at its next read. That room has freed for every instance too:
// the next copy leaves the others all but this instance's share of what
// the sum counts less than the previous copy in the oldest sub-window of
// the view (dropped), carried as the room that left the view is.
// Taken whole, because the reservation carried for the others (not yet
// seen to use it) was more than their shares of what is left, it was
// granted once per such reader (six instances, clocks within 2 s, through
// an aggregate: 36 of 30 in a span of a 30 s window).
// A sliding copy decided on under a quota other than the one it shared (a
// reload since) frees at most the quota now, and leaves the others their
// shares of a raise (raised); the next copy carries that as it carries
// the room that freed, or it would share the raise afresh before the
// others have published what they granted of it, and each instance would
// take its share again. With n < 2 there is no copy (below): a sole
// instance's decisions stay exact. An uncounted one (Uncounted) takes its
// allowance however few instances it finds live (n of 1 or less counts as
// 1): one that cannot see the others (its clock ahead makes their
// snapshots look old, or every instance's publishes fail) must not take
// the whole quota beside them.
//
// A nil sum, or n < 2 with a rank of 0 or more, gives the sum itself. t is
// a sum (NewSketchSum,
// SketchSumOfBinary), not a copy made by WithShares: every cell it does
// not count something in is taken to hold zero.
func (t *SketchSum) WithShares(s *Sketch, n, rank int, now time.Time, prev *SketchSum, hold time.Duration) *SketchSum {
	return t.WithSharesSole(s, n, rank, 0, now, prev, hold, nil, nil)
}

// WithSharesSole is WithShares for a sliding sketch some of whose cells
// only this instance counts (sole: bit i%64 of word i/64 for cell i; nil
// for none), and the others have not counted for long. In such a cell
// there is no grant of the others' to wait for: what it leaves them is
// all but its share, rounded up (settleSole), of what the quota has left
// over the own counts they have seen, those of seen, a snapshot of s
// (AppendSnapshot) that every
// other instance has read since it was taken (nil for none), in the
// sub-windows still in the view. Their shares of the key are computed on
// no less, and they take them if the key turns up there at once: a key
// let off its share whole would get them besides. So a key that only
// reaches this instance gets its share of what is left at each read that
// follows a publish of its grants, where the reservation carried afresh
// at each own grant would hold it at its first share. A weighted sketch
// ignores sole and seen (its cluster decides such a key on the sum
// without shares).
//
// of is, for an uncounted instance, the instances whose share of the
// quota it may take as its allowance where that is more
// (UncountedShare): 0 for the allowance alone.
func (t *SketchSum) WithSharesSole(s *Sketch, n, rank, of int, now time.Time, prev *SketchSum, hold time.Duration, sole []uint64, seen []byte) *SketchSum {
	if t == nil || n < 2 && rank >= 0 {
		return t
	}
	n = max(n, 1)
	e, el := s.clock(now)
	d := e - t.epoch
	// The oldest sub-window whose peers' counts the next copy compares
	// with this one's to see what the others used of their reservations
	// (carry): the sum's own, if it is older than now's.
	from := min(t.epoch, e)
	if d != 0 {
		// A sum of another window or sub-window (an aggregate's: read a
		// read interval or two after it was written, or written on a
		// clock ahead of this one's): the same counts, as of window e.
		// Left unshared, it had every instance that read it decide
		// alone until its next read (30 of 30 on each of three, from
		// an aggregator 2 s ahead, a sub-window's edge between them; a
		// token-bucket zone's, from an aggregate written before a
		// window's edge and read after it).
		t = t.shifted(d)
	}
	c := *t
	c.shares = nil
	c.sharedTail = c.tail != nil && d == 0 // the sum's, counted there
	// Every cell t counts something in is in use, below, and written
	// there unless it counts nothing after all (subtracting can leave a
	// cell at zero); every other cell holds zero in t too. c.used stays
	// t's: no sum is added to once read.
	c.counts = make([]uint32, len(t.counts))
	var p *shareState
	if prev != nil && prev.shares != nil && len(prev.counts) == len(t.counts) && s.carries(prev.epoch, prev.shares.origin, e) {
		p = prev.shares
	}
	// Times are counted from the start of window origin: the current
	// one, or for a sliding sketch the one the chain of copies that
	// carried the reservations began in, in units such that any time
	// until the chain ends fits 32 bits. The hold is rounded up, plus a
	// unit for the times rounded down: a long window's unit (5.6 s at 30
	// days) may be longer than the hold itself, which must not shrink
	// to nothing.
	origin, unit := e, max(int64(time.Millisecond), s.window>>32)
	if s.ring > 2 {
		unit = max(int64(time.Millisecond), s.window>>16)
		if p != nil {
			origin = p.origin
		}
	}
	b := shareBalance{
		n: uint64(n), q: uint64(s.quota.Load()),
		at: uint32(((e-origin)*s.window + el) / unit), hold: uint32(min((int64(hold)+unit-1)/unit+1, 1<<32-1)),
	}
	b.rank, b.as = shareRank(n, rank)
	b.turned = b.rank
	if b.rank == b.n {
		b.allow = uint64(UncountedShare(int64(b.q), of))
	}
	if s.ring > 2 {
		b.sliding, b.turned, b.as = true, turned(b.rank, uint64(e), b.n), turned(b.as, uint64(e), b.n)
	}
	// A copy made while the others did not count this instance left them
	// all: what they may still grant of it is what a counted copy would
	// have left them.
	b.joined = p != nil && p.rank >= p.n && b.rank < b.n

	// Every cell that counts nothing anywhere and held the previous
	// default is in the same state: it is settled once, here, and the
	// cells that are not are settled one by one below.
	st := &shareState{origin: origin, n: b.n, rank: b.rank, q: b.q, from: from}
	if s.ring > 2 {
		for d := range st.turns {
			st.turns[d] = turned(b.rank, uint64(e+int64(d)), b.n)
		}
	}
	// What the previous copy left the others of a raise since it was
	// made (raised): they may have granted their shares of it since,
	// unseen yet, so it is carried as the room that frees is (freed),
	// in every cell. Without it the first copy under the new quota
	// shared the raise afresh, and each instance took its share of it
	// again on top of what it had granted of the others' before the
	// read.
	var up uint64
	if p != nil && s.ring > 2 {
		up = p.raised(int(e-prev.epoch), b.q)
	}
	if p != nil {
		held, since := b.carry(p.def, p.defSince, 0, up, uint64(p.def), 0, 0)
		st.def, st.defSince = b.settle(b.q, 0, held, since)
	} else {
		st.def, st.defSince = b.settle(b.q, 0, 0, b.at)
	}
	c.def = st.def // every cell not written below: 0 + def

	// The cells in use, in order: counted by s or by the sum, or listed
	// by the previous copy.
	marks := slices.Clone(t.used)
	for _, i := range s.liveCells(now) {
		marks[i/64] |= 1 << (i % 64)
	}
	if p != nil {
		for _, c := range p.cells {
			marks[c.i/64] |= 1 << (c.i % 64)
		}
	}
	used := 0
	for _, m := range marks {
		used += bits.OnesCount64(m)
	}
	st.cells = make([]shareCell, 0, used)
	if s.ring > 2 {
		st.freed = make([]uint32, 0, used*(int(s.ring)-1))
		st.pos = make([]int32, len(t.counts)/int(s.ring))
	}
	w, rest := uint64(s.window), uint64(s.window)-uint64(el)
	r := int(s.ring)
	if r == 2 || len(sole)*64 < len(t.counts)/r {
		sole = nil
	}
	soleCells, soleSeen := t.seenCounts(seen, sole, e)
	js := 0 // soleCells[js] is the first sole cell not passed yet
	j := 0  // p.cells[j] is the first of the previous copy's cells not passed yet
	for i := range setCells(marks) {
		// A sliding sketch's older sub-windows count in full: they are
		// summed into ownPrev and peerPrev, and weighed whole (rest w).
		// gone[k] is what leaves the view k + 1 sub-windows on.
		var ownPrev, peerPrev uint64
		var gone [1<<sketchSlidingBits - 1]uint64
		for k := range r - 1 {
			ownPrev += s.count(i, e-int64(r)+1+int64(k))
			peerPrev += uint64(t.counts[r*i+k])
			gone[k] = ownPrev + peerPrev
		}
		ownCurr := s.count(i, e)
		peerCurr := uint64(t.curr(i))
		// What the own sketch and the peers counted from the window
		// the previous copy was made in on: the current one, or for a
		// sliding sketch maybe one or more before.
		ownSince, peerSince := ownCurr, peerCurr
		var prevCount uint64
		var lo int64 // the oldest window the peers' counts are compared from
		if p != nil {
			for w := prev.epoch; w < e; w++ {
				ownSince += s.count(i, w)
			}
			// The peers' counts from lo on, in the previous copy (its
			// reservation in its own window included) and now. The
			// same grants may sit in an older or a later sub-window in
			// the next sum though nothing was granted: a sum of an
			// older sub-window than its copy's (an aggregate summed on
			// a clock behind this one's) counts a peer ahead's grants
			// of the copy's sub-window in its own, which the copy holds
			// in the one before, and a later sum holds them in the
			// copy's; a reader that places a peer by whole sub-windows
			// may place it a sub-window later than at the read before.
			// Compared over the copy's window alone, such a move read
			// as the others' use of their reservation, which was then
			// handed out again. So a sliding copy's compares every
			// sub-window of the view but the oldest (all of them from
			// an older sum's on), where a move lands or starts.
			// In the windows before the copy's only what left them
			// counts (now's counts at most the copy's): it offsets
			// what moved into a later one; what grew there was granted
			// before the copy was made (published late), or moved
			// there by a placing, and is no use of the shares it left.
			// What leaves the oldest, a peer ahead drops first (a
			// move from there would leave the view): that room is
			// shared (dropped, below), not taken for a move.
			lo = max(min(p.from, prev.epoch, e-int64(r)+2), e-int64(r)+1)
			prevCount = uint64(prev.curr(i))
			for w := lo; w < e; w++ {
				nw := uint64(t.counts[r*i+r-1-int(e-w)])
				if w < prev.epoch {
					pw := uint64(prev.counts[r*i+r-1-int(prev.epoch-w)])
					prevCount += pw
					nw = min(nw, pw)
				}
				peerSince += nw
			}
		}
		// What the previous copy left the others here: listed, or
		// its default.
		var held uint64
		since := b.at
		if p != nil {
			pk, ps, po, freed := p.def, p.defSince, uint32(0), up
			for j < len(p.cells) && int(p.cells[j].i) < i {
				j++
			}
			if j < len(p.cells) && int(p.cells[j].i) == i {
				pc := &p.cells[j]
				pk, ps, po = pc.keep, pc.since, pc.owned
				freed += p.freedAt(j, int(e-prev.epoch), b.q)
				if r > 2 {
					// What left the sum since, not the view:
					// room freed as that of what leaves the
					// view is (dropped).
					x := min(t.dropped(prev, i, e, lo), b.q)
					freed += x - shareOf(x, b.n, b.turned)
				}
			}
			held, since = b.carry(pk, ps, po, freed, prevCount, peerSince, ownSince)
		}
		// The cell's estimate, rounded up, as sketchView.remaining
		// takes it.
		var est uint64
		if ownPrev|ownCurr|peerPrev|peerCurr != 0 {
			if r > 2 {
				rest = w
			}
			hi, lo := sketchNum(ownPrev+peerPrev, ownCurr+peerCurr, w, rest)
			est = sketchCeil(hi, lo, w)
		}
		var keep uint32
		if sole != nil && sole[i/64]&(1<<(i%64)) != 0 {
			for js < len(soleCells) && soleCells[js] < i {
				js++
			}
			keep, since = b.settleSole(b.q-min(peerPrev+peerCurr+soleSeen[js], b.q), soleSeen[js])
		} else {
			keep, since = b.settle(b.q-min(est, b.q), ownPrev+ownCurr, held, since)
		}
		owned := uint32(min(ownCurr, MaxSketchQuota))
		if keep == st.def && owned == 0 && peerPrev|peerCurr|ownPrev == 0 && since <= st.defSince {
			// As every cell that counts nothing, its hold having
			// begun no later than theirs: taking theirs lengthens
			// it, never shortens it.
			continue
		}
		st.cells = append(st.cells, shareCell{i: int32(i), keep: keep, since: since, owned: owned})
		if r > 2 {
			st.pos[i] = int32(len(st.cells))
			// The room that leaves frees: none while the cell
			// still holds the quota without it.
			for _, g := range gone {
				st.freed = append(st.freed, uint32(min(est, b.q)-min(est-min(g, est), b.q)))
			}
		}
		copy(c.counts[r*i:r*i+r-1], t.counts[r*i:r*i+r-1])
		c.counts[r*i+r-1] = uint32(min(peerCurr+uint64(keep), MaxSketchQuota)) - c.def
	}
	c.shares = st
	return &c
}

// seenCounts returns the cells sole marks, in increasing order, and what
// the snapshot seen counts in each over the sub-windows of window e's
// view. A snapshot that does not fit the sum, is not well formed, or is
// nil counts nothing.
func (t *SketchSum) seenCounts(seen []byte, sole []uint64, e int64) (cells []int, counts []uint64) {
	if sole == nil {
		return nil, nil
	}
	cells = slices.Collect(setCells(sole))
	counts = make([]uint64, len(cells))
	if seen == nil {
		return cells, counts
	}
	var h sketchHeader
	begin := func(got sketchHeader) error {
		if got.ring != t.ring || got.window != t.window || got.epoch > e {
			return errors.New("not a snapshot of this sum's sketch, of now or before")
		}
		h = got
		return t.fits(got)
	}
	if walkSketchBinary(seen, t.rows*t.width, begin, nil) != nil {
		return cells, counts
	}
	at := cellCursor{idx: cells}
	_ = walkSketchBinary(seen, t.rows*t.width, begin, func(k, i int, c uint32) {
		if v := at.find(k, i); v >= 0 && h.epoch-int64(h.ring)+1+int64(k) > e-int64(t.ring) {
			counts[v-k*len(cells)] += uint64(c)
		}
	})
	return cells, counts
}

// A shareState is what a copy made by WithShares left the other instances:
// in each cell listed in cells (in increasing order), its keep, from its
// since (in units of the window's time, see WithShares) on, while the own
// sketch counted its owned in the cell's current window; in every other
// cell def, from defSince, with nothing owned. Each is counted in the
// copy's current window.
type shareState struct {
	def, defSince uint32
	cells         []shareCell
	// origin is the window the times are counted from (WithShares).
	origin int64
	// from is the window from which on, at the latest, the next copy
	// compares the peers' counts with this one's (carry; it compares
	// every window of its view but the oldest, and from from on where
	// that is older): its own, or that of the older sum it was made
	// from (WithShares shifts such a sum to now's).
	from int64
	// freed holds, for a sliding sketch, ring − 1 counts for each cell
	// listed in cells, in the same order: entry k is the room (below the
	// quota) that what the cell counted, own and the peers', in the k + 1
	// oldest sub-windows of the copy's view frees when it leaves the view,
	// k + 1 sub-windows later.
	freed []uint32
	// pos holds, for a sliding sketch, for each cell, 1 + its index in
	// cells, or 0 if it is not listed: a decision finds a cell's freed in
	// two loads.
	pos []int32
	// n and rank are the instances the copy shares among and this one's
	// rank (WithShares; n for an instance the others do not count yet,
	// which takes no share, only its allowance, settled in the cells'
	// keep: see Uncounted).
	n, rank uint64
	// q is the quota the copy shared: a decision on a later one shares
	// what it adds (raised) and frees no more room than it holds
	// (freedAt).
	q uint64
	// turns holds, for a sliding sketch, the rank shareOf takes d
	// sub-windows after the copy's window (turned), at index d.
	turns [1 << sketchSlidingBits]uint64
}

// Uncounted is the rank WithShares takes for an instance ranked rank
// among the n it finds live that the others do not count yet (one that
// joined the cluster since their last reads): their shares cover all that
// is left, so it takes no share of it, nor of the room that frees, and
// leaves every cell's whole room to them but its allowance: at most
// UncountedAllowance of the quota, less what it counts in the cell over
// the sub-windows in the view (at least its own grants of a key in the
// last window: a cell counts every key that maps to it), and never more
// than its share were it counted (ranked rank, turned by the window as a
// counted one's is, or rounded up in a cell only it counts, as
// settleSole's). So a key gets at most the allowance from it in any span
// of the window, however often it re-balances while uncounted: each copy
// leaves it the allowance less what the view already counts, and the view
// reaches a window back. What it grants of the allowance comes on top of
// what the counted instances' shares cover: k instances uncounted at once
// add at most k × UncountedAllowance to a key's bound.
func Uncounted(rank int) int { return -1 - max(rank, 0) }

// UncountedAllowance is what an instance the others do not count yet
// (Uncounted) may grant a key of quota q in any span of the window: q/10 +
// 1, the slack of the cluster's bound of 1.1 × q + 1 (⌊1.1 × q⌋ + 1 = q +
// ⌊q/10⌋ + 1). A request heavier than that waits until it is counted.
func UncountedAllowance(q int64) int64 { return max(q, 0)/10 + 1 }

// UncountedShare is what an uncounted instance that shared the quota q
// with of instances at its last count (of ≥ 2) may grant a key in any span
// of the window: its share of q then, rounded down, or its allowance if
// more. Instances that each counted the same of, and take no more, grant
// a key at most max(q, of × UncountedAllowance(q)) between them.
func UncountedShare(q int64, of int) int64 {
	a := UncountedAllowance(q)
	if of >= 2 {
		a = max(a, max(q, 0)/int64(of))
	}
	return a
}

// shareRank is WithShares' rank as shareOf takes it, n for an uncounted
// instance (Uncounted, or a rank of n or more), and the rank an uncounted
// one would take were it counted (that of Uncounted's argument, capped at
// n − 1; n for a rank of n or more).
func shareRank(n, rank int) (r, as uint64) {
	switch {
	case rank >= n:
		return uint64(n), uint64(n)
	case rank < 0:
		return uint64(n), uint64(min(-1-rank, n-1))
	}
	return uint64(rank), uint64(rank)
}

// shareOf is the share of x of the instance of rank r among n: x/n, and
// one more for the x mod n instances of the lowest ranks, so that the n
// shares add up to x. A rank of n (RankUncounted) takes nothing.
func shareOf(x, n, r uint64) uint64 {
	if r >= n {
		return 0
	}
	share := x / n
	if r < x%n {
		share++
	}
	return share
}

// turned is rank turned by turn among n (n stays n): the rank shareOf
// takes in the sub-window turn, for a sliding sketch (turn 0 for a
// weighted one). Every instance gets the remainder in its turn, where a
// fixed order left the last-ranked one a key's last request of every
// window.
func turned(rank, turn, n uint64) uint64 {
	if rank >= n {
		return n
	}
	return (rank + turn%n) % n
}

// freedAt is what listed cell j leaves the other instances, d sub-windows
// after the copy's window, of the counts that have left the view since
// (freed): all but this instance's share of them, split as settle splits
// what is left. A whole sub-window's counts leave every instance's view at
// the same instant, between two reads: taken whole, that room would be
// granted once per instance to a key hit on all of them at once.
//
// The room was measured against the quota of the copy: under a lower one
// (a reload since) it frees at most the quota, so that the key is not
// held on the old quota's room until a re-balance carries that.
func (st *shareState) freedAt(j, d int, q uint64) uint64 {
	f := len(st.freed) / max(len(st.cells), 1)
	if d < 1 || d > f {
		return 0
	}
	gone := min(uint64(st.freed[j*f+d-1]), q)
	return gone - shareOf(gone, st.n, st.turns[d])
}

// raised is what this instance leaves the others, d sub-windows after the
// copy's window, of a quota q higher than the one the copy shared: all
// but its share of the difference, which the others are as free to grant
// as it is. Without it each instance would take the whole raise, once per
// instance.
func (st *shareState) raised(d int, q uint64) uint64 {
	if q <= st.q || d >= len(st.turns) {
		return 0
	}
	x := q - st.q
	return x - shareOf(x, st.n, st.turns[d])
}

// addFreed adds to the view, d sub-windows after the copy's window, what
// this instance leaves the others in each of the key's cells of the counts
// that have left the view since (leftTo), as counted in the current
// sub-window: it stays occupied until the next read re-balances, which
// carries it (carry). cols are the key's (ring × cell index). It does not
// allocate.
func (st *shareState) addFreed(cols *sketchCols, d, ring int, q uint64, v *sketchView, lingered *[MaxSketchRows]uint64) {
	for r := 0; r < v.n; r++ {
		x := st.leftTo(st.pos[cols[r]/uint64(ring)]-1, d, q, lingered[r])
		v.sub[r][len(v.sub[r])-1] += x
		v.rows[r].curr += x
	}
}

// leftTo is what the copy leaves the others, d sub-windows after its
// window, in its listed cell j (−1 for none) of the counts that have left
// the view since (freedAt) and of a raise (raised), under the quota q:
// none in its own window under the quota it shared. What still lingers in
// the view (Linger), lingered of what has just left it, has freed no room
// yet: the others need no share of it.
func (st *shareState) leftTo(j int32, d int, q, lingered uint64) uint64 {
	if d < 0 || d == 0 && q <= st.q {
		return 0
	}
	x := st.raised(d, q)
	if j >= 0 {
		f := st.freedAt(int(j), d, q)
		x += f - min(f, lingered)
	}
	return x
}

// dropped is what a sliding sum t of window e counts less than prev, the
// copy made at the previous read, in cell i over the sub-windows of e's
// view before to (those the carry does not compare: the oldest, unless
// prev was made of an older sum, WithShares). Those sub-windows are
// still in this view, and counts leave them only by leaving the sum: a
// peer whose clock is ahead of this one's (by less than a sub-window, or
// by what moving its counts by whole sub-windows leaves: storage's
// clockShift) drops its oldest sub-window from its snapshots, and an
// aggregator its own from its aggregate, at its sub-window's end, that
// much before this clock's; a reset learned at the read takes a key's
// counts out. Counts moved between those sub-windows offset each other,
// and a grant of before the copy published late offsets what left.
func (t *SketchSum) dropped(prev *SketchSum, i int, e, to int64) uint64 {
	r := t.ring
	var was, is uint64
	for w := e - int64(r) + 1; w < to; w++ {
		was += uint64(prev.counts[r*i+r-1-int(prev.epoch-w)])
		is += uint64(t.counts[r*i+r-1-int(e-w)])
	}
	return was - min(was, is)
}

// kept is what a sliding copy made by WithShares leaves the others in
// cell i, in its count of window epoch: 0 in any other sum.
func (t *SketchSum) kept(i int) uint32 {
	st := t.shares
	if st == nil || st.pos == nil {
		return 0
	}
	if j := st.pos[i] - 1; j >= 0 {
		return st.cells[j].keep
	}
	return st.def
}

// sketchShareChain is how many sub-windows a sliding sketch's copies made
// by WithShares carry their reservations over, times being counted from
// the first: then the next copy shares afresh.
const sketchShareChain = 1 << 15

// carries reports whether a copy made by WithShares in window e carries
// the reservations of one made in window prev, whose chain began in
// origin: in the same window, or for a sliding sketch a window the sum
// still holds (its counts since are known), within the chain.
func (s *Sketch) carries(prev, origin, e int64) bool {
	if s.ring == 2 {
		return prev == e
	}
	return prev <= e && e-prev < int64(s.ring)-1 && origin <= prev && e-origin < sketchShareChain &&
		e-origin < math.MaxInt64/s.window-1
}

// shifted returns a copy of the sum as of d windows later (d < 0:
// earlier): its counts of windows the new one holds, those of the newest
// d zero, and for d < 0 its counts of the windows after the new one's
// counted in the new one's, as if granted now (a sum written on a clock
// ahead: what it counts there was granted, and the counts of the windows
// it has dropped, older than its own, are zero but for its tail, the one
// before its oldest, that it still counted: Linger, in the cells in use,
// which Later marks). It reads only the cells the sum counts something in.
func (t *SketchSum) shifted(d int64) *SketchSum {
	c := *t
	c.epoch += d
	c.counts = make([]uint32, len(t.counts))
	r := int64(t.ring)
	// The window that has just left the new view, still counted within
	// linger of its end (Linger): its slot d − 1.
	c.tail, c.sharedTail = nil, false
	for i := range setCells(t.used) {
		src, dst := t.counts[t.ring*i:][:t.ring], c.counts[t.ring*i:][:t.ring]
		if d > 0 && d <= r && t.linger > 0 && src[d-1] != 0 {
			if c.tail == nil {
				c.tail = make(map[int32]uint32)
			}
			c.tail[int32(i)] = src[d-1]
		}
		if d >= 0 {
			if d < r {
				copy(dst, src[d:])
			}
			continue
		}
		if -d < r {
			copy(dst[-d:], src[:r+d])
		}
		var later uint64
		for _, n := range src[max(r+d, 0):] {
			later += uint64(n)
		}
		dst[r-1] = uint32(min(uint64(dst[r-1])+later, MaxSketchQuota))
		if n := t.tail[int32(i)]; n != 0 {
			// The window before the sum's oldest is in the new view
			// (its slot −d − 1), or after it.
			k := min(-d-1, r-1)
			dst[k] = uint32(min(uint64(dst[k])+uint64(n), MaxSketchQuota))
		}
	}
	return &c
}

type shareCell struct {
	i                  int32
	keep, since, owned uint32
}

// shareBalance is what WithShares settles each cell's reservation with:
// the instances and this one's rank among them, the quota, and the time
// into the window and the hold, in the units of shareState.
type shareBalance struct {
	n, rank, q uint64
	at, hold   uint32
	// turned is the rank shareOf takes (turned by the window, for a
	// sliding sketch); sliding is set for a sliding sketch, whose holds
	// are capped (settle).
	turned  uint64
	sliding bool
	// For an instance the others do not count yet (rank n, Uncounted):
	// as is the rank, turned as turned is, whose share caps its
	// allowance, and allow is the allowance (UncountedAllowance); 0 for
	// a counted one.
	as, allow uint64
	// joined is set when the previous copy was made while the others
	// did not count this instance (Uncounted) and this one is not.
	joined bool
}

// carry returns what a reservation of pk, made or seen used at ps, while
// the own sketch counted po, plus freed (what the copy left the others of
// the counts that left its view since, freedAt, or the sum, dropped),
// still holds for the others, and since when: less what the sum (whose
// count of the cell was prevCount with the reservation pk) has counted of
// theirs since; all of it again from now if this instance granted in the
// cell since (the others may have too, at the same moment, unseen yet) or
// room was freed (the others may have granted their shares of it since,
// unseen yet); all of it until hold passes; then nothing.
func (b shareBalance) carry(pk, ps, po uint32, freed, prevCount, peerCurr, ownCurr uint64) (held uint64, since uint32) {
	kept := uint64(pk) + freed
	if b.joined {
		kept -= shareOf(kept, b.n, b.turned)
	}
	if kept == 0 {
		return 0, b.at
	}
	then := prevCount - min(uint64(pk), prevCount)
	switch used := peerCurr - min(peerCurr, then); {
	case used != 0:
		return kept - min(used, kept), b.at
	case ownCurr > uint64(po) || freed != 0:
		return kept, b.at
	case b.at-min(b.at, ps) < b.hold:
		return kept, ps
	}
	return 0, b.at
}

// settle returns what a cell with left of the quota leaves the others, and
// since when: all but this instance's share, the n shares adding up to
// left (shareOf: the remainder of the division going one each to the
// instances first in turn, so the last requests of a key spread over the
// instances still pass), or what they were left before, held since since, if more:
// what they may still grant unseen is not shared again, nor left them
// twice.
//
// A sliding sketch's hold is capped at what n − 1 shares of the quota now
// can be: a hold made under a higher quota (a reload lowered it since)
// would otherwise deny the key here for as long as it is held.
//
// own is what the own sketch counts in the cell over the sub-windows in
// the view: an uncounted instance takes its allowance less that (mine).
func (b shareBalance) settle(left, own, held uint64, since uint32) (keep, from uint32) {
	k := left - b.mine(shareOf(left, b.n, b.turned), left, own)
	if b.sliding {
		held = min(held, b.q-b.mine(shareOf(b.q, b.n, b.turned), b.q, 0))
	}
	if held >= k {
		k = held
	} else {
		since = b.at
	}
	if k = min(k, MaxSketchQuota); k == 0 {
		return 0, 0
	}
	return uint32(k), since
}

// mine is what this instance takes of a cell with left of the quota, its
// share being share, and own what the own sketch counts in it over the
// sub-windows in the view: share, or for an instance the others do not
// count yet (Uncounted) its allowance less own, at most the share it
// would take were it counted. The view reaches a window back, so what it
// grants of that between two reads, with own, stays within the allowance
// in any span of the window; a re-balance hands it nothing more.
func (b shareBalance) mine(share, left, own uint64) uint64 {
	if b.rank < b.n {
		return share
	}
	return min(shareOf(left, b.n, b.as), b.allow-min(own, b.allow))
}

// settleSole returns what a cell only this instance counts, with left of
// the quota over the own counts the others have seen, leaves them, and
// since when (now): all but this instance's share, which takes the
// division's remainder whatever the turn. The others split what they see
// left by turns: a key that only reaches this instance would otherwise get
// its last units only in its turn, n − 1 sub-windows apart, and the
// others, if the key turns up there at once, take at most one unit of the
// remainder this one took too.
//
// The share is what this instance may grant over the own counts seen,
// those in the view of the snapshot the others have read: so an uncounted
// instance's is its allowance less seen (at most that share), and with
// what it granted unseen it reaches the allowance in all. Less own, as
// mine takes it of a left that counts every own grant, it counted those
// unseen twice, and granted half its allowance (a key pinned to an
// instance of a cluster whose writes all fail: 2 of 4 per window).
func (b shareBalance) settleSole(left, seen uint64) (keep, from uint32) {
	share := (left + b.n - 1) / b.n
	if b.rank == b.n {
		share = min(share, b.allow-min(seen, b.allow))
	}
	if k := min(left-share, MaxSketchQuota); k != 0 {
		return uint32(k), b.at
	}
	return 0, 0
}

// AppendCounted appends a bitmap of the cells in which s counts something
// at now (bit i%64 of word i/64 for cell i), reusing dst. It looks only at
// the cells that count something (liveCells).
func (s *Sketch) AppendCounted(dst []uint64, now time.Time) []uint64 {
	return s.AppendCountedSince(dst, now, now)
}

// AppendCountedSince is AppendCounted(dst, now) less the cells whose
// counts now all came after at: it marks the cells with a count in a window
// counted both at at and at now, so that a cell marked there was counted
// at at by counts that still count (none, once at's windows have all left
// the view).
func (s *Sketch) AppendCountedSince(dst []uint64, at, now time.Time) []uint64 {
	cells := s.rows * int(s.width)
	dst = append(dst[:0], make([]uint64, (cells+63)/64)...)
	e, _ := s.clock(now)
	last := min(e, floorDiv(at.UnixNano(), s.window))
	for _, c := range s.liveCells(now) {
		i := int(c)
		for w := e - int64(s.ring) + 1; w <= last; w++ {
			if s.count(i, w) != 0 {
				dst[i/64] |= 1 << (i % 64)
				break
			}
		}
	}
	return dst
}

// floorDiv is ⌊n/d⌋ for d > 0.
func floorDiv(n, d int64) int64 {
	q := n / d
	if n%d < 0 {
		q--
	}
	return q
}

// KeyCells sets cells to the index of the cell the key with hash h uses in
// each row of s, and returns the number of rows.
func (s *Sketch) KeyCells(h uint64, cells *[MaxSketchRows]int) int {
	var cols sketchCols
	s.columns(h, &cols)
	for i := range s.rows {
		cells[i] = int(cols[i] >> s.rbits)
	}
	return s.rows
}

// CellZero reports whether the sum counts nothing in cell i, in any of its
// windows.
func (t *SketchSum) CellZero(i int) bool {
	for k := range t.ring {
		if t.at(i, k) != 0 {
			return false
		}
	}
	return true
}
