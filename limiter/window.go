package limiter

import (
	"fmt"
	"math"
	"math/bits"
	"time"
)

// Windows is a Bloom table of sliding windows: caddy-ratelimit's "at most
// Events in any span of Window", in the fixed memory of 64-byte lines
// addressed as a Buckets table's are (the hash picks a line and K of its
// counters), but with eight 64-bit counters to a line where Buckets has
// sixteen of 32 bits.
//
// A counter splits time into sub-windows of Window/s, aligned to the
// table's clock, and holds the weight it counted in each of the last s+1
// (its groups), with the tick of its latest charge. A grant at tick G is
// counted by every request until tick G + Window (inclusive: the grant
// may have come at the end of its tick), so the newest group counts until
// its latest charge is a Window old, and an older group until its
// sub-window's end is. A request of weight w is granted if the emptiest
// of the key's K counters counts at most Events − w, and every one of the
// K counts it then; a denied request counts nothing, and is told to retry
// when the first of its counters will have room.
//
// # The bound, and the price of fixed memory
//
// A key never gets more than Events (in weight) in any span of Window:
// every grant is checked against a counter that counts every earlier grant
// of the key that falls in the Window before it, and counts it at least as
// long as the Window after it. That holds for racing requests (the
// Buckets protocol below), weights, refunds, held requests and SetLimit, on
// every path where a request's cost is known when it is granted; a cost
// charged after the fact (Charge) counts from the moment it is charged. A
// request held until it would pass is taken then, like any other: what a
// window counts is when requests went. (The Caddy module's action delay
// reserves its place at arrival with a Charge, which every later request
// counts, and refunds it just before the take.) Racing requests whose
// times were read out of order are checked, when a counter's latest charge
// is later than their time, against everything the counter holds, and
// counted as made at that latest charge: a request late by less than a
// sub-window still meets every grant of its own window (see look).
//
// The price is time: a grant counts until its sub-window's end is a Window
// old, so a request an exact sliding log would grant may wait up to a
// sub-window longer (ExtraWait, Window/s), and never more, for a key whose
// requests come in time order. s depends on Events (how many groups of a
// count fit in 64 bits; see windowLayout): 16 for Events 1, 13 for 2 or 3,
// 9 for 5, 7 for 10, 4 for 100, 3 for 128 to 511, 2 for 512 to 8191, 1
// beyond. Retry-After is exact for the table (the request is granted
// then, not a nanosecond before), and at most Window and a tick (the
// newest grant's tick: Window/2¹⁷ or finer).
//
// A key alone on its counters is exactly this; a key whose counters also
// count other keys' requests is denied sooner (a Bloom false positive,
// sized as for Buckets with eight counters to a line: see EstimateFalseDeny).
//
// # Layout
//
// A counter is T<<(g·cb) | c_{g−1} … c_1 c_0: T the tick of its latest
// charge modulo 2^sb, c_i the weight counted in the sub-window i before
// T's, g = s+1 fields of cb bits, the top bit always 0 (so no counter is
// all ones, the frozen marker SetLimit swaps in). 0 is an unused counter,
// and a counter whose counts all return to 0 stores 0. Ticks compare as
// serial numbers: a T up to half the field ahead of a request's time was
// written by a later request (whose time was read after this one's), and
// the request is checked against all of its groups and counted in its
// newest, as if it came at T. Sweep clears counters whose newest charge is
// long past before T could wrap round, and must run every SweepInterval.
//
// The live counts of a counter are capped at 2·Events: a charge that
// would go beyond drops the oldest counts instead, which changes no
// decision (a sum of 2·Events denies as any larger one does) and keeps
// every new charge whole.
//
// Windows is safe for concurrent use, takes no lock and allocates nothing
// per decision. Decisions follow the Buckets protocol: every counter of the
// key but the emptiest is charged first, the emptiest last with the CAS
// that grants, so every grant is checked against a counter that holds
// every earlier grant. SetLimit is exact beside decisions, as Buckets' is
// (see SetLimit).
//
// A refund (RefundAt) takes back what its charge counted, from the groups
// it was counted in, while the counters still hold them: a refund after
// its group stopped counting changes nothing. A Reservation taken before
// the latest SetLimit is converted with the counters (taking back from
// the group its charge went to, or an older one); one taken before two
// SetLimits takes back nothing.
type Windows struct {
	table[windowParams, *windowParams] // subs: every k-subset of a line's words
}

