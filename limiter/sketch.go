package limiter

import (
	"fmt"
	"math"
	"math/bits"
	"sync/atomic"
	"time"
)

// Bounds and defaults of a SketchConfig.
const (
	// MaxSketchQuota is the largest quota. Counters are 32 bits wide and
	// saturate at this value rather than wrap, so a saturated counter still
	// denies every request.
	MaxSketchQuota = math.MaxUint32
	// MinSketchWindow is the shortest window. Window numbers are kept
	// modulo 2^33 in the counters (see Sketch), which at 1ms is 99 days:
	// long enough that a stale counter coming back to life is negligible.
	// Shorter windows would also be comparable to the time between reading
	// the clock and updating the counters.
	MinSketchWindow = time.Millisecond
	// MaxSketchWindow is the longest window, about 146 years, so that two
	// windows still fit in a time.Duration (Reset can be up to two windows).
	MaxSketchWindow = time.Duration(math.MaxInt64 / 2)
	// MaxSketchRows is the most rows a sketch may have. Each decision keeps
	// one small fixed array per row on the stack.
	MaxSketchRows = 16
	// MaxSketchWidth is the most counters per row. At the maximum shape a
	// sketch holds 16 × 2^24 × 16 bytes = 4 GiB.
	MaxSketchWidth = 1 << 24
	// DefaultSketchRows is the number of rows when SketchConfig.Rows is 0.
	DefaultSketchRows = 4
	// DefaultSketchWidth is the number of counters per row when
	// SketchConfig.Width is 0: with the default rows, 1 MiB of counters.
	DefaultSketchWidth = 1 << 14
	// SketchSubWindows is how many sub-windows a sliding sketch
	// (SketchConfig.Sliding) divides its window into: its cells hold
	// SketchSubWindows + 1 of them, one 64-byte line.
	SketchSubWindows = 7
)

// sketchSlidingBits is log2 of the counters of a sliding sketch's cell:
// SketchSubWindows + 1 = 8.
const sketchSlidingBits = 3

// A SketchConfig describes a rolling quota enforced by a Sketch.
type SketchConfig struct {
	// Quota is how many tokens a key may take per Window, from 1 to
	// MaxSketchQuota.
	Quota int64
	// Window is the length of the rolling window, from MinSketchWindow to
	// MaxSketchWindow. Windows are aligned to Unix time (window number
	// floor(UnixNano / Window)) so that every instance of a cluster agrees
	// on their boundaries and can merge its counts with the others'.
	Window time.Duration
	// Rows is the number of independent hash rows, 1 to MaxSketchRows; 0
	// means DefaultSketchRows. More rows make a collision on every row less
	// likely and each decision a little slower.
	Rows int
	// Width is the number of counters per row, 1 to MaxSketchWidth (any
	// value, not only powers of two); 0 means DefaultSketchWidth. It should
	// be a few times the number of keys active in two windows: a key's
	// estimate is inflated by the keys it shares a counter with on every row.
	Width int
	// Sliding makes the sketch count every grant for a whole Window, in
	// sub-windows (see Sketch): a window zone's "at most Quota in any span
	// of Window". Without it the previous window is weighed by what is
	// left of it: a quota's rolling estimate.
	Sliding bool
}

