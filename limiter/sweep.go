package limiter

import "time"

// Sweep zeroes (marks full) every counter that came back to full at least
// sweepMargin ticks before now, so that no counter's 32-bit tick is ever
// old enough to wrap round and read as ahead again. It must run at least
// every SweepInterval of table time; the Caddy module runs it from one
// background goroutine per table, and again at once after SetLimit.
//
// A counter that came back to full more recently is left as it is: a
// request whose time was read before the sweep's (a stall; a sweep run at
// a later clock) still sees it as it stood at its own time, drained if it
// was, as long as it is less than sweepMargin late. Zeroing only what
// every such request would read as full anyway makes a sweep invisible
// to decisions.
//
// Sweep is never part of a decision. It reads every line but writes only
// the words that hold such a past time, with a CAS, so a concurrent charge
// is never overwritten, and a page of lines no key has touched is never
// written (it stays unallocated). It costs a few nanoseconds a line. A
// sweep that meets a table SetLimit is replacing stops: the conversion
// drops what it would have zeroed. A frozen word no SetLimit wrote (see
// table.moved) is thawed and swept with the rest.
func (b *Buckets) Sweep(now time.Time) {
	p := b.params()
	nowT := uint32(p.ticks(b.nowNanos(now)))
	b.sweep(p, func(v uint64) uint64 {
		for l := uint8(0); l < 2; l++ {
			if c := lane(v, l); c != 0 && aheadOf(c, nowT) == 0 && nowT-c >= sweepMargin {
				v = withLane(v, l, 0)
			}
		}
		return v
	})
}

// sweepTicks is how often, in ticks, Sweep must run, and sweepMargin how
// long a past value is kept. A past value that a sweep left (it was less
// than sweepMargin past, or still ahead) is then never more than
// sweepMargin + sweepTicks = 1.5·2³⁰ ticks behind the clock, far from the
// 2³¹ ticks at which it would read as ahead.
const (
	sweepTicks  = 1 << 30
	sweepMargin = 1 << 29
)

// SweepInterval is how often Sweep must run under the limit in force: 2³⁰
// ticks, at least a second (at MaxRate) and minutes to years for most
// limits.
func (b *Buckets) SweepInterval() time.Duration {
	p := b.p.Load()
	return time.Duration(p.nanos(sweepTicks))
}
