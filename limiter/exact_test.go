package limiter

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"
)

// The paths of issue 16 on which the table must stay exact: a refund that
// comes late, a SetLimit beside decisions, a sweep at a later clock than a
// request's, and two keys that share counters. Each is run through every
// interleaving of its atomic steps (runSchedule) where concurrency is the
// point.

// hashFor returns a hash whose key, on a one-line table, draws on exactly
// the given counters.
func hashFor(t *testing.T, b *Buckets, counters ...int) uint64 {
	t.Helper()
	var mask uint16
	for _, c := range counters {
		mask |= 1 << c
	}
	for i, s := range b.subs {
		if s.counters == mask {
			// placeIn picks subset ⌊low·len(subs) / 2³²⌋: the smallest
			// low that gives i.
			n := uint64(len(b.subs))
			low := (uint64(i)<<32 + n - 1) / n
			h := low
			if _, got, _ := placeIn(b.p.Load().lines, b.subs, h); got != s {
				t.Fatalf("hashFor: subset %d not reached", i)
			}
			return h
		}
	}
	t.Fatalf("no subset of %d counters is %v", b.k, counters)
	return 0
}

// setAhead makes counter c of line 0 tokens·per ticks short of full at tick
// 0 (tm(0)), for a table no goroutine uses yet.
func setAhead(b *Buckets, c int, tokens float64) {
	p := b.p.Load()
	setCounter(&p.lines[0], uint8(c), 0, uint32(tokens*float64(p.per)))
}

// A refund that comes after its charge was refilled away gives back
// nothing: burst 1, X at 0, Y at 1.5 s (the counter had refilled), X
// refunded at 1.6 s, and Z at 1.6 s must be denied. On the old code
// (subtracting X's charge from the counter) Z was granted: three grants in
// 1.6 s from a bucket of one that refills one a second.
func TestALateRefundGivesBackOnlyItsOwnCharge(t *testing.T) {
	b := newTable(t, Limit{Events: 1, Window: time.Second, Burst: 1}, 1<<12)
	const h = 99
	x, rx := b.TakeHash(h, 1, tm(0))
	y, _ := b.TakeHash(h, 1, tm(1500*time.Millisecond))
	b.RefundAt(rx, tm(1600*time.Millisecond))
	z, _ := b.TakeHash(h, 1, tm(1600*time.Millisecond))
	if !x.Allowed || !y.Allowed || z.Allowed {
		t.Errorf("burst 1: X %v, Y %v, and after X's late refund Z %v: want X and Y granted, Z denied", x.Allowed, y.Allowed, z.Allowed)
	}
	// A refund of a charge still partly owed gives back that part, and
	// leaves the charge queued behind it: burst 2, W at 3 s (due back at
	// 4 s), V at 3.5 s (queued: due back at 5 s), W refunded at 3.6 s
	// gives back 0.4 of a token, and the key is full again at 4.6 s.
	b = newTable(t, Limit{Events: 1, Window: time.Second, Burst: 2}, 1<<12)
	_, rw := b.TakeHash(h, 1, tm(3*time.Second))
	b.TakeHash(h, 1, tm(3500*time.Millisecond))
	b.RefundAt(rw, tm(3600*time.Millisecond))
	if d := b.PeekHash(h, 2, tm(3600*time.Millisecond)); d.Allowed || !within(d.RetryAfter, time.Second, lagOf(b.Limit())) {
		t.Errorf("W refunded at 3.6 s: %+v, want 2 tokens back in 1 s", d)
	}
}