// A Sketch enforces a rolling quota on any number of keys in fixed memory:
// a count-min sketch of Rows × Width counter pairs, one counter for the
// previous and one for the current window. A key's count in one row is
// prev × (W − t)/W + curr, t being the time elapsed in the current window;
// its estimate is the minimum over the rows. The estimate never
// undercounts a key, except through the saturation of a counter at
// MaxSketchQuota; other keys sharing its counters can only make it larger,
// so the sketch errs towards denying.
//
// Each counter is a 64-bit word holding a 32-bit count and the window
// number it counts, modulo 2^33 (the low bit is implied by which of the
// pair the word is). A counter tagged with an older window reads as zero
// and is reset by the next charge, so windows rotate lazily, without a
// sweep or a lock. A charge for a window that some other goroutine has
// already moved the counter past (by up to 2^11 windows) is dropped: that
// window is over and can no longer affect a decision. The modulus has a
// price only for a counter left untouched for about 2^33 windows (99 days
// of 1ms windows, 272 years of 1s ones): its old count may then be read
// as current, or block charges, for up to 2^11 windows.
//
// # Sliding sketches
//
// The weighted estimate assumes the previous window's grants were spread
// evenly over it: a key whose grants came late in one window may get up to
// twice its quota in a span of W across the edge. A sliding sketch
// (SketchConfig.Sliding, a window zone's cluster count) has no edge: its
// cells hold SketchSubWindows + 1 = 8 counters, one 64-byte line, over
// sub-windows of L = ⌈W/7⌉ (in nanoseconds) aligned to Unix time
// (counter e mod 8 of sub-window e, the tag holding e/8), and a key's
// count in a row is the plain sum of its last 8 sub-windows, the current
// one included: a grant is counted until its sub-window's end is 7L ≥ W
// old, exactly as the local window table (Windows) counts it. So every
// grant is checked against every earlier grant within W of it: the key
// never gets more than Quota in any span of W from the grants one sketch
// and the sums it decides with count. The price is time: a request an
// exact sliding log would grant waits at most 8L − W longer (about W/7),
// once the grants it waits on are counted, and a Retry-After is exact for
// the sketch but may be up to L − t beyond W when the key's current
// sub-window alone holds its quota. The memory is 64 bytes per cell where
// the weighted sketch has 16: the same cache line per row and decision,
// but 8 counts to add where there were 2, and a sketch four times larger
// in the CPU's caches (docs/cluster.md quotes BenchmarkSketchClusterDecision).
// Tags hold the sub-window number modulo 2^35 (the low 3 bits implied):
// 56 days at the shortest L, ⌈1ms/7⌉ (L is not held to MinSketchWindow, or
// a short window would wait up to 8 ms − W longer, not W/7), and the
// horizons above are 2^13 sub-windows. Why 8: a cell is then one line, as a weighted one's pair shares one, and
// 1/7 of the window is a modest extra wait (86 s for a 10-minute login
// window); 4 would halve the memory for an extra wait of W/3.
//
// A Sketch and its snapshots are aligned to Unix time, so the clock should
// be the wall clock of a synchronised host. A clock that steps back by
// less than 2^11 windows (2^13 sub-windows) re-enters windows that counters may have moved
// past: until it catches up, the keys of those counters are undercounted
// (their counts read as zero and charges to them are dropped).
//
// A Sketch is safe for concurrent use. Decisions take no lock and do not
// allocate.
type Sketch struct {
	quota atomic.Int64
	epoch atomic.Int64 // the window number clock last computed
	// window is the length of the windows the counters count, in
	// nanoseconds: the Window, or a sliding sketch's sub-window (span is
	// the Window then).
	window int64
	span   int64
	rows   int    // 1..MaxSketchRows
	width  uint64 // 1..MaxSketchWidth
	// ring is the counters per cell (2, or 8 when sliding), rbits its
	// log2: window e is counted in counter e mod ring, tagged e/ring.
	ring  uint64
	rbits uint8
	// slots holds, for row r and column c, the ring counters of the cell
	// at ring·(r·width+c) on, so a cell's counters share a cache line.
	slots []atomic.Uint64
	// live indexes the cells that may count something (sketch_live.go).
	live sketchLive
}

var _ Policy = (*Sketch)(nil)

