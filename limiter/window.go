package limiter

import (
	"fmt"
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// Windows is a Bloom table of fixed windows: caddy-ratelimit's "at most
// Events in a Window", in the fixed memory of a Buckets table, laid out and
// addressed the same way (the same 64-byte lines of 16 counters of 32 bits,
// the same hash picking a line and K counters).
//
// A counter holds one window: the tick it started at and the tokens it
// counted. A key's window starts at its first request once its previous
// window is over, and lasts Window: a request of weight w is granted if the
// emptiest of the key's K counters has counted at most Events − w in its
// window (a counter whose window is over has counted nothing), and then every
// one of the K counts it, starting a new window where the old one is over. A
// denied request counts nothing, and is told to retry when the first of its
// counters' windows ends: Retry-After counts down to the end of the window,
// as caddy-ratelimit's does. A lone key is exactly one window; another key
// is denied only when all K of its counters share windows with keys that
// used them up (a Bloom false positive, sized as for Buckets).
//
// # Against an exact sliding log
//
// caddy-ratelimit keeps every key's last Events timestamps (a sliding log):
// at most Events in any interval of length Window. A window anchored at a
// key's first request allows the same Events from that request on, and the
// same Retry-After, but a new window starts when the old one ends, so a key
// that sends one request, waits almost a Window and sends Events − 1, then
// Events more as the window ends, gets 2·Events − 1 within one Window (a
// burst on each side of a window's end). That is the worst case, and
// TestWindowsWorstCaseAgainstSlidingLog measures it on traces checked
// against an exact sliding log; a key that sends its requests at once, as
// a flood does, gets exactly what the sliding log grants. That is a key
// alone on its counters; a key whose counters also count other keys'
// requests is denied sooner, except that counters whose windows started
// at different times end at different times, and the key may then be
// granted by each in turn: at most 2·Events per counter within a Window,
// in the rare case (a Bloom false positive) that all K are shared.
//
// # Layout
//
// A counter is start<<countBits | count, where count holds up to two
// Events (Charge's debt, below) and start the rest of the 32 bits, in ticks
// of Window/2^16 at most (coarser only for the largest Events). 0 is an
// unused counter, and a count that returns to 0 stores 0. The count is at
// most 2·Events, even, so it never fills its field (all ones), and no
// counter is 0xFFFFFFFF: a word of two of them is SetLimit's frozen marker. A window starts
// at the start of its first request's tick, so it ends up to a tick
// (Window/65,536) before a Window has passed since that request: that is
// what makes Retry-After of a request denied at once Window exactly, as
// caddy-ratelimit's. Starts compare as serial numbers, so a request whose
// time was read before a stall sees a window started after it as running. A start must
// be cleared before it is half the start field old: Sweep clears windows
// that ended more than a margin ago and must run every SweepInterval, as
// for Buckets.
//
// Windows is safe for concurrent use, takes no lock and allocates nothing
// per decision; decisions follow the Buckets protocol (every counter of the
// key but the emptiest is charged first, the emptiest last with the CAS
// that grants), so every grant is checked against a counter that holds
// every earlier grant of its window. A refund takes back exactly what its
// charge added, and only from the window it was added to if that window
// has not ended by the refund's time. SetLimit is exact beside decisions,
// as Buckets' is (see SetLimit).
type Windows struct {
	base  time.Time
	k     int
	subs  []subset
	p     atomic.Pointer[windowParams]
	setMu sync.Mutex // serialises SetLimit
}

// params, setParams and moved are Buckets' (hook.go), for Windows.
func (w *Windows) params() *windowParams { return loadParams(&w.p) }

func (w *Windows) setParams(p *windowParams) { storeParams(&w.p, p) }

func (w *Windows) moved(p *windowParams) *windowParams { return movedFrom(&w.p, p) }

// windowParams is everything a decision reads besides the lines' words. It is
// immutable; SetLimit swaps in a new one, with new lines.
type windowParams struct {
	clock         // ticks of wt per window
	limit  Limit  // Burst 0
	lines  []line //
	gen    int64  // how many SetLimits made this; a Reservation remembers it
	events uint32 // the most a window grants
	ceil   uint32 // 2·events: the most a counter counts (Charge's debt)
	cb     uint8  // bits of the count
	cmask  uint32 // 1<<cb − 1
	smask  uint32 // the start field's values: 1<<(32−cb) − 1
	half   uint32 // 1<<(31−cb): starts this far apart or more read as past
	wt     uint32 // the window in ticks
	margin uint32 // how long after its end Sweep keeps a window (see Sweep)
	// from is the parameters (without lines) of the table SetLimit
	// converted into this one, for the Reservations taken from it; tick
	// is when it converted, in this table's ticks (from.tick in the old).
	from *windowParams
	tick uint64
}

// maxWindowTicks is the finest division of a window: 2¹⁶ ticks, so that a
// window starts at most Window/65,536 before its first request (under a
// millisecond for a minute). Events above 4095 leave fewer bits for the
// start, and windows of 2¹⁹/(2·Events) ticks or so: down to 128 ticks at
// MaxBurst events.
const maxWindowTicks = 1 << 16

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

// windowParamsFor returns the parameters of l (valid) with n zeroed lines.
func windowParamsFor(l Limit, n int) *windowParams {
	ceil := 2 * uint32(l.Events)
	cb := uint8(bits.Len32(ceil))
	sb := 32 - cb
	// A window is at most an eighth of the start field (a start is
	// cleared, at most two windows after it, well before it reads as ahead
	// again), and a tick at least a nanosecond.
	wt := uint64(min(maxWindowTicks, 1<<(sb-3)))
	for wt >= uint64(l.Window) {
		wt >>= 1
	}
	mult, _ := bits.Div64(wt, 0, uint64(l.Window))
	return &windowParams{
		clock:  clock{pe: wt, w: uint64(l.Window), mult: mult, nsPerTick: float64(l.Window) / float64(wt)},
		limit:  l,
		lines:  newLines(n),
		events: uint32(l.Events),
		ceil:   ceil,
		cb:     cb,
		cmask:  1<<cb - 1,
		smask:  1<<sb - 1,
		half:   1 << (sb - 1),
		wt:     uint32(wt),
		margin: uint32((1<<(sb-1) - 2*wt) / 4),
	}
}

// NewWindows returns a table of unused counters sized by cfg (as Buckets
// is); cfg.Limit must have no Burst. Its ticks count from the moment it is
// created; a time before that counts as its creation.
func NewWindows(cfg BucketsConfig) (*Windows, error) {
	return newWindows(cfg, time.Now())
}

func newWindows(cfg BucketsConfig, base time.Time) (*Windows, error) {
	if err := cfg.Limit.ValidateWindow(); err != nil {
		return nil, err
	}
	k, n, err := cfg.shape()
	if err != nil {
		return nil, err
	}
	w := &Windows{base: base, k: k, subs: subsets(k)}
	w.p.Store(windowParamsFor(cfg.Limit, n))
	return w, nil
}

// Limit returns the limit in force.
func (w *Windows) Limit() Limit { return w.p.Load().limit }

// K returns the number of counters each key draws on.
func (w *Windows) K() int { return w.k }

// Bytes returns the memory held by the table's lines.
func (w *Windows) Bytes() int { return len(w.p.Load().lines) * 64 }

// Lines returns the number of lines in the table.
func (w *Windows) Lines() int { return len(w.p.Load().lines) }

func (w *Windows) nowNanos(now time.Time) int64 { return max(int64(now.Sub(w.base)), 0) }

// read returns what counter value v has counted in its window at tick now,
// and the ticks until that window ends: 0 and 0 for an unused counter or an
// ended window. A window that starts after now (begun by a request whose
// time was read later than this one's) is running. A window that ended
// counting more than events (Charge's debt) carries the excess into the
// window that follows it at once: the debt is what that window has
// counted, so a request held for the next window is counted in it.
func (p *windowParams) read(v, now uint32) (used, left uint32) {
	if v == 0 {
		return 0, 0
	}
	start, c := v>>p.cb, v&p.cmask
	d := (now - start) & p.smask
	switch {
	case d >= p.half:
		return c, p.wt + (p.smask + 1 - d)
	case d < p.wt:
		return c, p.wt - d
	case c > p.events && d < 2*p.wt:
		return c - p.events, 2*p.wt - d
	}
	return 0, 0
}

// waits returns, for a counter that has counted used in a window that ends
// in left ticks, the ticks until it has room for cost (at most events) and
// until it has counted nothing. A count above events is carried into the
// next window (see read), so those may be a window later.
func (p *windowParams) waits(used, left, cost uint32) (room, clear uint32) {
	if used == 0 {
		return 0, 0
	}
	clear = left
	if used > p.events {
		clear += p.wt
	}
	switch {
	case used+cost <= p.events:
		return 0, clear
	case used+cost <= 2*p.events:
		return left, clear
	}
	return clear, clear
}

// chargeLane counts cost in counter value v at tick now, starting a new
// window if v's is over, up to ceil: the new value, and the record of the
// charge for a refund: the window's start and what was added, in the
// layout of a counter.
func (p *windowParams) chargeLane(v, cost, now uint32) (nv, rec uint32) {
	used, left := p.read(v, now)
	var start uint32
	switch {
	case left == 0:
		start = now & p.smask
	case v&p.cmask != used:
		start = (v>>p.cb + p.wt) & p.smask // the window a debt carried into
	default:
		start = v >> p.cb
	}
	add := min(cost, p.ceil-min(used, p.ceil))
	if add == 0 {
		return v, start << p.cb
	}
	return start<<p.cb | (used + add), start<<p.cb | add
}

// refundLane takes back from counter value v what the charge recorded in
// rec added, if v still holds the window it was added to.
func (p *windowParams) refundLane(v, rec uint32) uint32 {
	add := rec & p.cmask
	if v == 0 || add == 0 || v>>p.cb != rec>>p.cb {
		return v
	}
	c := v & p.cmask
	if c <= add {
		return 0
	}
	return v - add
}

// Allow is TakeHash(Hash(key), weight, now) without the Reservation.
func (w *Windows) Allow(key []byte, weight int64, now time.Time) Decision {
	d, _ := w.TakeHash(Hash(key), weight, now)
	return d
}

// TakeHash grants weight tokens to the key with hash h if the emptiest of
// its counters has room for them in its window at time now, and counts them
// in every one of its counters. A weight below 1 counts as 1. A weight above
// Events is denied with RetryAfter Never. Reset is the time until the
// key's window ends.
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
table:
	for {
		tick := p.ticks(ns)
		t := uint32(tick)
		ln, sub, index := placeIn(p.lines, w.subs, h)
		d := Decision{Limit: int64(p.events)}
		cost := uint32(1)
		commit := r != nil
		if weight > d.Limit {
			d.RetryAfter = Never
			commit = false
		} else if weight > 1 {
			cost = uint32(weight)
		}
		var vals [8]uint64
		for {
			// The emptiest counter decides (the first of equals); the first
			// counter to have room (or to be clear) is when the key does.
			best, fw, fl := uint32(math.MaxUint32), 0, uint8(0)
			retry, reset, after := uint32(math.MaxUint32), uint32(math.MaxUint32), uint32(math.MaxUint32)
			for m := sub.words; m != 0; m &= m - 1 {
				wi := bits.TrailingZeros8(m) & 7
				v := loadWord(&ln[wi])
				if v == frozen {
					p = w.moved(p)
					continue table
				}
				vals[wi] = v
				lanes := sub.lanes(wi)
				for l := uint8(0); l < 2; l++ {
					if lanes>>l&1 == 0 {
						continue
					}
					used, left := p.read(lane(v, l), t)
					if used < best {
						best, fw, fl = used, wi, l
					}
					room, clear := p.waits(used, left, cost)
					retry, reset = min(retry, room), min(reset, clear)
					if left == 0 {
						left = p.wt // the window this request starts
					}
					_, clear = p.waits(min(used+cost, p.ceil), left, 0)
					after = min(after, clear)
				}
			}
			if !commit || best+cost > p.events {
				d.Allowed = d.RetryAfter != Never && best+cost <= p.events
				d.Remaining = int64(p.events - min(best, p.events))
				d.Reset = p.until(ns, tick, uint64(reset))
				if !d.Allowed && d.RetryAfter != Never {
					d.RetryAfter = p.until(ns, tick, uint64(retry))
				}
				return d
			}
			// Only the header: chargeWord records every counter the key
			// charges, and nothing reads the others.
			r.index, r.units, r.epoch, r.tick = index, int64(cost), p.gen, tick
			var paid uint8 // the words charged so far
			for m := sub.words &^ (1 << fw); m != 0; m &= m - 1 {
				wi := bits.TrailingZeros8(m) & 7
				if _, ok := p.chargeWord(&ln[wi], vals[wi], sub, wi, cost, t, r); !ok {
					p = w.giveBack(w.moved(p), r, paid, ns)
					continue table
				}
				paid |= 1 << wi
			}
			used, res := p.chargeEmptiest(&ln[fw], vals[fw], sub, fw, fl, cost, t, r)
			switch res {
			case chargeGranted:
				d.Allowed = true
				d.Remaining = int64(p.events - min(used, p.events))
				d.Reset = p.until(ns, tick, uint64(after))
				return d
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

// chargeWord counts cost in the key's lanes of word wi (last seen as v),
// recording each charge in r, and returns the word it left; false, and
// nothing counted, if the word is frozen.
func (p *windowParams) chargeWord(q *uint64, v uint64, sub subset, wi int, cost, t uint32, r *Reservation) (uint64, bool) {
	lanes := sub.lanes(wi)
	for {
		nv := v
		for l := uint8(0); l < 2; l++ {
			if lanes>>l&1 != 0 {
				c, rec := p.chargeLane(lane(v, l), cost, t)
				nv = withLane(nv, l, c)
				r.short[sub.pos(2*wi+int(l))] = rec
			}
		}
		if nv == v || casWord(q, v, nv) {
			return nv, true
		}
		if v = loadWord(q); v == frozen {
			return 0, false
		}
	}
}

// chargeEmptiest counts cost in lane fl of word wi (last seen as v) if that
// counter still has room, with the key's other lane of the word, in one
// CAS. It returns what the counter has counted then, and an outcome of
// Buckets' chargeFullest.
func (p *windowParams) chargeEmptiest(q *uint64, v uint64, sub subset, wi int, fl uint8, cost, t uint32, r *Reservation) (uint32, int) {
	for {
		used, _ := p.read(lane(v, fl), t)
		if used+cost > p.events {
			return used, chargeLost
		}
		nv := v
		for l := uint8(0); l < 2; l++ {
			if sub.lanes(wi)>>l&1 != 0 {
				c, rec := p.chargeLane(lane(v, l), cost, t)
				nv = withLane(nv, l, c)
				r.short[sub.pos(2*wi+int(l))] = rec
			}
		}
		if casWord(q, v, nv) {
			return used + cost, chargeGranted
		}
		if v = loadWord(q); v == frozen {
			return 0, chargeFrozen
		}
	}
}

// giveBack takes back what r counted in the words in mask and clears r:
// the rollback of a decision that did not grant. It returns the parameters
// in force afterwards.
func (w *Windows) giveBack(p *windowParams, r *Reservation, mask uint8, ns int64) *windowParams {
	p = w.refundWords(p, r, mask, ns)
	*r = Reservation{}
	return p
}

// refundWords takes back what r counted in the key's counters of the words
// in mask, as much of it as is still owed at ns (see owed), from the table
// of p or, if SetLimit replaces it meanwhile, from the new one. It returns
// the parameters in force when it is done.
func (w *Windows) refundWords(p *windowParams, r *Reservation, mask uint8, ns int64) *windowParams {
	ln, sub := counterIn(p.lines, w.subs, r.index)
	if ln == nil {
		return p
	}
	for m := mask; m != 0; {
		if d := p.gen - r.epoch; d < 0 || d > 1 {
			return p
		}
		wi := bits.TrailingZeros8(m) & 7
		tick := p.ticks(ns)
		if p.gen == r.epoch {
			tick = max(tick, r.tick) // a refund never comes before its charge
		}
		if !p.refundWord(&p.lines[r.index>>16][wi], sub, wi, r, tick) {
			p = w.moved(p)
			continue
		}
		m &= m - 1
	}
	return p
}

// refundWord is refundWords for word wi: false, and nothing taken back, if
// the word is frozen.
func (p *windowParams) refundWord(q *uint64, sub subset, wi int, r *Reservation, tick uint64) bool {
	var rec [2]uint32
	for l := range 2 {
		if sub.lanes(wi)>>l&1 != 0 {
			rec[l] = p.owed(r, sub.pos(2*wi+l), tick)
		}
	}
	if rec == [2]uint32{} {
		return true
	}
	for {
		v := loadWord(q)
		if v == frozen {
			return false
		}
		nv := withLane(withLane(v, 0, p.refundLane(lane(v, 0), rec[0])), 1, p.refundLane(lane(v, 1), rec[1]))
		if nv == v || casWord(q, v, nv) {
			return true
		}
	}
}

// owed is the record of r's charge to its i-th counter, in p's layout, if
// that charge's window (with the window a debt carries into) has not ended
// by tick now: what a refund takes back. An ended window has counted its
// requests, and its start comes round again (the start field wraps), so a
// refund after it takes back nothing. A Reservation from the table
// SetLimit last replaced is converted as SetLimit converted the counters
// (nothing if its window was carrying a debt then); one from before that
// is owed nothing.
func (p *windowParams) owed(r *Reservation, i int, now uint64) uint32 {
	rec, since := r.short[i], now-r.tick
	switch p.gen - r.epoch {
	case 1:
		f := p.from
		if f.tick-r.tick >= uint64(f.half) {
			return 0
		}
		_, left := f.read(rec&^f.cmask|1, uint32(f.tick))
		start, ok := p.convertStart(left)
		if left == 0 || !ok {
			return 0
		}
		rec, since = start<<p.cb|min(rec&f.cmask, p.ceil), now-p.tick
	case 0:
	default:
		return 0
	}
	if d := (uint32(now) - rec>>p.cb) & p.smask; since >= uint64(p.half) || d >= 2*p.wt && d < p.half {
		return 0
	}
	return rec
}

// Refund is RefundAt(r, time.Now()).
func (w *Windows) Refund(r Reservation) { w.RefundAt(r, time.Now()) }

// RefundAt takes back what r counted, from the windows it was counted in,
// if they have not ended by now (a time before the charge's counts as the
// charge's): an ended window keeps what it counted, so a late refund never
// takes back another request's count from a window that started since. A
// Reservation taken before the latest SetLimit is converted with the
// counters; one taken before two SetLimits takes back nothing. A window
// that a refunded request started stays anchored at that request's time
// if another request was counted in it meanwhile: its end is then at most
// the time between the two requests early.
func (w *Windows) RefundAt(r Reservation, now time.Time) {
	if r.units <= 0 {
		return
	}
	p := w.params()
	if ln, sub := counterIn(p.lines, w.subs, r.index); ln != nil {
		w.refundWords(p, &r, sub.words, w.nowNanos(now))
	}
}

// Charge counts weight tokens for the key with hash h at time now without
// checking that its window has room, up to twice Events in each counter:
// for a cost known only after the request was served, or tokens reserved
// for a request that will wait for them. What a window counts beyond Events
// is carried into the next one, which starts as that one ends: a key
// charged into debt repays it there. A weight below 1 charges nothing.
//
// Allowed reports whether at least one counter took the whole charge;
// false means the key is at the ceiling and part of the charge was
// dropped. RetryAfter is the time until the window the charge is counted
// in has begun: 0 if the emptiest counter holds it within Events, else
// when its window ends and the excess is carried into the next (see
// read): when a request that reserved its tokens may go. RefundAt takes
// back what was charged.
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
		t := uint32(tick)
		cost := uint32(min(uint64(weight), uint64(p.ceil)))
		ln, sub, index := placeIn(p.lines, w.subs, h)
		r := Reservation{index: index, units: int64(cost), epoch: p.gen, tick: tick}
		best, retry, reset := uint32(math.MaxUint32), uint32(math.MaxUint32), uint32(math.MaxUint32)
		var paid uint8
		for m := sub.words; m != 0; m &= m - 1 {
			wi := bits.TrailingZeros8(m) & 7
			v := loadWord(&ln[wi])
			nv, ok := v, v != frozen
			if ok {
				nv, ok = p.chargeWord(&ln[wi], v, sub, wi, cost, t, &r)
			}
			if !ok {
				p = w.giveBack(w.moved(p), &r, paid, ns)
				continue table
			}
			paid |= 1 << wi
			for l := uint8(0); l < 2; l++ {
				if sub.lanes(wi)>>l&1 != 0 {
					used, left := p.read(lane(nv, l), t)
					room, clear := p.waits(used, left, 0)
					best, retry, reset = min(best, used), min(retry, room), min(reset, clear)
					d.Allowed = d.Allowed || r.short[sub.pos(2*wi+int(l))]&p.cmask == cost
				}
			}
		}
		d.Remaining = int64(p.events - min(best, p.events))
		d.Reset = p.until(ns, tick, uint64(reset))
		d.RetryAfter = p.until(ns, tick, uint64(retry))
		return d, r
	}
}

// Fill clears the counters of the key with hash h: its window is over, and
// so is that of every key sharing them.
func (w *Windows) Fill(h uint64) {
	for p := w.params(); ; {
		if ln, sub, _ := placeIn(p.lines, w.subs, h); clearKey(ln, sub) {
			return
		}
		p = w.moved(p)
	}
}

// SetLimit changes Events and Window of every counter at once, keeping each
// window's start and what it counted: a key that used 3 of "events 3" has 2
// left under "events 5", and a window started 30 s ago ends in 9 m 30 s
// under "window 10m". A window already longer than the new Window is over.
// A window that had ended less than Sweep's margin before is kept as ended
// as long ago (at least a new Window ago), so that a request whose time was
// read before SetLimit's sees its window as it stood then.
//
// As for Buckets, the counters are converted into new lines, and it is
// exact under concurrency the same way: each old word is swapped for the
// frozen marker as it is read (no counter is ever 0xFFFFFFFF: a count
// never fills its field), so a charge made to the old lines is either read
// and converted or fails, and the decision that made it waits for the new
// table, takes back there what it had counted, and decides again under the
// new limit. A Reservation taken before SetLimit refunds into the new
// table, converted (see RefundAt). Concurrent SetLimit calls are
// serialised; the last one leaves its limit in force.
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
			v := swapWord(&old.lines[i][j], frozen)
			if v == 0 {
				continue
			}
			for c := uint8(0); c < 2; c++ {
				used, left := old.read(lane(v, c), uint32(prev.tick))
				nv := np.convertEnded(lane(v, c))
				if used != 0 {
					nv = 0
					if start, ok := np.convertStart(left); ok {
						nv = start<<np.cb | min(used, np.ceil)
					}
				}
				if nv != 0 {
					setCounterValue(&np.lines[i], uint8(2*j)+c, nv)
				}
			}
		}
	}
	w.setParams(np)
	return nil
}

