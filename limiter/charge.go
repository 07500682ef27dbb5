package limiter

import (
	"math"
	"sync/atomic"
	"time"
)

// Charge charges weight tokens to the key with hash h whether or not it
// holds them: a cost learnt too late to refuse (the size of a response), or
// tokens reserved for a request that will wait for them. The key may go into
// debt, up to one burst below empty; later requests are denied until the
// debt is repaid by refill. A weight below 1 counts as 1.
//
// Every counter of the key is charged, each up to that ceiling. Allowed
// reports whether the charge was recorded in full on at least one counter,
// the only way the key's fullest counter holds it; when it is false the
// key is at the ceiling and part of the charge was dropped. RetryAfter is
// the time until the key is out of debt (its fullest counter back to empty,
// no other traffic assumed): when a request that reserved its tokens with
// Charge may go. Refund gives back exactly what was charged.
func (b *Buckets) Charge(h uint64, weight int64, now time.Time) (Decision, Reservation) {
	p := b.p.Load()
	t := p.t
	capUnits := uint64(p.capUnits)
	// More than two bursts cannot fit under the ceiling anyway; clamping
	// first keeps the multiplication below from overflowing.
	cost := uint64(min(max(weight, 1), 2*p.limit.burst())) * UnitsPerToken
	nowNs := b.nowNanos(now)
	nowTick := t.ticksAt(nowNs)
	ln, counters, at := b.place(t, h)
	for {
		w0 := atomic.LoadUint64(&ln[0])
		tick, _, _ := unpackClock(w0)
		// As in decide: charge needs the refill owed since the line's
		// tick to be less than a bucket's capacity.
		var owed uint64
		if elapsed := int32(uint32(nowTick) - tick); elapsed > 0 {
			owed = uint64(elapsed) * uint64(p.refill)
			if owed >= capUnits {
				t.refill(ln, w0, nowTick, uint64(elapsed), p)
				continue
			}
		}
		r := Reservation{index: at, units: int64(cost)}
		d := Decision{Limit: p.limit.burst()}
		best := uint64(math.MaxUint64)
		for i, c := range counters {
			added := charge(ln, c, cost, capUnits, owed)
			r.short[i] = uint32(cost - added)
			d.Allowed = d.Allowed || added == cost
			_, _, def := counterState(ln, c)
			best = min(best, subSat(def, owed))
		}
		d.Remaining = int64(capUnits-min(best, capUnits)) / UnitsPerToken
		d.RetryAfter = p.untilBelow(best, capUnits, nowNs, nowTick)
		d.Reset = p.untilBelow(best, 0, nowNs, nowTick)
		return d, r
	}
}