// A client held by `action delay` goes away seconds later: the zone that
// had granted its request (a Txn take) and the zone that held it (a Charge)
// are given back what they still owe, no more. Burst 2 at 1/s: H takes at
// 0 and is held; A takes at 0; the key refills; B and C take at 2.5 s;
// H's client leaves at 2.6 s; D at 2.6 s must be denied. On the old code
// H's rollback gave back a token already refilled away, and D was granted:
// three grants at one instant from a bucket of two.
func TestAHeldClientThatLeavesGivesBackOnlyWhatIsOwed(t *testing.T) {
	l := Limit{Events: 1, Window: time.Second, Burst: 2}
	zone := newTable(t, l, 1<<12)
	held := newTable(t, l, 1<<12)
	const h = 7
	var txn Txn
	if d := txn.Take(zone, h, 1, tm(0)); !d.Allowed {
		t.Fatalf("H: %+v", d)
	}
	_, debt := held.Charge(h, 1, tm(0))
	if d, _ := zone.TakeHash(h, 1, tm(0)); !d.Allowed {
		t.Fatalf("A: %+v", d)
	}
	for _, name := range []string{"B", "C"} {
		if d, _ := zone.TakeHash(h, 1, tm(2500*time.Millisecond)); !d.Allowed {
			t.Fatalf("%s at 2.5 s: %+v, want granted (the key refilled)", name, d)
		}
	}
	leave := tm(2600 * time.Millisecond)
	txn.RollbackAt(leave)
	held.RefundAt(debt, leave)
	if d, _ := zone.TakeHash(h, 1, leave); d.Allowed {
		t.Errorf("D at 2.6 s after H left: granted, a third grant at one instant with burst 2")
	}
	if d := held.PeekHash(h, 2, leave); !d.Allowed {
		t.Errorf("the holding zone after H left: %+v, want full (H's charge was refilled away)", d)
	}
}

// A sweep run at a later clock than a request's is invisible to it: 10
// granted at 1 s drain the key, Sweep(2 s), and a request whose time is
// still 1 s must be denied. On the old code the sweep zeroed the drained
// counters, and 10 more were granted at 1 s.
func TestASweepAtALaterClockRefillsNoLateRequest(t *testing.T) {
	b := newTable(t, Limit{Events: 10, Window: time.Second, Burst: 10}, 1<<12)
	const h = 5
	before := drain(b, h, tm(time.Second))
	b.Sweep(tm(2 * time.Second))
	if after := drain(b, h, tm(time.Second)); before != 10 || after != 0 {
		t.Errorf("%d granted at 1 s, Sweep(2 s), then %d more at 1 s: want 10 and 0", before, after)
	}
	// The same across a SetLimit: the conversion keeps the recently-past
	// counters as long past.
	noErr(t, b.SetLimit(Limit{Events: 20, Window: time.Second, Burst: 10}, tm(2*time.Second)))
	if after := drain(b, h, tm(time.Second)); after != 0 {
		t.Errorf("after SetLimit at 2 s, a request at 1 s: %d granted, want 0", after)
	}
	if got := drain(b, h, tm(2*time.Second)); got != 10 {
		t.Errorf("at 2 s: %d granted, want the full 10", got)
	}
}

// A setRace is requests of one key racing a SetLimit, through every
// interleaving, on a one-line table drained at 0 under from. SetLimit runs
// at at, no request's time is later, and the key is never full, so a
// token bucket whose limit changes at at, keeping what the key used, holds
// at end: burst(to) + ⌊rate(from)·at + rate(to)·(end − at)⌋ − what was
// granted after 0. Every schedule must grant exactly that in all.
type setRace struct {
	name     string
	from, to Limit
	k        int
	at       time.Duration
	reqs     []raceReq
	end      time.Duration
}

