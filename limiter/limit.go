package limiter

import (
	"fmt"
	"math"
	"math/bits"
	"time"
)

// A Limit is a token-bucket rate: Events per Window sustained, and up to
// Burst at once. A bucket starts full; every Window/Events one token
// returns, up to Burst.
type Limit struct {
	// Events is how many requests (of weight 1) the Window allows. At least 1.
	Events int64
	// Window is the period Events are counted over. Positive.
	Window time.Duration
	// Burst is the bucket's capacity in tokens. Zero means Events: "N per W"
	// then allows N at once, and N per W sustained.
	Burst int64
	// Debt is how many tokens below empty a key's counters may go: what
	// Charge may drive a key into (costs reported after a response, tokens
	// reserved by requests held until they return), and what the other
	// counters of a key pay beyond empty while its fullest has room. Zero
	// means the effective burst. At most MaxBurst. A table whose requests
	// are held up to a delay d needs d's worth of tokens, so that every
	// request whose tokens return within d can reserve them.
	Debt int64
}

// Bounds of what a Limit may ask of a token-bucket table. They follow from
// 32-bit counters holding times in ticks (see the package documentation).
const (
	// MaxBurst is the largest capacity: 2²⁰ tokens.
	MaxBurst = 1 << 20
	// MaxRate is the fastest rate, in tokens per second: a token every
	// microsecond.
	MaxRate = 1_000_000
	// aheadBits bounds how far ahead of now a counter can be: a burst and
	// its debt, in ticks, are at most 2^aheadBits (2^29 each with the
	// default debt of a burst; see chargeLane).
	aheadBits = 30
	// maxPer is the most ticks a token is divided into. A decision rounds
	// to whole ticks, so this is the precision of slow limits (1/4096 of a
	// token); fast ones get a tick of about a nanosecond.
	maxPer = 4096
)

// EffectiveBurst is the bucket's capacity: Burst, or Events if Burst is 0
// (a zone without burst allows Events at once). A valid Limit's is at most
// MaxBurst.
func (l Limit) EffectiveBurst() int64 {
	if l.Burst == 0 {
		return l.Events
	}
	return l.Burst
}

// debt is the effective Debt.
func (l Limit) debt() int64 {
	if l.Debt == 0 {
		return l.EffectiveBurst()
	}
	return l.Debt
}

// Validate reports whether a token-bucket table can enforce l, naming the
// field at fault.
func (l Limit) Validate() error {
	switch {
	case l.Events < 1:
		return fmt.Errorf("events must be at least 1, got %d", l.Events)
	case l.Window <= 0:
		return fmt.Errorf("window must be positive, got %v", l.Window)
	case l.Burst < 0:
		return fmt.Errorf("burst must not be negative, got %d", l.Burst)
	case l.EffectiveBurst() > MaxBurst:
		return fmt.Errorf("burst %d exceeds the maximum of %d", l.EffectiveBurst(), MaxBurst)
	case l.Debt < 0 || l.Debt > MaxBurst:
		return fmt.Errorf("debt %d must be between 0 and %d", l.Debt, MaxBurst)
	case l.Events > math.MaxInt64/int64(time.Second/MaxRate) || l.Window < time.Duration(l.Events)*(time.Second/MaxRate):
		return fmt.Errorf("events %d per window %v is faster than the maximum rate of %d per second", l.Events, l.Window, MaxRate)
	}
	return nil
}

// String formats l as "N/W burst B".
func (l Limit) String() string {
	return fmt.Sprintf("%d/%v burst %d", l.Events, l.Window, l.EffectiveBurst())
}

// clock is the discretisation of a valid Limit: time in ticks, a token worth
// per ticks. A token is a whole number of ticks, so weights are exact. per
// is the largest power of two (so that tokens are a shift away) that maxPer,
// the range (a burst in at most 2^aheadBits ticks) and a tick of more than a
// nanosecond allow: 4096 for most limits, 512 at MaxRate and for the
// largest bursts. A decision's only rounding is to whole ticks, always
// against the key (see line.go), so a limit is never exceeded and a key
// that refills completely between requests loses at most a tick per
// request.
type clock struct {
	per  uint64 // ticks per token, a power of two
	log  uint8  // per = 1 << log
	capT uint64 // burst·per: how far ahead a counter may be and still grant
	ceil uint64 // (burst+debt)·per: how far ahead a charge may push a counter (see chargeLane)
	// A time of ns nanoseconds is ns·pe/w ticks, exactly; ticks computes
	// its floor with multiplications only: mult = ⌊2⁶⁴·pe/w⌋ gives it or
	// one less, and one comparison of 128-bit products settles which.
	pe, w, mult uint64
	nsPerTick   float64 // w/pe, for Reset
}

// clockFor returns l's clock; l must be valid.
func clockFor(l Limit) clock {
	e, w := uint64(l.Events), uint64(l.Window)
	reach := uint64(l.EffectiveBurst() + l.debt())
	log := uint8(bits.Len64(min(maxPer, uint64(1<<aheadBits)/reach, (w-1)/e)) - 1)
	per := uint64(1) << log
	mult, _ := bits.Div64(per*e, 0, w) // per·e < w: ticks are longer than a nanosecond
	capT := uint64(l.EffectiveBurst()) * per
	return clock{per: per, log: log, capT: capT, ceil: reach * per, pe: per * e, w: w, mult: mult,
		nsPerTick: float64(w) / float64(per*e)}
}

// ticks converts a time on the table's clock (ns ≥ 0) to whole ticks,
// rounding down.
func (c *clock) ticks(ns int64) uint64 {
	tick, _ := bits.Mul64(uint64(ns), c.mult)
	xh, xl := bits.Mul64(uint64(ns), c.pe) // the time in ticks, times w
	if th, tl := bits.Mul64(tick+1, c.w); th < xh || th == xh && tl <= xl {
		tick++
	}
	return tick
}

// nanos is the first time, on the table's clock, at which ticks reads tick:
// ⌈tick·w / pe⌉, saturating at math.MaxInt64.
func (c *clock) nanos(tick uint64) int64 {
	hi, lo := bits.Mul64(tick, c.w)
	if hi >= c.pe {
		return math.MaxInt64
	}
	q, r := bits.Div64(hi, lo, c.pe)
	if r != 0 {
		q++
	}
	return int64(min(q, math.MaxInt64))
}

// until is the time from ns (which reads tick now) until the clock reads now
// plus ahead ticks, exactly, saturating at Never. It divides; decisions call
// it only to deny.
func (c *clock) until(ns int64, now uint64, ahead uint64) time.Duration {
	if ahead == 0 {
		return 0
	}
	t := c.nanos(now + ahead)
	if t == math.MaxInt64 {
		return Never
	}
	return time.Duration(t - ns)
}

// about is until without the division: at most a tick longer than the
// exact time (ns is at or after the start of its tick), never shorter. It
// is for Reset, which a granted request reports.
func (c *clock) about(ahead uint64) time.Duration {
	if ahead == 0 {
		return 0
	}
	f := math.Ceil(float64(ahead) * c.nsPerTick)
	if f >= float64(Never) {
		return Never
	}
	return time.Duration(f)
}
