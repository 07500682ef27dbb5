package limiter

import (
	"sync/atomic"
	"time"
)

// SetLimit changes the rate and burst of every counter at once, keeping what
// each key has used, in tokens: a key that used 3 of "events 3" has 2 tokens
// under "events 5", and a key that used 4 of 5 has none under "events 3" (it
// refills from 4 short, at the new rate). Lowering a limit after raising it
// therefore gives back what the key had refilled meanwhile.
//
// A counter holds a time in the table's ticks, and the tick depends on the
// limit, so SetLimit copies the counters, converted, into new lines (about
// 10 ns a line; lines no key touched are skipped and stay unallocated) and
// then swaps them in. Charges made to the old lines during the copy are
// lost, and Reservations taken before it refund nothing. Concurrent
// SetLimit calls are serialised by the caller's config loading; two racing
// calls leave one of the two limits in force.
func (b *Buckets) SetLimit(l Limit, now time.Time) error {
	if err := l.Validate(); err != nil {
		return err
	}
	if b.external {
		return ErrExternalLimit
	}
	old := b.p.Load()
	np := &bucketParams{clock: clockFor(l), limit: l, lines: newLines(len(old.lines)), gen: old.gen + 1}
	ns := b.nowNanos(now)
	oldTick := old.ticks(ns)
	newTick := np.ticks(ns)
	var a [countersPerLine]uint32
	for i := range old.lines {
		aheads(&old.lines[i], uint32(oldTick), &a)
		for c := range a {
			if a[c] != 0 {
				setCounter(&np.lines[i], uint8(c), uint32(newTick), convertAhead(uint64(a[c]), old.per, np.clock))
			}
		}
	}
	b.p.Store(np)
	return nil
}

// convertAhead converts a ticks ahead at per ticks a token to the ticks of
// clock c, rounding up (a key never gains by a conversion) and saturating
// at c's ceiling.
func convertAhead(a, per uint64, c clock) uint32 {
	// a < 2³², c.per ≤ 2²⁹: the product fits.
	return uint32(min((a*c.per+per-1)/per, c.ceil))
}

// setCounter stores counter c of ln as ahead ticks ahead of now. It is for
// lines no other goroutine uses yet (a table being built or restored).
func setCounter(ln *line, c uint8, now, ahead uint32) {
	var v uint32
	if ahead != 0 {
		v = store(now, ahead)
	}
	w := &ln[c>>1]
	atomic.StoreUint64(w, withLane(atomic.LoadUint64(w), c, v))
}