func (rc setRace) run(t *testing.T) {
	r1 := big.NewRat(rc.from.Events, int64(rc.from.Window))
	r2 := big.NewRat(rc.to.Events, int64(rc.to.Window))
	refill := new(big.Rat).Mul(r1, big.NewRat(int64(rc.at), 1))
	refill.Add(refill, new(big.Rat).Mul(r2, big.NewRat(int64(rc.end-rc.at), 1)))
	want := rc.to.EffectiveBurst() + floorRat(refill)
	const h = 0x1234_5678_9abc_def0
	schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		b, err := newBuckets(BucketsConfig{Limit: rc.from, Bytes: 64, K: rc.k}, clockEpoch)
		if err != nil {
			t.Fatal(err)
		}
		denier := newTable(t, Limit{Events: 1, Window: time.Hour}, 64)
		denier.Charge(h, 2, tm(0))
		setup := int64(drain(b, h, tm(0)))
		// Steps: SetLimit's load and store of the parameters (a
		// request's load runs with its next step: where it falls
		// between SetLimit's steps is what matters), and the key's
		// words in the old and the new lines (SetLimit's swaps of the
		// others touch nothing the requests read).
		_, sub, _ := placeIn(b.p.Load().lines, b.subs, h)
		watch := watchSetLimit(unsafe.Pointer(&b.p), sub, &b.p.Load().lines[0], func() *line { return &b.p.Load().lines[0] })
		reqs, granted := racers(b, denier, h, rc.reqs)
		fs := append([]func(){func() { noErr(t, b.SetLimit(rc.to, tm(rc.at))) }}, reqs...)
		return watch, fs, func(schedule string) {
			got, reqs := granted()
			total := setup + reqs + int64(drain(b, h, tm(rc.end)))
			if total != want {
				t.Errorf("%s, schedule %s (X is SetLimit): %d granted (%d by the racing requests: %v), want %d", rc.name, schedule, total, reqs, got, want)
			}
		}
	})
	t.Logf("%s: %d schedules", rc.name, schedules)
}

// watchSetLimit accepts SetLimit's loads and stores of the parameters at
// params (SetLimit is goroutine 0), and the words of the key's counters
// (sub) in old and in the line cur returns (the new table's once it is in
// force).
func watchSetLimit(params unsafe.Pointer, sub subset, old *line, cur func() *line) func(int, unsafe.Pointer) bool {
	return func(g int, a unsafe.Pointer) bool {
		if a == params {
			return g == 0
		}
		for _, ln := range []*line{old, cur()} {
			if off := uintptr(a) - uintptr(unsafe.Pointer(ln)); off < 64 && sub.words>>(off/8)&1 != 0 {
				return true
			}
		}
		return false
	}
}

// SetLimit beside decisions: charges made to the lines it is converting,
// and decisions that loaded the old limit before it, are neither dropped nor
// granted twice. On the old code (copy, then swap) charges to lines already
// copied were lost: burst 10 drained at 0, 5 refilled by 0.5 s, and the
// takes of 3 at 0.5 s during the copy were both granted, and then 5 more.
func TestSetLimitRacesAreExact(t *testing.T) {
	ms := time.Millisecond
	ten := Limit{Events: 10, Window: time.Second, Burst: 10}
	for _, rc := range []setRace{
		{"burst 10, 5 refilled, two takes of 3 during the copy", ten, Limit{Events: 20, Window: time.Second, Burst: 10}, 1, 500 * ms,
			[]raceReq{{500 * ms, 3, false}, {500 * ms, 3, false}}, 500 * ms},
		{"raised, a late request", Limit{Events: 2, Window: time.Second}, Limit{Events: 4, Window: time.Second}, 1, 500 * ms,
			[]raceReq{{400 * ms, 1, false}}, 900 * ms},
		{"raised, three counters", Limit{Events: 2, Window: time.Second}, Limit{Events: 4, Window: time.Second}, 3, 500 * ms,
			[]raceReq{{500 * ms, 1, false}}, 900 * ms},
		// The rate halves and the burst stays: a key never goes into a
		// debt that the final drain could not show.
		{"lowered", Limit{Events: 4, Window: time.Second}, Limit{Events: 2, Window: time.Second, Burst: 4}, 1, 500 * ms,
			[]raceReq{{400 * ms, 2, false}}, 1200 * ms},
		{"a rollback across it", Limit{Events: 2, Window: time.Second}, Limit{Events: 4, Window: time.Second}, 1, 500 * ms,
			[]raceReq{{500 * ms, 1, true}}, 900 * ms},
	} {
		rc.run(t)
	}
}