// NewSketch returns an empty sketch for c, or an error naming the first
// field of c that is out of range.
func NewSketch(c SketchConfig) (*Sketch, error) {
	if err := validSketchQuota(c.Quota); err != nil {
		return nil, err
	}
	if c.Window < MinSketchWindow || c.Window > MaxSketchWindow {
		return nil, fmt.Errorf("sketch: window must be between %v and %v, got %v", MinSketchWindow, MaxSketchWindow, c.Window)
	}
	if c.Rows == 0 {
		c.Rows = DefaultSketchRows
	}
	if c.Rows < 1 || c.Rows > MaxSketchRows {
		return nil, fmt.Errorf("sketch: rows must be between 1 and %d, got %d", MaxSketchRows, c.Rows)
	}
	if c.Width == 0 {
		c.Width = DefaultSketchWidth
	}
	if c.Width < 1 || c.Width > MaxSketchWidth {
		return nil, fmt.Errorf("sketch: width must be between 1 and %d, got %d", MaxSketchWidth, c.Width)
	}
	s := &Sketch{
		window: int64(c.Window),
		span:   int64(c.Window),
		rows:   c.Rows,
		width:  uint64(c.Width),
		ring:   2,
		rbits:  1,
		live:   newSketchLive(c.Rows * c.Width),
	}
	if c.Sliding {
		s.window = sketchSubWindow(c.Window)
		s.ring, s.rbits = 1<<sketchSlidingBits, sketchSlidingBits
	}
	s.slots = make([]atomic.Uint64, int(s.ring)*c.Rows*c.Width)
	s.quota.Store(c.Quota)
	return s, nil
}

// sketchSubWindow is a sliding sketch's sub-window for a window w:
// w/SketchSubWindows rounded up to the nanosecond, so that
// SketchSubWindows of them cover w and SketchSubWindows + 1 of them exceed
// it by less than one; at least 1 ns.
func sketchSubWindow(w time.Duration) int64 {
	n := int64(w)
	return max((n+SketchSubWindows-1)/SketchSubWindows, 1)
}

// SketchSlots is how many windows a cell of a sketch counts, sliding or
// not: what a snapshot lists.
func SketchSlots(sliding bool) int {
	if sliding {
		return 1 << sketchSlidingBits
	}
	return 2
}

func validSketchQuota(q int64) error {
	if q < 1 || q > MaxSketchQuota {
		return fmt.Errorf("sketch: quota must be between 1 and %d, got %d", int64(MaxSketchQuota), q)
	}
	return nil
}

// Clear forgets every count, as if the sketch were new. A charge racing
// with it may be kept or lost.
func (s *Sketch) Clear() {
	for i := range s.slots {
		s.slots[i].Store(0)
	}
}

// Quota returns the tokens a key may take per window.
func (s *Sketch) Quota() int64 { return s.quota.Load() }

// SetQuota changes the quota, from 1 to MaxSketchQuota. It applies to the
// next decision; counts already taken are kept, so lowering the quota below
// a key's estimate denies that key until its count decays.
func (s *Sketch) SetQuota(q int64) error {
	if err := validSketchQuota(q); err != nil {
		return err
	}
	s.quota.Store(q)
	return nil
}

// Window returns the length of the rolling window.
func (s *Sketch) Window() time.Duration { return time.Duration(s.span) }

// Slot returns the length of the windows the sketch's counters count and
// numbers (WindowNumber): the Window, or a sliding sketch's sub-window.
func (s *Sketch) Slot() time.Duration { return time.Duration(s.window) }

// Sliding reports whether the sketch counts every grant for a whole Window
// (SketchConfig.Sliding).
func (s *Sketch) Sliding() bool { return s.ring > 2 }

// Memory returns the bytes held by the counters, which is what a sketch
// grows with: 16 × Rows × Width, or 64 × Rows × Width when sliding. The index of the cells in use adds a
// sixty-fourth of that, and 4 bytes per cell in use.
func (s *Sketch) Memory() int { return 8 * len(s.slots) }

// Bytes returns every byte the sketch holds: its counters (Memory), the
// two bitmaps of its index of the cells in use (one bit per cell each),
// and that index's list, 4 bytes per cell listed (as allocated: a list
// keeps its room when cells leave it).
func (s *Sketch) Bytes() int {
	s.live.mu.Lock()
	listed := cap(s.live.cells)
	s.live.mu.Unlock()
	return s.Memory() + 8*len(s.live.marked) + 8*len(s.live.bits) + 4*listed
}