// convertStart is the start, in p's ticks, of a window of the table p was
// converted from that had left ticks to run at the conversion: its age,
// rounded down in the new ticks (against the key: its window ends no
// earlier). False if the window is over under p's Window.
func (p *windowParams) convertStart(left uint32) (uint32, bool) {
	old := p.from
	age := uint64(0)
	if elapsed := int64(old.wt) - int64(left); elapsed > 0 {
		age = p.ticks(int64(old.nanos(uint64(elapsed))))
	}
	if age >= uint64(p.wt) {
		return 0, false
	}
	return (uint32(p.tick) - uint32(age)) & p.smask, true
}

// convertEnded is counter value v of the table p was converted from, whose
// window (with the window a debt carries into) had ended at the
// conversion, as a window of p that ended as long ago (in p's ticks, and
// at least p's Window: an ended window stays ended), so that a request
// whose time was read before SetLimit's still sees it as it stood. 0 if
// it ended a margin ago or more, as Sweep would have cleared it.
func (p *windowParams) convertEnded(v uint32) uint32 {
	old := p.from
	if v == 0 {
		return 0
	}
	d := (uint32(old.tick) - v>>old.cb) & old.smask
	if d >= 2*old.wt+old.margin {
		return 0
	}
	c := min(v&old.cmask, p.ceil)
	age := max(p.ticks(int64(old.nanos(uint64(d)))), uint64(p.wt))
	if c > p.events {
		age = max(age, 2*uint64(p.wt))
	}
	if age >= uint64(2*p.wt+p.margin) {
		return 0
	}
	return ((uint32(p.tick)-uint32(age))&p.smask)<<p.cb | c
}

