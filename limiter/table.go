package limiter

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// A Table is a zone's per-key rate in the Bloom table: token buckets
// (Buckets) or windows (Windows). Both place keys alike and answer alike.
type Table interface {
	Policy
	Allow(key []byte, weight int64, now time.Time) Decision
	Charge(h uint64, weight int64, now time.Time) (Decision, Reservation)
	Fill(h uint64)
	Limit() Limit
	SetLimit(l Limit, now time.Time) error
	Sweep(now time.Time)
	SweepInterval() time.Duration
	Stats(now time.Time) BucketStats
	Bytes() int
	Lines() int
	K() int
}

var (
	_ Table = (*Windows)(nil)
	_ Table = (*Buckets)(nil)
)

// table is what Buckets and Windows share, whatever their counters hold:
// the clock's zero, a key's counters (k of a line, any of subs), the
// parameters in force and the lock that serialises SetLimit; and what is
// done with them word by word without reading a counter's meaning:
// filling a key's counters, giving back a Reservation's charge, waiting
// out a SetLimit. P is the table's parameters (bucketParams,
// windowParams); each table keeps what its counters mean: its decide,
// Charge, SetLimit, Sweep and Stats, and how one word takes a refund
// (refundWord). A decision reads the parameters and the lines through the
// concrete P, never through PP's methods, which are for the paths off a
// grant (refunds, Fill, a SetLimit met).
type table[P any, PP paramsOf[P]] struct {
	base  time.Time // zero of the table's clock: ticks count from here
	k     int       // how many counters a key draws on
	subs  []subset  // every subset of a line's counters a key may draw on
	p     atomic.Pointer[P]
	setMu sync.Mutex // serialises SetLimit
}

// paramsOf is what the table scaffolding needs of a table's parameters P.
type paramsOf[P any] interface {
	*P
	// common returns the parameters every table has.
	common() *tableParams
	// refundWord gives back, in the word at q, what r charged to the
	// key's counters of word wi of sub, as much of it as the table owes
	// back at ns: false, and nothing given back, if the word is frozen.
	// r is a copy: a pointer passed through a type parameter's method
	// escapes, and would cost a decision that holds its Reservation on
	// the stack an allocation.
	refundWord(q *uint64, sub subset, wi int, r Reservation, ns int64) bool
}

// tableParams is what every table's parameters hold. Parameters are
// immutable; SetLimit swaps in new ones, with new lines.
type tableParams struct {
	clock
	limit Limit
	lines []line
	gen   int64 // how many SetLimits made this; a Reservation remembers it
}

func (p *tableParams) common() *tableParams { return p }

// Limit returns the limit in force.
func (t *table[P, PP]) Limit() Limit { return PP(t.p.Load()).common().limit }

// K returns the number of counters each key draws on.
func (t *table[P, PP]) K() int { return t.k }

// Bytes returns the memory held by the table's lines.
func (t *table[P, PP]) Bytes() int { return len(PP(t.p.Load()).common().lines) * 64 }

// Lines returns the number of lines in the table.
func (t *table[P, PP]) Lines() int { return len(PP(t.p.Load()).common().lines) }

// nowNanos is now on the table's clock, never negative.
func (t *table[P, PP]) nowNanos(now time.Time) int64 { return max(int64(now.Sub(t.base)), 0) }

// params and setParams load and replace the parameters in force, through
// hook.go's choke point.
func (t *table[P, PP]) params() *P { return loadParams(&t.p) }

func (t *table[P, PP]) setParams(p *P) { storeParams(&t.p, p) }

// Fill returns the counters of the key with hash h to unused: a Buckets
// key's are full, a Windows key's count nothing. Keys that share those
// counters gain too.
func (t *table[P, PP]) Fill(h uint64) {
	for p := t.params(); ; {
		if ln, sub, _ := placeIn(PP(p).common().lines, t.subs, h); clearKey(ln, sub) {
			return
		}
		p = t.moved(p)
	}
}

// Refund is RefundAt(r, time.Now()): for a caller that holds a Reservation
// in real time. (A time before the charge's counts as the charge's: a
// refund never comes before its charge.)
func (t *table[P, PP]) Refund(r Reservation) { t.RefundAt(r, time.Now()) }

// RefundAt gives back what of r's charge the key's counters still hold at
// now, each table by its own rule: a Buckets counter what its charge still
// owes, a Windows counter what it counted in a group it still holds (see
// each type's documentation). A time before the charge's counts as the
// charge's; a Reservation taken before two SetLimits, or the zero
// Reservation, gives back nothing.
func (t *table[P, PP]) RefundAt(r Reservation, now time.Time) {
	if r.units <= 0 {
		return
	}
	p := t.params()
	if ln, sub := counterIn(PP(p).common().lines, t.subs, r.index); ln != nil {
		t.refundWords(p, &r, sub.words, t.nowNanos(now))
	}
}

