package limiter

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestSubSatMatchesReference(t *testing.T) {
	edges := []uint64{0, 1, 2, 63, 64, 1023, 1024, 1 << 20, laneMask - 1, laneMask}
	check := func(a, b, amount uint64) {
		t.Helper()
		v := a | b<<32
		if got, want := subSat(v, amount), subSatRef(v, amount); got != want {
			t.Fatalf("subSat(%d|%d<<32, %d) = %#x, reference %#x", a, b, amount, got, want)
		}
	}
	for _, a := range edges {
		for _, b := range edges {
			for _, amount := range edges {
				check(a, b, amount)
			}
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 1_000_000 {
		check(r.Uint64()&laneMask, r.Uint64()&laneMask, r.Uint64()&laneMask)
	}
}

func TestSettlePaysOnlyStaleNonZeroWords(t *testing.T) {
	const pending = 100
	tests := []struct {
		name      string
		w, gen    uint64
		want      uint64
		wantOwing bool
	}{
		{"current word is untouched", 150 | 70<<32 | 1<<63, 1, 150 | 70<<32 | 1<<63, false},
		{"stale word pays, flooring at zero", 150 | 70<<32, 1, 50 | 1<<63, true},
		{"stale zero word owes nothing", 0, 1, 1 << 63, false},
		{"generation zero is current too", 5 | 5<<32, 0, 5 | 5<<32, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := owes(tt.w, tt.gen); got != tt.wantOwing {
				t.Errorf("owes = %v, want %v", got, tt.wantOwing)
			}
			if got := settle(tt.w, pending, tt.gen); got != tt.want {
				t.Errorf("settle = %#x, want %#x", got, tt.want)
			}
		})
	}
}

func FuzzSubSat(f *testing.F) {
	f.Add(uint64(0), uint64(0))
	f.Add(uint64(laneMask|laneMask<<32), uint64(1))
	f.Add(uint64(1024|5<<32), uint64(1024))
	f.Fuzz(func(t *testing.T, v, amount uint64) {
		v &= valueMask
		amount &= laneMask
		if got, want := subSat(v, amount), subSatRef(v, amount); got != want {
			t.Fatalf("subSat(%#x, %d) = %#x, reference %#x", v, amount, got, want)
		}
	})
}

func TestDivisorIsExactDivision(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for _, tick := range []time.Duration{1000, 1001, 1333, 625 * time.Millisecond, 145833333, 1<<40 + 7} {
		lt := newLineTable(1, tick)
		for range 100_000 {
			ns := int64(r.Uint64() >> 1)
			if r.IntN(2) == 0 {
				ns = int64(r.Uint64N(1 << 40))
			}
			if got, want := lt.ticksAt(ns), ns/int64(tick); got != want {
				t.Fatalf("ticksAt(%d) with tick %d = %d, want %d", ns, tick, got, want)
			}
			if got, want := newDivisor(uint64(tick)).div(uint64(ns)*2), uint64(ns)*2/uint64(tick); got != want {
				t.Fatalf("div(%d) by %d = %d, want %d", uint64(ns)*2, tick, got, want)
			}
		}
		for _, ns := range []int64{0, int64(tick) - 1, int64(tick), 1<<63 - 1} {
			if got, want := lt.ticksAt(ns), ns/int64(tick); got != want {
				t.Fatalf("ticksAt(%d) with tick %d = %d, want %d", ns, tick, got, want)
			}
		}
	}
}
