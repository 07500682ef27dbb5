package limiter

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"
)

// A SketchSum is the sum of other instances' sketch snapshots, each added
// once, for a Sketch to decide on its own counts plus theirs (TakeHashWith)
// without merging them into its counters: a cluster replaces a peer's
// snapshot by its next one by building a new sum, so no snapshot is ever
// counted twice, and a dead peer's counts age out with its windows.
//
// A sum holds two windows, Epoch − 1 and Epoch, fixed when it is built
// (NewSketchSum). A snapshot of window Epoch adds both its windows; one of
// window Epoch − 1 adds its current counts to the sum's previous window;
// one of Epoch + 1 (a peer whose clock is a little ahead) adds its
// previous counts to the sum's current window; older ones add nothing.
// When the sum is read later, in window Epoch + 1, its current window is
// the previous one; beyond that it adds nothing.
//
// A sum for a sliding sketch holds its eight sub-windows, Epoch − 7 to
// Epoch, in the same way: each window of a snapshot or of a later view
// meets the sum's window of the same number, if the sum holds it.
//
// Counts saturate at MaxSketchQuota. Add is not safe for concurrent use; a
// sum that is no longer added to may be read by any number of goroutines.
type SketchSum struct {
	window      time.Duration // the sketch's Slot
	span        time.Duration // its Window
	rows, width int
	ring        int // windows per cell: 2, or 8 for a sliding sketch
	epoch       int64
	// counts holds cell c's count of window epoch − ring + 1 + k at
	// ring·c + k, so that a decision finds them in one cache line.
	counts []uint32
	// used has a bit per cell (bit i%64 of word i/64), set for every cell
	// that an added snapshot counted (subtracting may leave some at zero),
	// so that the work done on a sum follows its cells in use, not its
	// size.
	used []uint64
	// shares is set on a copy made by WithShares: what it left the other
	// instances, for the next WithShares to carry.
	shares *shareState
	// def is added to every count of window epoch as it is read (mod
	// 2³², so a cell may hold less than def): a copy made by WithShares
	// leaves every cell it does not list def for the other instances, and
	// that way it leaves it them without touching those cells (curr). It
	// is 0 in a sum, and kept by the copies (Clone, WithoutHash) of a copy
	// made by WithShares, which no snapshot is added to.
	def uint32
	// linger is how long into a sub-window a sliding sum still counts
	// what it held of the sub-window that has just left the view (its
	// snapshots' writers' clocks may be behind this one's by that much:
	// Linger), less than a sub-window; made is 1 + the time into its
	// sub-window at which NewSketchSum made it, 0 if not known
	// (AddBinaryLinger). tail holds, by cell, what it counts of window
	// epoch − ring, which has left the view but not linger ago while now
	// is within linger of window epoch's start (AddBinaryLinger); nil for
	// none. It is never written once the sum is read (copies that
	// change it clone it). sharedTail is set on a copy made by WithShares
	// in the sum's own sub-window, whose tail is the sum's.
	linger, made int64
	tail         map[int32]uint32
	sharedTail   bool
}

// tailEntryBytes bounds what an entry of a sum's tail holds: a map slot
// of 8 bytes and its control byte, at least 7/16 of the slots full (Go's
// maps fill their tables to 7/8 before doubling them); about 19 as
// measured at 16 to 257 thousand entries.
const tailEntryBytes = 21

// Bytes returns what the sum holds: 4 bytes per cell and window (two, or
// eight for a sliding sketch) for its counts, up to 21 per cell of its
// tail (Linger) unless it is its sum's (a copy made by WithShares in the
// sum's sub-window) and, unless copied reports that it shares its sum's
// (copies made by WithShares and WithoutHash do), a bitmap of the cells
// in use, 1 bit per cell. A copy made by WithShares adds 16 bytes per
// cell it lists (44 for a sliding sketch, and 4 per cell), as allocated.
// A nil sum holds nothing.
func (t *SketchSum) Bytes(copied bool) int {
	if t == nil {
		return 0
	}
	n := 4 * len(t.counts)
	if !t.sharedTail {
		n += tailEntryBytes * len(t.tail)
	}
	if !copied {
		n += 8 * len(t.used)
	}
	if t.shares != nil {
		n += 16*cap(t.shares.cells) + 4*cap(t.shares.freed) + 4*len(t.shares.pos)
	}
	return n
}