// TakeHash grants weight tokens to the key with hash h if its estimate plus
// weight is at most the quota, and charges them to the current window on
// every row. A weight below 1 is taken as 1: every request costs something.
// A weight above the quota is denied with RetryAfter Never.
//
// Concurrent takes never grant more than the quota between them: a take
// charges first, then checks the estimate again and gives its charge back
// if a concurrent take got there first. Two such takes may then both be
// denied where one of them would have fitted, and a RetryAfter computed
// after such a race may be zero.
func (s *Sketch) TakeHash(h uint64, weight int64, now time.Time) (Decision, Reservation) {
	return s.TakeHashWith(h, weight, now, nil)
}

// look reads what TakeHashWith and PeekHashWith both start from: the quota,
// the weight as charged, the current window and the time into it, the
// key's cells (into cols) and their counts now, its own plus the peers'
// (into v).
func (s *Sketch) look(h uint64, weight int64, now time.Time, peers *SketchSum, cols *sketchCols, v *sketchView) (q, w uint64, e, t int64) {
	q = uint64(s.quota.Load())
	w = sketchWeight(weight)
	e, t = s.clock(now)
	s.columns(h, cols)
	s.read(cols, e, t, v)
	peers.addTo(cols, e, q, v)
	return q, w, e, t
}

// PeekHash answers whether TakeHash would grant the request, charging
// nothing; Remaining and Reset are what the key holds now (see
// PeekHashWith). A weight below 1 is taken as 1.
func (s *Sketch) PeekHash(h uint64, weight int64, now time.Time) Decision {
	return s.PeekHashWith(h, weight, now, nil)
}

// Refund takes back what a TakeHash of this sketch charged. A charge
// counted in a window that has since become the previous one is taken from
// that window, so the key's estimate drops by exactly what the charge
// still weighs; a charge from an older window has no weight left and is
// ignored. Counters never go below zero. The zero Reservation refunds
// nothing.
func (s *Sketch) Refund(r Reservation) {
	if r.units <= 0 {
		return
	}
	var cols sketchCols
	s.columns(r.index, &cols)
	s.sub(&cols, r.epoch, uint64(r.units))
}

// Add counts n tokens for the key with hash h in the current window without
// checking the quota: for traffic another policy decided on. An n below 1
// adds nothing; counters saturate at MaxSketchQuota.
func (s *Sketch) Add(h uint64, n int64, now time.Time) {
	if n < 1 {
		return
	}
	e, _ := s.clock(now)
	var cols sketchCols
	s.columns(h, &cols)
	s.add(&cols, e, uint64(n))
}

// Estimate returns the key's current count in the rolling window:
// prev × (W − t)/W + curr (a sliding sketch: the sum of its sub-windows),
// minimised over the rows. It is zero for a key
// never seen, and at least the key's true count.
func (s *Sketch) Estimate(h uint64, now time.Time) float64 {
	e, t := s.clock(now)
	var cols sketchCols
	s.columns(h, &cols)
	var v sketchView
	s.read(&cols, e, t, &v)
	hi, lo := v.num(v.minRow())
	return (float64(hi)*0x1p64 + float64(lo)) / float64(s.window)
}

// sketchWeight is the weight a request is charged: at least 1.
func sketchWeight(weight int64) uint64 {
	if weight < 1 {
		return 1
	}
	return uint64(weight)
}

// clock returns the current window number and the nanoseconds elapsed in
// it, flooring so that times before 1970 still fall in the right window.
// The last window number seen is cached because a 64-bit division costs
// as much as the rest of a decision's arithmetic; the cache is only a
// hint, checked against the clock every time.
func (s *Sketch) clock(now time.Time) (e, t int64) {
	n := now.UnixNano()
	e = s.epoch.Load()
	if t = n - e*s.window; t >= 0 && t < s.window {
		return e, t
	}
	e, t = n/s.window, n%s.window
	if t < 0 {
		e--
		t += s.window
	}
	s.epoch.Store(e)
	return e, t
}