// windowParams is everything a decision reads besides the lines' words. It is
// immutable; SetLimit swaps in a new one, with new lines. Its clock counts
// wt ticks a window, and its limit has Burst 0.
type windowParams struct {
	tableParams
	events uint64 // the most any span of a window grants
	ceil   uint64 // 2·events: the most a counter's counts add up to
	g      uint8  // groups: s+1
	cb     uint8  // bits of a group's count
	tshift uint8  // g·cb: where T starts
	stb    uint8  // a sub-window is 1<<stb ticks
	cmask  uint64 // 1<<cb − 1
	ones   uint64 // a 1 at the bottom of every group: Σ 1<<(i·cb), i < g
	top    uint8  // (g−1)·cb: the oldest group's shift, where sum adds up
	s      uint64 // sub-windows in a window
	smask  uint64 // T's values: 1<<sb − 1
	half   uint64 // 1<<(sb−1): a T this far ahead or more is past
	wt     uint64 // the window in ticks: s<<stb
	margin uint64 // how long after its window Sweep keeps a counter
	// from is the parameters (without lines) of the table SetLimit
	// converted into this one, for the Reservations taken from it; tick
	// is when it converted, in this table's ticks (from.tick in the old).
	from *windowParams
	tick uint64
}

// Bounds of the window layout (see windowLayout).
const (
	// windowCounters is how many counters a window line holds.
	windowCounters = 8
	// maxSubWindows bounds s: a decision adds up to s+1 counts.
	maxSubWindows = 16
	// minWindowBits is the coarsest division of a window the layout
	// takes to gain a sub-window: 2¹⁷ ticks.
	minWindowBits = 17
	// maxWindowBits is the finest: 2²⁴ ticks.
	maxWindowBits = 24
	// sweepFloor is the shortest SweepInterval a layout allows where its
	// window is shorter: T gets the bits to wait that long.
	sweepFloor = 100 * time.Millisecond
)

// ValidateWindow reports whether a Windows table can enforce l, naming the
// field at fault: Events from 1 to MaxBurst, a positive Window and no Burst.
func (l Limit) ValidateWindow() error {
	switch {
	case l.Events < 1:
		return fmt.Errorf("events must be at least 1, got %d", l.Events)
	case l.Events > MaxBurst:
		return fmt.Errorf("events %d in a window exceeds the maximum of %d (set burst for a token bucket)", l.Events, MaxBurst)
	case l.Window <= 0:
		return fmt.Errorf("window must be positive, got %v", l.Window)
	case l.Window < time.Microsecond:
		return fmt.Errorf("window %v is shorter than the minimum of 1µs", l.Window)
	case l.Burst != 0:
		return fmt.Errorf("a window has no burst, got %d", l.Burst)
	}
	return nil
}

// windowLayout divides a counter's 63 bits for l (valid): g groups of cb
// bits (cb holds 2·Events), and T's sb bits, of which stb+bits.Len(s) count
// a window and the rest (at least 3, and enough for a SweepInterval of
// sweepFloor) the windows T may be old before it wraps. It takes the most
// groups (up to maxSubWindows+1) that leave a window at least 2^minWindowBits
// ticks (or two groups, whatever is left), then refines the tick up to
// 2^maxWindowBits a window, and never below a nanosecond.
func windowLayout(l Limit) (g, cb, stb, sb uint8) {
	cb = uint8(bits.Len64(2 * uint64(l.Events)))
	hb := uint8(3)
	if l.Window < sweepFloor {
		hb += uint8(bits.Len64(uint64((sweepFloor - 1) / l.Window)))
	}
	avail := func(n uint8) int { return min(63-int(n)*int(cb), 32) }
	g = 2
	for n := uint8(maxSubWindows + 1); n > 2; n-- {
		if avail(n)-int(hb) >= minWindowBits {
			g = n
			break
		}
	}
	s := uint64(g - 1)
	ls := bits.Len64(s)
	stb = uint8(max(0, min(maxWindowBits, avail(g)-int(hb))-ls))
	for stb > 0 && s<<stb >= uint64(l.Window) {
		stb-- // a tick of at least a nanosecond
	}
	return g, cb, stb, uint8(avail(g))
}

// windowParamsFor returns the parameters of l (valid) with n zeroed lines.
func windowParamsFor(l Limit, n int) *windowParams {
	g, cb, stb, sb := windowLayout(l)
	s := uint64(g - 1)
	wt := s << stb
	mult, _ := bits.Div64(wt, 0, uint64(l.Window))
	half := uint64(1) << (sb - 1)
	return &windowParams{
		tableParams: tableParams{
			clock: clock{pe: wt, w: uint64(l.Window), mult: mult, nsPerTick: float64(l.Window) / float64(wt)},
			limit: l,
			lines: newLines(n),
		},
		events: uint64(l.Events),
		ceil:   2 * uint64(l.Events),
		g:      g,
		cb:     cb,
		tshift: g * cb,
		stb:    stb,
		cmask:  1<<cb - 1,
		ones:   (1<<(uint(g)*uint(cb)) - 1) / (1<<cb - 1),
		top:    (g - 1) * cb,
		s:      s,
		smask:  1<<sb - 1,
		half:   half,
		wt:     wt,
		margin: (half - wt) / 4,
	}
}