// curr returns cell i's count of window epoch.
func (t *SketchSum) curr(i int) uint32 { return t.counts[t.ring*i+t.ring-1] + t.def }

// at returns cell i's count of window epoch − ring + 1 + k.
func (t *SketchSum) at(i, k int) uint32 {
	if k == t.ring-1 {
		return t.curr(i)
	}
	return t.counts[t.ring*i+k]
}

// sumOf returns an empty sum of s's shape, of window epoch, without its
// counts allocated.
func (s *Sketch) sumOf(epoch int64) *SketchSum {
	return &SketchSum{
		window: time.Duration(s.window),
		span:   time.Duration(s.span),
		rows:   s.rows,
		width:  int(s.width),
		ring:   int(s.ring),
		epoch:  epoch,
	}
}

// alloc allocates the sum's counts and bitmap, zeroed.
func (t *SketchSum) alloc() *SketchSum {
	cells := t.rows * t.width
	t.counts, t.used = make([]uint32, t.ring*cells), make([]uint64, (cells+63)/64)
	return t
}

// NewSketchSum returns an empty sum for snapshots of s, of the window of
// now. It allocates 8 bytes (32 for a sliding sketch) and a bit per cell
// of s.
func (s *Sketch) NewSketchSum(now time.Time) *SketchSum {
	e, in := s.clock(now)
	t := s.sumOf(e).alloc()
	t.made = in + 1
	return t
}

// AddBinary adds a snapshot in the binary form of Sketch.AppendSnapshot
// (untrusted input) and returns its window number. A snapshot of another
// shape or window, or not well formed, is rejected with an error and adds
// nothing.
func (t *SketchSum) AddBinary(data []byte) (epoch int64, err error) {
	return t.applyBinary(data, nil, 0, true, false)
}

// applyBinary adds the snapshot in binary form data (untrusted input) to
// the sum, or takes it out (add false: each cell never below zero, and a
// cell saturated at MaxSketchQuota stays so, since what it held is not
// known), less the snapshot's own counts of the keys in forget
// (AddBinaryForgetting), and returns its window number. A snapshot of
// another shape or window, or not well formed, is rejected with an error
// and changes nothing. It visits only the snapshot's cells. Its windows
// are counted shift windows later (AddBinaryLater); a sliding sum counts
// those after its own window in its own.
func (t *SketchSum) applyBinary(data []byte, forget []Forget, shift int64, add, fold bool) (epoch int64, err error) {
	if t.def != 0 {
		return 0, errors.New("sketch sum: a copy made by WithShares is not added to")
	}
	var h sketchHeader
	begin := func(got sketchHeader) error {
		if err := t.fits(got); err != nil {
			return err
		}
		h = got
		return nil
	}
	cells := t.rows * t.width
	if err := walkSketchBinary(data, cells, begin, nil); err != nil {
		return 0, err
	}
	epoch = h.epoch
	// The snapshot's window epoch − ring + 1 + k goes to the sum's slot
	// k + epoch − t.epoch, if the sum holds it.
	shift = max(min(shift, 1<<40), -1<<40) // far beyond any ring; no overflow below
	off := int(max(min(epoch+shift-t.epoch, 2*int64(t.ring)), -2*int64(t.ring)))
	last := t.ring + 1 // past the sum's windows: dropped
	if t.ring > 2 {
		// What a sliding snapshot counts after the sum's window (a clock
		// ahead of this one's) was granted by now: dropped, a peer's
		// grants of its newest sub-windows went unseen here until this
		// clock caught up.
		last = t.ring - 1
	}
	slot := func(k int) int { return min(k+off, last) }
	fold = fold && t.ring > 2 && (add || t.tail != nil)
	if h.ring != t.ring {
		// A weighted snapshot of the sliding sketch's window (a peer of
		// an older version): see olderSlot.
		slot = func(k int) int { return t.olderSlot(epoch - 1 + int64(k)) }
	}
	idx, vals := t.forgotten(data, h, forget)
	at := cellCursor{idx: idx}
	_ = walkSketchBinary(data, cells, begin, func(wk int, i int, c uint32) {
		if v := at.find(wk, i); v >= 0 {
			c = vals[v]
		}
		k := slot(wk)
		if k == -1 && fold {
			// The window just before the sum's oldest: see tail.
			if !add {
				if n, ok := t.tail[int32(i)]; ok && n != MaxSketchQuota {
					t.tail[int32(i)] = n - min(n, c)
				}
				return
			}
			if t.tail == nil {
				t.tail = make(map[int32]uint32)
			}
			t.tail[int32(i)] = uint32(min(uint64(t.tail[int32(i)])+uint64(c), MaxSketchQuota))
			return
		}
		if k < 0 || k >= t.ring {
			return
		}
		p := &t.counts[t.ring*i+k]
		switch {
		case add:
			t.used[i/64] |= 1 << (i % 64)
			*p = uint32(min(uint64(*p)+uint64(c), MaxSketchQuota))
		case *p != MaxSketchQuota:
			*p -= min(*p, c)
		}
	})
	if h.ring != t.ring {
		// Its windows are the sum's own from now on.
		epoch = t.epoch
	}
	return epoch, nil
}