// sketchCols holds, for each row, the index of the key's first counter:
// ring × its cell's.
type sketchCols [MaxSketchRows]uint64

// columns derives the key's cell in each row from its one hash by double
// hashing (h + i·h2), reducing each to [0, width) with a multiply-shift
// rather than a modulo. h2 is h with its halves swapped, so that rows
// depend on all 64 bits of h.
func (s *Sketch) columns(h uint64, cols *sketchCols) { sketchColumns(h, s.rows, s.width, s.ring, cols) }

// sketchColumns is Sketch.columns for a sketch of the given shape.
func sketchColumns(h uint64, rows int, width, ring uint64, cols *sketchCols) {
	h2 := bits.RotateLeft64(h, 32) | 1
	g := h
	for i := 0; i < rows; i++ {
		c, _ := bits.Mul64(g, width)
		cols[i] = ring * (uint64(i)*width + c)
		g += h2
	}
}

const sketchCountMask = 1<<32 - 1

// sketchStaleHorizon is how far ahead, in units of ring windows, a
// counter's tag may be for a charge to the window it no longer holds to
// be dropped rather than to reset it. It must cover the longest a
// goroutine may stall between reading the clock and charging; beyond it a
// tag is taken as an old one that wrapped around.
const sketchStaleHorizon = 1 << 10

// tag is what a counter of window e is tagged with. The low bits of e are
// implied by which counter of the cell holds the window (slot).
func (s *Sketch) tag(e int64) uint32 { return uint32(e >> s.rbits) }

// slot is which counter of a cell holds window e.
func (s *Sketch) slot(e int64) uint64 { return uint64(e) & (s.ring - 1) }

// sketchCount returns the count a counter word holds for the window tagged
// tag: zero if the word holds another window.
func sketchCount(word uint64, tag uint32) uint64 {
	if uint32(word>>32) != tag {
		return 0
	}
	return word & sketchCountMask
}

// sketchAddSlot adds n to the count of the window tagged tag in slot,
// saturating.
func sketchAddSlot(slot *atomic.Uint64, tag uint32, n uint64) {
	for {
		old := slot.Load()
		var c uint64
		switch t := uint32(old >> 32); {
		case t == tag:
			c = old & sketchCountMask
		case old&sketchCountMask != 0 && t-tag < sketchStaleHorizon:
			return
		}
		c = min(c+n, sketchCountMask)
		if slot.CompareAndSwap(old, uint64(tag)<<32|c) {
			return
		}
	}
}

// sketchSubSlot subtracts n from the count of the window tagged tag in
// slot, stopping at zero, if slot still holds that window.
func sketchSubSlot(slot *atomic.Uint64, tag uint32, n uint64) {
	for {
		old := slot.Load()
		if uint32(old>>32) != tag {
			return
		}
		c := old & sketchCountMask
		c -= min(c, n)
		if slot.CompareAndSwap(old, uint64(tag)<<32|c) {
			return
		}
	}
}

func (s *Sketch) add(cols *sketchCols, e int64, n uint64) {
	p, tag := s.slot(e), s.tag(e)
	for i := 0; i < s.rows; i++ {
		sketchAddSlot(&s.slots[cols[i]+p], tag, n)
		s.live.mark(cols[i] >> s.rbits)
	}
}

func (s *Sketch) sub(cols *sketchCols, e int64, n uint64) {
	p, tag := s.slot(e), s.tag(e)
	for i := 0; i < s.rows; i++ {
		sketchSubSlot(&s.slots[cols[i]+p], tag, n)
	}
}

// count returns cell i's count of window e.
func (s *Sketch) count(i int, e int64) uint64 {
	return sketchCount(s.slots[uint64(i)<<s.rbits+s.slot(e)].Load(), s.tag(e))
}

