package siphash

import "testing"

// The reference implementation's vector for the 8-byte message 00 01 … 07
// under the key 00 01 … 0f (its vectors_sip64[8]).
func TestReferenceVector(t *testing.T) {
	const k0, k1, m = 0x0706050403020100, 0x0f0e0d0c0b0a0908, 0x0706050403020100
	if got, want := Sum64(k0, k1, m), uint64(0x93f5f5799a932462); got != want {
		t.Fatalf("Sum64 = %#x, want %#x", got, want)
	}
}

// Each half of the key changes the result.
func TestEveryPartOfTheKeyCounts(t *testing.T) {
	base := Sum64(1, 2, 3)
	for _, other := range []uint64{Sum64(0, 2, 3), Sum64(1, 0, 3), Sum64(1, 2, 0)} {
		if other == base {
			t.Fatalf("a changed input gave the same hash %#x", base)
		}
	}
}

func BenchmarkSum64(b *testing.B) {
	var h uint64
	for i := range b.N {
		h = Sum64(h, 42, uint64(i))
	}
	sink = h
}

var sink uint64
