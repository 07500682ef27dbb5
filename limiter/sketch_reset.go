package limiter

import (
	"maps"
	"math"
	"slices"
	"time"
)

// WindowNumber is the number of the window of length window that t falls
// in, floor(UnixNano / window): how a Sketch and its snapshots number their
// windows.
func WindowNumber(t time.Time, window time.Duration) int64 {
	n, w := t.UnixNano(), int64(window)
	e := n / w
	if n%w < 0 {
		e--
	}
	return e
}

// A key's counts in a window of a count-min sketch are at least its true
// count there on every row, so the least of them, its estimate for that
// window, is what a reset can take away without knowing the other keys:
// taken from every row's cell, it removes at least all of the key's own
// count there. Other keys sharing one of those cells lose at most that much
// of their count in it, in their favour, and nothing elsewhere. Afterwards
// the key is counted in that window as a key never seen: only by what
// other keys sharing a cell with it on every row add.

// Reset is ResetHash(h, now, now): forgets the key with hash h in the
// windows begun by now.
func (s *Sketch) Reset(h uint64, now time.Time) { s.ResetHash(h, now, now) }

// ResetHash forgets the key with hash h in the windows that had begun by
// at, the time of the reset: in each such window of those the sketch
// holds at now (two, or a sliding sketch's eight sub-windows), it subtracts the key's estimate for that window from each
// of the key's cells, never below zero. Windows that began after at are
// untouched. A charge made concurrently may be forgotten with the rest.
func (s *Sketch) ResetHash(h uint64, at, now time.Time) {
	last := WindowNumber(at, time.Duration(s.window))
	e, _ := s.clock(now)
	var cols sketchCols
	s.columns(h, &cols)
	for w := e - int64(s.ring) + 1; w <= e; w++ {
		if w > last {
			continue
		}
		p, tag := s.slot(w), s.tag(w)
		m := uint64(math.MaxUint64)
		for i := 0; i < s.rows; i++ {
			m = min(m, sketchCount(s.slots[cols[i]+p].Load(), tag))
		}
		if m > 0 {
			for i := 0; i < s.rows; i++ {
				sketchSubSlot(&s.slots[cols[i]+p], tag, m)
			}
		}
	}
}

// A Forget names a key whose counts a snapshot added to a SketchSum should
// leave out: those of the snapshot's windows that had begun by At, as if
// the snapshot's sketch had been reset (Sketch.ResetHash) at At before it
// was taken.
type Forget struct {
	Hash uint64
	At   time.Time
}

// ForgetHash subtracts from the sum the key's estimate in it for each of its
// windows that had begun by at, as Sketch.ResetHash does. It changes the sum
// in place, so it must not be used on a sum that is being read: see
// WithoutHash.
func (t *SketchSum) ForgetHash(h uint64, at time.Time) {
	last := WindowNumber(at, t.window)
	var cols sketchCols
	sketchColumns(h, t.rows, uint64(t.width), uint64(t.ring), &cols)
	for k := range t.ring {
		if t.epoch-int64(t.ring)+1+int64(k) > last {
			continue
		}
		// A count of window epoch is held less def (curr), which
		// subtracting m from keeps; in a sliding copy made by
		// WithShares it holds what the copy leaves the others too,
		// which is no key's count and stays.
		var bias uint32
		if k == t.ring-1 {
			bias = t.def
		}
		m := uint32(math.MaxUint32)
		for i := 0; i < t.rows; i++ {
			n := t.counts[cols[i]+uint64(k)] + bias
			if k == t.ring-1 {
				n -= t.kept(int(cols[i]) / t.ring)
			}
			m = min(m, n)
		}
		for i := 0; i < t.rows; i++ {
			t.counts[cols[i]+uint64(k)] -= m
		}
	}
	if t.tail != nil && t.epoch-int64(t.ring) <= last {
		// The window before the oldest, still counted (Linger).
		m := uint32(math.MaxUint32)
		for i := 0; i < t.rows; i++ {
			m = min(m, t.tail[int32(int(cols[i])/t.ring)])
		}
		for i := 0; i < t.rows && m != 0; i++ {
			t.tail[int32(int(cols[i])/t.ring)] -= m
		}
	}
}