// NewWindows returns a table of unused counters sized by cfg (as Buckets
// is, with eight counters to a line: see WindowLinesFor); cfg.Limit must
// have no Burst. Its ticks count from the moment it is created; a time
// before that counts as its creation.
func NewWindows(cfg BucketsConfig) (*Windows, error) {
	return newWindows(cfg, time.Now())
}

func newWindows(cfg BucketsConfig, base time.Time) (*Windows, error) {
	if err := cfg.Limit.ValidateWindow(); err != nil {
		return nil, err
	}
	k, n, err := cfg.shapeOf(windowCounters)
	if err != nil {
		return nil, err
	}
	w := &Windows{table: table[windowParams, *windowParams]{base: base, k: k, subs: wordSubsets(k)}}
	w.p.Store(windowParamsFor(cfg.Limit, n))
	return w, nil
}

// wordSubsets lists every subset of k of a line's eight words: a window
// key's counters, each a whole word (both lanes of it, for clearKey).
func wordSubsets(k int) []subset {
	var out []subset
	for m := uint16(0); m < 1<<windowCounters; m++ {
		if bits.OnesCount16(m) != k {
			continue
		}
		var s subset
		for wi := range windowCounters {
			if m>>wi&1 != 0 {
				s.counters |= 3 << (2 * wi)
				s.words |= 1 << wi
			}
		}
		out = append(out, s)
	}
	return out
}

// SubWindows is s, the sub-windows a window is divided into under the
// limit in force.
func (w *Windows) SubWindows() int { return int(w.p.Load().s) }

// ExtraWait is the most a request may wait beyond what an exact sliding
// log would make it wait, under the limit in force: a sub-window,
// Window/SubWindows, rounded up to a nanosecond.
func (w *Windows) ExtraWait() time.Duration {
	p := w.p.Load()
	return time.Duration(p.nanos(1 << p.stb))
}

// count is group i of counter value v.
func (p *windowParams) count(v uint64, i int) uint64 { return v >> (uint(i) * uint(p.cb)) & p.cmask }

// live returns how many of v's groups count at tick t (groups 0 to n−1),
// and, if v's latest charge is ahead of t, by how many ticks (the request
// is then checked as if it came at T: every group counts).
func (p *windowParams) live(v, t uint64) (n int, ahead uint64) {
	if v == 0 {
		return 0, 0
	}
	T := v >> p.tshift
	d := (t - T) & p.smask
	switch {
	case d >= p.half:
		return int(p.g), (T - t) & p.smask
	case d > p.wt:
		return 0, 0
	}
	// k sub-windows since T's: group i ≥ 1 counts while k + i ≤ s, the
	// newest while d ≤ wt (so k ≤ s).
	k := (t>>p.stb - T>>p.stb) & (p.smask >> p.stb)
	return int(p.s + 1 - k), 0
}

// sum is what groups 0 to n−1 of v count, added in one multiplication
// (the loop over the groups, sumGroups in the tests, is the reference):
// field j of v's groups times ones is the sum of groups 0 to j, which is
// at most what all of v's groups count, which is at most ceil < 1<<cb
// (look and convert keep it so), so no field carries into the next and
// the oldest field, at top, holds the whole sum.
func (p *windowParams) sum(v uint64, n int) uint64 {
	f := v & (1<<(uint(n)*uint(p.cb)) - 1)
	return f * p.ones >> p.top & p.cmask
}

// expires is how many ticks after t group i of v stops counting (v's
// latest charge is ahead of t by ahead ticks, or d ticks past): the newest
// a window and a tick after T, an older one a window after its
// sub-window ends.
func (p *windowParams) expires(v uint64, i int, d, ahead uint64) uint64 {
	T := v >> p.tshift
	e := p.wt + 1
	if i > 0 {
		e = (p.s+1-uint64(i))<<p.stb - T&(1<<p.stb-1)
	}
	return e + ahead - d
}

