package limiter

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestBurstThenRefill(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 5, Window: 10 * time.Second}, clk)
	key := []byte("client")
	for i := range 5 {
		d := b.Allow(key, 1, clk.Now())
		if !d.Allowed || d.Remaining != int64(4-i) || d.Limit != 5 {
			t.Fatalf("request %d: %+v, want allowed with %d remaining of 5", i+1, d, 4-i)
		}
	}
	d := b.Allow(key, 1, clk.Now())
	lag := lagOf(b.Limit())
	if d.Allowed || d.Remaining != 0 || !within(d.RetryAfter, 2*time.Second, lag) || !within(d.Reset, 10*time.Second, lag) {
		t.Fatalf("6th request: %+v, want denied, retry after 2s, full in 10s", d)
	}
	clk.Advance(d.RetryAfter - time.Nanosecond)
	if d := b.Allow(key, 1, clk.Now()); d.Allowed {
		t.Fatalf("1ns before RetryAfter: %+v, want denied", d)
	}
	clk.Advance(time.Nanosecond)
	if d := b.Allow(key, 1, clk.Now()); !d.Allowed {
		t.Fatalf("at RetryAfter: %+v, want allowed", d)
	}
}

func TestWeightsSpendSeveralTokens(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 10, Window: 10 * time.Second}, clk)
	key := []byte("search")
	if d := b.Allow(key, 7, clk.Now()); !d.Allowed || d.Remaining != 3 {
		t.Fatalf("weight 7 of 10: %+v", d)
	}
	d := b.Allow(key, 4, clk.Now())
	if d.Allowed || !within(d.RetryAfter, time.Second, lagOf(b.Limit())) {
		t.Fatalf("weight 4 with 3 left: %+v, want denied for 1s", d)
	}
	if d := b.Allow(key, 3, clk.Now()); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("a denied request must charge nothing: weight 3 with 3 left gave %+v", d)
	}
	if d := b.Allow(key, 11, clk.Now()); d.Allowed || d.RetryAfter != Never {
		t.Fatalf("weight above burst: %+v, want denied forever", d)
	}
}

func TestLargeBurstIsCountedToTheToken(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 1_000_000, Window: time.Hour}, clk)
	n := 0
	for b.Allow([]byte("k"), 1, clk.Now()).Allowed {
		n++
	}
	if n != 1_000_000 {
		t.Fatalf("burst of 10^6 granted %d", n)
	}
	b2 := roomy(t, Limit{Events: 1_000_000, Window: time.Hour}, clk)
	n = 0
	for b2.Allow([]byte("k"), 10_000, clk.Now()).Allowed {
		n++
	}
	if n != 100 {
		t.Fatalf("weight 10^4 from a burst of 10^6 granted %d times, want 100", n)
	}
}

func TestInvalidLimitsAreRejected(t *testing.T) {
	for _, l := range []Limit{
		{Events: 0, Window: time.Second},
		{Events: -1, Window: time.Second},
		{Events: 1, Window: 0},
		{Events: 1, Window: -time.Second},
		{Events: 1, Window: time.Second, Burst: -1},
		{Events: 1, Window: time.Second, Burst: MaxBurst + 1},
		{Events: 10_000_000, Window: time.Second, Burst: 1},
	} {
		if _, err := NewBuckets(BucketsConfig{Limit: l, Bytes: 64}); err == nil {
			t.Errorf("%+v: accepted", l)
		}
	}
	ok := Limit{Events: 1, Window: time.Second}
	for _, cfg := range []BucketsConfig{
		{Limit: ok, Bytes: 63},
		{Limit: ok, Bytes: -1},
		{Limit: ok, K: 9},
		{Limit: ok, K: -1},
		{Limit: ok, Sources: -5},
		{Limit: ok, FalseDeny: 1},
		{Limit: ok, FalseDeny: -0.1},
		{Limit: ok, Sources: 1 << 40, FalseDeny: 1e-9},
	} {
		if _, err := NewBuckets(cfg); err == nil {
			t.Errorf("%+v: accepted", cfg)
		}
	}
}

