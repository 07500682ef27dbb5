package limiter

import (
	"math/big"
	"math/rand/v2"
	"testing"
	"time"
)

// textbook is a token bucket as a textbook states it, in exact rationals:
// it holds up to burst tokens, gains Events/Window tokens per nanosecond of
// elapsed time, and grants w tokens if it holds w. It shares nothing with
// Buckets: no ticks, no rounding, no counters.
type textbook struct {
	rate, burst, tokens *big.Rat
	last                int64 // ns of the last update
}

func newTextbook(l Limit) *textbook {
	return &textbook{
		rate:   big.NewRat(l.Events, int64(l.Window)),
		burst:  big.NewRat(l.EffectiveBurst(), 1),
		tokens: big.NewRat(l.EffectiveBurst(), 1),
	}
}

// at returns the tokens held at ns (not before the last update).
func (tb *textbook) at(ns int64) *big.Rat {
	t := new(big.Rat).Mul(tb.rate, big.NewRat(max(ns-tb.last, 0), 1))
	t.Add(t, tb.tokens)
	if t.Cmp(tb.burst) > 0 {
		t.Set(tb.burst)
	}
	return t
}

func (tb *textbook) advance(ns int64) {
	tb.tokens = tb.at(ns)
	tb.last = max(tb.last, ns)
}

// take grants w tokens at ns if the bucket holds them.
func (tb *textbook) take(ns, w int64) bool {
	tb.advance(ns)
	if tb.tokens.Cmp(big.NewRat(w, 1)) < 0 {
		return false
	}
	tb.tokens.Sub(tb.tokens, big.NewRat(w, 1))
	return true
}

// wait is the time from ns until the bucket holds w tokens, in ns.
func (tb *textbook) wait(ns, w int64) *big.Rat {
	short := new(big.Rat).Sub(big.NewRat(w, 1), tb.at(ns))
	if short.Sign() <= 0 {
		return new(big.Rat)
	}
	return short.Quo(short, tb.rate)
}

// tickOf bounds the table's tick: 1/512 of a token's time, or a nanosecond
// at the fastest rates. Reading the time down to a tick makes the table lag
// a textbook bucket by up to a tick; charging a full counter from the start
// of the current tick lets its next token come up to a tick early (the one
// rounding that favours a key, once per refill from full: see line.go).
func tickOf(l Limit) time.Duration {
	return l.Window/time.Duration(l.Events)/512 + 1
}

// lagOf is how much later than a textbook bucket the table may grant:
// two ticks.
func lagOf(l Limit) time.Duration { return 2 * tickOf(l) }

func floorRat(r *big.Rat) int64 {
	q := new(big.Int).Quo(r.Num(), r.Denom())
	if r.Sign() < 0 && !r.IsInt() {
		q.Sub(q, big.NewInt(1))
	}
	return q.Int64()
}

func ratNs(r *big.Rat) time.Duration {
	f, _ := r.Float64()
	return time.Duration(f)
}