// waits reads counter v at tick t for a request of cost (at most events):
// what it counts, the ticks until it has room for cost, and until it
// counts nothing.
func (p *windowParams) waits(v, t, cost uint64) (used, room, clear uint64) {
	n, d, ahead := p.at(v, t)
	if used = p.sum(v, n); used == 0 {
		return 0, 0, 0
	}
	clear = p.clearing(v, n, d, ahead)
	if used+cost <= p.events {
		return used, 0, clear
	}
	rem := used
	for i := n - 1; i >= 0; i-- {
		rem -= p.count(v, i)
		if rem+cost <= p.events {
			return used, p.expires(v, i, d, ahead), clear
		}
	}
	return used, clear, clear
}

// at is live(v, t) with how many ticks past v's latest charge t is (0 if
// it is ahead): what expires needs.
func (p *windowParams) at(v, t uint64) (n int, d, ahead uint64) {
	n, ahead = p.live(v, t)
	if n != 0 && ahead == 0 {
		d = (t - v>>p.tshift) & p.smask
	}
	return n, d, ahead
}

// clearing is when v, whose groups 0 to n−1 count something at a tick d
// past (or ahead before) its latest charge, counts nothing: when the
// newest group that counts anything expires.
func (p *windowParams) clearing(v uint64, n int, d, ahead uint64) uint64 {
	for i := range n {
		if p.count(v, i) != 0 {
			return p.expires(v, i, d, ahead)
		}
	}
	return 0
}

// look reads counter value v at tick t for a request of cost: what it
// counts then (used), and what charging cost there would leave (nv; its
// latest charge's tick, nv>>tshift, is where a refund finds the group). A
// grant needs both of every counter it charges, and one pass finds both.
//
// The charge moves the groups to t's sub-window (those that no longer fit
// in the counter drop out), puts cost into the newest, whose latest charge
// becomes t (or stays T, if T is later), and drops the oldest counts
// beyond ceil. Moving the groups k sub-windows drops the oldest k, those
// whose sub-window has left the window at t (if T is ahead, none moves),
// so the groups kept add up to what v counts at t (all), unless t is more
// than a window past T, when v counts 0 and its newest groups are kept
// all the same (see below). all also says whether the charge drops
// anything.
//
// Groups that no longer count at t are kept while they fit: a request
// whose time was read before this one's (and which finds T ahead of it)
// is checked against every group, so it still counts the grants of its
// own window if it is less than a sub-window late.
func (p *windowParams) look(v, t, cost uint64) (used, nv uint64) {
	T, f, all := t&p.smask, uint64(0), uint64(0) // an unused counter: no groups
	if v != 0 {
		T, f = v>>p.tshift, v&(1<<p.tshift-1)
		d := (t - T) & p.smask
		if d < p.half { // T is t or earlier: move the groups to t's sub-window
			if k := (t>>p.stb - T>>p.stb) & (p.smask >> p.stb); k >= uint64(p.g) {
				f = 0
			} else {
				f = f << (k * uint64(p.cb)) & (1<<p.tshift - 1)
			}
			T = t & p.smask
		}
		if all = p.sum(f, int(p.g)); d <= p.wt || d >= p.half {
			used = all
		}
	}
	if all+cost <= p.ceil { // nothing to drop: one add
		return used, T<<p.tshift | (f + cost)
	}
	return used, p.dropOldest(T, f, cost)
}

// dropOldest is the counter of latest charge T and groups f with cost (at
// least 1) added to the newest group, keeping the newest counts up to
// ceil in all (0 if nothing is left), group by group: look's charge when
// it takes the counts beyond ceil.
func (p *windowParams) dropOldest(T, f, cost uint64) uint64 {
	left := p.ceil
	var out uint64
	for i := range int(p.g) {
		c := f >> (uint(i) * uint(p.cb)) & p.cmask
		if i == 0 {
			c += cost
		}
		c = min(c, left)
		left -= c
		out |= c << (uint(i) * uint(p.cb))
	}
	if out == 0 {
		return 0
	}
	return T<<p.tshift | out
}

// refund takes back up to add from the group of v whose latest charge was
// at tick T (if v still holds it), leaving 0 if nothing is left.
func (p *windowParams) refund(v, T, add uint64) uint64 {
	if v == 0 || add == 0 {
		return v
	}
	pos := ((v>>p.tshift)>>p.stb - T>>p.stb) & (p.smask >> p.stb)
	if pos >= uint64(p.g) {
		return v
	}
	sh := pos * uint64(p.cb)
	v -= min(v>>sh&p.cmask, add) << sh
	if v&(1<<p.tshift-1) == 0 {
		return 0
	}
	return v
}

