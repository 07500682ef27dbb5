package limiter

import (
	"fmt"
	"math"
	"math/bits"
	"sync/atomic"
	"time"
	"unsafe"
)

// Buckets is a Bloom token-bucket table: a fixed number of cache lines of
// token counters, shared by every key (after Amazon's "network communication
// rate limiter", US 9654483).
//
// A key's hash picks one line and K of its 14 counters. A request of weight
// w is granted if the fullest of those K counters holds w tokens, and only
// that counter pays. A key that floods drains its own K counters; another
// key is denied only if all K of its counters are drained, which happens
// when they all collide with flooding keys (a Bloom false positive). Memory
// is fixed by the table size, whatever the number of keys.
//
// Every counter is a token bucket of capacity Limit.Burst refilled at
// Limit.Events per Limit.Window, lazily: a line is refilled when it is
// touched, by the whole time elapsed since its tick.
//
// Buckets is safe for concurrent use; decisions take no lock and allocate
// nothing.
type Buckets struct {
	base  time.Time // zero of the table's clock: ticks count from here
	k     int
	subs  []uint8 // every k-subset of a line's counters, k bytes each
	nSubs uint64  // len(subs)/k
	p     atomic.Pointer[bucketParams]
}

// bucketParams is everything a decision reads besides the lines. It is
// immutable; SetLimit swaps in a new one.
type bucketParams struct {
	limit Limit
	tickParams
	perRefill divisor // divides by refill
	t         *lineTable
}

// lineTable is the lines and their clock. The tick length is a property of
// the table: a limit with a different tick moves the counters to a new one.
type lineTable struct {
	lines     []line
	tick      time.Duration
	perTick   divisor      // divides by tick
	lastSweep atomic.Int64 // tick of the last wrap sweep (see sweep)
}

// ticksAt is ns / tick for ns ≥ 0.
func (t *lineTable) ticksAt(ns int64) int64 { return int64(t.perTick.div(uint64(ns))) }

// A divisor divides by a fixed d > 0 with a multiply. A 64-bit division is
// the slowest instruction of a decision; the multiply by ⌊(2⁶⁴−1)/d⌋ is short
// by at most one, which one comparison repairs.
type divisor struct{ d, inv uint64 }

func newDivisor(d uint64) divisor { return divisor{d: d, inv: math.MaxUint64 / d} }

func (v divisor) div(x uint64) uint64 {
	q, _ := bits.Mul64(x, v.inv)
	if x-q*v.d >= v.d {
		q++
	}
	return q
}

// BucketsConfig configures a Buckets table.
type BucketsConfig struct {
	// Limit is the rate and burst of every counter.
	Limit Limit
	// Bytes is the table's size, rounded down to whole 64-byte lines. Zero
	// means: size it from Sources and FalseDeny.
	Bytes int
	// Sources is the number of sources expected to be over their limit at
	// the same time (flooding). Used only when Bytes is zero; default
	// DefaultSources.
	Sources int
	// FalseDeny is the largest acceptable probability that a source under
	// its limit is denied while Sources others flood. Used only when Bytes
	// is zero; default DefaultFalseDeny.
	FalseDeny float64
	// K is how many counters each key may draw on, 1 to 8; default 4.
	K int
}

// Defaults of BucketsConfig.
const (
	DefaultSources   = 100_000
	DefaultFalseDeny = 0.005
	DefaultK         = 4
	// MaxBytes bounds a table: 16 GiB.
	MaxBytes = 16 << 30
)

// NewBuckets returns a table of full buckets. Its ticks count from the
// moment it is created; every method that depends on time takes it as an
// argument, which should come from time.Now (its monotonic reading keeps a
// stepped wall clock from refilling or draining buckets).
func NewBuckets(cfg BucketsConfig) (*Buckets, error) {
	return newBuckets(cfg, time.Now())
}