// TestLoneKeyMatchesTextbook replays random requests of one key, at random
// nanoseconds, against the textbook bucket: every grant must be one the
// textbook makes (never more), every denial one it makes or within the
// lag of its threshold, and Remaining, RetryAfter and Reset must agree to
// within the lag. The textbook is fed the table's own decisions, so the two
// never drift apart.
func TestLoneKeyMatchesTextbook(t *testing.T) {
	for _, l := range []Limit{
		{Events: 5, Window: 10 * time.Second},
		{Events: 100, Window: time.Minute, Burst: 20},
		{Events: 1000, Window: time.Second},
		{Events: 1, Window: time.Hour, Burst: 3},
		{Events: 7, Window: 13 * time.Second},
		{Events: 1, Window: 24 * time.Hour},
		{Events: MaxRate, Window: time.Second, Burst: 1000},
	} {
		t.Run(l.String(), func(t *testing.T) {
			b := roomy(t, l, nil)
			tb := newTextbook(l)
			lag := lagOf(l)
			slack := new(big.Rat).Mul(tb.rate, big.NewRat(int64(lag), 1))
			early := new(big.Rat).Mul(tb.rate, big.NewRat(int64(tickOf(l)), 1))
			token := l.Window / time.Duration(l.Events)
			r := rand.New(rand.NewPCG(3, 4))
			const h = 77
			ns := int64(0)
			for i := range 20_000 {
				ns += r.Int64N(int64(token)*2 + 1)
				now := tm(time.Duration(ns))
				w := int64(1 + r.IntN(3))
				have := tb.at(ns)
				var d Decision
				if r.IntN(5) == 0 {
					d = b.PeekHash(h, w, now)
				} else {
					d, _ = b.TakeHash(h, w, now)
					if d.Allowed && have.Cmp(new(big.Rat).Sub(big.NewRat(w, 1), early)) < 0 {
						t.Fatalf("request %d (weight %d at %v): granted, textbook holds %s", i, w, time.Duration(ns), have.FloatString(6))
					}
					if d.Allowed && !tb.take(ns, w) {
						// Granted up to a tick early: the textbook
						// owes that grant the sliver it lacks.
						tb.tokens = big.NewRat(w, 1)
						tb.take(ns, w)
					}
				}
				if !d.Allowed && w <= l.EffectiveBurst() {
					if have.Cmp(new(big.Rat).Add(big.NewRat(w, 1), slack)) >= 0 {
						t.Fatalf("request %d (weight %d at %v): denied, textbook holds %s", i, w, time.Duration(ns), have.FloatString(6))
					}
					wait := ratNs(tb.wait(ns, w))
					if d.RetryAfter < wait-tickOf(l) || d.RetryAfter > wait+lag {
						t.Fatalf("request %d: RetryAfter %v, textbook %v", i, d.RetryAfter, wait)
					}
					if b.PeekHash(h, w, now.Add(d.RetryAfter)).Allowed != true || b.PeekHash(h, w, now.Add(d.RetryAfter-1)).Allowed {
						t.Fatalf("request %d: RetryAfter %v is not when the request is granted", i, d.RetryAfter)
					}
				}
				left := tb.at(ns)
				if hi, lo := floorRat(new(big.Rat).Add(left, early)), floorRat(new(big.Rat).Sub(left, slack)); d.Remaining > hi || d.Remaining < lo {
					t.Fatalf("request %d: Remaining %d, textbook %s", i, d.Remaining, left.FloatString(6))
				}
				full := ratNs(tb.wait(ns, l.EffectiveBurst()))
				if d.Reset < full-tickOf(l) || d.Reset > full+lag {
					t.Fatalf("request %d: Reset %v, textbook %v", i, d.Reset, full)
				}
			}
		})
	}
}

// TestAnyRateIsEnforcedWithin01Percent drains a key at every step over 50
// full refills: it must be granted the burst plus the refill, never more,
// and no less than 0.1% under.
func TestAnyRateIsEnforcedWithin01Percent(t *testing.T) {
	for _, l := range []Limit{
		{Events: 1, Window: 24 * time.Hour},
		{Events: 7, Window: 13 * time.Second},
		{Events: MaxRate, Window: time.Second},
		{Events: MaxRate, Window: time.Second, Burst: 1},
		{Events: 1_000_000, Window: time.Hour, Burst: 1_000_000},
		{Events: 10_000, Window: time.Second, Burst: MaxBurst},
		{Events: 3, Window: 7 * time.Second},
	} {
		t.Run(l.String(), func(t *testing.T) {
			b := roomy(t, l, nil)
			w := max(1, l.EffectiveBurst()/1000)
			fill := time.Duration(float64(l.EffectiveBurst()) / perSecond(l) * float64(time.Second))
			step := fill / 200
			granted := int64(0)
			now := time.Duration(0)
			for range 200 * 50 {
				for b.Allow([]byte("k"), w, tm(now)).Allowed {
					granted += w
				}
				now += step
			}
			now -= step
			want := float64(l.EffectiveBurst()) + perSecond(l)*now.Seconds()
			if float64(granted) > want {
				t.Fatalf("granted %d tokens, more than the textbook's %.1f", granted, want)
			}
			if e := (want - float64(granted)) / want; e > 0.001+float64(w)/want {
				t.Fatalf("granted %d tokens, textbook %.0f (%.4f%% under)", granted, want, e*100)
			}
		})
	}
}

// perSecond is l's sustained rate in tokens per second, the rate the
// references refill at.
func perSecond(l Limit) float64 {
	return float64(l.Events) / l.Window.Seconds()
}
