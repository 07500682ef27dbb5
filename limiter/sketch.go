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
)

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
// A Sketch and its snapshots are aligned to Unix time, so the clock should
// be the wall clock of a synchronised host. A clock that steps back by
// less than 2^11 windows re-enters windows that counters may have moved
// past: until it catches up, the keys of those counters are undercounted
// (their counts read as zero and charges to them are dropped).
//
// A Sketch is safe for concurrent use. Decisions take no lock and do not
// allocate.
type Sketch struct {
	quota  atomic.Int64
	epoch  atomic.Int64 // the window number clock last computed
	window int64        // nanoseconds
	rows   int          // 1..MaxSketchRows
	width  uint64       // 1..MaxSketchWidth
	// slots holds, for row r and column c, the counter of even windows at
	// 2(r·width+c) and that of odd windows right after it, so the two
	// counters of a cell share a cache line.
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
		rows:   c.Rows,
		width:  uint64(c.Width),
		slots:  make([]atomic.Uint64, 2*c.Rows*c.Width),
		live:   newSketchLive(c.Rows * c.Width),
	}
	s.quota.Store(c.Quota)
	return s, nil
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
func (s *Sketch) Window() time.Duration { return time.Duration(s.window) }

// Memory returns the bytes held by the counters, which is what a sketch
// grows with: 16 × Rows × Width. The index of the cells in use adds a
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
	peers.addTo(cols, e, v)
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
// prev × (W − t)/W + curr, minimised over the rows. It is zero for a key
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

// sketchCols holds, for each row, the index of the key's counter pair.
type sketchCols [MaxSketchRows]uint64

// columns derives the key's cell in each row from its one hash by double
// hashing (h + i·h2), reducing each to [0, width) with a multiply-shift
// rather than a modulo. h2 is h with its halves swapped, so that rows
// depend on all 64 bits of h.
func (s *Sketch) columns(h uint64, cols *sketchCols) { sketchColumns(h, s.rows, s.width, cols) }

// sketchColumns is Sketch.columns for a sketch of the given shape.
func sketchColumns(h uint64, rows int, width uint64, cols *sketchCols) {
	h2 := bits.RotateLeft64(h, 32) | 1
	g := h
	for i := 0; i < rows; i++ {
		c, _ := bits.Mul64(g, width)
		cols[i] = 2 * (uint64(i)*width + c)
		g += h2
	}
}

const sketchCountMask = 1<<32 - 1

// sketchStaleHorizon is how far ahead, in units of two windows, a
// counter's tag may be for a charge to the window it no longer holds to
// be dropped rather than to reset it. It must cover the longest a
// goroutine may stall between reading the clock and charging; beyond it a
// tag is taken as an old one that wrapped around.
const sketchStaleHorizon = 1 << 10

// sketchTag is what a counter of window e is tagged with. The low bit of e
// is implied by which counter of the pair holds the window.
func sketchTag(e int64) uint32 { return uint32(e >> 1) }

// sketchCount returns the count a counter word holds for the window tagged
// tag: zero if the word holds another window.
func sketchCount(word uint64, tag uint32) uint64 {
	if uint32(word>>32) != tag {
		return 0
	}
	return word & sketchCountMask
}

// sketchAddSlot adds n to the count of window e in slot, saturating.
func sketchAddSlot(slot *atomic.Uint64, e int64, n uint64) {
	tag := sketchTag(e)
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

// sketchSubSlot subtracts n from the count of window e in slot, stopping at zero,
// if slot still holds window e.
func sketchSubSlot(slot *atomic.Uint64, e int64, n uint64) {
	tag := sketchTag(e)
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
	p := uint64(e & 1)
	for i := 0; i < s.rows; i++ {
		sketchAddSlot(&s.slots[cols[i]+p], e, n)
		s.live.mark(cols[i] / 2)
	}
}

func (s *Sketch) sub(cols *sketchCols, e int64, n uint64) {
	p := uint64(e & 1)
	for i := 0; i < s.rows; i++ {
		sketchSubSlot(&s.slots[cols[i]+p], e, n)
	}
}

// touch loads the key's cells and their marks (Touch): a cell's two
// counters share a line, and so do 64 cells' marks.
func (s *Sketch) touch(h uint64) {
	var cols sketchCols
	s.columns(h, &cols)
	for i := 0; i < s.rows; i++ {
		s.slots[cols[i]].Load()
		s.live.marked[cols[i]/2/64].Load()
	}
}

// read loads the key's counters for windows e−1 and e into v.
func (s *Sketch) read(cols *sketchCols, e, t int64, v *sketchView) {
	cp, pp := uint64(e&1), uint64((e-1)&1)
	ct, pt := sketchTag(e), sketchTag(e-1)
	v.n, v.w, v.t = s.rows, uint64(s.window), uint64(t)
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
// prev·(W−t) + curr·W, needs up to 96 bits, so it is held in 128.
type sketchView struct {
	n    int
	w, t uint64 // window length and time into it, ns; t < w
	rows [MaxSketchRows]sketchRow
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