// WithoutHash returns a copy of the sum less the key's counts, as ForgetHash
// takes them; the sum itself, which deciders may be reading, is unchanged.
// It allocates as much as NewSketchSum. A nil sum gives nil.
func (t *SketchSum) WithoutHash(h uint64, at time.Time) *SketchSum {
	if t == nil {
		return nil
	}
	c := *t
	c.counts = slices.Clone(t.counts) // c.used stays t's: no sum is added to once read
	c.tail, c.sharedTail = maps.Clone(t.tail), false
	if t.ring == 2 {
		// A weighted copy's reservations, carried by the next
		// WithShares, are measured against the counts as they were:
		// the next re-balance starts afresh.
		c.shares = nil
	}
	// A sliding copy keeps what it leaves the others (its shares are
	// read, never written): a reset of one key must not hand this
	// instance every other key's shares, and the room their counts free,
	// until the next read re-balances. In the key's own cells it still
	// leaves them their shares of the room its forgotten counts would
	// have freed, until then: taken out there, the room of every key
	// sharing a cell with it would be this instance's whole on that row,
	// which is all a decision needs to pass.
	c.ForgetHash(h, at)
	return &c
}

// AddBinaryForgetting adds a snapshot as AddBinary does, less its own
// counts of the keys in forget: as if the snapshot's sketch had been reset
// (Sketch.ResetHash) for each of them in order before it was taken. A key's
// counts are the snapshot's, not the sum's, so what other snapshots in the
// sum count for the key stays. Besides what AddBinary does it reads the
// snapshot's cells of those keys as they go by, in a few bytes per key and
// row.
func (t *SketchSum) AddBinaryForgetting(data []byte, forget []Forget) (epoch int64, err error) {
	return t.applyBinary(data, forget, 0, true, false)
}

// AddBinaryLater adds a snapshot as AddBinaryForgetting does, each of its
// windows counted as the window shift after it (before it for shift < 0):
// a snapshot written on a clock behind this one's is placed on this one's
// (shift > 0), one written ahead moved back (shift < 0), by a reader that
// measured how far (storage: an instance's peers). A sliding sum counts
// what that places after its own window in its own, as granted now, where
// such counts (of a clock ahead) were dropped.
func (t *SketchSum) AddBinaryLater(data []byte, forget []Forget, shift int64) (epoch int64, err error) {
	return t.applyBinary(data, forget, shift, true, false)
}

// AddBinaryLinger is AddBinaryLater of a snapshot whose writer's clock
// may be up to early behind this one's once placed (Linger(early)): made
// by NewSketchSum within early of its sub-window's start, the sum keeps
// what the snapshot counts of the sub-window before its oldest, which has
// left this view but maybe not the writer's, apart (its tail), and counts
// it within linger of that start, where it dropped it.
func (t *SketchSum) AddBinaryLinger(data []byte, forget []Forget, shift int64, early time.Duration) (epoch int64, err error) {
	t.Linger(early)
	return t.applyBinary(data, forget, shift, true, t.made != 0 && t.made-1 < int64(early))
}

// SubtractBinaryLinger takes out what AddBinaryLinger of the same
// snapshot, keys, shift and early added to a sum made when this one was
// (SketchSumOfBinaryAt), its tail included.
func (t *SketchSum) SubtractBinaryLinger(data []byte, forget []Forget, shift int64, early time.Duration) (epoch int64, err error) {
	return t.applyBinary(data, forget, shift, false, t.made != 0 && t.made-1 < int64(early))
}

// SubtractBinaryLater takes out what AddBinaryLater of the same snapshot,
// keys and shift added (SubtractBinaryForgetting).
func (t *SketchSum) SubtractBinaryLater(data []byte, forget []Forget, shift int64) (epoch int64, err error) {
	return t.applyBinary(data, forget, shift, false, false)
}

