package limiter

import (
	"math/big"
	"testing"
	"time"
	"unsafe"

	"github.com/floodgate-rl/floodgate/internal/testclock"
)

// tm is clockEpoch + d: tables made by newBuckets(…, clockEpoch) count ticks
// from there.
func tm(d time.Duration) time.Time { return clockEpoch.Add(d) }

func newTable(t testing.TB, l Limit, bytes int) *Buckets {
	t.Helper()
	b, err := newBuckets(BucketsConfig{Limit: l, Bytes: bytes}, clockEpoch)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// drain takes weight-1 requests from the key at now until one is denied and
// returns how many were granted. A policy that never denies (the bug a
// caller checks for) stops at maxDrain, more than any burst or quota the
// tests set, so the count is wrong rather than the test hung.
func drain(p Policy, h uint64, now time.Time) int {
	n := 0
	for n < maxDrain {
		if d, _ := p.TakeHash(h, 1, now); !d.Allowed {
			return n
		}
		n++
	}
	return n
}

const maxDrain = 1 << 21

// The scenario: limit 10/s, burst 10, drained at t=0; request X
// decides at 990 ms but is held between its loads and its CASes while Y
// runs at 1.05 s; then the key is drained at 1.07 s. A token bucket grants
// exactly 10 more by then, whichever of X and Y it sees first (10.7 tokens
// of refill, capped at the burst of 10, and 0.2 more if Y found it full):
// every schedule must give 20 in all, not 21 (a grant on an empty bucket)
// and not fewer (tokens lost).
func TestRefillDuringAStalledDecisionIsExact(t *testing.T) {
	const h = 42
	var b *Buckets
	var granted int
	schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		b = newTable(t, Limit{Events: 10, Window: time.Second}, 64)
		granted = drain(b, h, tm(0))
		var x, y bool
		return watchLines(&b.p.Load().lines[0]), []func(){
				func() { d, _ := b.TakeHash(h, 1, tm(990*time.Millisecond)); x = d.Allowed },
				func() { d, _ := b.TakeHash(h, 1, tm(1050*time.Millisecond)); y = d.Allowed },
			}, func(schedule string) {
				total := granted + count(x) + count(y) + drain(b, h, tm(1070*time.Millisecond))
				if total != 20 {
					t.Errorf("schedule %s: %d grants by 1.07 s (X %v, Y %v), want 20 = burst 10 + 10 refilled", schedule, total, x, y)
				}
			}
	})
	t.Logf("%d schedules", schedules)
}

func count(ok bool) int {
	if ok {
		return 1
	}
	return 0
}

// A long window with a large burst: Reset and RetryAfter of a drained key
// are the decades it takes to refill, saturating rather than overflowing.
func TestLongWindowsDoNotOverflow(t *testing.T) {
	year := 365 * 24 * time.Hour
	for _, l := range []Limit{
		{Events: 1, Window: year, Burst: 300},
		{Events: 10, Window: 30 * year, Burst: 100},
	} {
		b := newTable(t, l, 64)
		drain(b, 7, tm(0))
		d := b.PeekHash(7, 1, tm(0))
		// 300 years is beyond a Duration (292 years): Never.
		if d.Allowed || d.Reset != Never || !within(d.RetryAfter, l.Window/time.Duration(l.Events), lagOf(l)) {
			t.Errorf("%v drained: %+v, want Reset Never and RetryAfter %v", l, d, l.Window/time.Duration(l.Events))
		}
	}
}

// The reload scenarios, as an operator would run them: keeping what
// each key used, in tokens, across limit changes.
func TestLoweringALimitAfterRaisingItKeepsWhatWasUsed(t *testing.T) {
	five := Limit{Events: 5, Window: time.Minute}
	fifty := Limit{Events: 50, Window: time.Minute}

	// Exhaust at 5, raise to 50, take 2, wait 5 s, lower to 5: 7 used,
	// 50/60 × 5 = 4.17 refilled, so 2.17 used of 5: 2 left.
	b := newTable(t, five, 64)
	drain(b, 1, tm(0))
	noErr(t, b.SetLimit(fifty, tm(time.Second)))
	for range 2 {
		if d, _ := b.TakeHash(1, 1, tm(time.Second)); !d.Allowed {
			t.Fatalf("denied after raising to 50: %+v", d)
		}
	}
	noErr(t, b.SetLimit(five, tm(6*time.Second)))
	if d := b.PeekHash(1, 1, tm(6*time.Second)); !d.Allowed || d.Remaining != 2 || d.Reset > 60*time.Second {
		t.Errorf("after raising, 2 requests, 5 s, lowering: %+v, want 2 left and Reset within the window", d)
	}

	// Exhaust at 5, raise to 50, wait 8 s, lower to 5: 50/60 × 8 = 6.7
	// refilled of 5 used: full.
	b = newTable(t, five, 64)
	drain(b, 1, tm(0))
	noErr(t, b.SetLimit(fifty, tm(time.Second)))
	noErr(t, b.SetLimit(five, tm(9*time.Second)))
	if d := b.PeekHash(1, 1, tm(9*time.Second)); !d.Allowed || d.Remaining != 5 {
		t.Errorf("after raising, 8 s, lowering: %+v, want full (5)", d)
	}
}

