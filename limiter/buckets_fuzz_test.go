package limiter

import (
	"math/big"
	"testing"
	"time"
)

// fuzzLimits are the limits a differential run moves between: slow and
// fast rates, bursts from 1 to MaxBurst, every one with its burst written.
var fuzzLimits = []Limit{
	{Events: 5, Window: 10 * time.Second, Burst: 5},
	{Events: 100, Window: time.Minute, Burst: 20},
	{Events: 1000, Window: time.Second, Burst: 1000},
	{Events: 1, Window: time.Hour, Burst: 3},
	{Events: 7, Window: 13 * time.Second, Burst: 7},
	{Events: MaxRate, Window: time.Second, Burst: 1000},
	{Events: 1, Window: 24 * time.Hour, Burst: 1},
	{Events: 10_000, Window: time.Second, Burst: MaxBurst},
	{Events: 1, Window: time.Hour, Burst: 3, Debt: 40},
	{Events: 5, Window: 10 * time.Second, Burst: 5, Debt: 1},
	{Events: 100, Window: time.Minute, Burst: 20, Debt: 500},
	{Events: 1000, Window: time.Second, Burst: 1000, Debt: MaxBurst},
	{Events: 1, Window: 24 * time.Hour, Burst: 1, Debt: 3600},
}

// An event is what the exact reference replays: a charge the table made
// (a grant, or a cost charged after the fact), with the tokens it took at
// its time, or a change of limit.
type event struct {
	ns       int64
	applied  *big.Rat // tokens the charge took; nil for a change of limit
	limit    Limit    // the limit from ns on, for a change of limit
	refunded bool
}

// exactBucket is a token bucket by definition, in exact rationals: it
// replays every event from the start, so a refunded charge is as if it had
// never been made, and a change of limit keeps what the key has used (the
// contract of SetLimit) in the new rate and burst, at most a burst of debt.
// A charge replays what it took at its own time, not its weight: what went
// past the ceiling of a burst of debt was dropped then (Buckets.Charge) and
// stays dropped when an earlier charge is refunded; so does the debt a
// change of limit drops beyond a burst, from the charges that made it last
// (setLimit). A late refund gives back at most what this bucket does, so
// it bounds the table from above.
type exactBucket struct {
	first  Limit
	events []event
}

// at returns the tokens the key holds at ns (negative in debt).
func (x *exactBucket) at(ns int64) *big.Rat {
	l := x.first
	tokens := big.NewRat(l.EffectiveBurst(), 1)
	last := int64(0)
	refill := func(to int64) {
		rate := big.NewRat(l.Events, int64(l.Window))
		tokens.Add(tokens, rate.Mul(rate, big.NewRat(to-last, 1)))
		if b := big.NewRat(l.EffectiveBurst(), 1); tokens.Cmp(b) > 0 {
			tokens.Set(b)
		}
		last = to
	}
	for _, e := range x.events {
		if e.ns > ns {
			break
		}
		refill(e.ns)
		switch {
		case e.applied == nil:
			used := new(big.Rat).Sub(big.NewRat(l.EffectiveBurst(), 1), tokens)
			l = e.limit
			tokens.Sub(big.NewRat(l.EffectiveBurst(), 1), used)
		case !e.refunded:
			tokens.Sub(tokens, e.applied)
		}
		if floor := big.NewRat(-l.debt(), 1); tokens.Cmp(floor) < 0 {
			tokens.Set(floor)
		}
	}
	refill(ns)
	return tokens
}