// fits checks that a snapshot with header h can be added to the sum: of
// its shape and window, or a weighted snapshot of the window of a sliding
// sum's sketch (olderSlot).
func (t *SketchSum) fits(h sketchHeader) error {
	switch {
	case h.rows != t.rows || h.width != t.width:
	case h.ring == t.ring && h.window == t.window:
		return nil
	case h.ring == 2 && t.ring > 2 && h.window == t.span:
		return nil
	}
	return fmt.Errorf("sketch snapshot: a %d×%d snapshot of %d windows of %v does not fit a %d×%d sketch of %d windows of %v",
		h.rows, h.width, h.ring, h.window, t.rows, t.width, t.ring, t.window)
}

// olderSlot is where a sliding sum counts window e of a weighted snapshot
// of its sketch's Window W: a peer still running a version whose window
// zones' cluster counts were weighted, during a rolling upgrade. Its
// window's grants may have come at any time in it, so they are counted as
// if they came at its last nanosecond: in the sub-window holding it, or
// the sum's current one if that is later. So they are counted at least a
// W after they came, never less (the sliding bound holds for what such a
// peer grants), and the older instance, which cannot read a sliding
// snapshot, errs the other way (see docs/cluster.md). −1 is a window the
// sum no longer counts.
func (t *SketchSum) olderSlot(e int64) int {
	w, sub := int64(t.span), int64(t.window)
	if e >= math.MaxInt64/w-1 || e < math.MinInt64/w+1 {
		return -1
	}
	last := (e+1)*w - 1
	k := last / sub
	if last%sub < 0 {
		k--
	}
	k = min(k, t.epoch) - t.epoch + int64(t.ring) - 1
	if k < 0 {
		return -1
	}
	return int(k)
}

