package limiter

import (
	"fmt"
	"math"
	"math/bits"
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
// A refund (RefundAt) gives back what of its charge each counter still
// owes at the refund's time, as if the charge had been made from a full
// counter at its own time: all of it at the time of the charge, less
// whatever time has refilled since, nothing once its cost has refilled. It
// never gives back another request's charge, whatever other refunds and
// takes came between; a charge queued behind others and refunded late is
// given back less than its place in the queue would owe (see the package
// documentation). A Reservation taken before the latest SetLimit is
// converted with the counters, less what of it the conversion's cap at
// the limit's debt may have dropped; one taken before two SetLimits gives
// back nothing (the error is a grant too few, never one too many).
//
// Buckets is safe for concurrent use; decisions take no lock and allocate
// nothing. Time is a parameter: callers pass the time of each call, read
// from time.Now. Sweep must run at least every SweepInterval (see Sweep).
type Buckets struct {
	table[bucketParams, *bucketParams] // subs: every k-subset of a line's counters
	// external is set by NewBucketsOver: the lines are not Go memory and
	// SetLimit must not replace them.
	external bool
}

// bucketParams is everything a decision reads besides the lines' words. It
// is immutable; SetLimit swaps in a new one, with new lines.
type bucketParams struct {
	tableParams
	// from is how SetLimit converted the previous table into this one,
	// for the Reservations taken from it.
	from conversion
}

// A conversion is SetLimit's change of clock: at the moment it converted,
// the old clock read oldTick and the new one newTick, and a token was per
// old ticks.
type conversion struct {
	per              uint64
	oldTick, newTick uint64
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
	k, n, err := cfg.shapeOf(countersPerLine)
	if err != nil {
		return nil, err
	}
	b := &Buckets{table: table[bucketParams, *bucketParams]{base: base, k: k, subs: subsets(k)}}
	b.p.Store(&bucketParams{tableParams: tableParams{clock: clockFor(cfg.Limit), limit: cfg.Limit, lines: newLines(n)}})
	return b, nil
}

// lines works out the number of lines the config asks for, in a table of
// m counters to a line.
func (cfg BucketsConfig) lines(k, m int) (int, error) {
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
	n := linesFor(sources, fd, k, m)
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

// lanes returns which lanes of word wi are the key's: bit l for lane l.
func (s subset) lanes(wi int) uint8 { return uint8(s.counters>>(2*wi)) & 3 }

// pos is the position of counter c among the key's counters, in
// increasing order: where a Reservation records it.
func (s subset) pos(c int) int { return bits.OnesCount16(s.counters & (1<<c - 1)) }

// at is a tick as the counters see it: mod 2³².
type at struct{ now uint32 }

// decide is TakeHash when r is not nil (r receives the charge; the caller
// passes it zeroed) and PeekHash when it is. It returns the Decision in
// registers and writes the Reservation in place, so a caller that holds
// the charge (Txn) copies nothing.
//
// A decision that meets a frozen word (SetLimit replaced the lines it
// loaded) waits for the new table, gives back there what it had charged,
// and decides again under the new limit: every charge lands in the table
// in force, converted with the rest by SetLimit, or is given back.
func (b *Buckets) decide(h uint64, weight int64, now time.Time, r *Reservation) Decision {
	ns := b.nowNanos(now)
	p := b.params()
table:
	for {
		tick := p.ticks(ns)
		t := at{now: uint32(tick)}
		ln, sub, index := placeIn(p.lines, b.subs, h)
		d := Decision{Limit: p.limit.EffectiveBurst()}
		capT := uint32(p.capT)
		cost := uint32(p.per) // weight·per ≤ capT < 2³⁰ for a weight that can be granted (capT + debt ≤ 2³⁰)
		commit := r != nil
		if weight > d.Limit {
			d.RetryAfter = Never
			commit = false // still report what the key holds
		} else if weight > 1 {
			cost = uint32(weight) << p.log
		}
		var vals [8]uint64
		for {
			// The fullest counter (the one least ahead; the first of
			// equals) decides.
			best, fw, fl := uint32(math.MaxUint32), 0, uint8(0)
			for m := sub.words; m != 0; m &= m - 1 {
				wi := bits.TrailingZeros8(m) & 7
				v := loadWord(&ln[wi])
				if v == frozen {
					p = b.moved(p)
					continue table
				}
				vals[wi] = v
				lanes := sub.lanes(wi)
				if lanes&1 != 0 {
					if a := aheadOf(uint32(v), t.now); a < best {
						best, fw, fl = a, wi, 0
					}
				}
				if lanes&2 != 0 {
					if a := aheadOf(uint32(v>>32), t.now); a < best {
						best, fw, fl = a, wi, 1
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
			// counters sees exactly one token bucket; the others pay
			// first, and the fullest pays last with the one CAS that
			// grants. Two requests of one key therefore meet on the same
			// counter, and every grant is checked against a counter that
			// already holds every earlier grant's charge.
			// Only the header: record writes end and short for every
			// counter the key charges, and nothing reads the others.
			r.index, r.units, r.epoch, r.tick = index, int64(cost), p.gen, tick
			var paid uint8 // the words charged so far
			for m := sub.words &^ (1 << fw); m != 0; m &= m - 1 {
				wi := bits.TrailingZeros8(m) & 7
				nv, short, ok := chargeWord(&ln[wi], vals[wi], sub.lanes(wi), cost, uint32(p.ceil), t)
				if !ok {
					p = b.giveBack(b.moved(p), r, paid, ns)
					continue table
				}
				r.record(sub, wi, nv, short)
				paid |= 1 << wi
			}
			nv, after, short, res := chargeFullest(&ln[fw], vals[fw], fl, sub.lanes(fw), cost, capT, uint32(p.ceil), t)
			switch res {
			case chargeGranted:
				r.record(sub, fw, nv, short)
				d.Allowed = true
				d.Remaining = int64(capT-min(after, capT)) >> p.log
				d.Reset = p.about(uint64(after))
				return d
			case chargeFrozen:
				p = b.giveBack(b.moved(p), r, paid, ns)
				continue table
			}
			// The fullest counter no longer has room: take back the
			// others' payments and decide again.
			if q := b.giveBack(p, r, paid, ns); q != p {
				p = q
				continue table
			}
		}
	}
}

// record notes in r what word wi's charge left (nv): the TAT each of the
// key's counters there now ends at, and how much less than the cost each
// took (short holds lane l's shortfall in bits 32l; see chargeWord).
func (r *Reservation) record(sub subset, wi int, nv, short uint64) {
	lanes := sub.lanes(wi)
	i := sub.pos(2 * wi)
	if lanes&1 != 0 {
		r.end[i] = uint32(nv)
		r.short[i] = uint32(short)
		i++
	}
	if lanes&2 != 0 {
		r.end[i] = uint32(nv >> 32)
		r.short[i] = uint32(short >> 32)
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

// chargeWord charges cost to the given lanes of the word at q (whose value
// was last seen as v) and returns the word it left and how much less than
// cost each lane was charged, lane l's in bits 32l: 0 when every lane took
// the whole cost. ok is false, and nothing charged, if the word is frozen.
func chargeWord(q *uint64, v uint64, lanes uint8, cost, ceil uint32, t at) (nv, short uint64, ok bool) {
	for {
		nv, short = v, 0
		if lanes&1 != 0 {
			c, s := chargeLane(uint32(v), cost, ceil, t)
			nv, short = nv&^0xffffffff|uint64(c), uint64(s)
		}
		if lanes&2 != 0 {
			c, s := chargeLane(uint32(v>>32), cost, ceil, t)
			nv, short = nv&0xffffffff|uint64(c)<<32, short|uint64(s)<<32
		}
		if nv == v || casWord(q, v, nv) {
			return nv, short, true
		}
		if v = loadWord(q); v == frozen {
			return 0, 0, false
		}
	}
}

// Outcomes of chargeFullest.
const (
	chargeLost    = iota // the counter no longer has room
	chargeGranted        // charged: the request is granted
	chargeFrozen         // the word is frozen: SetLimit replaced the lines
)

// chargeFullest charges cost to lane fl of the word at q (last seen as v) if
// that counter still has room, together with the key's other lane of the
// word, in one CAS. It returns the word it left, how far ahead the counter
// is then, and the shortfalls as chargeWord does (lane fl's is always 0).
func chargeFullest(q *uint64, v uint64, fl, lanes uint8, cost, capT, ceil uint32, t at) (nv uint64, after uint32, short uint64, res int) {
	for {
		a := aheadOf(lane(v, fl), t.now)
		if a+cost > capT {
			return v, a + cost, 0, chargeLost
		}
		after = a + cost
		nv = withLane(v, fl, store(t.now, after))
		short = 0
		if o := fl ^ 1; lanes>>o&1 != 0 {
			c, s := chargeLane(lane(v, o), cost, ceil, t)
			nv, short = withLane(nv, o, c), uint64(s)<<laneShift(o)
		}
		if casWord(q, v, nv) {
			return nv, after, short, chargeGranted
		}
		if v = loadWord(q); v == frozen {
			return v, 0, 0, chargeFrozen
		}
	}
}

// refundLane takes amount ticks back from counter value v at tick now, no
// more than the counter is ahead: a counter is never more than full.
func refundLane(v, amount, now uint32) uint32 {
	a := aheadOf(v, now)
	if a == 0 || amount == 0 {
		return v
	}
	return store(now, a-min(amount, a))
}

// outstanding is how many ticks of r's charge to its i-th counter are still
// owed at tick now of p's clock: what a refund gives back. It is the
// charge as if it had been made from a full counter at its own time: what
// it paid less the ticks since. A charge queued behind others (made when
// the counter was already ahead) is owed more while the ones under it stay;
// but a refund of one of those moves it down, and its Reservation cannot
// see that happen (the counter holds one time, and the same time and
// Reservation arise with and without such a refund: see
// TestARefundAfterAnEarlierOnesGivesBackNoLaterCharge). Whatever happened
// under it, a charge starts no earlier than its own time, so this much of
// it is still ahead of now, and giving it back never gives back another
// request's charge: the price is a grant too few for a queued charge
// refunded late, at most the ticks between its charge and its refund.
//
// A Reservation from the table SetLimit last replaced is converted as
// SetLimit converted the counters, less what of it the conversion's cap
// at the limit's debt may have dropped (reckoned from the end it recorded,
// which is never earlier than its end now); one from before that is owed
// nothing.
func (r *Reservation) outstanding(p *bucketParams, i int, now uint64) uint32 {
	paid := uint64(uint32(r.units) - r.short[i])
	switch p.gen - r.epoch {
	case 0:
		return uint32(paid - min(paid, now-r.tick)) // now ≥ r.tick: see refundWord
	case 1:
		f := &p.from
		left := paid - min(paid, f.oldTick-min(f.oldTick, r.tick)) // owed at the conversion, in old ticks
		if left == 0 {
			return 0
		}
		owed := left * p.per / f.per
		// The conversion caps the counter at the limit's debt: what lay
		// beyond was dropped, the top of the counter first, and the
		// charge reached no further than the end it recorded.
		a := uint64(aheadOf(r.end[i], uint32(f.oldTick)))
		if end := (a*p.per + f.per - 1) / f.per; end > p.ceil {
			owed -= min(owed, end-p.ceil)
		}
		return uint32(owed - min(owed, now-min(now, f.newTick)))
	}
	return 0
}

// refundWord is refundWords for word wi of the key's counters sub, in the
// word at q: what each counter still owes at ns (outstanding), never
// reckoned before the charge in the table it was made in.
func (p *bucketParams) refundWord(q *uint64, sub subset, wi int, r Reservation, ns int64) bool {
	tick := p.ticks(ns)
	if p.gen == r.epoch {
		tick = max(tick, r.tick) // a refund never comes before its charge
	}
	now := uint32(tick)
	var owed [2]uint32
	for l := range 2 {
		if sub.lanes(wi)>>l&1 != 0 {
			owed[l] = r.outstanding(p, sub.pos(2*wi+l), tick)
		}
	}
	if owed == [2]uint32{} {
		return true
	}
	for {
		v := loadWord(q)
		if v == frozen {
			return false
		}
		nv := withLane(withLane(v, 0, refundLane(lane(v, 0), owed[0], now)), 1, refundLane(lane(v, 1), owed[1], now))
		if nv == v || casWord(q, v, nv) {
			return true
		}
	}
}

// Charge charges weight tokens to the key with hash h at time now without
// checking that it has them: for a cost known only after the request was
// served (a response's size, say), or tokens reserved for a request that
// will wait for them. Every counter of the key pays, up to the limit's Debt
// beyond empty (by default a burst: twice the burst short of full), so a key
// charged past its tokens is denied until it has paid the debt back, and
// owes no more than Debt. A weight below 1 charges nothing.
//
// Allowed reports whether at least one counter took the whole charge, the
// only way the key's fullest counter holds it; false means the key is at
// the ceiling and part of the charge was dropped. RetryAfter is the time
// until the key is out of debt (its fullest counter back to empty, no other
// traffic assumed): when a request that reserved its tokens may go.
// RefundAt gives back what of the charge is still owed.
func (b *Buckets) Charge(h uint64, weight int64, now time.Time) (Decision, Reservation) {
	ns := b.nowNanos(now)
	p := b.params()
table:
	for {
		d := Decision{Limit: p.limit.EffectiveBurst()}
		if weight < 1 {
			return d, Reservation{}
		}
		tick := p.ticks(ns)
		t := at{now: uint32(tick)}
		cost := uint32(min(uint64(weight), p.ceil/p.per) * p.per) // ≤ ceil ≤ 2³⁰
		ln, sub, index := placeIn(p.lines, b.subs, h)
		r := Reservation{index: index, units: int64(cost), epoch: p.gen, tick: tick}
		best := uint32(math.MaxUint32)
		var paid uint8
		for m := sub.words; m != 0; m &= m - 1 {
			wi := bits.TrailingZeros8(m) & 7
			lanes := sub.lanes(wi)
			v := loadWord(&ln[wi])
			nv, short, ok := v, uint64(0), v != frozen
			if ok {
				nv, short, ok = chargeWord(&ln[wi], v, lanes, cost, uint32(p.ceil), t)
			}
			if !ok {
				p = b.giveBack(b.moved(p), &r, paid, ns)
				continue table
			}
			r.record(sub, wi, nv, short)
			paid |= 1 << wi
			for l := uint8(0); l < 2; l++ {
				if lanes>>l&1 != 0 {
					d.Allowed = d.Allowed || uint32(short>>laneShift(l)) == 0
					best = min(best, aheadOf(lane(nv, l), t.now))
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
