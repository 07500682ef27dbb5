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
// where a key's requests go. The sum itself, which deciders may be
// reading, is unchanged. It allocates as much as NewSketchSum, and walks
// every cell once. A nil sum, or n < 2, gives the sum itself.
func (t *SketchSum) WithShares(s *Sketch, n, rank int, now time.Time) *SketchSum {
	if t == nil || n < 2 {
		return t
	}
	c := *t
	c.counts = slices.Clone(t.counts)
	e, el := s.clock(now)
	if e != t.epoch {
		return &c // a sum of another window: nothing to share on
	}
	q := uint64(s.quota.Load())
	w, rest := uint64(s.window), uint64(s.window)-uint64(el)
	cp, pp := uint64(e&1), uint64((e-1)&1)
	ct, pt := sketchTag(e), sketchTag(e-1)
	for i := range s.rows * int(s.width) {
		ownPrev := sketchCount(s.slots[2*i+int(pp)].Load(), pt)
		ownCurr := sketchCount(s.slots[2*i+int(cp)].Load(), ct)
		peerPrev, peerCurr := uint64(c.counts[2*i]), uint64(c.counts[2*i+1])
		// The cell's estimate, rounded up, as sketchView.remaining takes it.
		hi, lo := bits.Mul64(ownPrev+peerPrev, rest)
		h2, l2 := bits.Mul64(ownCurr+peerCurr, w)
		lo, carry := bits.Add64(lo, l2, 0)
		hi, _ = bits.Add64(hi, h2, carry)
		est, rem := bits.Div64(hi, lo, w)
		if rem != 0 {
			est++
		}
		if est >= q {
			continue
		}
		// The n shares add up to what is left: the remainder of the
		// division goes one each to the instances ranked first, so the
		// last requests of a key spread over the instances still pass.
		left := q - est
		share := left / uint64(n)
		if uint64(rank) < left%uint64(n) {
			share++
		}
		keep := left - share
		p := &c.counts[2*i+1]
		*p = uint32(min(uint64(*p)+keep, MaxSketchQuota))
	}
	return &c
}

// AppendCounted appends a bitmap of the cells in which s counts something
// at now (bit i%64 of word i/64 for cell i), reusing dst.
func (s *Sketch) AppendCounted(dst []uint64, now time.Time) []uint64 {
	cells := s.rows * int(s.width)
	dst = append(dst[:0], make([]uint64, (cells+63)/64)...)
	e, _ := s.clock(now)
	cp, pp := uint64(e&1), uint64((e-1)&1)
	ct, pt := sketchTag(e), sketchTag(e-1)
	for i := range cells {
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