// touch loads the key's cells and their marks (Touch): a cell's two
// counters share a line, and so do 64 cells' marks.
func (s *Sketch) touch(h uint64) {
	var cols sketchCols
	s.columns(h, &cols)
	for i := 0; i < s.rows; i++ {
		s.slots[cols[i]].Load()
		s.live.marked[cols[i]>>s.rbits/64].Load()
	}
}

// read loads the key's counters for windows e−1 and e into v, or for a
// sliding sketch those of windows e−7 to e.
func (s *Sketch) read(cols *sketchCols, e, t int64, v *sketchView) {
	v.n, v.w, v.t = s.rows, uint64(s.window), uint64(t)
	if v.sliding = s.ring > 2; v.sliding {
		v.lingerEnd, v.linger, v.lingerNext, v.share = 0, [MaxSketchRows]uint64{}, 0, nil // a sum's to add (addTo)
		// Window e − 7 + k is in counter (e + 1 + k) mod 8, tagged
		// with its own number / 8.
		first := e - (1<<sketchSlidingBits - 1)
		for i := 0; i < s.rows; i++ {
			cell := s.slots[cols[i] : cols[i]+1<<sketchSlidingBits : cols[i]+1<<sketchSlidingBits]
			sub := &v.sub[i]
			var sum uint64
			for k := range sub {
				w := first + int64(k)
				c := sketchCount(cell[w&(1<<sketchSlidingBits-1)].Load(), uint32(w>>sketchSlidingBits))
				sub[k] = c
				sum += c
			}
			v.rows[i] = sketchRow{curr: sum}
		}
		return
	}
	cp, pp := s.slot(e), s.slot(e-1)
	ct, pt := s.tag(e), s.tag(e-1)
	for i := 0; i < s.rows; i++ {
		v.rows[i] = sketchRow{
			prev: sketchCount(s.slots[cols[i]+pp].Load(), pt),
			curr: sketchCount(s.slots[cols[i]+cp].Load(), ct),
		}
	}
}

type sketchRow struct{ prev, curr uint64 }

// A sketchView is one key's counters at one instant, from which a Decision
// is computed in exact integer arithmetic: a row's estimate times W,
// prev·(W−t) + curr·W, needs up to 96 bits, so it is held in 128. A
// sliding sketch's view holds in each row's curr the sum of its
// sub-windows (prev is 0) and in sub each sub-window's count, oldest
// first, the current one last; w and t are then the sub-window's. A
// sliding view of a sum that lingers (SketchSum.Linger) counts in each
// row's curr, besides its sub-windows, what a peer counted of the
// sub-window that has just left it, linger, until lingerEnd into the
// current sub-window (t < lingerEnd < w), when it leaves: so a wait
// (slidingWait) knows when those counts go. Such a sum lingers each of
// its sub-windows in turn as it leaves the view: peers[i][k] is what the
// sum counts of sub-window k that it will still count lingerNext into
// the sub-window after it leaves (valid if lingerNext > 0), so a wait on
// them is that much longer.
type sketchView struct {
	n          int
	w, t       uint64 // window length and time into it, ns; t < w
	sliding    bool
	lingerEnd  uint64
	lingerNext uint64
	rows       [MaxSketchRows]sketchRow
	sub        [MaxSketchRows][1 << sketchSlidingBits]uint64
	linger     [MaxSketchRows]uint64
	peers      [MaxSketchRows][1 << sketchSlidingBits]uint32 // a sum's counts, as it holds them
	// share is, for a view of a sliding copy made by WithShares, the
	// copy's shares (nil for none), shareD how many sub-windows after
	// the copy's the view is, shareQ the quota, and shareCols and
	// shareRing the key's columns and the copy's ring: so that a wait
	// knows what of the room that frees as sub-windows and lingers leave
	// goes to the others (addFreed, leftTo). The columns, not the cells'
	// places among those the copy lists: looking those up is a load from
	// an index of the whole table per row, which only a denial's wait
	// needs, not every decision.
	share     *shareState
	shareD    int
	shareQ    uint64
	shareRing uint64
	shareCols sketchCols
}

