package limiter

import (
	"sync"
	"testing"
	"time"
	"unsafe"
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

// Requests that reserve tokens with Charge one after another queue behind
// each other: each one's wait includes every earlier charge.
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
	// Racing reservations: each is told at least its own charge and at
	// most all of them, and none is lost (the key owes all ten).
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
	for _, w := range waits {
		if w < 6*time.Second || w > 10*time.Second {
			t.Fatalf("concurrent waits %v, want each from 6s to 10s", waits)
		}
	}
	if d := b.PeekHash(h, 1, clk.Now()); d.RetryAfter != 11*time.Second {
		t.Fatalf("after ten reservations: the next token in %v, want 11s (a charge lost)", d.RetryAfter)
	}
}

// Two reservations that race are queued by each counter on its own, and
// each reports its key's fullest counter: where two counters of the key
// (in different words) took the racers in opposite orders, both are told
// the wait of the first, and no counter's order decides which goes first.
// What holds in every interleaving: each is told at least its own place,
// at most the last, and the key owes both, so what the racers take early
// the key's next request waits for. Two held requests may so go at the
// same time, one place early; over any longer span the key pays for both.
func TestRacingReservationsAreEachToldAtLeastTheirOwnPlace(t *testing.T) {
	limit := Limit{Events: 10, Window: 10 * time.Second}
	const h = 0x1234_5678_9abc_def0
	var ties int
	schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		b, err := newBuckets(BucketsConfig{Limit: limit, Bytes: 64, K: 4}, clockEpoch)
		if err != nil {
			t.Fatal(err)
		}
		b.TakeHash(h, 10, tm(0))
		var waits [2]time.Duration
		fs := []func(){
			func() { d, _ := b.Charge(h, 1, tm(0)); waits[0] = d.RetryAfter },
			func() { d, _ := b.Charge(h, 1, tm(0)); waits[1] = d.RetryAfter },
		}
		return watchLines(&b.p.Load().lines[0]), fs, func(schedule string) {
			for i, w := range waits {
				if w < time.Second || w > 2*time.Second {
					t.Errorf("schedule %s: racer %d told %v, want 1s or 2s (waits %v)", schedule, i, w, waits)
				}
			}
			if waits[0] == waits[1] {
				ties++
			}
			if d := b.PeekHash(h, 1, tm(0)); d.RetryAfter != 3*time.Second {
				t.Errorf("schedule %s: the next token in %v, want 3s: a racer's charge lost", schedule, d.RetryAfter)
			}
		}
	})
	t.Logf("%d schedules, %d in which both racers were told the same wait", schedules, ties)
}