// newBuckets is NewBuckets with ticks counted from base.
func newBuckets(cfg BucketsConfig, base time.Time) (*Buckets, error) {
	if err := cfg.Limit.Validate(); err != nil {
		return nil, err
	}
	k := cfg.K
	if k == 0 {
		k = DefaultK
	}
	if k < 1 || k > 8 {
		return nil, fmt.Errorf("k must be between 1 and 8, got %d", k)
	}
	n, err := cfg.lines(k)
	if err != nil {
		return nil, err
	}
	tp, _ := cfg.Limit.ticks()
	b := &Buckets{base: base, k: k, subs: subsets(countersPerLine, k)}
	b.nSubs = uint64(len(b.subs) / k)
	b.p.Store(newParams(cfg.Limit, tp, newLineTable(n, tp.tick)))
	return b, nil
}

func newParams(l Limit, tp tickParams, t *lineTable) *bucketParams {
	return &bucketParams{limit: l, tickParams: tp, perRefill: newDivisor(uint64(tp.refill)), t: t}
}

// lines works out the number of lines the config asks for.
func (cfg BucketsConfig) lines(k int) (int, error) {
	if cfg.Bytes != 0 {
		if cfg.Bytes < 64 || cfg.Bytes > MaxBytes {
			return 0, fmt.Errorf("memory must be between 64 bytes and %d bytes, got %d", MaxBytes, cfg.Bytes)
		}
		return cfg.Bytes / 64, nil
	}
	sources, fd := cfg.Sources, cfg.FalseDeny
	if sources == 0 {
		sources = DefaultSources
	}
	if fd == 0 {
		fd = DefaultFalseDeny
	}
	if sources < 1 {
		return 0, fmt.Errorf("sources must be at least 1, got %d", sources)
	}
	if !(fd > 0 && fd < 1) {
		return 0, fmt.Errorf("false-deny probability must be between 0 and 1, got %g", fd)
	}
	n := LinesFor(sources, fd, k)
	if n > MaxBytes/64 {
		return 0, fmt.Errorf("%d sources at false-deny probability %g need %d bytes, more than the maximum of %d",
			sources, fd, n*64, MaxBytes)
	}
	return n, nil
}

// newLineTable allocates n lines aligned to 64 bytes, so that a line is one
// cache line and no decision touches two.
func newLineTable(n int, tick time.Duration) *lineTable {
	raw := make([]line, n+1)
	off := uintptr(unsafe.Pointer(&raw[0])) & 63
	start := 0
	if off != 0 {
		// Go aligns large allocations to pages in practice; this is the
		// fallback when it does not. A line is 64 bytes, so shift by whole
		// words into the spare line.
		words := unsafe.Slice((*uint64)(unsafe.Pointer(&raw[0])), 8*(n+1))
		shifted := words[(64-off)/8:]
		raw = unsafe.Slice((*line)(unsafe.Pointer(&shifted[0])), n)
	}
	adviseHugePages(raw[start:n])
	return &lineTable{lines: raw[start:n], tick: tick, perTick: newDivisor(uint64(tick))}
}

// Limit returns the limit in force.
func (b *Buckets) Limit() Limit { return b.p.Load().limit }

// K returns the number of counters each key draws on.
func (b *Buckets) K() int { return b.k }

// Bytes returns the memory held by the table's lines.
func (b *Buckets) Bytes() int { return len(b.p.Load().t.lines) * 64 }

// Lines returns the number of lines in the table.
func (b *Buckets) Lines() int { return len(b.p.Load().t.lines) }

// Allow is TakeHash(Hash(key), weight, now) without the Reservation.
func (b *Buckets) Allow(key []byte, weight int64, now time.Time) Decision {
	d, _ := b.TakeHash(Hash(key), weight, now)
	return d
}

// TakeHash grants weight tokens to the key with hash h if the fullest of its
// counters holds them, and charges that counter. A weight below 1 counts as
// 1. A weight above the burst is denied with RetryAfter Never.
func (b *Buckets) TakeHash(h uint64, weight int64, now time.Time) (Decision, Reservation) {
	return b.decide(h, weight, now, true)
}

// PeekHash answers what TakeHash would, charging nothing and changing
// nothing.
func (b *Buckets) PeekHash(h uint64, weight int64, now time.Time) Decision {
	d, _ := b.decide(h, weight, now, false)
	return d
}