// TestIdlePastWrapReadsFull leaves a drained key alone for up to several
// wraps of the 32-bit tick while Sweep runs as the Caddy module runs it:
// the key must then read full, and the sweeps must not have written a line
// no key touched.
func TestIdlePastWrapReadsFull(t *testing.T) {
	for _, wraps := range []int64{0, 1, 3} {
		b := newTable(t, Limit{Events: 5, Window: time.Second}, 64*64)
		key := []byte("sleeper")
		drain(b, Hash(key), tm(0))
		used := nonZero(rawWords(b))
		idle := time.Duration(wraps)*time.Duration(b.p.Load().nanos(1<<32)) + time.Hour
		for now := time.Duration(0); now < idle; now += b.SweepInterval() {
			b.Sweep(tm(now))
		}
		if n := nonZero(rawWords(b)); n > used {
			t.Fatalf("sweeps wrote to untouched words: %d in use, %d before", n, used)
		}
		if d := b.Allow(key, 5, tm(idle)); !d.Allowed {
			t.Fatalf("after %v idle (%d wraps): %+v, want a full bucket", idle, wraps, d)
		}
	}
}

// TestSweepZeroesOnlyPastCounters: a sweep leaves a counter that is still
// short of full as it is, and one that refilled less than sweepMargin ago
// (a late request may still read it), and zeroes one that refilled before.
func TestSweepZeroesOnlyPastCounters(t *testing.T) {
	b := newTable(t, Limit{Events: 5, Window: time.Second}, 64)
	drain(b, 1, tm(0))
	b.Sweep(tm(500 * time.Millisecond))
	if d := b.PeekHash(1, 1, tm(500*time.Millisecond)); d.Remaining != 2 {
		t.Fatalf("swept half-way through the refill: %+v, want 2 left", d)
	}
	b.Sweep(tm(2 * time.Second))
	if n := nonZero(rawWords(b)); n == 0 {
		t.Fatalf("a sweep a second after the refill zeroed the key: a late request would see it full")
	}
	margin := time.Duration(b.p.Load().nanos(sweepMargin))
	b.Sweep(tm(time.Second + margin + time.Millisecond))
	if n := nonZero(rawWords(b)); n != 0 {
		t.Fatalf("%d words still set after every counter refilled %v ago and a sweep ran", n, margin)
	}
}

func TestConcurrentTakesNeverExceedBurstPlusRefill(t *testing.T) {
	clk := newFakeClock()
	l := Limit{Events: 1000, Window: time.Second, Burst: 100}
	b := roomy(t, l, clk)
	var granted, steps atomic.Int64
	var wg sync.WaitGroup
	// 20,000 steps of a tenth of a token: the burst of 100 refills 20
	// times over while the takers race.
	const totalSteps = 20_000
	step := 100 * time.Microsecond
	// Eight goroutines take 1 or 2 tokens at a time from one key; between
	// takes they move the shared clock on, so refills race with charges.
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; steps.Load() < totalSteps; i++ {
				w := int64(1 + (g+i)%2)
				if d, _ := b.TakeHash(Hash([]byte("hot")), w, clk.Now()); d.Allowed {
					granted.Add(w)
				}
				if i%4 == 0 && steps.Add(1) <= totalSteps {
					clk.Advance(step)
				}
			}
		}()
	}
	wg.Wait()
	// With the clock stopped, take what is left: nothing may have been
	// created, and (since the takers kept the bucket from ever filling up)
	// nothing lost.
	for b.Allow([]byte("hot"), 1, clk.Now()).Allowed {
		granted.Add(1)
	}
	elapsed := time.Duration(totalSteps) * step
	limit := l.EffectiveBurst() + int64(perSecond(l)*elapsed.Seconds())
	if g := granted.Load(); g > limit {
		t.Fatalf("granted %d tokens in %v, more than burst+refill = %d", g, elapsed, limit)
	} else if g < limit-2 {
		t.Fatalf("granted only %d tokens of %d: refills were lost", g, limit)
	}
}