// Allow is TakeHash(Hash(key), weight, now) without the Reservation.
func (w *Windows) Allow(key []byte, weight int64, now time.Time) Decision {
	d, _ := w.TakeHash(Hash(key), weight, now)
	return d
}

// TakeHash grants weight tokens to the key with hash h if the emptiest of
// its counters has room for them at time now, and counts them in every one
// of its counters. A weight below 1 counts as 1. A weight above Events is
// denied with RetryAfter Never. Reset is the time until the key counts
// nothing.
func (w *Windows) TakeHash(h uint64, weight int64, now time.Time) (d Decision, r Reservation) {
	d = w.decide(h, weight, now, &r)
	return d, r
}

// PeekHash answers whether TakeHash would grant the request, charging
// nothing; Remaining and Reset are what the key holds now.
func (w *Windows) PeekHash(h uint64, weight int64, now time.Time) Decision {
	return w.decide(h, weight, now, nil)
}

// decide is TakeHash when r is not nil and PeekHash when it is, as
// Buckets.decide, and like it a decision that meets a frozen word
// (SetLimit replaced the lines it loaded) waits for the new table, takes
// back there what it had counted, and decides again under the new limit.
func (w *Windows) decide(h uint64, weight int64, now time.Time, r *Reservation) Decision {
	ns := w.nowNanos(now)
	p := w.params()
	var vals, nvs [8]uint64 // the key's counters, by word, and what charging them leaves
table:
	for {
		tick := p.ticks(ns)
		ln, sub, index := placeIn(p.lines, w.subs, h)
		d := Decision{Limit: int64(p.events)}
		cost := uint64(1)
		commit := r != nil
		if weight > d.Limit {
			d.RetryAfter = Never
			commit = false
		} else if weight > 1 {
			cost = uint64(weight)
		}
		for {
			// The emptiest counter decides (the first of equals). A grant
			// needs only what each counts and what charging it leaves
			// (look); a denial or a peek also reads when each has room
			// and counts nothing (answer).
			best, fw := uint64(math.MaxUint64), 0
			for m := sub.words; m != 0; m &= m - 1 {
				wi := bits.TrailingZeros8(m) & 7
				v := loadWord(&ln[wi])
				if v == frozen {
					p = w.moved(p)
					continue table
				}
				used, nv := p.look(v, tick, cost)
				vals[wi], nvs[wi] = v, nv
				if used < best {
					best, fw = used, wi
				}
			}
			if !commit || best+cost > p.events {
				return p.answer(d, &vals, sub.words, ns, tick, cost)
			}
			// Only the header: chargeWord records every counter the key
			// charges, and nothing reads the others.
			r.index, r.units, r.epoch, r.tick = index, int64(cost), p.gen, tick
			var paid uint8 // the words charged so far
			for m := sub.words &^ (1 << fw); m != 0; m &= m - 1 {
				wi := bits.TrailingZeros8(m) & 7
				if _, ok := p.chargeWord(&ln[wi], vals[wi], nvs[wi], keyPos(sub, wi), cost, tick, r); !ok {
					p = w.giveBack(w.moved(p), r, paid, ns)
					continue table
				}
				paid |= 1 << wi
			}
			// The emptiest last, if it still has room, in the CAS that
			// grants.
			nv, res := p.chargeWithin(&ln[fw], vals[fw], best, nvs[fw], keyPos(sub, fw), cost, tick, r, p.events)
			switch res {
			case chargeGranted:
				// The charge is in the newest group, which counts until a
				// window and a tick after the counter's latest charge
				// (tick, or a racing request's later one): Reset, within a
				// tick and without a division, as Buckets'. At tick the
				// counter counts all its groups. (A new Decision, not d
				// with its fields set: d lives in memory across the calls
				// above, and reading it back whole after its byte-wide
				// Allowed was stored stalls the return.)
				return Decision{
					Allowed:   true,
					Limit:     int64(p.events),
					Remaining: int64(p.events - min(p.sum(nv, int(p.g)), p.events)),
					Reset:     p.about(p.wt + 1 + (nv>>p.tshift-tick)&p.smask),
				}
			case chargeFrozen:
				p = w.giveBack(w.moved(p), r, paid, ns)
				continue table
			}
			// The emptiest counter no longer has room: take back the
			// others' charges and decide again.
			if q := w.giveBack(p, r, paid, ns); q != p {
				p = q
				continue table
			}
		}
	}
}