// addTo adds the sum's counts of the key's cells to v, a view of window e,
// and for a sliding copy made by WithShares what it leaves the others
// under the quota q (addFreed). A nil sum adds nothing.
func (t *SketchSum) addTo(cols *sketchCols, e int64, q uint64, v *sketchView) {
	if t == nil {
		return
	}
	if t.ring > 2 {
		// The view's window e − ring + 1 + k is the sum's slot
		// k + e − t.epoch.
		d := e - t.epoch
		if d <= -int64(t.ring) || d >= int64(t.ring) {
			return
		}
		lo, hi := max(0, -int(d)), min(t.ring, t.ring-int(d)) // the view's windows the sum holds
		var lingered [MaxSketchRows]uint64
		for i := 0; i < v.n; i++ {
			c := t.counts[int(cols[i])+lo+int(d):][:hi-lo] // cols[i]: ring × the cell's index
			sub := v.sub[i][lo:hi]
			var sum uint64
			for k, n := range c {
				if k == len(c)-1 && d >= 0 {
					n += t.def // the sum's window epoch: mod 2³², see def
				}
				sub[k] += uint64(n)
				sum += uint64(n)
			}
			if t.linger > 0 {
				// Each of the sum's slots but its newest (slot ring − 1,
				// which no view after it holds the sum for) still counts
				// linger into the sub-window after it leaves the view.
				v.lingerNext = uint64(t.linger)
				p := &v.peers[i]
				*p = [len(p)]uint32{}
				for k := lo; k < hi && k+int(d) < t.ring-1; k++ {
					p[k] = c[k-lo]
				}
			}
			if v.t < uint64(t.linger) {
				// The view's window e − ring, left it v.t ago, still
				// counted (Linger) until linger into this one: the
				// sum's slot d − 1, or its tail.
				var n uint64
				if d > 0 {
					n = uint64(t.counts[int(cols[i])+int(d)-1])
				} else if d == 0 && t.tail != nil {
					n = uint64(t.tail[int32(int(cols[i])/t.ring)])
				}
				v.linger[i] += n
				v.lingerEnd = uint64(t.linger)
				sum += n
				lingered[i] = n
			}
			v.rows[i].curr += sum
		}
		if st := t.shares; st != nil && st.freed != nil {
			// A copy made by WithShares: what it leaves the others of
			// the room that frees, now (d sub-windows ago, or under a
			// lower quota) and as the view's sub-windows leave it
			// (slidingWait).
			v.share, v.shareD, v.shareQ, v.shareRing, v.shareCols = st, int(d), q, uint64(t.ring), *cols
			if d > 0 || d == 0 && q > st.q {
				// Room has freed since the copy (leftTo's none
				// otherwise): the lookups only then.
				st.addFreed(cols, int(d), t.ring, q, v, &lingered)
			}
		}
		return
	}
	// The view's window e − 1 is the sum's slot e − t.epoch, its window e
	// the next slot; only slots 0 and 1 exist.
	switch e - t.epoch {
	case 0:
		for i := 0; i < v.n; i++ {
			c := cols[i] // 2 × the cell's index
			v.rows[i].prev += uint64(t.counts[c])
			v.rows[i].curr += uint64(t.counts[c+1] + t.def)
		}
	case 1:
		for i := 0; i < v.n; i++ {
			v.rows[i].prev += uint64(t.counts[cols[i]+1] + t.def)
		}
	case -1:
		for i := 0; i < v.n; i++ {
			v.rows[i].curr += uint64(t.counts[cols[i]])
		}
	}
}

// TakeHashWith is TakeHash deciding on the key's estimate in s plus its
// estimate in peers (nil for none), at time now: the request is granted if
// both together, plus weight, are within the quota, and only s is charged.
// peers must be a sum for snapshots of s (NewSketchSum).
func (s *Sketch) TakeHashWith(h uint64, weight int64, now time.Time, peers *SketchSum) (Decision, Reservation) {
	var cols sketchCols
	var v sketchView
	q, w, e, t := s.look(h, weight, now, peers, &cols, &v)
	if w > q || !v.fits(q-w) {
		return v.denied(q, w), Reservation{}
	}
	s.add(&cols, e, w)
	s.read(&cols, e, t, &v)
	peers.addTo(&cols, e, q, &v)
	if !v.fits(q) {
		s.sub(&cols, e, w)
		v.remove(w)
		return v.denied(q, w), Reservation{}
	}
	return v.granted(q), Reservation{index: h, epoch: e, units: int64(w)}
}