// SubtractBinaryForgetting takes out of the sum what AddBinaryForgetting
// of the same snapshot and keys added to it, cell by cell and never below
// zero; a cell saturated at MaxSketchQuota stays so, since what it held is
// not known. It visits only the snapshot's cells, so that taking an
// instance's own contribution out of an aggregate costs what that
// contribution holds, not the table's size.
func (t *SketchSum) SubtractBinaryForgetting(data []byte, forget []Forget) (epoch int64, err error) {
	return t.applyBinary(data, forget, 0, false, false)
}

// forgotten returns the cells of the keys in forget (sorted, without
// repeats) and the snapshot's counts of them, well formed data with header
// h, less what forgetting the keys in order takes (see
// AddBinaryForgetting): vals[k·len(idx)+j] for its window k, oldest first.
// Nothing to forget gives nil.
func (t *SketchSum) forgotten(data []byte, h sketchHeader, forget []Forget) (idx []int, vals []uint32) {
	if len(forget) == 0 {
		return nil, nil
	}
	idx = make([]int, 0, len(forget)*t.rows)
	var cols sketchCols
	for _, f := range forget {
		sketchColumns(f.Hash, t.rows, uint64(t.width), 1, &cols)
		for i := 0; i < t.rows; i++ {
			idx = append(idx, int(cols[i]))
		}
	}
	slices.Sort(idx)
	idx = slices.Compact(idx)
	vals = make([]uint32, h.ring*len(idx))
	at := cellCursor{idx: idx}
	_ = walkSketchBinary(data, t.rows*t.width, func(sketchHeader) error { return nil }, func(k int, i int, c uint32) {
		if v := at.find(k, i); v >= 0 {
			vals[v] = c
		}
	})
	var pos [MaxSketchRows]int
	for _, f := range forget {
		last := WindowNumber(f.At, h.window)
		sketchColumns(f.Hash, t.rows, uint64(t.width), 1, &cols)
		for i := 0; i < t.rows; i++ {
			pos[i], _ = slices.BinarySearch(idx, int(cols[i]))
		}
		for k := range h.ring {
			if h.epoch-int64(h.ring)+1+int64(k) > last {
				continue
			}
			v := vals[k*len(idx):]
			m := uint32(math.MaxUint32)
			for i := 0; i < t.rows; i++ {
				m = min(m, v[pos[i]])
			}
			for i := 0; i < t.rows; i++ {
				v[pos[i]] -= m
			}
		}
	}
	return idx, vals
}

// MergeBinaryForgetting adds a snapshot in binary form (untrusted input)
// into the sketch's own counters, its windows aligned to now as in a
// SketchSum, less the snapshot's counts of the keys in forget, as
// AddBinaryForgetting leaves them out: for an instance restoring what it
// published before a restart. It is an error, and adds nothing, if the
// snapshot is not well formed or not of the sketch's shape and window.
// Merging the same snapshot twice counts it twice.
func (s *Sketch) MergeBinaryForgetting(data []byte, now time.Time, forget []Forget) error {
	sum := s.NewSketchSum(now)
	if _, err := sum.AddBinaryForgetting(data, forget); err != nil {
		return err
	}
	for k := range sum.ring {
		e := sum.epoch - int64(sum.ring) + 1 + int64(k)
		p, tag := s.slot(e), s.tag(e)
		for i := range setCells(sum.used) {
			if c := sum.counts[sum.ring*i+k]; c != 0 {
				sketchAddSlot(&s.slots[uint64(i)<<s.rbits+p], tag, uint64(c))
				s.live.mark(uint64(i))
			}
		}
	}
	return nil
}

// A cellCursor finds the cells of a sorted list (idx) as a walk of a
// snapshot passes them, in increasing order within each
// of its windows.
type cellCursor struct {
	idx  []int
	j, k int
}

// find returns where cell i of the snapshot's window k goes in a list of
// values for idx's cells (each window's in turn, oldest first), or −1 if
// i is not in idx.
func (c *cellCursor) find(k, i int) int {
	if k != c.k {
		c.j, c.k = 0, k
	}
	for c.j < len(c.idx) && c.idx[c.j] < i {
		c.j++
	}
	if c.j == len(c.idx) || c.idx[c.j] != i {
		return -1
	}
	return k*len(c.idx) + c.j
}