// answer is the Decision d of a request of cost at tick tick (ns) that
// charges nothing, its key's counters being vals at the words in mask: a
// denial, or a peek. The first counter to have room is when the key does;
// the first to count nothing, its Reset.
func (p *windowParams) answer(d Decision, vals *[8]uint64, mask uint8, ns int64, tick, cost uint64) Decision {
	best := uint64(math.MaxUint64)
	retry, reset := uint64(math.MaxUint64), uint64(math.MaxUint64)
	for m := mask; m != 0; m &= m - 1 {
		used, room, clear := p.waits(vals[bits.TrailingZeros8(m)&7], tick, cost)
		best, retry, reset = min(best, used), min(retry, room), min(reset, clear)
	}
	d.Allowed = d.RetryAfter != Never && retry == 0
	d.Remaining = int64(p.events - min(best, p.events))
	d.Reset = p.until(ns, tick, reset)
	if !d.Allowed && d.RetryAfter != Never {
		d.RetryAfter = p.until(ns, tick, retry)
	}
	return d
}

// keyPos is where a Reservation records counter word wi of sub.
func keyPos(sub subset, wi int) int { return bits.OnesCount8(sub.words & (1<<wi - 1)) }

// chargeWord counts cost in the counter word at q (last seen as v, which
// the charge leaves as nv: see look) for a request at tick t, recording
// the charge as the key's i-th counter in r, and returns the counter it
// left; false, and nothing counted, if the word is frozen.
func (p *windowParams) chargeWord(q *uint64, v, nv uint64, i int, cost, t uint64, r *Reservation) (uint64, bool) {
	for {
		r.short[i], r.end[i] = uint32(cost), uint32(nv>>p.tshift)
		if nv == v || casWord(q, v, nv) {
			return nv, true
		}
		if v = loadWord(q); v == frozen {
			return 0, false
		}
		_, nv = p.look(v, t, cost)
	}
}

// chargeWithin is chargeWord if the counter, which counts used at t,
// still has room for cost within limit counts, in one CAS. It returns the
// counter it left, and an outcome of Buckets' chargeFullest.
func (p *windowParams) chargeWithin(q *uint64, v, used, nv uint64, i int, cost, t uint64, r *Reservation, limit uint64) (uint64, int) {
	for {
		if used+cost > limit {
			return v, chargeLost
		}
		r.short[i], r.end[i] = uint32(cost), uint32(nv>>p.tshift)
		if casWord(q, v, nv) {
			return nv, chargeGranted
		}
		if v = loadWord(q); v == frozen {
			return 0, chargeFrozen
		}
		used, nv = p.look(v, t, cost)
	}
}

// refundWord is refundWords for word wi of the key's counters sub, in the
// word at q: it takes back what r counted there from the group it was
// counted in (see owed), reckoned at ns, or at the charge if that is later.
func (p *windowParams) refundWord(q *uint64, sub subset, wi int, r Reservation, ns int64) bool {
	T, add := p.owed(&r, keyPos(sub, wi), max(p.ticks(ns), r.tick))
	if add == 0 {
		return true
	}
	for {
		v := loadWord(q)
		if v == frozen {
			return false
		}
		nv := p.refund(v, T, add)
		if nv == v || casWord(q, v, nv) {
			return true
		}
	}
}

// owed is what a refund at tick now takes back of r's charge to its i-th
// counter, in p's layout: the group (by its latest charge's tick) and the
// weight. Nothing once the charge is so old that T could have wrapped
// round to its group again. A Reservation from the table SetLimit last
// replaced is converted as SetLimit converted the counters; one from
// before that is owed nothing.
func (p *windowParams) owed(r *Reservation, i int, now uint64) (T, add uint64) {
	T, add = uint64(r.end[i]), uint64(r.short[i])
	switch p.gen - r.epoch {
	case 0:
		if now-r.tick >= p.half/2 {
			return 0, 0
		}
	case 1:
		f := p.from
		if f.tick-r.tick >= f.half/2 || now-p.tick >= p.half/2 {
			return 0, 0
		}
		T = p.convertTick(r.tick+(T-r.tick)&f.smask) & p.smask
		add = min(add, p.ceil)
	default:
		return 0, 0
	}
	return T, add
}