// setLimit changes the limit at ns. The debt beyond a burst of the new
// limit is dropped, and it is the latest charges' tokens that are dropped,
// as the table caps each counter's time ahead and with it the ends of the
// charges on top (Reservation.outstanding).
func (x *exactBucket) setLimit(ns int64, nl Limit) {
	have := x.at(ns)
	drop := have.Sub(big.NewRat(-nl.EffectiveBurst()-nl.debt()+x.limitAt(ns).EffectiveBurst(), 1), have) // tokens below a burst of debt
	for i := len(x.events) - 1; i >= 0 && drop.Sign() > 0; i-- {
		e := &x.events[i]
		if e.applied == nil || e.refunded {
			continue
		}
		if e.applied.Sign() < 0 {
			break // a fill: nothing before it is owed
		}
		d := new(big.Rat).Set(drop)
		if d.Cmp(e.applied) > 0 {
			d.Set(e.applied)
		}
		e.applied = new(big.Rat).Sub(e.applied, d)
		drop.Sub(drop, d)
	}
	x.events = append(x.events, event{ns: ns, limit: nl})
}

// limitAt is the limit in force at ns.
func (x *exactBucket) limitAt(ns int64) Limit {
	l := x.first
	for _, e := range x.events {
		if e.applied == nil && e.ns <= ns {
			l = e.limit
		}
	}
	return l
}

// owedBucket is the least a key may hold under the refund rule of
// Buckets.RefundAt: a token bucket run forward, where a refund gives back
// what of its charge a charge made from full at its own time would still
// owe, paid less the refill since, less what a change of limit's cap at a
// burst of debt dropped (reckoned from the end the charge's Reservation
// recorded, as the table does), and nothing across two changes of limit.
// Charges take their whole weight, down to a burst of debt, so the table
// holds at least this much.
type owedBucket struct {
	l       Limit
	tokens  *big.Rat
	last    int64
	changes []event // the changes of limit so far
}

func newOwedBucket(l Limit) *owedBucket {
	return &owedBucket{l: l, tokens: big.NewRat(l.EffectiveBurst(), 1)}
}

// at brings the bucket to ns and returns what it holds.
func (y *owedBucket) at(ns int64) *big.Rat {
	r := big.NewRat(y.l.Events, int64(y.l.Window))
	y.tokens.Add(y.tokens, r.Mul(r, big.NewRat(ns-y.last, 1)))
	if b := big.NewRat(y.l.EffectiveBurst(), 1); y.tokens.Cmp(b) > 0 {
		y.tokens.Set(b)
	}
	y.last = ns
	return new(big.Rat).Set(y.tokens)
}

// charge takes w tokens at ns, down to a burst of debt, and returns what
// it took.
func (y *owedBucket) charge(ns, w int64) *big.Rat {
	have := y.at(ns)
	room := have.Add(have, big.NewRat(y.l.debt(), 1))
	a := big.NewRat(w, 1)
	if a.Cmp(room) > 0 {
		a.Set(room)
	}
	y.tokens.Sub(y.tokens, a)
	return a
}

func (y *owedBucket) setLimit(ns int64, l Limit) {
	used := new(big.Rat).Sub(big.NewRat(y.l.EffectiveBurst(), 1), y.at(ns))
	y.l = l
	y.tokens.Sub(big.NewRat(l.EffectiveBurst(), 1), used)
	if floor := big.NewRat(-l.debt(), 1); y.tokens.Cmp(floor) < 0 {
		y.tokens.Set(floor)
	}
	y.changes = append(y.changes, event{ns: ns, limit: l})
}

// refund gives back at ns what of a charge of paid tokens, made at from
// under limit l with changes changes of limit before it and recorded as
// ending end tokens ahead of from, is still owed: paid less the refill
// since from; at a change of limit, less what of the recorded end lay
// beyond the new burst of debt; nothing across two changes.
func (y *owedBucket) refund(ns int64, paid, end *big.Rat, from int64, l Limit, changes int) {
	y.at(ns)
	if len(y.changes)-changes > 1 {
		return
	}
	owed, pos := new(big.Rat).Set(paid), new(big.Rat).Set(end)
	refill := func(to int64) {
		r := big.NewRat(l.Events, int64(l.Window))
		r.Mul(r, big.NewRat(to-from, 1))
		owed.Sub(owed, r)
		pos.Sub(pos, r)
		from = to
	}
	for _, c := range y.changes[changes:] {
		refill(c.ns)
		l = c.limit
		if ceil := big.NewRat(l.EffectiveBurst()+l.debt(), 1); pos.Cmp(ceil) > 0 {
			owed.Sub(owed, new(big.Rat).Sub(pos, ceil))
			pos.Set(ceil)
		}
	}
	refill(ns)
	if owed.Sign() <= 0 {
		return
	}
	y.tokens.Add(y.tokens, owed)
	if b := big.NewRat(y.l.EffectiveBurst(), 1); y.tokens.Cmp(b) > 0 {
		y.tokens.Set(b)
	}
}

