package limiter

import (
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
// (rank is this instance's, from 0 to n − 1), so that they add up to what
// is left. So n instances that decide on the same counts grant a key at
// most what the cluster had left for it, and a key hit on all of them at
// once gets about its quota, not n of them. Every cell gets its
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
// allocates 20 bytes per cell (8 of NewSketchSum's and 12 for the
// reservations), and walks every cell once. A nil sum, or n < 2, gives
// the sum itself.
func (t *SketchSum) WithShares(s *Sketch, n, rank int, now time.Time, prev *SketchSum, hold time.Duration) *SketchSum {
	if t == nil || n < 2 {
		return t
	}
	c := *t
	c.counts = slices.Clone(t.counts)
	e, el := s.clock(now)
	if e != t.epoch {
		return &c // a sum of another window: nothing to share on
	}
	cells := s.rows * int(s.width)
	c.keep, c.since, c.owned = make([]uint32, cells), make([]uint32, cells), make([]uint32, cells)
	carried := prev != nil && prev.epoch == e && len(prev.keep) == cells && len(prev.owned) == cells
	unit := max(int64(time.Millisecond), s.window>>32) // so that any time in the window fits 32 bits
	at, holdUnits := uint32(el/unit), uint32(min(int64(hold)/unit, 1<<32-1))
	q := uint64(s.quota.Load())
	w, rest := uint64(s.window), uint64(s.window)-uint64(el)
	cp, pp := uint64(e&1), uint64((e-1)&1)
	ct, pt := sketchTag(e), sketchTag(e-1)
	for i := range cells {
		ownPrev := sketchCount(s.slots[2*i+int(pp)].Load(), pt)
		ownCurr := sketchCount(s.slots[2*i+int(cp)].Load(), ct)
		peerPrev, peerCurr := uint64(c.counts[2*i]), uint64(c.counts[2*i+1])
		c.owned[i] = uint32(min(ownCurr, MaxSketchQuota))
		// What the previous copy left the others, less what the sum has
		// counted of theirs since; gone once unused for hold.
		var held uint64
		since := at
		if carried && prev.keep[i] != 0 {
			then := uint64(prev.counts[2*i+1]) - min(uint64(prev.keep[i]), uint64(prev.counts[2*i+1]))
			if used := peerCurr - min(peerCurr, then); used != 0 {
				held = uint64(prev.keep[i]) - min(used, uint64(prev.keep[i]))
			} else if ownCurr > uint64(prev.owned[i]) {
				// This instance granted in the cell since: the others
				// may have too, at the same moment, unseen yet; the
				// hold starts again.
				held = uint64(prev.keep[i])
			} else if at-min(at, prev.since[i]) < holdUnits {
				held, since = uint64(prev.keep[i]), prev.since[i]
			}
		}
		// The cell's estimate, rounded up, as sketchView.remaining takes it.
		hi, lo := bits.Mul64(ownPrev+peerPrev, rest)
		h2, l2 := bits.Mul64(ownCurr+peerCurr, w)
		lo, carry := bits.Add64(lo, l2, 0)
		hi, _ = bits.Add64(hi, h2, carry)
		est, rem := bits.Div64(hi, lo, w)
		if rem != 0 {
			est++
		}
		// The n shares add up to what is left: the remainder of the
		// division goes one each to the instances ranked first, so the
		// last requests of a key spread over the instances still pass.
		left := q - min(est, q)
		share := left / uint64(n)
		if uint64(rank) < left%uint64(n) {
			share++
		}
		// The others keep what they were left before, if more than their
		// shares now: what they may still grant unseen is not shared
		// again, nor left them twice.
		keep := left - share
		if held >= keep {
			keep = held
		} else {
			since = at
		}
		if keep = min(keep, MaxSketchQuota); keep == 0 {
			continue
		}
		c.keep[i], c.since[i] = uint32(keep), since
		p := &c.counts[2*i+1]
		*p = uint32(min(uint64(*p)+keep, MaxSketchQuota))
	}
	return &c
}

// AppendCounted appends a bitmap of the cells in which s counts something
// at now (bit i%64 of word i/64 for cell i), reusing dst. It looks only at
// the cells that count something (liveCells).
func (s *Sketch) AppendCounted(dst []uint64, now time.Time) []uint64 {
	cells := s.rows * int(s.width)
	dst = append(dst[:0], make([]uint64, (cells+63)/64)...)
	e, _ := s.clock(now)
	cp, pp := uint64(e&1), uint64((e-1)&1)
	ct, pt := sketchTag(e), sketchTag(e-1)
	for _, c := range s.liveCells(now) {
		i := int(c)
		if sketchCount(s.slots[2*i+int(pp)].Load(), pt)+sketchCount(s.slots[2*i+int(cp)].Load(), ct) != 0 {
			dst[i/64] |= 1 << (i % 64)
		}
	}
	return dst
}

// KeyCells sets cells to the index of the cell the key with hash h uses in
// each row of s, and returns the number of rows.
func (s *Sketch) KeyCells(h uint64, cells *[MaxSketchRows]int) int {
	var cols sketchCols
	s.columns(h, &cols)
	for i := range s.rows {
		cells[i] = int(cols[i] / 2)
	}
	return s.rows
}

// CellZero reports whether the sum counts nothing in cell i, in either
// window.
func (t *SketchSum) CellZero(i int) bool { return t.counts[2*i]|t.counts[2*i+1] == 0 }