// PeekHashWith answers whether TakeHashWith would grant the request,
// charging nothing; Remaining and Reset are what the key holds now, before
// any charge, as Buckets.PeekHash reports them.
func (s *Sketch) PeekHashWith(h uint64, weight int64, now time.Time, peers *SketchSum) Decision {
	var cols sketchCols
	var v sketchView
	q, w, _, _ := s.look(h, weight, now, peers, &cols, &v)
	if w > q || !v.fits(q-w) {
		return v.denied(q, w)
	}
	return v.granted(q)
}

// EstimateWith returns the key's estimate at now, its own counts plus
// peers' (nil for none), rounded up: what Remaining is the quota less,
// without the floor at zero.
func (s *Sketch) EstimateWith(h uint64, now time.Time, peers *SketchSum) int64 {
	var cols sketchCols
	var v sketchView
	s.look(h, 1, now, peers, &cols, &v)
	hi, lo := v.num(v.minRow())
	return int64(min(sketchCeil(hi, lo, v.w), math.MaxInt64))
}

// AppendSnapshot appends the binary form of the sketch's snapshot at time
// now straight from its counters, without a dense copy (the tests keep one,
// SketchSnapshot, as the reference this must match), and returns it with
// the snapshot's window number. Its size grows with the nonzero counters,
// at most 9 bytes per counter (typically 2 to 4), and so does the time it
// takes: it reads only the cells that count something (liveCells).
func (s *Sketch) AppendSnapshot(dst []byte, now time.Time) ([]byte, int64) {
	e, _ := s.clock(now)
	live := s.liveCells(now)
	dst = appendSketchHeader(dst, s.sumOf(e))
	for w := e - int64(s.ring) + 1; w <= e; w++ {
		dst = appendSketchCells(dst, listedCells(live), func(i int) uint32 {
			return uint32(s.count(i, w))
		})
	}
	return dst, e
}

// A cluster may publish the sum of its instances' snapshots as one
// aggregate, for each instance to read instead of every snapshot: the sum
// in the binary form of a snapshot (AppendBinary), of the sum's own
// windows. A reader loads it with SketchSumOfBinary and takes its own
// snapshots back out with SubtractBinaryForgetting, both in the
// aggregate's windows, so that what it subtracts is exactly what was
// added, whatever window the reader is in by then.

// AppendBinary appends the sum in the binary form of a SketchSnapshot of
// the sum's windows (Epoch − 1 and Epoch), as SketchSnapshot.AppendBinary
// would write it. It reads only the cells the sum may count something in,
// so it is for a sum, not a copy made by WithShares.
func (t *SketchSum) AppendBinary(dst []byte) []byte {
	cells := setCells(t.used)
	dst = appendSketchHeader(dst, t)
	for k := range t.ring {
		dst = appendSketchCells(dst, cells, func(i int) uint32 { return t.at(i, k) })
	}
	return dst
}

// AppendTail appends what a sliding sum counts of the sub-window before
// its oldest (its tail: AddBinaryLinger) as one window's list of cells of
// the binary form (an empty list for none), for SketchSumOfBinaryAt to
// give back: an aggregate of snapshots, written within its members' linger
// of its sub-window's start, carries what they still count there.
func (t *SketchSum) AppendTail(dst []byte) []byte {
	cells := make([]int, 0, len(t.tail))
	for i, n := range t.tail {
		if n != 0 {
			cells = append(cells, int(i))
		}
	}
	slices.Sort(cells)
	return appendSketchCells(dst, slices.Values(cells), func(i int) uint32 { return t.tail[int32(i)] })
}