// Two keys that share a counter: A's fullest counter (c0) has one token, its
// others are c2 and c4; B's fullest is c2 (its others, c6 and c8, are a
// burst in debt, as far as a counter goes). Two requests of A race for its
// last token: the loser charges c2 and c4, finds c0 taken, and must give
// them back, or B, which never raced, pays for it. At 1 s B has refilled
// exactly one token.
func TestALostRaceGivesBackWhatAnotherKeyWouldPay(t *testing.T) {
	l := Limit{Events: 2, Window: time.Second}
	schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		b := newTable(t, l, 64)
		ha, hb := hashFor(t, b, 0, 2, 4), hashFor(t, b, 2, 6, 8)
		setAhead(b, 0, 1)
		setAhead(b, 2, 1.25)
		setAhead(b, 4, 2)
		setAhead(b, 6, 4)
		setAhead(b, 8, 4)
		var granted [2]bool
		take := func(i int) func() {
			return func() { d, _ := b.TakeHash(ha, 1, tm(0)); granted[i] = d.Allowed }
		}
		return watchLines(&b.p.Load().lines[0]), []func(){take(0), take(1)}, func(schedule string) {
			a, bGot := count(granted[0])+count(granted[1]), drain(b, hb, tm(time.Second))
			if a != 1 || bGot != 1 {
				t.Errorf("schedule %s: A granted %d (want 1), then B at 1 s %d (want 1: c2 is 0.25 token short)", schedule, a, bGot)
			}
		}
	})
	t.Logf("%d schedules", schedules)
}

// A sweep that zeroes a long-past counter races a take of the other
// counter of the same word: the take's charge must survive (Sweep writes
// with a CAS computed from what it read). The key then holds exactly its
// burst less the take.
func TestASweepNeverOverwritesACharge(t *testing.T) {
	l := Limit{Events: 2, Window: time.Second}
	var schedules int
	schedules = everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		b, err := newBuckets(BucketsConfig{Limit: l, Bytes: 64, K: 1}, clockEpoch)
		noErr(t, err)
		h := hashFor(t, b, 0)
		setAhead(b, 1, 1) // full since 0.5 s, long past at the sweep
		at := tm(time.Duration(b.p.Load().nanos(sweepMargin)) + time.Hour)
		var took bool
		word := &b.p.Load().lines[0][0]
		return func(_ int, a unsafe.Pointer) bool { return a == unsafe.Pointer(word) }, []func(){
				func() { b.Sweep(at) },
				func() { d, _ := b.TakeHash(h, 1, at); took = d.Allowed },
			}, func(schedule string) {
				if got := drain(b, h, at); !took || got != 1 {
					t.Errorf("schedule %s: take granted %v, then %d more, want true and 1", schedule, took, got)
				}
			}
	})
	t.Logf("%d schedules", schedules)
}

// Charge, Fill and a refund after refill, each racing a take of the same
// key (one counter, 2/s, drained at 0).
func TestChargeFillAndLateRefundRacesAreExact(t *testing.T) {
	l := Limit{Events: 2, Window: time.Second}
	ms := time.Millisecond
	const h = 0x0fed_cba9_8765_4321
	for _, tc := range []struct {
		name  string
		other func(b *Buckets, r Reservation)
		end   time.Duration
		want  int // granted to the take and the final drain together
	}{
		// 1.5 tokens at 750 ms, one charged: 0.5 + 1 by 1.25 s, whichever
		// goes first.
		{"charge", func(b *Buckets, _ Reservation) { b.Charge(h, 1, tm(750*ms)) }, 1250 * ms, 1},
		// Full at 750 ms before or after the take: 2 by 1.3 s.
		{"fill", func(b *Buckets, _ Reservation) { b.Fill(h) }, 1300 * ms, 3},
		// The reservation of 0 s was refilled by 1 s: its refund at
		// 750 ms gives back the 0.25 token still owed at most.
		{"late refund", func(b *Buckets, r Reservation) { b.RefundAt(r, tm(750*ms)) }, 1250 * ms, 2},
	} {
		schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
			b, err := newBuckets(BucketsConfig{Limit: l, Bytes: 64, K: 1}, clockEpoch)
			noErr(t, err)
			_, r := b.TakeHash(h, 1, tm(-time.Second)) // before the table: counts as 0
			drain(b, h, tm(0))
			var took bool
			return watchLines(&b.p.Load().lines[0]), []func(){
					func() { tc.other(b, r) },
					func() { d, _ := b.TakeHash(h, 1, tm(750*ms)); took = d.Allowed },
				}, func(schedule string) {
					if got := count(took) + drain(b, h, tm(tc.end)); got != tc.want {
						t.Errorf("%s, schedule %s: take %v, %d granted in all, want %d", tc.name, schedule, took, got, tc.want)
					}
				}
		})
		t.Logf("%s: %d schedules", tc.name, schedules)
	}
}

