package limiter

import (
	"math/bits"
	"testing"
	"time"
	"unsafe"
)

// pairedKey returns a hash whose key, on a one-line table of b, has both
// counters of some word, and that word.
func pairedKey(t *testing.T, b *Buckets) (uint64, int) {
	t.Helper()
	p := b.p.Load()
	for h := uint64(1); h < 1<<12; h++ {
		h := h * 0x9e37_79b9_7f4a_7c15
		_, sub, _ := placeIn(p.lines, b.subs, h)
		for m := sub.words; m != 0; m &= m - 1 {
			if w := bits.TrailingZeros8(m); sub.lanes(w) == 3 {
				return h, w
			}
		}
	}
	t.Fatal("no key of 4096 has two counters in one word")
	return 0, 0
}

// atTick is the first time b's clock reads tick.
func atTick(b *Buckets, tick uint64) time.Time {
	return b.base.Add(time.Duration(b.p.Load().nanos(tick)))
}

// markerIn returns the first word of b's lines with a counter holding
// 0xFFFFFFFF, or -1.
func markerIn(b *Buckets) (int, uint64) {
	for i, ln := range b.p.Load().lines {
		for j, w := range ln {
			if uint32(w) == ^uint32(0) || uint32(w>>32) == ^uint32(0) {
				return 8*i + j, w
			}
		}
	}
	return -1, 0
}

// TestNoCounterHoldsTheFrozenMarker: a charge, a charge without a check
// and a refund that would end a counter at 0xFFFFFFFF (at the wrap of the
// 32-bit tick) store 1 there instead (valid), so that no word of a key
// whose two counters share it becomes the frozen marker. On a valid that
// maps only 0 to 1 (the XDP program's old store), every case stores the
// marker.
func TestNoCounterHoldsTheFrozenMarker(t *testing.T) {
	for _, l := range []Limit{
		{Events: 5, Window: time.Second, Burst: 8},
		{Events: MaxRate, Window: time.Second, Burst: 3},
	} {
		fresh := func() (*Buckets, uint64, uint64) {
			b, err := newBuckets(BucketsConfig{Limit: l, Bytes: 64, K: 8}, clockEpoch)
			if err != nil {
				t.Fatal(err)
			}
			h, _ := pairedKey(t, b)
			return b, h, b.p.Load().per
		}
		_, _, c := fresh()
		edge := uint64(1<<32-1) - c // a token charged here ends at 0xFFFFFFFF
		for _, tc := range []struct {
			name string
			run  func(b *Buckets, h uint64)
		}{
			{"a take", func(b *Buckets, h uint64) { b.TakeHash(h, 1, atTick(b, edge)) }},
			{"a take of two", func(b *Buckets, h uint64) { b.TakeHash(h, 2, atTick(b, edge-c)) }},
			{"a charge", func(b *Buckets, h uint64) { b.Charge(h, 1, atTick(b, edge)) }},
			// Two takes a tick before the edge; the second's refund
			// at the edge owes c − 1 (a tick has refilled) and leaves
			// the counters c ahead of the edge: at 0xFFFFFFFF.
			{"a refund", func(b *Buckets, h uint64) {
				b.TakeHash(h, 1, atTick(b, edge-1))
				_, r := b.TakeHash(h, 1, atTick(b, edge-1))
				b.RefundAt(r, atTick(b, edge))
			}},
		} {
			b, h, _ := fresh()
			tc.run(b, h)
			if i, w := markerIn(b); i >= 0 {
				t.Errorf("%v, %s at the wrap: word %d is %#x, a counter holds 0xFFFFFFFF", l, tc.name, i, w)
			}
		}
	}
}