// Charge counts weight tokens for the key with hash h at time now without
// checking that it has room: a cost known only after the request was
// served. Each counter counts at most 2·Events (the oldest counts go
// first), so however large the charge, the key counts nothing a window
// after it. A weight below 1 charges nothing.
//
// Allowed reports whether the charge was counted whole (false if it
// exceeds 2·Events). RetryAfter is the time until a request of weight 1
// would pass. RefundAt takes back what was charged.
func (w *Windows) Charge(h uint64, weight int64, now time.Time) (Decision, Reservation) {
	ns := w.nowNanos(now)
	p := w.params()
table:
	for {
		d := Decision{Limit: int64(p.events)}
		if weight < 1 {
			return d, Reservation{}
		}
		tick := p.ticks(ns)
		cost := min(uint64(weight), p.ceil)
		ln, sub, index := placeIn(p.lines, w.subs, h)
		r := Reservation{index: index, units: int64(cost), epoch: p.gen, tick: tick}
		best, retry, reset := uint64(math.MaxUint64), uint64(math.MaxUint64), uint64(math.MaxUint64)
		var paid uint8
		for m := sub.words; m != 0; m &= m - 1 {
			wi := bits.TrailingZeros8(m) & 7
			v := loadWord(&ln[wi])
			nv, ok := v, v != frozen
			if ok {
				_, cv := p.look(v, tick, cost)
				nv, ok = p.chargeWord(&ln[wi], v, cv, keyPos(sub, wi), cost, tick, &r)
			}
			if !ok {
				p = w.giveBack(w.moved(p), &r, paid, ns)
				continue table
			}
			paid |= 1 << wi
			used, room, clear := p.waits(nv, tick, 1)
			best, retry, reset = min(best, used), min(retry, room), min(reset, clear)
		}
		d.Allowed = uint64(weight) <= p.ceil
		d.Remaining = int64(p.events - min(best, p.events))
		d.Reset = p.until(ns, tick, reset)
		d.RetryAfter = p.until(ns, tick, retry)
		return d, r
	}
}

// Reserve counts weight tokens for the key with hash h at time now, as
// Charge does, if each of the key's counters has room for them within its
// ceiling (2·Events), and else counts nothing: Allowed reports which. It is
// the reservation of a request held for its place (action delay): one that
// made a counter drop its oldest counts, as Charge may, would erase grants
// the window still holds, and a reservation given back when its client
// leaves would then have let the key past its limit. Each counter is
// checked and charged in one CAS, as a grant is; RefundAt takes it back.
func (w *Windows) Reserve(h uint64, weight int64, now time.Time) (Decision, Reservation) {
	ns := w.nowNanos(now)
	p := w.params()
table:
	for {
		d := Decision{Limit: int64(p.events)}
		if weight < 1 || uint64(weight) > p.ceil {
			return d, Reservation{}
		}
		tick := p.ticks(ns)
		cost := uint64(weight)
		ln, sub, index := placeIn(p.lines, w.subs, h)
		r := Reservation{index: index, units: int64(cost), epoch: p.gen, tick: tick}
		var paid uint8
		for m := sub.words; m != 0; m &= m - 1 {
			wi := bits.TrailingZeros8(m) & 7
			v := loadWord(&ln[wi])
			res := chargeFrozen
			if v != frozen {
				used, nv := p.look(v, tick, cost)
				_, res = p.chargeWithin(&ln[wi], v, used, nv, keyPos(sub, wi), cost, tick, &r, p.ceil)
			}
			switch res {
			case chargeFrozen:
				p = w.giveBack(w.moved(p), &r, paid, ns)
				continue table
			case chargeLost:
				if q := w.giveBack(p, &r, paid, ns); q != p {
					p = q
					continue table
				}
				return d, Reservation{}
			}
			paid |= 1 << wi
		}
		d.Allowed = true
		return d, r
	}
}

// SetLimit changes Events and Window of every counter at once, keeping
// each grant's time: a grant counts until it is the new Window old, so a
// key that used 3 of "events 3" has 2 left under "events 5" and a key that
// used 100 of "events 100" is denied under "events 10" exactly until its
// grants fall out of the Window, as an exact sliding log would (a lowered
// limit carries no debt). Each group moves to the new sub-window that
// holds its latest possible grant, so a grant is never counted shorter;
// counts beyond the new 2·Events drop the oldest, which changes no
// decision.
//
// As for Buckets, the counters are converted into new lines, and it is
// exact under concurrency the same way: each old word is swapped for the
// frozen marker as it is read (no counter is all ones: its top bit is
// 0), so a charge made to the old lines is either read and converted or
// fails, and the decision that made it waits for the new table, takes back
// there what it had counted, and decides again under the new limit. A
// Reservation taken before SetLimit refunds into the new table, converted
// (see RefundAt). Concurrent SetLimit calls are serialised; the last one
// leaves its limit in force.
func (w *Windows) SetLimit(l Limit, now time.Time) error {
	if err := l.ValidateWindow(); err != nil {
		return err
	}
	w.setMu.Lock()
	defer w.setMu.Unlock()
	old := w.params()
	np := windowParamsFor(l, len(old.lines))
	np.gen = old.gen + 1
	ns := w.nowNanos(now)
	prev := *old
	prev.lines, prev.from = nil, nil // the old parameters, not its memory
	prev.tick = old.ticks(ns)
	np.from, np.tick = &prev, np.ticks(ns)
	for i := range old.lines {
		for j := range old.lines[i] {
			if v := swapWord(&old.lines[i][j], frozen); v != 0 {
				np.lines[i][j] = np.convert(v)
			}
		}
	}
	w.setParams(np)
	return nil
}

