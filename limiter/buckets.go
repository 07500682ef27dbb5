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
// A key's hash picks one line and K of its 16 counters. A request of weight
// w is granted if the fullest of those K counters holds w tokens, and then
// every one of the K pays (see the package documentation for why). A key
// that floods drains its own K counters; another key is denied only if all
// K of its counters are drained, which happens when they all collide with
// flooding keys (a Bloom false positive). Memory is fixed by the table size,
// whatever the number of keys.
//
// Every counter is a token bucket of capacity Limit.Burst refilled at
// Limit.Events per Limit.Window. Refill is not written anywhere: a counter
// holds the time at which it will be full again (line.go).
//
// Buckets is safe for concurrent use; decisions take no lock and allocate
// nothing. Time is a parameter: callers pass the time of each call, read
// from time.Now. Sweep must run at least every SweepInterval (see Sweep).
type Buckets struct {
	base  time.Time // zero of the table's clock: ticks count from here
	k     int
	subs  []subset // every k-subset of a line's counters
	nSubs uint64   // len(subs)
	p     atomic.Pointer[bucketParams]
	// external is set by NewBucketsOver: the lines are not Go memory and
	// SetLimit must not replace them.
	external bool
}

// bucketParams is everything a decision reads besides the lines' words. It
// is immutable; SetLimit swaps in a new one, with new lines.
type bucketParams struct {
	clock
	limit Limit
	lines []line
	gen   int64 // how many SetLimits made this; a Reservation remembers it
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
	// K is how many counters each key may draw on, 1 to 8; default
	// DefaultK.
	K int
}

// Defaults of BucketsConfig.
const (
	DefaultSources   = 100_000
	DefaultFalseDeny = 0.005
	DefaultK         = 3
	// MaxBytes bounds a table: 16 GiB.
	MaxBytes = 16 << 30
)

// NewBuckets returns a table of full buckets. Its ticks count from the
// moment it is created; every method that depends on time takes it as an
// argument, which should come from time.Now (its monotonic reading keeps a
// stepped wall clock from refilling or draining buckets). A time before the
// table's creation counts as its creation.
func NewBuckets(cfg BucketsConfig) (*Buckets, error) {
	return newBuckets(cfg, time.Now())
}