// A limit raised from 10 a minute to a million a second: its sweep interval
// falls from days to a second, and sweeps at the new interval (what the
// Caddy module's sweep loop runs once SetLimit wakes it) keep every idle
// key full across many wraps of the 32-bit time (4.3 s at that rate).
func TestSweepsAtTheRaisedLimitsIntervalKeepIdleKeysFull(t *testing.T) {
	b := newTable(t, Limit{Events: 10, Window: time.Minute, Burst: 10}, 1<<12)
	slow := b.SweepInterval()
	b.TakeHash(1, 1, tm(0))
	noErr(t, b.SetLimit(Limit{Events: MaxRate, Window: time.Second, Burst: MaxRate}, tm(time.Second)))
	b.TakeHash(2, 1000, tm(time.Second))
	fast := b.SweepInterval()
	if fast > 3*time.Second || slow < 24*time.Hour {
		t.Fatalf("sweep interval %v at 10 a minute, %v at a million a second", slow, fast)
	}
	idle := time.Minute
	for now := time.Second; now <= idle; now += fast / 2 {
		b.Sweep(tm(now))
	}
	for _, h := range []uint64{1, 2} {
		if d := b.PeekHash(h, MaxRate, tm(idle)); !d.Allowed {
			t.Errorf("key %d after %v idle at a million a second: %+v, want full", h, idle, d)
		}
	}
}

// A SetLimit that caps a key's debt at a burst drops the charges on top,
// and a refund of one of those gives back nothing: under a burst of a
// million, X and Y charge 2305 each; SetLimit to 5 per 10 s, burst 5, keeps
// a burst of debt (X's first 10 tokens); Y refunded must leave the key in
// debt. On the old code Y's end, capped with the counter, made Y owe the 10
// tokens that were X's, and the key was full again (found by
// FuzzBucketsAgainstExactReference, seed setlimit-refund-of-a-dropped-charge).
func TestARefundAfterSetLimitGivesBackNothingTheCapDropped(t *testing.T) {
	b := newTable(t, Limit{Events: 10_000, Window: time.Second, Burst: MaxBurst}, 1<<12)
	const h = 77
	_, rx := b.Charge(h, 2305, tm(0))
	_, ry := b.Charge(h, 2305, tm(0))
	if err := b.SetLimit(Limit{Events: 5, Window: 10 * time.Second, Burst: 5}, tm(0)); err != nil {
		t.Fatal(err)
	}
	b.RefundAt(ry, tm(0))
	if d := b.PeekHash(h, 1, tm(0)); d.Allowed {
		t.Errorf("Y, dropped by SetLimit's cap, refunded: %+v, want the key still a burst in debt", d)
	}
	// X's 10 tokens are all that is left of the debt: its refund makes
	// the key full, but for a tick of rounding against the key.
	b.RefundAt(rx, tm(0))
	if d := b.PeekHash(h, 5, tm(time.Millisecond)); !d.Allowed {
		t.Errorf("X refunded too: %+v, want the key full", d)
	}
}