// giveBack refunds what r charged to the words in mask and clears r: the
// rollback of a decision that did not grant. It returns the parameters in
// force afterwards.
func (t *table[P, PP]) giveBack(p *P, r *Reservation, mask uint8, ns int64) *P {
	p = t.refundWords(p, r, mask, ns)
	*r = Reservation{}
	return p
}

// refundWords gives back what r charged to its key's counters in the words
// of mask (as refundWord reckons it at ns), in the table of p or, if
// SetLimit replaces it meanwhile, in the new one. A Reservation from before
// the latest two SetLimits is owed nothing. It returns the parameters in
// force when it is done.
func (t *table[P, PP]) refundWords(p *P, r *Reservation, mask uint8, ns int64) *P {
	ln, sub := counterIn(PP(p).common().lines, t.subs, r.index)
	if ln == nil {
		return p
	}
	for m := mask; m != 0; {
		c := PP(p).common()
		if d := c.gen - r.epoch; d < 0 || d > 1 {
			return p
		}
		wi := bits.TrailingZeros8(m) & 7
		if !PP(p).refundWord(&c.lines[r.index>>16][wi], sub, wi, *r, ns) {
			p = t.moved(p)
			continue
		}
		m &= m - 1
	}
	return p
}

// sweep is a table's Sweep over the lines of p: it replaces every word v
// that is not zero with swept(v), with a CAS, where that differs, so a
// concurrent charge is never overwritten and a line no key touched is
// never written. It stops at a table SetLimit is replacing (the
// conversion drops what it would have cleared), and thaws a stray frozen
// word (see moved) and sweeps it with the rest.
func (t *table[P, PP]) sweep(p *P, swept func(v uint64) uint64) {
	lines := PP(p).common().lines
	for i := range lines {
		ln := &lines[i]
		for j := range ln {
			for {
				v := loadWord(&ln[j])
				if v == 0 {
					break
				}
				if v == frozen {
					if q, ok := t.thawStray(p); !ok || q != p {
						return // SetLimit replaces the table
					}
					continue // a stray marker, thawed: sweep the word
				}
				if nv := swept(v); nv == v || casWord(&ln[j], v, nv) {
					break
				}
			}
		}
	}
}

// moved is what an operation does on meeting a frozen word in the lines
// of p: it waits while a SetLimit runs, and returns the parameters in
// force once none does. A SetLimit holds setMu from before it freezes the
// first word until the new lines are in force, so a frozen word found
// while p is still in force and setMu is free was written by no
// conversion, but by the other side of a shared table (NewBucketsOver)
// storing 0xFFFFFFFF in both counters of a word, as the XDP program did
// before it had valid. moved thaws such words (see thawStray) and returns
// p, and the operation goes on there: a new table would never come. (A
// Windows table shares no memory: for it, moved only waits.) SetLimit
// only converts, never waits on anything, so the wait is bounded by its
// copy of the table (about 10 ns a line).
func (t *table[P, PP]) moved(p *P) *P {
	for {
		if q := loadParams(&t.p); q != p {
			return q
		}
		if q, ok := t.thawStray(p); ok {
			return q
		}
		wait(func() bool { return t.p.Load() != p || t.setIdle() })
	}
}

// thawStray takes setMu if it is free and then, if p is still in force,
// stores in every frozen word of p's lines what valid makes of its two
// counters (1 each: two ticks later, against the key), the value a charge
// would have stored. It returns the parameters in force and false, having
// done nothing, if a SetLimit holds setMu. It scans the table (once: it
// leaves no frozen word), and none of it goes through loadWord or casWord:
// a test's pause there would hold setMu while the test runs a SetLimit,
// which would block on it for good.
func (t *table[P, PP]) thawStray(p *P) (*P, bool) {
	if !t.setMu.TryLock() {
		return p, false
	}
	defer t.setMu.Unlock()
	q := t.p.Load()
	if q == p {
		lines := PP(p).common().lines
		for i := range lines {
			for j := range lines[i] {
				if v := &lines[i][j]; atomic.LoadUint64(v) == frozen {
					atomic.CompareAndSwapUint64(v, frozen, thawed)
				}
			}
		}
	}
	return q, true
}

// setIdle reports whether no SetLimit holds setMu.
func (t *table[P, PP]) setIdle() bool {
	if !t.setMu.TryLock() {
		return false
	}
	t.setMu.Unlock()
	return true
}