// num returns row i's estimate times W.
func (v *sketchView) num(i int) (hi, lo uint64) {
	return sketchNum(v.rows[i].prev, v.rows[i].curr, v.w, v.w-v.t)
}

// sketchNum returns prev·rest + curr·w in 128 bits: a count's estimate
// times the window w, rest being what is left of the current window.
func sketchNum(prev, curr, w, rest uint64) (hi, lo uint64) {
	h1, l1 := bits.Mul64(prev, rest)
	h2, l2 := bits.Mul64(curr, w)
	lo, c := bits.Add64(l1, l2, 0)
	hi, _ = bits.Add64(h1, h2, c)
	return hi, lo
}

// sketchCeil returns the estimate sketchNum's hi, lo stand for, rounded
// up, as a request's remaining takes it. The estimate is below
// prev + curr < 2^34, so the quotient fits.
func sketchCeil(hi, lo, w uint64) uint64 {
	est, rem := bits.Div64(hi, lo, w)
	if rem != 0 {
		est++
	}
	return est
}

// rowFits reports whether row i's estimate is at most limit.
func (v *sketchView) rowFits(i int, limit uint64) bool {
	hi, lo := v.num(i)
	lh, ll := bits.Mul64(limit, v.w)
	return hi < lh || hi == lh && lo <= ll
}

// fits reports whether the key's estimate is at most limit.
func (v *sketchView) fits(limit uint64) bool {
	for i := 0; i < v.n; i++ {
		if v.rowFits(i, limit) {
			return true
		}
	}
	return false
}

// minRow returns the row with the smallest estimate.
func (v *sketchView) minRow() int {
	m := 0
	mh, ml := v.num(0)
	for i := 1; i < v.n; i++ {
		if hi, lo := v.num(i); hi < mh || hi == mh && lo < ml {
			m, mh, ml = i, hi, lo
		}
	}
	return m
}

// remove takes w from the current window of every row, stopping at zero.
func (v *sketchView) remove(w uint64) {
	for i := 0; i < v.n; i++ {
		if v.sliding {
			last := &v.sub[i][len(v.sub[i])-1]
			w := min(*last, w)
			*last -= w
			v.rows[i].curr -= w
			continue
		}
		v.rows[i].curr -= min(v.rows[i].curr, w)
	}
}

// remaining is floor(q − estimate), at least zero.
func (v *sketchView) remaining(q uint64) int64 {
	hi, lo := v.num(v.minRow())
	if est := sketchCeil(hi, lo, v.w); est < q {
		return int64(q - est)
	}
	return 0
}

// reset is the time until the estimate is zero: the earliest time any row
// has neither a current nor a previous count.
func (v *sketchView) reset() time.Duration {
	if v.sliding {
		return v.slidingWait(0, false)
	}
	best := 2*v.w - v.t
	for i := 0; i < v.n && best > 0; i++ {
		switch r := v.rows[i]; {
		case r.curr == 0 && r.prev == 0:
			best = 0
		case r.curr == 0:
			best = min(best, v.w-v.t)
		}
	}
	return time.Duration(best)
}

// retry is the time until the estimate is at most need, assuming no new
// traffic: the earliest time any row gets there. A row with both counts at
// least those of a row already solved cannot get there sooner, and
// skipping it spares a 128-bit division; usually the rows are equal.
func (v *sketchView) retry(need uint64) time.Duration {
	if v.sliding {
		return v.slidingWait(need, true)
	}
	best := uint64(math.MaxUint64)
	var solved [MaxSketchRows]int
	n := 0
rows:
	for i := 0; i < v.n; i++ {
		r := v.rows[i]
		for _, j := range solved[:n] {
			if d := v.rows[j]; d.prev <= r.prev && d.curr <= r.curr {
				continue rows
			}
		}
		best = min(best, v.rowRetry(i, need))
		solved[n] = i
		n++
	}
	return time.Duration(best)
}