// The refund of an earlier charge moves the charges on top of it down, and
// their Reservations must not give back more than what is left of them:
// burst 2 at one a second, X and Y at 0, X refunded at 0 (Y now ends at
// 1 s), Z at 0.9 s, Y refunded at 0.9 s. Had X and Y never been made the
// key would hold 1 token (Z's charge from full); it must not hold more.
// On the old code Y's Reservation recorded its end as 2 s, so its refund
// gave back a whole token, 0.9 of it Z's, and the key held 1.9. The
// counter and the Reservation are the same as when X was never refunded
// and Z never made (where Y does owe a token), so no rule on them alone
// can give back more than Y's cost less the time since it was charged
// (found by reading; FuzzBucketsAgainstExactReference skipped such
// refunds until this was fixed).
func TestARefundAfterAnEarlierOnesGivesBackNoLaterCharge(t *testing.T) {
	b := newTable(t, Limit{Events: 1, Window: time.Second, Burst: 2}, 1<<12)
	const h = 9
	_, rx := b.TakeHash(h, 1, tm(0))
	_, ry := b.TakeHash(h, 1, tm(0))
	b.RefundAt(rx, tm(0))
	at := tm(900 * time.Millisecond)
	if z, _ := b.TakeHash(h, 1, at); !z.Allowed {
		t.Fatalf("Z: %+v", z)
	}
	b.RefundAt(ry, at)
	if d := b.PeekHash(h, 2, at); d.RetryAfter < 900*time.Millisecond {
		t.Errorf("X and Y refunded, Z charged at 0.9 s: %+v, want at most 1 token left (2 in a second)", d)
	}
}

// The same refunds racing the take that could be given back in their
// stead, through every interleaving of their steps: burst 2 at one a
// second, X and Y at 0; X refunded at 0, Z taken at 0.9 s and Y refunded
// at 0.9 s run in any order (a refund's time read before the take ran is
// a late one). Had X and Y never been made, Z is granted if taken at all
// and the key holds 1.1 tokens at 1 s, so the take and a drain at 1 s
// grant exactly 2 in every schedule. On the old code a schedule that
// refunds X before Y granted 3: Y gave back Z's charge as its own.
func TestRefundsRacingATakeGiveBackNoOtherCharge(t *testing.T) {
	l := Limit{Events: 1, Window: time.Second, Burst: 2}
	ms := time.Millisecond
	// One counter, and two sharing a word (keys of more words are the same
	// refunds word by word, with many more schedules to run).
	for _, counters := range [][]int{{0}, {0, 1}} {
		k := len(counters)
		schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
			b, err := newBuckets(BucketsConfig{Limit: l, Bytes: 64, K: k}, clockEpoch)
			noErr(t, err)
			h := hashFor(t, b, counters...)
			_, rx := b.TakeHash(h, 1, tm(0))
			_, ry := b.TakeHash(h, 1, tm(0))
			var took bool
			return watchLines(&b.p.Load().lines[0]), []func(){
					func() { b.RefundAt(rx, tm(0)) },
					func() { d, _ := b.TakeHash(h, 1, tm(900*ms)); took = d.Allowed },
					func() { b.RefundAt(ry, tm(900*ms)) },
				}, func(schedule string) {
					if got := count(took) + drain(b, h, tm(time.Second)); got != 2 {
						t.Errorf("K=%d, schedule %s (Y takes Z): Z granted %v, %d granted in all, want 2", k, schedule, took, got)
					}
				}
		})
		t.Logf("K=%d: %d schedules", k, schedules)
	}
}

// tokensOf is what the key with hash h holds at ns in b, exactly: the
// burst less its fullest counter's ticks ahead, in tokens.
func tokensOf(b *Buckets, h uint64, ns int64) *big.Rat {
	p := b.p.Load()
	ln, sub, _ := placeIn(p.lines, b.subs, h)
	var a [countersPerLine]uint32
	aheads(ln, uint32(p.ticks(ns)), &a)
	least := uint32(math.MaxUint32)
	for c := range countersPerLine {
		if sub.counters>>c&1 != 0 {
			least = min(least, a[c])
		}
	}
	return new(big.Rat).Sub(big.NewRat(p.limit.EffectiveBurst(), 1), big.NewRat(int64(least), int64(p.per)))
}