// Sweep clears every counter whose window (with the window a debt carries
// into) ended at least p.margin ticks before now, so that no start is ever
// old enough to read as running again. It must run at least every
// SweepInterval; like Buckets.Sweep it writes only words that change, with
// a CAS, and never a line no key touched, and stops at a table SetLimit is
// replacing.
//
// A window that ended more recently is left as it is: a request whose time
// was read before the sweep's (a stall; a sweep run at a later clock)
// still sees it as it stood at its own time, running if it was, as long as
// it is less than the margin late.
func (w *Windows) Sweep(now time.Time) {
	p := w.params()
	t := uint32(p.ticks(w.nowNanos(now)))
	for i := range p.lines {
		ln := &p.lines[i]
		for j := range ln {
			for {
				v := loadWord(&ln[j])
				if v == 0 {
					break
				}
				if v == frozen {
					return
				}
				nv := v
				for l := uint8(0); l < 2; l++ {
					if c := lane(v, l); c != 0 {
						if d := (t - c>>p.cb) & p.smask; d >= 2*p.wt+p.margin && d < p.half {
							nv = withLane(nv, l, 0)
						}
					}
				}
				if nv == v || casWord(&ln[j], v, nv) {
					break
				}
			}
		}
	}
}

// SweepInterval is how often Sweep must run under the limit in force: half
// of what is left of half the start field after two windows, twice the
// margin. A start Sweep leaves is less than two windows and the margin old,
// so at the next sweep it is less than half the start field old, and still
// reads as past. It is a window for the largest Events and far longer for
// most limits (63 windows at Events 100).
func (w *Windows) SweepInterval() time.Duration {
	p := w.p.Load()
	return time.Duration(p.nanos(uint64(p.half-2*p.wt) / 2))
}

// Stats measures the table at now as Buckets.Stats does: a counter is busy
// if its window has counted anything, empty if it has no room left for a
// request.
func (w *Windows) Stats(now time.Time) BucketStats {
	p := w.p.Load()
	t := uint32(p.ticks(w.nowNanos(now)))
	n := len(p.lines)
	step := 1
	if n > maxStatLines {
		step = n / maxStatLines
	}
	base := choose(countersPerLine, w.k)
	var empty, busy, sampled int
	var fd float64
	for i := 0; i < n; i += step {
		lineEmpty := 0
		for j := range p.lines[i] {
			v := loadWord(&p.lines[i][j])
			for l := uint8(0); l < 2; l++ {
				used, _ := p.read(lane(v, l), t)
				if used > 0 {
					busy++
				}
				if used >= p.events {
					lineEmpty++
				}
			}
		}
		empty += lineEmpty
		fd += choose(lineEmpty, w.k) / base
		sampled++
	}
	return statsOf(n, w.k, sampled, empty, busy, fd)
}

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