// nowNanos is now on the table's clock, never negative.
func (b *Buckets) nowNanos(now time.Time) int64 { return max(int64(now.Sub(b.base)), 0) }

// place returns the line and counters of hash h, and where they are as a
// Reservation index: the line in the high bits, the subset in the low 16.
func (b *Buckets) place(t *lineTable, h uint64) (*line, []uint8, uint64) {
	idx := uint64(uint32(h>>32)) * uint64(len(t.lines)) >> 32
	s := int(uint64(uint32(h)) * b.nSubs >> 32)
	return &t.lines[idx], b.subs[s*b.k : s*b.k+b.k : s*b.k+b.k], idx<<16 | uint64(s)
}

// counterAt resolves a Reservation index back to its line and counters, or
// nil if it does not fit the current table.
func (b *Buckets) counterAt(t *lineTable, index uint64) (*line, []uint8) {
	idx, s := index>>16, int(index&0xffff)
	if idx >= uint64(len(t.lines)) || uint64(s) >= b.nSubs {
		return nil, nil
	}
	return &t.lines[idx], b.subs[s*b.k : s*b.k+b.k : s*b.k+b.k]
}

func (b *Buckets) decide(h uint64, weight int64, now time.Time, commit bool) (Decision, Reservation) {
	p := b.p.Load()
	t := p.t
	if weight < 1 {
		weight = 1
	}
	nowNs := b.nowNanos(now)
	nowTick := t.ticksAt(nowNs)
	if nowTick-t.lastSweep.Load() >= sweepEvery {
		t.sweep(p, nowTick)
	}
	ln, counters, at := b.place(t, h)
	d := Decision{Limit: p.limit.burst()}
	capUnits := uint64(p.capUnits)
	cost := uint64(weight) * UnitsPerToken
	if weight > MaxBurst || cost > capUnits {
		d.RetryAfter = Never
		commit = false // still report what the key holds
	}
	for {
		w0 := atomic.LoadUint64(&ln[0])
		tick, pending, gen := unpackClock(w0)
		// The refill a line is owed since its tick is not written back on
		// every touch: a charge lifts the counter to the owed amount
		// first (see charge), which keeps it exact relative to the old
		// tick. Only once a full bucket's worth is owed is the line
		// brought up to date (refill), so a busy line pays for that once
		// per refill period, not once per tick.
		//
		// elapsed is exact while a line's tick is less than 2³¹ ticks
		// old; sweep keeps every line younger than that.
		var owed uint64
		if elapsed := int32(uint32(nowTick) - tick); elapsed > 0 {
			owed = uint64(elapsed) * uint64(p.refill)
			if owed >= capUnits {
				if commit {
					t.refill(ln, w0, nowTick, uint64(elapsed), p)
					continue
				}
				owed = min(owed, laneMask)
			}
		}
		// The fullest counter (smallest deficit; the first of equals)
		// decides.
		best, f := uint64(math.MaxUint64), 0
		for i, c := range counters {
			w := atomic.LoadUint64(&ln[counterWord(c)])
			def := w >> counterShift(c) & laneMask
			if owes(w, gen) {
				def = subSat(def, pending)
			}
			if def = subSat(def, owed); def < best {
				best, f = def, i
			}
		}
		if best+cost > capUnits || !commit {
			d.Allowed = d.RetryAfter != Never && best+cost <= capUnits
			d.Remaining = int64(capUnits-min(best, capUnits)) / UnitsPerToken
			d.Reset = p.untilBelow(best, 0, nowNs, nowTick)
			if !d.Allowed && d.RetryAfter != Never {
				d.RetryAfter = p.untilBelow(best, capUnits-cost, nowNs, nowTick)
			}
			return d, Reservation{}
		}
		// Every counter of the key pays, so that a key alone on its
		// counters sees exactly one token bucket; the others pay first,
		// and the fullest pays last with the one CAS that grants.
		// Two requests of one key therefore meet on the same counter,
		// and every grant is checked against a counter that already
		// holds every earlier grant's charge.
		r := Reservation{index: uint64(at), units: int64(cost)}
		for i, c := range counters {
			if i != f {
				r.short[i] = uint32(cost - charge(ln, c, cost, capUnits, owed))
			}
		}
		if after, ok := chargeIfRoom(ln, counters[f], cost, capUnits, owed); ok {
			d.Allowed = true
			d.Remaining = int64(capUnits-min(after, capUnits)) / UnitsPerToken
			d.Reset = p.untilBelow(after, 0, nowNs, nowTick)
			return d, r
		}
		// The fullest counter no longer has room: take back the others'
		// payments and decide again.
		refundExcept(ln, counters, f, r)
	}
}