// returnsWithin runs f and fails the test if it has not returned in 10 s (it is
// left running: on the old code it spun for ever).
func returnsWithin(t *testing.T, name string, f func()) bool {
	t.Helper()
	done := make(chan struct{})
	go func() { f(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(10 * time.Second):
		t.Errorf("%s on a table with a stray frozen word did not return in 10 s", name)
		return false
	}
}

// TestAStrayFrozenWordIsThawed: a frozen word that no SetLimit wrote (the
// XDP program once stored one; see valid) is waited on by nothing. An
// operation that meets it stores in it what valid makes of two 0xFFFFFFFF
// and goes on: on the old code PeekHash, TakeHash, Charge, Fill, Stats and
// RefundAt waited for ever for a new table, and Sweep stopped at it,
// leaving the rest of the table unswept.
func TestAStrayFrozenWordIsThawed(t *testing.T) {
	l := Limit{Events: 5, Window: time.Second, Burst: 8}
	at := tm(time.Second)
	for _, tc := range []struct {
		name string
		run  func(b *Buckets, h uint64, freeze func())
	}{
		{"PeekHash", func(b *Buckets, h uint64, freeze func()) { freeze(); b.PeekHash(h, 1, at) }},
		{"TakeHash", func(b *Buckets, h uint64, freeze func()) { freeze(); b.TakeHash(h, 1, at) }},
		{"Charge", func(b *Buckets, h uint64, freeze func()) { freeze(); b.Charge(h, 1, at) }},
		{"Fill", func(b *Buckets, h uint64, freeze func()) { freeze(); b.Fill(h) }},
		{"Stats", func(b *Buckets, h uint64, freeze func()) { freeze(); b.Stats(at) }},
		{"RefundAt", func(b *Buckets, h uint64, freeze func()) {
			_, r := b.TakeHash(h, 1, at)
			freeze()
			b.RefundAt(r, at)
		}},
	} {
		b, err := newBuckets(BucketsConfig{Limit: l, Bytes: 64, K: 8}, clockEpoch)
		if err != nil {
			t.Fatal(err)
		}
		h, w := pairedKey(t, b)
		p := b.p.Load()
		if !returnsWithin(t, tc.name, func() { tc.run(b, h, func() { p.lines[0][w] = frozen }) }) {
			continue
		}
		if b.p.Load() != p {
			t.Errorf("%s: the table was replaced", tc.name)
		}
		if v := p.lines[0][w]; v == frozen {
			t.Errorf("%s: the word is still frozen", tc.name)
		}
		if d := b.PeekHash(h, 1, at); !d.Allowed {
			t.Errorf("%s: then the key is denied: %+v", tc.name, d)
		}
	}

	// Sweep thaws the word, sweeps it, and sweeps the lines after it.
	b, err := newBuckets(BucketsConfig{Limit: l, Bytes: 128}, clockEpoch)
	if err != nil {
		t.Fatal(err)
	}
	p := b.p.Load()
	p.lines[0][0] = frozen
	p.lines[1][0] = 5 // long past at the sweep's tick
	b.Sweep(atTick(b, sweepMargin+10))
	if p.lines[0][0] != 0 || p.lines[1][0] != 0 {
		t.Errorf("after Sweep the stray frozen word is %#x and a long-past word after it %#x, want both swept to 0", p.lines[0][0], p.lines[1][0])
	}
}

// A stray frozen word beside SetLimit, through every interleaving: the
// decision that meets it thaws it only while no SetLimit runs, and waits
// for the new table while one does, so no schedule writes a word of the
// replaced table after the conversion froze it (a grant there would be
// lost from the conversion), none waits for ever, and the key, full at
// its time, is granted in every schedule.
func TestAStrayFrozenWordBesideSetLimit(t *testing.T) {
	from, to := Limit{Events: 5, Window: time.Second, Burst: 8}, Limit{Events: 10, Window: time.Second, Burst: 8}
	schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		b, err := newBuckets(BucketsConfig{Limit: from, Bytes: 64, K: 2}, clockEpoch)
		if err != nil {
			t.Fatal(err)
		}
		h, w := pairedKey(t, b) // both counters in word w
		old := b.p.Load()
		old.lines[0][w] = frozen
		_, sub, _ := placeIn(old.lines, b.subs, h)
		watch := watchSetLimit(unsafe.Pointer(&b.p), sub, &old.lines[0], func() *line { return &b.p.Load().lines[0] })
		var granted bool
		fs := []func(){
			func() { noErr(t, b.SetLimit(to, tm(time.Second))) },
			func() { d, _ := b.TakeHash(h, 1, tm(time.Second)); granted = d.Allowed },
		}
		return watch, fs, func(schedule string) {
			for j, v := range old.lines[0] {
				if v != frozen {
					t.Errorf("schedule %s (X is SetLimit): word %d of the replaced line is %#x after the conversion", schedule, j, v)
				}
			}
			if i, v := markerIn(b); i >= 0 {
				t.Errorf("schedule %s: word %d of the new table is %#x", schedule, i, v)
			}
			if !granted {
				t.Errorf("schedule %s: the key, full, was denied", schedule)
			}
		}
	})
	t.Logf("%d schedules", schedules)
}
