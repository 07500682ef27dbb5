package limiter

import (
	"slices"
	"sync"
	"testing"
	"time"
)

func TestChargeDrivesAKeyIntoDebtThatRefillRepays(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 10, Window: 10 * time.Second}, clk) // 1 token per second
	h := Hash([]byte("k"))
	b.TakeHash(h, 7, clk.Now())
	d, r := b.Charge(h, 6, clk.Now()) // 3 left, 6 charged: 3 in debt
	if !d.Allowed || d.Remaining != 0 || d.RetryAfter != 3*time.Second || !r.Charged() {
		t.Fatalf("charge into debt: %+v, want recorded, 0 left, out of debt in 3s", d)
	}
	clk.Advance(3*time.Second + time.Second - time.Nanosecond)
	if d := b.PeekHash(h, 1, clk.Now()); d.Allowed {
		t.Fatalf("before the debt and one token are repaid: %+v, want denied", d)
	}
	clk.Advance(time.Nanosecond)
	if d := b.PeekHash(h, 1, clk.Now()); !d.Allowed {
		t.Fatalf("after the debt and one token are repaid: %+v, want allowed", d)
	}
	// Refunded 4 s after it was made, the charge gives back its 6 tokens
	// less the 4 refilled since: it was queued behind the 7, so 6 were
	// still ahead, but its Reservation cannot tell that from an earlier
	// charge refunded under it (see RefundAt).
	b.RefundAt(r, clk.Now())
	if d := b.PeekHash(h, 1, clk.Now()); d.Remaining != 3 {
		t.Fatalf("after refunding the charge: %d remaining, want 3", d.Remaining)
	}
}

func TestChargeDebtIsBoundedByOneBurst(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 10, Window: 10 * time.Second}, clk)
	h := Hash([]byte("k"))
	if d, _ := b.Charge(h, 20, clk.Now()); !d.Allowed || d.RetryAfter != 10*time.Second {
		t.Fatalf("two bursts from full: %+v, want recorded, out of debt in 10s", d)
	}
	d, r := b.Charge(h, 1, clk.Now())
	if d.Allowed || d.RetryAfter != 10*time.Second {
		t.Fatalf("a charge past the ceiling: %+v, want not recorded, debt still 10s", d)
	}
	b.RefundAt(r, clk.Now()) // gives back nothing, as nothing was charged
	if d := b.PeekHash(h, 1, clk.Now()); d.RetryAfter != 11*time.Second {
		t.Fatalf("after refunding the dropped charge: retry %v, want 11s", d.RetryAfter)
	}
	if d, _ := b.Charge(h, 1<<62, clk.Now()); d.Allowed {
		t.Fatalf("a huge weight: %+v, want clamped and not recorded", d)
	}
}

// Requests that reserve tokens with Charge and wait for RetryAfter never
// pass faster than the rate: each one's wait includes every earlier charge.
func TestChargedReservationsQueueBehindEachOther(t *testing.T) {
	clk := newFakeClock()
	b := roomy(t, Limit{Events: 10, Window: 10 * time.Second}, clk)
	h := Hash([]byte("k"))
	b.TakeHash(h, 10, clk.Now())
	for i := 1; i <= 5; i++ {
		if d, _ := b.Charge(h, 1, clk.Now()); d.RetryAfter != time.Duration(i)*time.Second {
			t.Fatalf("reservation %d: wait %v, want %ds", i, d.RetryAfter, i)
		}
	}
	// Concurrent reservations read the key after their own charge, so a
	// wait may include a later one's charge too, never less than its own.
	var mu sync.Mutex
	var waits []time.Duration
	var wg sync.WaitGroup
	for range 5 {
		wg.Go(func() {
			d, _ := b.Charge(h, 1, clk.Now())
			mu.Lock()
			waits = append(waits, d.RetryAfter)
			mu.Unlock()
		})
	}
	wg.Wait()
	slices.Sort(waits)
	for i, w := range waits {
		if w < time.Duration(6+i)*time.Second || w > 10*time.Second {
			t.Fatalf("concurrent waits %v, want the i-th at least 6+i s and at most 10s", waits)
		}
	}
}