// untilBelow is the time from nowNs until a deficit of def units, refilled
// every tick from nowTick on, is at most target.
func (p *bucketParams) untilBelow(def, target uint64, nowNs, nowTick int64) time.Duration {
	if def <= target {
		return 0
	}
	ticks := p.perRefill.div(def - target + uint64(p.refill) - 1)
	return time.Duration((nowTick+int64(ticks))*int64(p.t.tick) - nowNs)
}

// refill brings line ln, whose clock word read w0, up to nowTick: it pays
// every word's debt to the previous refill, then claims the new one. It gives
// up silently if another goroutine claims first; callers re-read the line.
func (t *lineTable) refill(ln *line, w0 uint64, nowTick int64, elapsed uint64, p *bucketParams) {
	_, pending, gen := unpackClock(w0)
	for i := 1; i < len(ln); i++ {
		for {
			w := atomic.LoadUint64(&ln[i])
			if !owes(w, gen) || atomic.CompareAndSwapUint64(&ln[i], w, settle(w, pending, gen)) {
				break
			}
		}
	}
	// Stored deficits reach three capacities (see charge), so the amount
	// is not capped at one.
	amount := min(elapsed*uint64(p.refill), laneMask)
	atomic.CompareAndSwapUint64(&ln[0], w0, clockWord(uint32(nowTick), amount, gen^1))
}

// Refund returns what r charged to its counters. A charge that has since
// been refilled away returns nothing more than the counter lacks: a
// deficit never goes below zero.
func (b *Buckets) Refund(r Reservation) {
	if r.units <= 0 {
		return
	}
	if ln, counters := b.counterAt(b.p.Load().t, r.index); ln != nil {
		refundExcept(ln, counters, -1, r)
	}
}

// refundExcept gives back what r charged to each counter but the one at
// position skip. Refunds subtract from the stored deficit, the inverse of
// the additions charge made, so a rollback undoes exactly what it did.
func refundExcept(ln *line, counters []uint8, skip int, r Reservation) {
	for i, c := range counters {
		if i == skip {
			continue
		}
		paid := uint64(r.units) - uint64(r.short[i])
		for {
			w, s, def := counterState(ln, c)
			if casCounter(ln, c, w, s, subSat(def, paid)) {
				break
			}
		}
	}
}

// counterState reads counter c: its word as it is (what a CAS must find),
// the word with any refill it owes paid, and the counter's stored deficit.
func counterState(ln *line, c uint8) (w, settled, def uint64) {
	_, pending, gen := unpackClock(atomic.LoadUint64(&ln[0]))
	w = atomic.LoadUint64(&ln[counterWord(c)])
	settled = settle(w, pending, gen)
	return w, settled, settled >> counterShift(c) & laneMask
}

// casCounter stores def as counter c's stored deficit if its word still
// reads w; settled is that word with its debt paid (from counterState).
func casCounter(ln *line, c uint8, w, settled, def uint64) bool {
	sh := counterShift(c)
	return atomic.CompareAndSwapUint64(&ln[counterWord(c)], w, settled&^(laneMask<<sh)|def<<sh)
}

// A counter's stored deficit is relative to its line's tick: the deficit
// now is the stored one less what the line is owed since (owed), floored at
// zero. To charge it without bringing the whole line up to date, a charge
// first lifts the stored deficit to at least owed (which changes nothing
// now, but stops the refill credited before the charge from also paying
// for the charge), then adds. Stored deficits stay below three capacities:
// owed is less than one, and the deficit now at most two (see charge).

