package limiter

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// A sync walks the cells that count something, not the whole sketch: a
// cluster's snapshot, shares and own-count bitmap cost what its keys
// counted, however large the sketch (sized for the floods it must
// withstand) is. The cells that may count something are the ones that did
// at the last walk plus the ones charged since, which every charge marks
// in a bitmap of one bit per cell after adding its count.
//
// A walk takes the marks before it reads the counts: a charge whose mark
// it took has its count seen, and one that marks after the walk took the
// bits is marked again for the next walk. So no cell with a count is ever
// left out of a walk, and a cell listed that no longer counts anything
// (its windows have passed, or it was refunded) is dropped by the next.

// sketchLive is a sketch's index of the cells that may count something.
type sketchLive struct {
	// marked holds a bit per cell, set when a count is added to it (and
	// only then written, so that hot cells cost a decision one load).
	marked []atomic.Uint64
	mu     sync.Mutex
	// cells is, in increasing order, the cells that counted something in
	// a window at least as recent as the one before epoch, or were marked
	// since, and bits a scratch bitmap of cells, all zero between walks.
	cells []int32
	bits  []uint64
	// epoch is the window of the walk that last checked every cell
	// listed.
	epoch int64
}

func newSketchLive(cells int) sketchLive {
	words := (cells + 63) / 64
	return sketchLive{marked: make([]atomic.Uint64, words), bits: make([]uint64, words)}
}

// mark notes that cell i has been charged.
func (l *sketchLive) mark(i uint64) {
	w, bit := &l.marked[i/64], uint64(1)<<(i%64)
	if w.Load()&bit == 0 {
		w.Or(bit)
	}
}

// liveCells returns, in increasing order, every cell of s that counts
// something in window e − 1 of now or later (a sliding sketch's e − 7), and possibly a few that no
// longer do. The slice is the caller's to read; it is never changed.
// Within a window it costs a pass over the marks (one bit per cell) and
// a merge of the cells marked since the last walk; the first walk of a
// window also looks at every cell listed, to drop those whose windows
// have passed. A walk in an earlier window than the last one's (a clock
// behind, or a sync that read the clock before another took the lock)
// looks at every cell, since the list has dropped what that window still
// counts, and leaves the index as it is.
func (s *Sketch) liveCells(now time.Time) []int32 {
	l := &s.live
	l.mu.Lock()
	defer l.mu.Unlock()
	e, _ := s.clock(now)
	if e == l.epoch && l.cells != nil {
		return l.addMarked()
	}
	if e < l.epoch {
		var cells []int32
		for i := range s.rows * int(s.width) {
			if s.cellLive(i, e) {
				cells = append(cells, int32(i))
			}
		}
		return cells
	}
	l.epoch = e
	n := len(l.cells)
	for _, i := range l.cells {
		l.bits[i/64] |= 1 << (i % 64)
	}
	l.takeMarks(func(w int, b uint64) {
		l.bits[w] |= b
		n += bits.OnesCount64(b)
	})
	cells := make([]int32, 0, n)
	for i := range setCells(l.bits) {
		if s.cellLive(i, e) {
			cells = append(cells, int32(i))
		}
	}
	clear(l.bits)
	l.cells = cells
	return cells
}

// cellLive reports whether cell i counts something in window e − ring + 1
// (e − 1, or a sliding sketch's e − 7) or later: one of its counter words
// holds such a window (its tag and the counter's place in the cell, modulo
// 2^32·ring as tags are: at or after e − ring + 1, within the horizon of a
// clock ahead, see sketchAddSlot) with a count.
func (s *Sketch) cellLive(i int, e int64) bool {
	mod := uint64(1)<<(32+s.rbits) - 1
	for p := range s.ring {
		word := s.slots[uint64(i)<<s.rbits+p].Load()
		w := int64(word>>32)<<s.rbits | int64(p)
		if word&sketchCountMask != 0 && uint64(w-(e-int64(s.ring)+1))&mod < s.ring*sketchStaleHorizon {
			return true
		}
	}
	return false
}

// takeMarks clears the marks, passing each word of them that had any set
// to f with its index.
func (l *sketchLive) takeMarks(f func(w int, b uint64)) {
	for w := range l.marked {
		if l.marked[w].Load() != 0 {
			f(w, l.marked[w].Swap(0))
		}
	}
}

// addMarked merges the cells marked since the last walk into the list, in
// the window of the last walk (whose cells all still count, or did in
// this window: a refund may have emptied one, which stays listed until
// the next window's walk). l.mu is held.
func (l *sketchLive) addMarked() []int32 {
	var marked []int32
	l.takeMarks(func(w int, b uint64) {
		for ; b != 0; b &= b - 1 {
			marked = append(marked, int32(w*64+bits.TrailingZeros64(b)))
		}
	})
	if len(marked) == 0 {
		return l.cells
	}
	merged := make([]int32, 0, len(l.cells)+len(marked))
	i, j := 0, 0
	for i < len(l.cells) || j < len(marked) {
		switch {
		case j == len(marked) || i < len(l.cells) && l.cells[i] < marked[j]:
			merged = append(merged, l.cells[i])
			i++
		case i == len(l.cells) || marked[j] < l.cells[i]:
			merged = append(merged, marked[j])
			j++
		default: // listed and marked
			merged = append(merged, marked[j])
			i++
			j++
		}
	}
	l.cells = merged
	return merged
}
