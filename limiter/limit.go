package limiter

import (
	"fmt"
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
}

// Bounds of what a Limit may ask of a token-bucket table. They follow from
// 31-bit counters holding tokens in units of 1/UnitsPerToken (see the
// package documentation).
const (
	// UnitsPerToken is the fixed-point scale of a counter: one token is
	// 512 units, so weights and refills are exact to 1/512 token.
	UnitsPerToken = 512
	// MaxBurst is the largest capacity a counter can hold: a stored
	// deficit reaches three capacities (see charge), in 31 bits.
	MaxBurst = (1<<31 - 1) / 3 / UnitsPerToken
	// minTick is the shortest tick. Rounding a tick to whole nanoseconds
	// then changes the rate by at most 0.05%.
	minTick = time.Microsecond
	// minRefill is the smallest refill per tick, in units: 1/16 token. Ticks
	// are as short as possible given this and minTick.
	minRefill = UnitsPerToken / 16
)

// burst returns the effective capacity.
func (l Limit) burst() int64 {
	if l.Burst == 0 {
		return l.Events
	}
	return l.Burst
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
	case l.burst() > MaxBurst:
		return fmt.Errorf("burst %d exceeds the maximum of %d", l.burst(), MaxBurst)
	}
	if _, err := l.ticks(); err != nil {
		return err
	}
	return nil
}

// PerSecond is the sustained rate in tokens per second.
func (l Limit) PerSecond() float64 {
	return float64(l.Events) / l.Window.Seconds()
}

// String formats l as "N/W burst B".
func (l Limit) String() string {
	return fmt.Sprintf("%d/%v burst %d", l.Events, l.Window, l.burst())
}

// tickParams is the discretisation of a Limit: every tick, every counter
// regains refill units, up to capUnits.
type tickParams struct {
	tick     time.Duration // length of a tick; ≥ minTick
	refill   int64         // units regained per tick; ≥ minRefill unless the bucket fills in one tick
	capUnits int64         // capacity in units
}

// ticks chooses the tick for l: the shortest tick, no shorter than minTick,
// in which a counter regains a whole number of units, at least minRefill.
func (l Limit) ticks() (tickParams, error) {
	capUnits := l.burst() * UnitsPerToken
	// units per nanosecond
	rate := float64(l.Events) * UnitsPerToken / float64(l.Window)
	refill := int64(rate*float64(minTick)) + 1 // ceil for any non-integer product
	if refill < minRefill {
		refill = minRefill
	}
	if refill > capUnits {
		refill = capUnits
	}
	tick := time.Duration(float64(refill)/rate + 0.5)
	if tick < minTick-1 {
		return tickParams{}, fmt.Errorf("rate %d/%v with burst %d refills the whole bucket in under %v; raise burst",
			l.Events, l.Window, l.burst(), minTick)
	}
	if tick < 1 || float64(tick) > float64(1<<62) {
		return tickParams{}, fmt.Errorf("rate %d/%v is out of range", l.Events, l.Window)
	}
	return tickParams{tick: tick, refill: refill, capUnits: capUnits}, nil
}