// newBuckets is NewBuckets with ticks counted from base.
func newBuckets(cfg BucketsConfig, base time.Time) (*Buckets, error) {
	if err := cfg.Limit.Validate(); err != nil {
		return nil, err
	}
	k, n, err := cfg.shape()
	if err != nil {
		return nil, err
	}
	b := &Buckets{base: base, k: k, subs: subsets(k)}
	b.nSubs = uint64(len(b.subs))
	b.p.Store(&bucketParams{clock: clockFor(cfg.Limit), limit: cfg.Limit, lines: newLines(n)})
	return b, nil
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

// newLines allocates n zeroed (full) lines aligned to 64 bytes, so that a
// line is one cache line and no decision touches two.
func newLines(n int) []line {
	raw := make([]line, n+1)
	if off := uintptr(unsafe.Pointer(&raw[0])) & 63; off != 0 {
		// Go aligns large allocations to pages in practice; this is the
		// fallback when it does not. A line is 64 bytes, so shift by whole
		// words into the spare line.
		words := unsafe.Slice((*uint64)(unsafe.Pointer(&raw[0])), 8*(n+1))
		shifted := words[(64-off)/8:]
		raw = unsafe.Slice((*line)(unsafe.Pointer(&shifted[0])), n+1)
	}
	adviseHugePages(raw[:n])
	return raw[:n:n]
}

// Limit returns the limit in force.
func (b *Buckets) Limit() Limit { return b.p.Load().limit }

// K returns the number of counters each key draws on.
func (b *Buckets) K() int { return b.k }

// Bytes returns the memory held by the table's lines.
func (b *Buckets) Bytes() int { return len(b.p.Load().lines) * 64 }

// Lines returns the number of lines in the table.
func (b *Buckets) Lines() int { return len(b.p.Load().lines) }

// Allow is TakeHash(Hash(key), weight, now) without the Reservation.
func (b *Buckets) Allow(key []byte, weight int64, now time.Time) Decision {
	d, _ := b.TakeHash(Hash(key), weight, now)
	return d
}

// TakeHash grants weight tokens to the key with hash h if the fullest of its
// counters holds them at time now, and charges every one of its counters. A
// weight below 1 counts as 1. A weight above the burst is denied with
// RetryAfter Never.
func (b *Buckets) TakeHash(h uint64, weight int64, now time.Time) (d Decision, r Reservation) {
	d = b.decide(h, weight, now, &r) // into the result: no copy of r
	return d, r
}

// PeekHash answers whether TakeHash would grant the request, charging
// nothing and changing nothing; Remaining and Reset are what the key holds
// now, before any charge.
func (b *Buckets) PeekHash(h uint64, weight int64, now time.Time) Decision {
	return b.decide(h, weight, now, nil)
}

// nowNanos is now on the table's clock, never negative.
func (b *Buckets) nowNanos(now time.Time) int64 { return max(int64(now.Sub(b.base)), 0) }

// A subset is a key's counters in its line, as masks: bit c of counters is
// set for counter c, bit w of words for each word holding one of them.
// Counter c is lane c&1 of word c>>1, so word w's lanes of the key are
// counters>>(2w)&3, read together with one load and charged with one CAS.
// Precomputed for every subset, it saves a decision from working out which
// of the key's counters share a word.
type subset struct {
	counters uint16
	words    uint8
}

// lanes returns which lanes of word w are the key's: bit l for lane l.
func (s subset) lanes(w int) uint8 { return uint8(s.counters>>(2*w)) & 3 }

// pos is the position of counter c among the key's counters, in
// increasing order: where a Reservation records it.
func (s subset) pos(c int) int { return bits.OnesCount16(s.counters & (1<<c - 1)) }

// place returns the line and counters of hash h, and where they are as a
// Reservation index: the line in the high bits, the subset in the low 16.
func (b *Buckets) place(p *bucketParams, h uint64) (*line, subset, uint64) {
	return placeIn(p.lines, b.subs, h)
}

// counterAt resolves a Reservation index back to its line and counters, or
// nil if it does not fit the current table.
func (b *Buckets) counterAt(p *bucketParams, index uint64) (*line, subset) {
	return counterIn(p.lines, b.subs, index)
}

// at is a tick as the counters see it: mod 2³².
type at struct{ now uint32 }

// decide is TakeHash when r is not nil (r receives the charge; the caller
// passes it zeroed) and PeekHash when it is. It returns the Decision in
// registers and writes the Reservation in place, so a caller that holds
// the charge (Txn) copies nothing.
func (b *Buckets) decide(h uint64, weight int64, now time.Time, r *Reservation) Decision {
	p := b.p.Load()
	ns := b.nowNanos(now)
	tick := p.ticks(ns)
	t := at{now: uint32(tick)}
	ln, sub, index := b.place(p, h)
	d := Decision{Limit: p.limit.burst()}
	capT := uint32(p.capT)
	cost := uint32(p.per) // weight·per ≤ capT ≤ 2²⁹ for a weight that can be granted
	commit := r != nil
	if weight > d.Limit {
		d.RetryAfter = Never
		commit = false // still report what the key holds
	} else if weight > 1 {
		cost = uint32(weight) << p.log
	}
	var vals [8]uint64
	for {
		// The fullest counter (the one least ahead; the first of equals)
		// decides.
		best, fw, fl := uint32(math.MaxUint32), 0, uint8(0)
		for m := sub.words; m != 0; m &= m - 1 {
			w := bits.TrailingZeros8(m) & 7
			v := loadWord(&ln[w])
			vals[w] = v
			lanes := sub.lanes(w)
			if lanes&1 != 0 {
				if a := aheadOf(uint32(v), t.now); a < best {
					best, fw, fl = a, w, 0
				}
			}
			if lanes&2 != 0 {
				if a := aheadOf(uint32(v>>32), t.now); a < best {
					best, fw, fl = a, w, 1
				}
			}
		}
		if !commit || best+cost > capT {
			d.Allowed = d.RetryAfter != Never && best+cost <= capT
			d.Remaining = int64(capT-min(best, capT)) >> p.log
			d.Reset = p.about(uint64(best))
			if !d.Allowed && d.RetryAfter != Never {
				d.RetryAfter = p.until(ns, tick, uint64(best+cost-capT))
			}
			return d
		}
		// Every counter of the key pays, so that a key alone on its
		// counters sees exactly one token bucket; the others pay first,
		// and the fullest pays last with the one CAS that grants. Two
		// requests of one key therefore meet on the same counter, and
		// every grant is checked against a counter that already holds
		// every earlier grant's charge.
		*r = Reservation{index: index, units: int64(cost), epoch: p.gen}
		for m := sub.words &^ (1 << fw); m != 0; m &= m - 1 {
			w := bits.TrailingZeros8(m) & 7
			r.setShort(sub, w, chargeWord(&ln[w], vals[w], sub.lanes(w), cost, uint32(p.ceil), t))
		}
		after, short, ok := chargeFullest(&ln[fw], vals[fw], fl, sub.lanes(fw), cost, capT, uint32(p.ceil), t)
		if ok {
			r.setShort(sub, fw, short)
			d.Allowed = true
			d.Remaining = int64(capT-min(after, capT)) >> p.log
			d.Reset = p.about(uint64(after))
			return d
		}
		// The fullest counter no longer has room: take back the others'
		// payments and decide again.
		refundExcept(ln, sub, fw, *r)
		*r = Reservation{}
	}
}

// setShort records in r how much less than cost the key's counters in word
// w were charged: short holds lane l's shortfall in bits 32l (see
// chargeWord). It is rare: only a counter more than a burst in debt falls
// short.
func (r *Reservation) setShort(sub subset, w int, short uint64) {
	if short != 0 {
		r.setShortSlow(sub, w, short)
	}
}

func (r *Reservation) setShortSlow(sub subset, w int, short uint64) {
	for l := range 2 {
		if sub.lanes(w)>>l&1 != 0 {
			r.short[sub.pos(2*w+l)] = uint32(short >> (32 * l))
		}
	}
}

// chargeLane is the charge of cost to counter value v: the new value and
// how much less than cost was added. A counter may be charged past empty,
// so that charges and refunds are additions that commute and a request
// that rolls back after losing a race undoes exactly what it did, but only
// up to ceil ticks ahead: beyond, a charge falls short.
func chargeLane(v, cost, ceil uint32, t at) (nv, short uint32) {
	base := aheadOf(v, t.now)
	add := min(cost, ceil-min(base, ceil))
	if add == 0 {
		return v, cost
	}
	return store(t.now, base+add), cost - add
}

// chargeWord charges cost to the given lanes of the word at p (whose value
// was last seen as w) and returns how much less than cost each lane was
// charged, lane l's in bits 32l: 0 when every lane took the whole cost.
func chargeWord(p *uint64, w uint64, lanes uint8, cost, ceil uint32, t at) uint64 {
	for {
		nw, short := w, uint64(0)
		if lanes&1 != 0 {
			v, s := chargeLane(uint32(w), cost, ceil, t)
			nw, short = nw&^0xffffffff|uint64(v), uint64(s)
		}
		if lanes&2 != 0 {
			v, s := chargeLane(uint32(w>>32), cost, ceil, t)
			nw, short = nw&0xffffffff|uint64(v)<<32, short|uint64(s)<<32
		}
		if nw == w || casWord(p, w, nw) {
			return short
		}
		w = loadWord(p)
	}
}

// chargeFullest charges cost to lane fl of the word at p (last seen as w) if
// that counter still has room, together with the key's other lane of the
// word, in one CAS. It returns how far ahead the counter is then, and the
// shortfalls as chargeWord does (lane fl's is always 0).
func chargeFullest(p *uint64, w uint64, fl, lanes uint8, cost, capT, ceil uint32, t at) (after uint32, short uint64, ok bool) {
	for {
		a := aheadOf(lane(w, fl), t.now)
		if a+cost > capT {
			return a + cost, 0, false
		}
		after = a + cost
		nw := withLane(w, fl, store(t.now, after))
		short = 0
		if o := fl ^ 1; lanes>>o&1 != 0 {
			v, s := chargeLane(lane(w, o), cost, ceil, t)
			nw, short = withLane(nw, o, v), uint64(s)<<laneShift(o)
		}
		if casWord(p, w, nw) {
			return after, short, true
		}
		w = loadWord(p)
	}
}

// refundLane takes paid ticks back from counter value v. A counter that has
// since come back to full stays full: the result is then in the past.
func refundLane(v, paid uint32) uint32 {
	if v == 0 || paid == 0 {
		return v
	}
	if v -= paid; v == 0 {
		v = 1
	}
	return v
}

// refundExcept gives back what r charged to the key's counters in every
// word but skip (-1 for none). Refunds subtract what the charges added, so a
// rollback undoes exactly what it did.
func refundExcept(ln *line, sub subset, skip int, r Reservation) {
	for m := sub.words; m != 0; m &= m - 1 {
		w := bits.TrailingZeros8(m) & 7
		if w == skip {
			continue
		}
		p := &ln[w]
		for {
			v := loadWord(p)
			nv := v
			for l := uint8(0); l < 2; l++ {
				if sub.lanes(w)>>l&1 != 0 {
					paid := uint32(r.units) - r.short[sub.pos(2*w+int(l))]
					nv = withLane(nv, l, refundLane(lane(v, l), paid))
				}
			}
			if nv == v || casWord(p, v, nv) {
				break
			}
		}
	}
}

// Refund returns what r charged to its counters. A charge that has since
// been refilled away returns nothing more than the counter lacks: a
// counter is never more than full. A Reservation taken before a SetLimit
// refunds nothing (it is in another table's ticks): the error is a grant
// too few, never one too many.
func (b *Buckets) Refund(r Reservation) {
	if r.units <= 0 {
		return
	}
	p := b.p.Load()
	if r.epoch != p.gen {
		return
	}
	if ln, sub := b.counterAt(p, r.index); ln != nil {
		refundExcept(ln, sub, -1, r)
	}
}

// Charge charges weight tokens to the key with hash h at time now without
// checking that it has them: for a cost known only after the request was
// served (a response's size, say), or tokens reserved for a request that
// will wait for them. Every counter of the key pays, up to a debt of one
// burst beyond empty (twice the burst short of full), so a key charged past
// its tokens is denied until it has paid the debt back, and no more than
// about a burst. A weight below 1 charges nothing.
//
// Allowed reports whether at least one counter took the whole charge, the
// only way the key's fullest counter holds it; false means the key is at
// the ceiling and part of the charge was dropped. RetryAfter is the time
// until the key is out of debt (its fullest counter back to empty, no other
// traffic assumed): when a request that reserved its tokens may go. Refund
// gives back exactly what was charged.
func (b *Buckets) Charge(h uint64, weight int64, now time.Time) (Decision, Reservation) {
	p := b.p.Load()
	d := Decision{Limit: p.limit.burst()}
	if weight < 1 {
		return d, Reservation{}
	}
	ns := b.nowNanos(now)
	tick := p.ticks(ns)
	t := at{now: uint32(tick)}
	cost := uint32(min(uint64(weight), 2*uint64(p.limit.burst())) * p.per) // ≤ ceil ≤ 2³⁰
	ln, sub, index := b.place(p, h)
	r := Reservation{index: index, units: int64(cost), epoch: p.gen}
	best := uint32(math.MaxUint32)
	for m := sub.words; m != 0; m &= m - 1 {
		w := bits.TrailingZeros8(m) & 7
		lanes := sub.lanes(w)
		short := chargeWord(&ln[w], loadWord(&ln[w]), lanes, cost, uint32(p.ceil), t)
		r.setShort(sub, w, short)
		v := loadWord(&ln[w])
		for l := uint8(0); l < 2; l++ {
			if lanes>>l&1 != 0 {
				d.Allowed = d.Allowed || uint32(short>>laneShift(l)) == 0
				best = min(best, aheadOf(lane(v, l), t.now))
			}
		}
	}
	capT := uint32(p.capT)
	d.Remaining = int64(capT-min(best, capT)) >> p.log
	d.Reset = p.about(uint64(best))
	if best > capT {
		d.RetryAfter = p.until(ns, tick, uint64(best-capT))
	}
	return d, r
}

// Fill makes the counters of the key with hash h full again. Keys that
// share those counters gain too.
func (b *Buckets) Fill(h uint64) {
	p := b.p.Load()
	ln, sub, _ := b.place(p, h)
	for m := sub.words; m != 0; m &= m - 1 {
		w := bits.TrailingZeros8(m) & 7
		q := &ln[w]
		for {
			v := loadWord(q)
			nv := v
			for l := uint8(0); l < 2; l++ {
				if sub.lanes(w)>>l&1 != 0 {
					nv = withLane(nv, l, 0)
				}
			}
			if nv == v || casWord(q, v, nv) {
				break
			}
		}
	}
}

// subsets lists every k-element subset of a line's counters, in
// lexicographic order of their counters. A key's hash picks one uniformly.
func subsets(k int) []subset {
	var out []subset
	var rec func(start, depth int, s subset)
	rec = func(start, depth int, s subset) {
		if depth == k {
			out = append(out, s)
			return
		}
		for c := start; c < countersPerLine; c++ {
			rec(c+1, depth+1, subset{counters: s.counters | 1<<c, words: s.words | 1<<(c>>1)})
		}
	}
	rec(0, 0, subset{})
	return out
}

var _ Policy = (*Buckets)(nil)