// SketchSumOfBinaryAt is SketchSumOfBinary of a sum made at at (a time of
// its window, not checked here) by NewSketchSum, with what it counted of
// the sub-window before its oldest, tail (untrusted input, AppendTail's
// form; nil for none): so that SubtractBinaryLinger takes a snapshot out
// as AddBinaryLinger added it to that sum, tail included, and a sum that
// lingers (Linger) counts the tail as that sum did.
func (s *Sketch) SketchSumOfBinaryAt(data, tail []byte, at time.Time) (*SketchSum, error) {
	t, err := s.SketchSumOfBinary(data)
	if err != nil {
		return nil, err
	}
	if t.ring <= 2 {
		return t, nil
	}
	if in := at.UnixNano() - t.epoch*int64(t.window); in >= 0 && in < int64(t.window) {
		t.made = in + 1
	}
	if tail == nil {
		return t, nil
	}
	d := sketchDecoder{data: tail}
	cells := t.rows * t.width
	t.tail = make(map[int32]uint32)
	if err := d.cells(cells, -1, t.ring, func(_ int, i int, c uint32) {
		t.tail[int32(i)] = c
	}); err != nil {
		return nil, err
	}
	if d.off != len(tail) {
		return nil, fmt.Errorf("sketch snapshot: %d trailing bytes after the window before the oldest", len(tail)-d.off)
	}
	return t, nil
}

// SketchSumOfBinary returns a sum of snapshots of s holding the snapshot in
// binary form data (untrusted input), of data's own window rather than
// now's: a sum read later, in the window after, still counts its current
// window as the previous one, as any sum does. It is an error, and gives
// nil, if data is not well formed or not of s's shape and window.
func (s *Sketch) SketchSumOfBinary(data []byte) (*SketchSum, error) {
	t := s.sumOf(0)
	cells := t.rows * t.width
	err := walkSketchBinary(data, cells, func(h sketchHeader) error {
		if h.ring != t.ring {
			// An aggregate of the other kind (an older aggregator's
			// weighted sum): its members' counts could not be taken
			// out of it window by window.
			return fmt.Errorf("sketch snapshot: a sum of %d windows a cell is not one of this sketch's %d", h.ring, t.ring)
		}
		t.epoch = h.epoch
		return nil
	}, nil)
	if err != nil {
		return nil, err
	}
	t.alloc()
	if _, err := t.AddBinary(data); err != nil {
		return nil, err
	}
	return t, nil
}

// Later returns the sum with each of its windows counted as the window
// shift after it (before it for shift < 0), as AddBinaryLater places a
// snapshot: an aggregate summed on another instance's clock, placed on
// the reader's. What that places after now's window is counted in now's,
// as granted now (a decision on a sum dated after its window would drop
// it). The sum may be changed in place and returned.
func (t *SketchSum) Later(shift int64, now time.Time) *SketchSum {
	if t.ring <= 2 {
		return t
	}
	t.epoch += max(min(shift, 1<<40), -1<<40)
	if e := WindowNumber(now, t.window); t.epoch > e {
		// Its tail is in the view then: its cells are in use.
		for i, n := range t.tail {
			if n != 0 {
				t.used[i/64] |= 1 << (i % 64)
			}
		}
		return t.shifted(e - t.epoch)
	}
	return t
}

// Linger has a sliding sum count what it holds of a sub-window until d
// into the sub-window after it leaves the view, where it stopped
// counting it at that sub-window's start: its counts are of writers whose
// clocks may be up to d behind this one's (less than a sub-window: d is
// capped at a sub-window less a nanosecond), so that they never leave
// this view before they leave their writers'. A request denied on them
// is told to retry (RetryAfter, Reset) when they leave, d into the
// sub-window, not at its end; one denied before, on counts that pass only
// once the sum's part of a sub-window leaves, d after that sub-window
// leaves the view, not when it leaves (the view's own part leaves then).
// Copies of the sum (Clone, WithShares, WithoutHash) keep it.
func (t *SketchSum) Linger(d time.Duration) {
	if t.ring > 2 && d > 0 {
		t.linger = max(t.linger, min(int64(d), int64(t.window)-1))
	}
}

// Epoch is the number of the sum's current window (WindowNumber).
func (t *SketchSum) Epoch() int64 { return t.epoch }

// Clone returns a copy of the sum's counts, without what WithShares left
// the other instances.
func (t *SketchSum) Clone() *SketchSum {
	c := *t
	c.counts = slices.Clone(t.counts)
	c.used = slices.Clone(t.used)
	c.tail, c.sharedTail = maps.Clone(t.tail), false
	c.shares = nil
	return &c
}