// FuzzBucketsAgainstExactReference drives one key of a table with a
// sequence of operations decoded from the input: time moving by slivers of
// a token up to days (with the sweeps the table requires), takes and peeks
// of any weight, costs charged after the fact, refunds at any later time,
// sweeps and changes of limit. Every grant must be one the exact reference
// makes (never more than burst + refill, a refunded charge as if never
// made), and every denial of a weight the burst can hold one the least a
// late refund gives back makes too (no token lost), each within the
// table's rounding of a few ticks a token.
func FuzzBucketsAgainstExactReference(f *testing.F) {
	f.Add(uint8(0), []byte{1, 1, 1, 1, 1, 1, 0, 40, 1, 1})
	f.Add(uint8(1), []byte{1, 3, 1, 3, 3, 0, 0, 200, 1, 0, 5, 2, 1, 1})
	f.Add(uint8(2), []byte{6, 200, 1, 0, 0, 255, 1, 1, 4, 0, 1, 9})
	f.Add(uint8(3), []byte{1, 0, 1, 0, 1, 0, 1, 0, 0, 250, 1, 0, 5, 0, 1, 0, 0, 7, 5, 3, 1, 0})
	f.Add(uint8(5), []byte{1, 2, 1, 2, 3, 0, 0, 3, 1, 2, 4, 1, 7, 5})
	f.Add(uint8(7), []byte{6, 9, 1, 4, 0, 60, 5, 6, 1, 1, 0, 255, 5, 7, 1, 3})
	f.Add(uint8(6), []byte{1, 0, 0, 251, 1, 0, 0, 254, 4, 0, 1, 0})
	// Burst 3 at one an hour: X and Y, X refunded, 7/8 of a token later Z,
	// Y refunded, an eighth later a take of 3 (the exact bucket holds
	// 2.125; the old refund rule gave back Z's charge as Y's, and granted
	// it: TestARefundAfterAnEarlierOnesGivesBackNoLaterCharge).
	f.Add(uint8(3), []byte{1, 0, 1, 0, 3, 0, 0, 7, 1, 0, 3, 0, 0, 1, 1, 2})
	f.Fuzz(func(t *testing.T, start uint8, ops []byte) {
		if len(ops) > 600 {
			return
		}
		l := fuzzLimits[int(start)%len(fuzzLimits)]
		b := newTable(t, l, 1<<16)
		x := &exactBucket{first: l}
		y := newOwedBucket(l)
		const h = 77
		var ns, swept int64
		// held are the charges that may still be refunded, oldest first,
		// as a held request or a response cost holds its Reservation.
		type charge struct {
			r       Reservation
			event   int      // in x.events
			end     *big.Rat // how far ahead of full its Reservation ends, in tokens
			limit   Limit    // in force when it was made
			changes int      // of limit before it
		}
		var held []charge
		// record charges w tokens at ns to both references.
		record := func(r Reservation, w int64) {
			a := y.charge(ns, w)
			x.events = append(x.events, event{ns: ns, applied: a})
			end := big.NewRat(int64(aheadOf(r.end[0], uint32(r.tick))), int64(b.p.Load().per))
			held = append(held, charge{r: r, event: len(x.events) - 1, end: end, limit: l, changes: len(y.changes)})
			if len(held) > 4 {
				held = held[1:]
			}
		}
		arg := func(i int) byte {
			if i+1 < len(ops) {
				return ops[i+1]
			}
			return 0
		}
		// tol is the table's rounding, in tokens: a few ticks of every
		// limit the key has been under (a tick is 1/512 of a token, or a
		// nanosecond at the fastest rates; see tickOf).
		tol := new(big.Rat)
		addTol := func(l Limit) {
			tick := big.NewRat(int64(tickOf(l))*l.Events, int64(l.Window))
			tol.Add(tol, tick.Mul(tick, big.NewRat(3, 1)))
		}
		addTol(l)
		for i := 0; i < len(ops); i += 2 {
			a := arg(i)
			switch ops[i] % 8 {
			case 0: // time passes
				token := int64(l.Window) / l.Events
				d := token * int64(a%64) / 8
				if a >= 240 {
					d = int64(a-239) * int64(l.Window)
				}
				for ns+d > swept+int64(b.SweepInterval())/2 {
					swept += int64(b.SweepInterval()) / 2
					b.Sweep(tm(time.Duration(swept)))
				}
				ns += d
			case 1, 2: // take or peek
				w := 1 + int64(a%4)
				if a >= 252 {
					w = l.EffectiveBurst() + int64(a-253)
				}
				now := tm(time.Duration(ns))
				have, least := x.at(ns), y.at(ns)
				var d Decision
				if ops[i]%8 == 2 {
					d = b.PeekHash(h, w, now)
				} else {
					var r Reservation
					d, r = b.TakeHash(h, w, now)
					if d.Allowed {
						record(r, w)
					}
				}
				if d.Allowed && have.Cmp(new(big.Rat).Sub(big.NewRat(w, 1), tol)) < 0 {
					t.Fatalf("op %d: %s granted weight %d at %v; the exact bucket holds %s", i/2, l, w, time.Duration(ns), have.FloatString(4))
				}
				if !d.Allowed && w <= l.EffectiveBurst() && least.Cmp(new(big.Rat).Add(big.NewRat(w, 1), tol)) >= 0 {
					t.Fatalf("op %d: %s denied weight %d at %v; the key holds at least %s (a token lost)", i/2, l, w, time.Duration(ns), least.FloatString(4))
				}
			case 3: // a held take or charge is refunded
				if len(held) == 0 {
					break
				}
				k := int(a) % len(held)
				c := held[k]
				b.RefundAt(c.r, tm(time.Duration(ns)))
				x.events[c.event].refunded = true
				y.refund(ns, x.events[c.event].applied, c.end, x.events[c.event].ns, c.limit, c.changes)
				held = append(held[:k], held[k+1:]...)
			case 4: // a sweep
				b.Sweep(tm(time.Duration(ns)))
				swept = ns
			case 5: // a reload changes the limit
				nl := fuzzLimits[int(a)%len(fuzzLimits)]
				if err := b.SetLimit(nl, tm(time.Duration(ns))); err != nil {
					t.Fatal(err)
				}
				x.setLimit(ns, nl)
				y.setLimit(ns, nl)
				l = nl
				addTol(l)
				swept = ns
			case 6: // a cost charged after the response
				w := 1 + int64(a)*int64(a)
				_, r := b.Charge(h, w, tm(time.Duration(ns)))
				record(r, min(w, l.EffectiveBurst()+l.debt()))
			case 7: // a fill (the admin API's reset) makes the key full
				b.Fill(h)
				have := x.at(ns)
				if full := big.NewRat(l.EffectiveBurst(), 1); have.Cmp(full) < 0 {
					x.events = append(x.events, event{ns: ns, applied: big.NewRat(-floorRat(new(big.Rat).Sub(full, have))-1, 1)})
				}
				y.at(ns)
				y.tokens.SetInt64(l.EffectiveBurst())
				held = nil
			}
		}
	})
}
