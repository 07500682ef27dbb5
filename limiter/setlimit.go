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
// limit, so SetLimit converts the counters as they stand at now into new
// lines (rounding against the key; lines no key touched stay unallocated)
// and then puts them in force. It is exact under concurrency: it swaps each
// old word for a frozen marker as it reads it, so a charge made to the old
// lines is either read (and converted) or fails, and the decision that
// made it waits for the new table, gives back there what it had charged,
// and decides again under the new limit. No request is granted beyond the
// burst and refill of the limits in force, and no charge is dropped. The
// price: decisions that meet a frozen word wait for the copy (about 10 ns a
// line), and the copy writes every word of the old table once, so its
// untouched pages are faulted in until it is collected.
//
// A Reservation taken before SetLimit refunds into the new table, converted
// (see RefundAt). Concurrent SetLimit calls are serialised; the last one
// leaves its limit in force.
func (b *Buckets) SetLimit(l Limit, now time.Time) error {
	if err := l.Validate(); err != nil {
		return err
	}
	if b.external {
		return ErrExternalLimit
	}
	b.setMu.Lock()
	defer b.setMu.Unlock()
	b.convertInto(l, now, newLines(len(b.params().lines)))
	return nil
}

// convertInto is SetLimit converting the table into lines, which are zero
// and as many as the table's; b.setMu is held. It returns the parameters
// it replaced: nothing reads their lines once those are garbage.
func (b *Buckets) convertInto(l Limit, now time.Time, lines []line) *bucketParams {
	old := b.params()
	np := &bucketParams{tableParams: tableParams{clock: clockFor(l), limit: l, lines: lines, gen: old.gen + 1}}
	ns := b.nowNanos(now)
	np.from = conversion{per: old.per, oldTick: old.ticks(ns), newTick: np.ticks(ns)}
	for i := range old.lines {
		for j := range old.lines[i] {
			v := swapWord(&old.lines[i][j], frozen)
			if v == 0 {
				continue
			}
			for c := uint8(0); c < 2; c++ {
				if nv := np.from.convert(lane(v, c), old.per, np.clock); nv != 0 {
					setCounterValue(&np.lines[i], uint8(2*j)+c, nv)
				}
			}
		}
	}
	b.setParams(np)
	return old
}

// convert is counter value v of the old table as a value of the new one,
// whose clock is c: a counter ahead keeps what it used, in tokens (rounded
// up); one that came back to full less than sweepMargin ago stays as long
// past, in the new ticks (rounded down), so that a late request still sees
// it as it stood (see Sweep); any other is full.
func (f *conversion) convert(v uint32, per uint64, c clock) uint32 {
	if v == 0 {
		return 0
	}
	oldT, newT := uint32(f.oldTick), uint32(f.newTick)
	if a := aheadOf(v, oldT); a != 0 {
		return store(newT, convertAhead(uint64(a), per, c))
	}
	past := uint64(oldT-v) * c.per / per
	if uint64(oldT-v) >= sweepMargin || past >= sweepMargin {
		return 0
	}
	return valid(newT - uint32(past))
}

// convertAhead converts a ticks ahead at per ticks a token to the ticks of
// clock c, rounding up (a key never gains by a conversion) and saturating
// at c's ceiling.
func convertAhead(a, per uint64, c clock) uint32 {
	// a < 2³², c.per ≤ 2²⁹: the product fits.
	return uint32(min((a*c.per+per-1)/per, c.ceil))
}

// setCounterValue stores value v in counter c of ln, a line no other
// goroutine uses yet.
func setCounterValue(ln *line, c uint8, v uint32) {
	w := &ln[c>>1]
	atomic.StoreUint64(w, withLane(atomic.LoadUint64(w), c, v))
}