func noErr(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// Rounding errs on the under-grant side: a drained key is never granted its
// n-th token before a token bucket refilled at exactly Events/Window has n
// whole tokens. The times probed are a nanosecond before each token is due,
// computed with rationals.
func TestNoTokenComesEarly(t *testing.T) {
	for _, l := range []Limit{
		{Events: 3, Window: time.Second},
		{Events: 7, Window: time.Second},
		{Events: 1000, Window: 3 * time.Second},
		{Events: 999_999, Window: time.Second, Burst: 1_000_000},
		{Events: 1, Window: 24 * time.Hour},
		{Events: 13, Window: 7 * time.Minute, Burst: 1},
	} {
		for n := int64(1); n <= 40; n++ {
			b := newTable(t, l, 64)
			drain(b, 3, tm(0))
			// The n-th token is due at n·Window/Events.
			due := new(big.Rat).SetFrac64(n*int64(l.Window), l.Events)
			ns := new(big.Int).Quo(due.Num(), due.Denom()) // floor
			if due.IsInt() {
				ns.Sub(ns, big.NewInt(1))
			}
			probe := tm(time.Duration(ns.Int64()))
			if got := drain(b, 3, probe); got >= int(n) {
				t.Errorf("%v: %d tokens granted at %v after draining, before the %d-th is due at %s ns", l, got, time.Duration(ns.Int64()), n, due.FloatString(1))
				break
			}
		}
	}
}

// PeekHash changes nothing, at any time, however long the table was idle.
func TestPeekWritesNothing(t *testing.T) {
	b := newTable(t, Limit{Events: 5, Window: time.Second}, 64*64)
	drain(b, 9, tm(0))
	before := rawWords(b)
	for _, d := range []time.Duration{time.Second, time.Hour, 400 * 24 * time.Hour, 10 * 365 * 24 * time.Hour} {
		b.PeekHash(10, 1, tm(d))
		b.PeekHash(9, 1, tm(d))
		if after := rawWords(b); after != before {
			t.Fatalf("PeekHash at %v wrote to the table (%d non-zero words before, %d after)", d, nonZero(before), nonZero(after))
		}
	}
}

// rawWords copies the table's words, and nonZero counts those in use.
func rawWords(b *Buckets) string {
	lines := b.p.Load().lines
	out := make([]byte, 0, 64*len(lines))
	for i := range lines {
		for _, w := range lines[i] {
			for s := 0; s < 64; s += 8 {
				out = append(out, byte(w>>s))
			}
		}
	}
	return string(out)
}

func nonZero(raw string) int {
	n := 0
	for i := 0; i+8 <= len(raw); i += 8 {
		if raw[i:i+8] != "\x00\x00\x00\x00\x00\x00\x00\x00" {
			n++
		}
	}
	return n
}

// roomy is a table big enough that test keys do not share counters.
func roomy(t testing.TB, l Limit, clk *testclock.Clock) *Buckets {
	t.Helper()
	return newTable(t, l, 1<<16)
}

// A request whose time was read before a stall (here 0.6 s, more than half
// a burst) must still see a drained key as drained: a counter two bursts
// ahead of the latest time is farther ahead of a late time, and is not a
// past time that wrapped.
func TestALateRequestSeesADrainedKey(t *testing.T) {
	b := newTable(t, Limit{Events: 100, Window: time.Second}, 64)
	drain(b, 5, tm(time.Second))
	b.Charge(5, 1000, tm(time.Second)) // a burst of debt: two bursts short of full
	if d, _ := b.TakeHash(5, 1, tm(400*time.Millisecond)); d.Allowed {
		t.Fatalf("a request 0.6 s late was granted on a key two bursts in debt: %+v", d)
	}
	if d := b.PeekHash(5, 1, tm(2*time.Second)); d.Allowed || d.Remaining != 0 {
		t.Fatalf("a second later: %+v, want still in debt", d)
	}
	if d := b.PeekHash(5, 1, tm(3*time.Second+lagOf(b.Limit()))); !d.Allowed || d.Remaining != 100 {
		t.Fatalf("two seconds later: %+v, want full", d)
	}
}