func TestConcurrentTakesWithFrozenClockGrantExactlyBurst(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 500, Window: time.Second}, clk)
	var granted atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				if b.Allow([]byte("hot"), 1, clk.Now()).Allowed {
					granted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if g := granted.Load(); g != 500 {
		t.Fatalf("1600 concurrent requests against a burst of 500 granted %d", g)
	}
}

func TestRefundRestoresExactly(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 10, Window: time.Second}, clk)
	h := Hash([]byte("k"))
	b.TakeHash(h, 4, clk.Now())
	_, r := b.TakeHash(h, 5, clk.Now())
	if !r.Charged() {
		t.Fatal("a granted take must hold a charge")
	}
	b.RefundAt(r, clk.Now())
	if d := b.PeekHash(h, 1, clk.Now()); d.Remaining != 6 {
		t.Fatalf("after refunding 5 of 9: %d remaining, want 6", d.Remaining)
	}
	_, none := b.TakeHash(h, 7, clk.Now())
	if none.Charged() {
		t.Fatal("a denied take must hold no charge")
	}
	b.RefundAt(none, clk.Now())
	if d := b.PeekHash(h, 1, clk.Now()); d.Remaining != 6 {
		t.Fatalf("refunding a denial changed the bucket: %d remaining", d.Remaining)
	}
}

func TestPeekChargesNothing(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 2, Window: time.Second}, clk)
	h := Hash([]byte("k"))
	for range 10 {
		if d := b.PeekHash(h, 1, clk.Now()); !d.Allowed || d.Remaining != 2 {
			t.Fatalf("peek: %+v", d)
		}
	}
}

func TestFillRefillsAKey(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 2, Window: time.Hour}, clk)
	h := Hash([]byte("k"))
	b.TakeHash(h, 2, clk.Now())
	b.Fill(h)
	if d := b.PeekHash(h, 2, clk.Now()); !d.Allowed {
		t.Fatalf("after Fill: %+v", d)
	}
}

func TestSetLimitKeepsConsumption(t *testing.T) {
	tests := []struct {
		name     string
		to       Limit
		wantLeft int64
	}{
		{"raising 3 to 5 gives 2 more", Limit{Events: 5, Window: time.Minute}, 2},
		{"raising the window keeps the tick", Limit{Events: 3, Window: 2 * time.Minute}, 0},
		{"an odd new rate moves to a new tick", Limit{Events: 7, Window: 11 * time.Second}, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newFakeClock()
			b := roomy(t, Limit{Events: 3, Window: time.Minute}, clk)
			h := Hash([]byte("k"))
			b.TakeHash(h, 3, clk.Now())
			if err := b.SetLimit(tt.to, clk.Now()); err != nil {
				t.Fatal(err)
			}
			if n := int64(drain(b, h, clk.Now())); n != tt.wantLeft {
				t.Fatalf("after SetLimit(%v) an exhausted key got %d more, want %d", tt.to, n, tt.wantLeft)
			}
		})
	}
}

func TestSetLimitLoweringTakesTheDifference(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 5, Window: 10 * time.Second}, clk)
	h := Hash([]byte("k"))
	b.TakeHash(h, 4, clk.Now()) // 1 left of 5
	if err := b.SetLimit(Limit{Events: 3, Window: 10 * time.Second}, clk.Now()); err != nil {
		t.Fatal(err)
	}
	d := b.PeekHash(h, 1, clk.Now())
	if d.Allowed || d.Limit != 3 {
		t.Fatalf("used 4, limit lowered to 3: %+v, want denied", d)
	}
	// 4 used refills at 3 per 10s: 1 token is back after (4−3+1)/0.3 =
	// 6.67s.
	if d.RetryAfter < 6*time.Second || d.RetryAfter > 7*time.Second {
		t.Fatalf("retry after %v, want about 6.7s", d.RetryAfter)
	}
}

