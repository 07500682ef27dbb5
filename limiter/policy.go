package limiter

import (
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
)

// Hash is the one hash floodgate computes per key: xxhash64 of its bytes.
// Every policy takes the hash rather than the key, so a request that is
// checked against several policies hashes each key once.
func Hash(key []byte) uint64 { return xxhash.Sum64(key) }

// HashString is Hash of a string's bytes, without copying them.
func HashString(key string) uint64 { return xxhash.Sum64String(key) }

// A Policy is one limit on keys: a token-bucket table (Buckets) or a rolling
// quota (Sketch). Implementations are safe for concurrent use.
type Policy interface {
	// TakeHash grants weight tokens to the key with hash h if it has them
	// at time now, and charges them. A denied request is charged nothing.
	TakeHash(h uint64, weight int64, now time.Time) (Decision, Reservation)
	// PeekHash answers whether TakeHash would grant the request, without
	// charging anything; Remaining and Reset are what the key holds now,
	// before any charge (a denied request's headers, an admin inspection).
	PeekHash(h uint64, weight int64, now time.Time) Decision
	// Refund returns what a Reservation from TakeHash charged (for a
	// token-bucket table, what of it is still owed now: see Buckets).
	Refund(Reservation)
}

// Touch loads the memory a decision of p for the key with hash h reads,
// deciding and changing nothing. A request checked against several
// policies touches them all before any decides, so that their cache misses
// overlap: a decision's compare-and-swaps wait for every load before them,
// so misses met one decision after another add up. A policy of another
// kind than Buckets, Windows and Sketch is not touched.
func Touch(p Policy, h uint64) {
	switch p := p.(type) {
	case *Buckets:
		touchLine(placeIn(p.params().lines, p.subs, h))
	case *Windows:
		touchLine(placeIn(p.params().lines, p.subs, h))
	case *Sketch:
		p.touch(h)
	}
}

// touchLine loads the first word of ln: the whole line comes into cache.
func touchLine(ln *line, _ subset, _ uint64) { atomic.LoadUint64(&ln[0]) }

// MaxInlinePolicies is how many charges a Txn holds without allocating.
const MaxInlinePolicies = 8

type heldCharge struct {
	p Policy
	r Reservation
}

// A Txn charges several policies as one: a request is granted only if every
// policy grants it, and a denied request leaves no charge anywhere.
//
// Charges are taken one by one and refunded if a later policy denies, so no
// policy ever grants more than its limit, even under concurrency. The price
// is that a concurrent request may, for the few nanoseconds between a charge
// and its refund, see tokens that are about to come back as taken.
//
// The zero Txn is ready to use. A Txn is not safe for concurrent use; it is
// meant to live on the stack of one request.
type Txn struct {
	denied bool
	n      int
	// now is the time of the latest Take: a denial rolls back as of then.
	now    time.Time
	inline [MaxInlinePolicies]heldCharge
	more   []heldCharge
}

// Take asks p for weight tokens of the key with hash h at time now: one
// reading of the clock for every policy of a request. After the first
// denial, Take no longer charges: it answers with PeekHash, so the caller
// still learns every policy's state (for headers and Retry-After).
func (t *Txn) Take(p Policy, h uint64, weight int64, now time.Time) Decision {
	if t.denied {
		return p.PeekHash(h, weight, now)
	}
	t.now = now
	if t.n >= MaxInlinePolicies {
		d, r := p.TakeHash(h, weight, now)
		if !d.Allowed {
			return t.deny(d)
		}
		t.more = append(t.more, heldCharge{p, r})
		t.n++
		return d
	}
	// The usual request has one token-bucket table per zone: decide it
	// without the interface call, its Reservation written straight into
	// the slot that holds it rather than copied out through TakeHash.
	slot := &t.inline[t.n]
	var d Decision
	if b, ok := p.(*Buckets); ok {
		d = b.decide(h, weight, now, &slot.r)
	} else {
		d, slot.r = p.TakeHash(h, weight, now)
	}
	if !d.Allowed {
		slot.r = Reservation{}
		return t.deny(d)
	}
	slot.p = p
	t.n++
	return d
}

// Check asks p whether it would grant weight tokens of the key with hash h
// at time now, charging nothing: a denial denies t as Take's does, and
// rolls back what t holds. It is the admission of a request whose cost is
// charged later, once known (a response's status or time), so that a key
// whose budget is spent is refused before the request is served.
func (t *Txn) Check(p Policy, h uint64, weight int64, now time.Time) Decision {
	d := p.PeekHash(h, weight, now)
	if !t.denied && !d.Allowed {
		t.now = now
		return t.deny(d)
	}
	return d
}

// deny records a denial by a policy that charged nothing and rolls back
// every charge held.
func (t *Txn) deny(d Decision) Decision {
	t.denied = true
	t.RollbackAt(t.now)
	return d
}

// Deny records a denial by something that is not a Policy (a zone's places
// in flight, Concurrency) as of now: it rolls back every charge held, and
// later Takes only peek, as after a policy's denial.
func (t *Txn) Deny(now time.Time) {
	t.denied = true
	t.RollbackAt(now)
}

// Denied reports whether any Take in t was denied.
func (t *Txn) Denied() bool { return t.denied }

// Rollback is RollbackAt(time.Now()).
func (t *Txn) Rollback() { t.RollbackAt(time.Now()) }

// RollbackAt refunds every charge t holds, as of time now: a token-bucket
// table gives back what of each charge is still owed then (all of it
// right after the Take, less what has refilled since; see Buckets). A Txn
// that was denied has already rolled back; RollbackAt is for callers that
// abandon a granted request, at once (a later, non-limiter check failed)
// or later (a held client went away).
func (t *Txn) RollbackAt(now time.Time) {
	for i := 0; i < t.n && i < MaxInlinePolicies; i++ {
		t.refund(t.inline[i], now)
		t.inline[i] = heldCharge{}
	}
	for i := range t.more {
		t.refund(t.more[i], now)
	}
	t.more = t.more[:0]
	t.n = 0
}

// refund gives c back as of now.
func (t *Txn) refund(c heldCharge, now time.Time) {
	switch p := c.p.(type) {
	case *Buckets:
		p.RefundAt(c.r, now)
	case *Windows:
		p.RefundAt(c.r, now)
	default:
		c.p.Refund(c.r)
	}
}