// charge adds cost to counter c's deficit and returns what it added.
//
// A deficit may go past capacity (the counter is then "below empty" and
// must refill past zero before it grants again), up to twice capacity. Only
// at that ceiling does a charge fall short. Within it, charges and refunds
// are plain additions, so they commute: a request that rolls back its
// charges after losing a race undoes exactly what it did, whatever other
// requests did in between. A ceiling at capacity would not: a charge that
// stopped at empty, then a rollback, leaves the counter fuller than every
// grant it has seen.
func charge(ln *line, c uint8, cost, capUnits, owed uint64) uint64 {
	ceiling := 2 * capUnits
	for {
		w, s, def := counterState(ln, c)
		added := min(cost, ceiling-min(subSat(def, owed), ceiling))
		if casCounter(ln, c, w, s, max(def, owed)+added) {
			return added
		}
	}
}

// chargeIfRoom adds cost to counter c if it still holds that much, and
// returns its deficit now.
func chargeIfRoom(ln *line, c uint8, cost, capUnits, owed uint64) (uint64, bool) {
	for {
		w, s, def := counterState(ln, c)
		after := subSat(def, owed) + cost
		if after > capUnits {
			return after, false
		}
		if casCounter(ln, c, w, s, max(def, owed)+cost) {
			return after, true
		}
	}
}

// Reset makes the counters of the key with hash h full again. Keys that
// share those counters gain too.
func (b *Buckets) Reset(h uint64) {
	ln, counters, _ := b.place(b.p.Load().t, h)
	for _, c := range counters {
		for {
			w, s, _ := counterState(ln, c)
			if casCounter(ln, c, w, s, 0) {
				break
			}
		}
	}
}

// sweepEvery is how often (in ticks) every line of a table is refilled, so
// that no line's 32-bit tick is ever more than 2³¹ ticks behind the clock.
const sweepEvery = 1 << 30

// sweep refills every line to nowTick, once per sweepEvery ticks. A line
// whose tick is older than half the tick's wrap period would otherwise read
// a wrong elapsed time. The tick is at least a microsecond, so a sweep runs
// at most every 18 minutes, in the request that finds it due (about 20 ns a
// line). If the table went unused for more than 2³¹ ticks, every line has
// been idle for at least 2³⁰ ticks, far longer than any bucket takes to
// fill, so the sweep sets every counter full without reading it.
func (t *lineTable) sweep(p *bucketParams, nowTick int64) {
	last := t.lastSweep.Load()
	if nowTick-last < sweepEvery || !t.lastSweep.CompareAndSwap(last, nowTick) {
		return
	}
	idle := nowTick-last >= 2*sweepEvery
	for i := range t.lines {
		ln := &t.lines[i]
		for {
			w0 := atomic.LoadUint64(&ln[0])
			tick, _, gen := unpackClock(w0)
			if idle {
				for j := 1; j < len(ln); j++ {
					atomic.StoreUint64(&ln[j], gen<<63)
				}
				atomic.StoreUint64(&ln[0], clockWord(uint32(nowTick), 0, gen))
				break
			}
			elapsed := int32(uint32(nowTick) - tick)
			if elapsed <= 0 {
				break
			}
			t.refill(ln, w0, nowTick, uint64(elapsed), p)
		}
	}
}

// subsets lists every k-element subset of {0 … n−1}, k bytes each, in
// lexicographic order. A key's hash picks one uniformly.
func subsets(n, k int) []uint8 {
	var out []uint8
	cur := make([]uint8, k)
	var rec func(start, depth int)
	rec = func(start, depth int) {
		if depth == k {
			out = append(out, cur...)
			return
		}
		for i := start; i < n; i++ {
			cur[depth] = uint8(i)
			rec(i+1, depth+1)
		}
	}
	rec(0, 0)
	return out
}

var _ Policy = (*Buckets)(nil)