// convertTick is the tick of p that holds the last nanosecond of tick T
// of the table p was converted from (both full, not modulo): where a grant
// made in T is, rounded later.
func (p *windowParams) convertTick(T uint64) uint64 {
	end := p.from.nanos(T + 1)
	if end == math.MaxInt64 {
		return p.tick + p.half/2
	}
	return p.ticks(end - 1)
}

// convert is counter value v of the table p was converted from, as a
// counter of p (see SetLimit): 0 if Sweep would have cleared it.
func (p *windowParams) convert(v uint64) uint64 {
	f := p.from
	d := (f.tick - v>>f.tshift) & f.smask
	Tf := f.tick - d // the latest charge, in full ticks of f
	if d >= f.half {
		Tf = f.tick + (v>>f.tshift-f.tick)&f.smask
	} else if d > f.wt+f.margin {
		return 0
	}
	T := p.convertTick(Tf)
	if T < p.tick && p.tick-T > p.wt+p.margin {
		return 0
	}
	var groups [maxSubWindows + 1]uint64
	for i := range int(f.g) {
		c := f.count(v, i)
		if c == 0 {
			continue
		}
		last := Tf // the group's latest possible grant
		if i > 0 {
			last = (Tf>>f.stb-uint64(i)+1)<<f.stb - 1
		}
		pos := (T>>p.stb - p.convertTick(last)>>p.stb) & (p.smask >> p.stb)
		if pos < uint64(p.g) {
			groups[pos] += c
		}
	}
	var out uint64
	left := p.ceil
	for i := range int(p.g) {
		c := min(groups[i], left)
		left -= c
		out |= c << (uint(i) * uint(p.cb))
	}
	if out == 0 {
		return 0
	}
	return T&p.smask<<p.tshift | out
}

// Sweep clears every counter whose latest charge is more than a window
// and p.margin ticks old, so that no T is ever old enough to read as
// ahead again. It must run at least every SweepInterval; like
// Buckets.Sweep it writes only words that change, with a CAS, and never a
// line no key touched, and stops at a table SetLimit is replacing.
//
// A counter that stopped counting more recently is left as it is: a
// request whose time was read before the sweep's (a stall; a sweep run at
// a later clock) still sees it as it stood at its own time, as long as
// it is less than the margin late.
func (w *Windows) Sweep(now time.Time) {
	p := w.params()
	t := p.ticks(w.nowNanos(now))
	w.sweep(p, func(v uint64) uint64 {
		if d := (t - v>>p.tshift) & p.smask; d < p.wt+p.margin || d >= p.half {
			return v
		}
		return 0
	})
}

// SweepInterval is how often Sweep must run under the limit in force: half
// of what is left of half the T field after a window, twice the margin. A
// T that Sweep leaves is less than a window and the margin old, so at the
// next sweep it is less than half the field old, and still reads as past.
// It is at least one and a half windows, and at least 100 ms.
func (w *Windows) SweepInterval() time.Duration {
	p := w.p.Load()
	return time.Duration(p.nanos((p.half - p.wt) / 2))
}

// Stats measures the table at now as Buckets.Stats does: a counter is busy
// if it counts anything, empty if it has no room left for a request.
func (w *Windows) Stats(now time.Time) BucketStats {
	p := w.p.Load()
	t := p.ticks(w.nowNanos(now))
	n := len(p.lines)
	step := 1
	if n > maxStatLines {
		step = n / maxStatLines
	}
	base := choose(windowCounters, w.k)
	var empty, busy, sampled int
	var fd float64
	for i := 0; i < n; i += step {
		lineEmpty := 0
		for j := range p.lines[i] {
			v := loadWord(&p.lines[i][j])
			if v == frozen {
				continue
			}
			used, _, _ := p.waits(v, t, 1)
			if used > 0 {
				busy++
			}
			if used >= p.events {
				lineEmpty++
			}
		}
		empty += lineEmpty
		fd += choose(lineEmpty, w.k) / base
		sampled++
	}
	return statsOf(n, w.k, windowCounters, sampled, empty, busy, fd)
}
