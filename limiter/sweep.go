package limiter

import "time"

// Sweep zeroes (marks full) every counter whose time has passed at now, so
// that no counter's 32-bit tick is ever old enough to wrap round and read
// as ahead again. It must run at least every SweepInterval of table time;
// the Caddy module runs it from one background goroutine per table.
//
// Sweep is never part of a decision. It reads every line but writes only
// the words that hold a past time, with a CAS, so a concurrent charge is
// never overwritten, and a page of lines no key has touched is never
// written (it stays unallocated). It costs a few nanoseconds a line.
func (b *Buckets) Sweep(now time.Time) {
	p := b.p.Load()
	tick := p.ticks(b.nowNanos(now))
	nowT := uint32(tick)
	for i := range p.lines {
		ln := &p.lines[i]
		for j := range ln {
			for {
				w := loadWord(&ln[j])
				if w == 0 {
					break
				}
				nw := w
				for l := uint8(0); l < 2; l++ {
					if v := lane(w, l); v != 0 && aheadOf(v, nowT) == 0 {
						nw = withLane(nw, l, 0)
					}
				}
				if nw == w || casWord(&ln[j], w, nw) {
					break
				}
			}
		}
	}
}

// sweepTicks is how often, in ticks, Sweep must run. A past value that a
// sweep left (it was still ahead then) is then never more than sweepTicks
// behind the clock, far from the 2³¹ ticks at which it would read as ahead.
const sweepTicks = 1 << 30

// SweepInterval is how often Sweep must run under the limit in force: 2³⁰
// ticks, at least a second (at MaxRate) and minutes to years for most
// limits.
func (b *Buckets) SweepInterval() time.Duration {
	p := b.p.Load()
	return time.Duration(p.nanos(sweepTicks))
}