// What the refund rule costs, measured: random takes and held charges of
// one key (a zone with action delay over its limit), refunded in any order
// up to 3 s later, against the exact bucket where a refunded charge was
// never made. After every refund the table holds no more than the exact
// bucket (within a few ticks), and the gap that refund opened is at most
// its bound, the refill between its charge and the refund (and at most
// its cost). The test logs how much of that bound the refunds used.
func TestLateRefundsUnderGrantAtMostTheirRefill(t *testing.T) {
	l := Limit{Events: 10, Window: time.Second, Burst: 10}
	tol := big.NewRat(3*int64(tickOf(l))*l.Events, int64(l.Window))
	rate := big.NewRat(l.Events, int64(l.Window))
	var refunds, late int
	gapSum, boundSum := new(big.Rat), new(big.Rat)
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 19))
		b := newTable(t, l, 1<<12)
		x := &exactBucket{first: l}
		y := newOwedBucket(l)
		const h = 42
		type held struct {
			r     Reservation
			event int
			ns    int64
		}
		var hs []held
		var ns int64
		for op := 0; op < 400; op++ {
			ns += r.Int64N(int64(300 * time.Millisecond))
			now := tm(time.Duration(ns))
			switch k := r.IntN(4); {
			case k == 0 && len(hs) > 0:
				i := r.IntN(len(hs))
				c := hs[i]
				hs = append(hs[:i], hs[i+1:]...)
				before := new(big.Rat).Sub(x.at(ns), tokensOf(b, h, ns))
				b.RefundAt(c.r, now)
				x.events[c.event].refunded = true
				gap := new(big.Rat).Sub(x.at(ns), tokensOf(b, h, ns))
				if gap.Cmp(new(big.Rat).Neg(tol)) < 0 {
					t.Fatalf("seed %d op %d: the table holds %s more than the exact bucket", seed, op, new(big.Rat).Neg(gap).FloatString(4))
				}
				paid := x.events[c.event].applied
				bound := new(big.Rat).Mul(rate, big.NewRat(ns-c.ns, 1))
				if bound.Cmp(paid) > 0 {
					bound.Set(paid)
				}
				opened := gap.Sub(gap, before)
				if opened.Cmp(new(big.Rat).Add(bound, tol)) > 0 {
					t.Fatalf("seed %d op %d: a refund %v late opened a gap of %s tokens, more than its bound %s", seed, op,
						time.Duration(ns-c.ns), opened.FloatString(4), bound.FloatString(4))
				}
				refunds++
				if bound.Sign() > 0 {
					late++
					gapSum.Add(gapSum, opened)
					boundSum.Add(boundSum, bound)
				}
			case k == 1:
				w := 1 + r.Int64N(3)
				_, res := b.Charge(h, w, now)
				x.events = append(x.events, event{ns: ns, applied: y.charge(ns, w)})
				hs = append(hs, held{res, len(x.events) - 1, ns})
			default:
				w := 1 + r.Int64N(3)
				if d, res := b.TakeHash(h, w, now); d.Allowed {
					x.events = append(x.events, event{ns: ns, applied: y.charge(ns, w)})
					hs = append(hs, held{res, len(x.events) - 1, ns})
				}
			}
			for len(hs) > 0 && ns-hs[0].ns > int64(3*time.Second) {
				hs = hs[1:] // served: never refunded
			}
		}
	}
	g, _ := gapSum.Float64()
	bd, _ := boundSum.Float64()
	t.Logf("%d refunds, %d of them late: they under-granted %.1f tokens in all against the exact bucket (%.3f a late refund), %.0f%% of their bound of %.1f",
		refunds, late, g, g/float64(max(late, 1)), 100*g/max(bd, 1e-9), bd)
}