// TestIdleTimeIsNotCreditedToLaterCharges: a full key left alone for half a
// refill period, then drained, has a burst and no more: refill while full
// is lost, as in any token bucket.
func TestIdleTimeIsNotCreditedToLaterCharges(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 10, Window: 10 * time.Second}, clk)
	key := []byte("k")
	b.Allow([]byte("neighbour"), 1, clk.Now())
	clk.Advance(5 * time.Second)
	n := 0
	for b.Allow(key, 1, clk.Now()).Allowed {
		n++
	}
	if n != 10 {
		t.Fatalf("after 5s idle a full key took %d, want its burst of 10", n)
	}
	clk.Advance(time.Second + lagOf(b.Limit()))
	if d := b.Allow(key, 1, clk.Now()); !d.Allowed {
		t.Fatalf("a second later: %+v, want one token back", d)
	}
	if d := b.Allow(key, 1, clk.Now()); d.Allowed {
		t.Fatalf("a second later, second request: %+v, want denied", d)
	}
}

// within reports whether got is want to within the table's rounding: at
// most lag later, or half of it earlier (see tickOf).
func within(got, want, lag time.Duration) bool { return got >= want-lag/2 && got <= want+lag }

// TestChargeQueuesReservationsUpToTheDebt is what a zone that holds
// requests relies on: with a debt of five tokens, five requests that find
// the bucket empty at the same instant each reserve a token, the n-th
// waiting n token times, and the sixth finds the key at its ceiling. With
// the default debt (a burst of one), only the first reservation fits.
func TestChargeQueuesReservationsUpToTheDebt(t *testing.T) {
	for _, tc := range []struct {
		debt int64
		fits int
	}{{0, 1}, {5, 5}} {
		l := Limit{Events: 5, Window: time.Second, Burst: 1, Debt: tc.debt}
		b, err := NewBuckets(BucketsConfig{Limit: l, Bytes: 64 << 10})
		if err != nil {
			t.Fatal(err)
		}
		now := time.Unix(1_000_000, 0)
		h := HashString("held")
		if d, _ := b.TakeHash(h, 1, now); !d.Allowed {
			t.Fatalf("debt %d: the first request: %+v", tc.debt, d)
		}
		for i := 1; i <= 6; i++ {
			d, _ := b.Charge(h, 1, now)
			want := time.Duration(i) * 200 * time.Millisecond
			if i <= tc.fits {
				if !d.Allowed || d.RetryAfter < want || d.RetryAfter > want+time.Millisecond {
					t.Errorf("debt %d: reservation %d: %+v, want allowed, wait %v", tc.debt, i, d, want)
				}
			} else if d.Allowed {
				t.Errorf("debt %d: reservation %d: %+v, want the ceiling", tc.debt, i, d)
			}
		}
	}
}

// TestARefundDatedBeforeItsChargeGivesItAllBack: a refund's time can be
// read before its charge's (another goroutine's clock reading, a request
// that began earlier); it counts as the charge's own time, so the whole
// charge comes back, never nothing.
func TestARefundDatedBeforeItsChargeGivesItAllBack(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 10, Window: time.Second}, clk)
	h := Hash([]byte("k"))
	clk.Advance(time.Second)
	_, r := b.TakeHash(h, 10, clk.Now())
	if !r.Charged() {
		t.Fatal("a granted take must hold a charge")
	}
	b.RefundAt(r, clk.Now().Add(-300*time.Millisecond))
	if d := b.PeekHash(h, 1, clk.Now()); d.Remaining != 10 {
		t.Fatalf("after refunding all 10, dated 300 ms before the charge: %d remaining, want 10", d.Remaining)
	}
}