// rowRetry solves prev·(W−t') + curr·W ≤ need·W for the first t' ≥ t,
// moving into the next window (where curr becomes prev) if curr alone is
// above need. W − t' is an integer, so flooring the division is exact.
func (v *sketchView) rowRetry(i int, need uint64) uint64 {
	if v.rowFits(i, need) {
		return 0
	}
	r := v.rows[i]
	if r.curr > need {
		// Next window, s ns in: curr·(W−s) ≤ need·W. need·W/curr < W, and
		// the high word of need·W is below need < curr, so Div64 is safe.
		hi, lo := bits.Mul64(need, v.w)
		q, _ := bits.Div64(hi, lo, r.curr)
		return (v.w - v.t) + (v.w - q)
	}
	// This window: prev·(W−t') ≤ (need−curr)·W. The row does not fit now,
	// so (need−curr)·W < prev·(W−t) ≤ prev·2^63, and Div64 is safe.
	hi, lo := bits.Mul64(need-r.curr, v.w)
	q, _ := bits.Div64(hi, lo, r.prev)
	return v.w - q - v.t
}

// slidingWait is, for a sliding view, the time until some row counts at
// most need, assuming no new traffic and no new copy (a read): what
// lingers stops counting at lingerEnd, and sub-window k of the ring
// (oldest first) at the end of the current sub-window plus k sub-windows,
// so the first of those with the rest at most need gives the wait;
// lingerNext later if the rest is at most need only without what a sum
// still counts of sub-window k then (peers: a sum lingers what leaves the
// view, Linger). With shares set, what a copy made by WithShares leaves
// the others of the room that frees then (share: addFreed) is counted as
// it will be, so that a request told to retry then passes then; without,
// as it is now (Reset: when the counts are gone).
func (v *sketchView) slidingWait(need uint64, shares bool) time.Duration {
	share := v.share
	if !shares {
		share = nil
	}
	best := uint64(math.MaxUint64)
	for i := 0; i < v.n && best > 0; i++ {
		left := v.rows[i].curr
		if left <= need {
			best = 0
			break
		}
		j := int32(-1) // row i's cell among those the copy lists
		if share != nil {
			j = share.pos[v.shareCols[i]/v.shareRing] - 1
		}
		// The counts alone, without what lingers and what the room
		// freed leaves the others now (in the current sub-window).
		now := v.leftTo(share, j, 0, v.linger[i])
		rest := left - v.linger[i] - now
		if v.linger[i] > 0 && rest+v.leftTo(share, j, 0, 0) <= need {
			best = min(best, v.lingerEnd-v.t)
			continue
		}
		last := len(v.sub[i]) - 1
		for k, c := range v.sub[i] {
			if k == last {
				c -= now
			}
			if rest -= c; rest+v.leftTo(share, j, k+1, 0) <= need {
				at := v.w - v.t + uint64(k)*v.w
				if v.lingerNext > 0 {
					if n := uint64(v.peers[i][k]); rest+n+v.leftTo(share, j, k+1, n) > need {
						at += v.lingerNext
					}
				}
				best = min(best, at)
				break
			}
		}
	}
	return time.Duration(best)
}

// leftTo is what share, the view's copy's (nil for none), leaves the
// others in a row's cell, j among those it lists (−1 for none), of the
// room that has freed m sub-windows after
// the view's (addFreed), lingered of what has just left the view still
// counting.
func (v *sketchView) leftTo(share *shareState, j int32, m int, lingered uint64) uint64 {
	if share == nil {
		return 0
	}
	return share.leftTo(j, v.shareD+m, v.shareQ, lingered)
}

func (v *sketchView) denied(q, w uint64) Decision {
	d := Decision{
		Limit:      int64(q),
		Remaining:  v.remaining(q),
		RetryAfter: Never,
		Reset:      v.reset(),
	}
	if w <= q {
		d.RetryAfter = v.retry(q - w)
	}
	return d
}

func (v *sketchView) granted(q uint64) Decision {
	return Decision{
		Allowed:   true,
		Limit:     int64(q),
		Remaining: v.remaining(q),
		Reset:     v.reset(),
	}
}
