package limiter

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// sharing returns a key that shares exactly shared of its cells with h in
// s, and one that shares none if shared is 0.
func sharing(t *testing.T, s *Sketch, h uint64, shared int) uint64 {
	t.Helper()
	var hc, kc sketchCols
	s.columns(h, &hc)
	for i := range 1 << 20 {
		k := Hash(fmt.Appendf(nil, "key%d", i))
		s.columns(k, &kc)
		n := 0
		for r := 0; r < s.rows; r++ {
			if kc[r] == hc[r] {
				n++
			}
		}
		if n == shared && k != h {
			return k
		}
	}
	t.Fatalf("no key shares %d cells", shared)
	return 0
}

// A reset subtracts the key's own counts in both windows, never below zero,
// and leaves a key that shares none of its cells as it was; a key sharing
// one cell keeps its count there.
func TestSketchResetHash(t *testing.T) {
	const window = 10 * time.Second
	s := newSumTestSketch(t, 100, window, 4, 64)
	k := Hash([]byte("k"))
	apart, near := sharing(t, s, k, 0), sharing(t, s, k, 1)
	t0 := sketchEpoch0.Add(2 * time.Second)
	chargeSketch(t, s, k, 7, t0)
	chargeSketch(t, s, near, 4, t0)
	now := t0.Add(window)
	chargeSketch(t, s, k, 3, now)
	chargeSketch(t, s, apart, 5, now)
	if got := s.Estimate(k, now); got != 7*0.8+3 {
		t.Fatalf("before the reset k's estimate is %v", got)
	}
	s.ResetHash(k, now, now)
	if got := s.Estimate(k, now); got != 0 {
		t.Fatalf("after the reset k's estimate is %v, want 0", got)
	}
	if got := s.Estimate(apart, now); got != 5 {
		t.Fatalf("a key sharing no cell: %v, want its 5", got)
	}
	if got := s.Estimate(near, now); got != 4*0.8 {
		t.Fatalf("a key sharing one cell: %v, want its 4 of the previous window", got)
	}
	// Again: nothing is left to take, and no counter wraps below zero.
	s.ResetHash(k, now, now)
	if d := s.PeekHash(k, 100, now); !d.Allowed || d.Remaining != 100 {
		t.Fatalf("after two resets k gets %+v, want the whole quota", d)
	}
	for i := range s.slots {
		if c := s.slots[i].Load() & sketchCountMask; c > 100 {
			t.Fatalf("a counter holds %d: it wrapped", c)
		}
	}
}

// A reset forgets the windows that had begun by its time, not later ones:
// a reset learned late keeps what the key took after it.
func TestSketchResetHashKeepsLaterWindows(t *testing.T) {
	const window = 10 * time.Second
	s := newSumTestSketch(t, 100, window, 4, 64)
	k := Hash([]byte("k"))
	at := sketchEpoch0.Add(5 * time.Second)
	chargeSketch(t, s, k, 40, at)
	now := at.Add(window)
	chargeSketch(t, s, k, 6, now) // after the reset, in the next window
	s.ResetHash(k, at, now)
	if got := s.Estimate(k, now); got != 6 {
		t.Fatalf("estimate %v, want the 6 taken in the window after the reset", got)
	}
}

// WithoutHash leaves the sum it copies, which deciders may be reading,
// untouched, and takes the key's counts out of the copy.
func TestSketchSumWithoutHash(t *testing.T) {
	const window = 10 * time.Second
	own := newSumTestSketch(t, 10, window, 4, 64)
	peer := newSumTestSketch(t, 1<<20, window, 4, 64)
	k := Hash([]byte("k"))
	apart := sharing(t, own, k, 0)
	now := sketchEpoch0.Add(3 * time.Second)
	chargeSketch(t, peer, k, 9, now.Add(-window))
	chargeSketch(t, peer, k, 4, now)
	chargeSketch(t, peer, apart, 8, now)
	sum := own.NewSketchSum(now)
	if _, err := sum.AddBinary(must(peer.AppendSnapshot(nil, now))); err != nil {
		t.Fatal(err)
	}
	before := slices.Clone(sum.counts)
	cp := sum.WithoutHash(k, now)
	if !slices.Equal(sum.counts, before) {
		t.Fatal("WithoutHash changed the sum it copied")
	}
	if d := own.PeekHashWith(k, 10, now, cp); !d.Allowed {
		t.Fatalf("k with the copy: %+v, want the whole quota", d)
	}
	if d := own.PeekHashWith(k, 1, now, sum); d.Allowed {
		t.Fatalf("k with the original sum: %+v, want denied", d)
	}
	if d := own.PeekHashWith(apart, 2, now, cp); !d.Allowed || d.Remaining != 2 {
		t.Fatalf("another key with the copy: %+v, want its 8 of 10 still counted", d)
	}
	if d := own.PeekHashWith(apart, 3, now, cp); d.Allowed {
		t.Fatalf("another key with the copy: %+v, want its 8 of 10 still counted", d)
	}
	if (*SketchSum)(nil).WithoutHash(k, now) != nil {
		t.Fatal("a nil sum's copy is not nil")
	}
}

// Adding a snapshot forgetting keys gives the sum that adding the
// snapshot of the same sketch reset for those keys gives, cell for cell,
// whatever the snapshot's window relative to the sum's, and leaves the
// counts other snapshots add for the keys; subtracting it forgetting the
// same keys takes out exactly that.
func TestAddBinaryForgettingIsAddingTheResetSnapshot(t *testing.T) {
	const window = 10 * time.Second
	rng := rand.New(rand.NewPCG(3, 4))
	own := newSumTestSketch(t, 1<<20, window, 4, 128)
	t0 := sketchEpoch0.Add(4 * time.Second)
	for _, lag := range []int{-1, 0, 1, 2} {
		peer := newSumTestSketch(t, 1<<20, window, 4, 128)
		other := newSumTestSketch(t, 1<<20, window, 4, 128)
		for w := range 2 {
			for range 600 {
				h := Hash([]byte{byte(rng.IntN(200))})
				chargeSketch(t, peer, h, 1+rng.Int64N(4), t0.Add(time.Duration(w)*window))
				chargeSketch(t, other, h, 1, t0.Add(time.Duration(w)*window))
			}
		}
		taken := t0.Add(window) // the snapshot's current window is t0's + 1
		snap := must(peer.AppendSnapshot(nil, taken))
		var forget []Forget
		for i := range 12 {
			// Some resets cover both of the snapshot's windows, some only
			// its previous one.
			at := taken
			if i%3 == 0 {
				at = t0
			}
			forget = append(forget, Forget{Hash: Hash([]byte{byte(rng.IntN(200))}), At: at})
		}
		forget = append(forget, forget[0]) // a key twice: the second finds nothing
		reset := newSumTestSketch(t, 1<<20, window, 4, 128)
		if err := reset.mergeBinary(snap, taken); err != nil {
			t.Fatal(err)
		}
		for _, f := range forget {
			reset.ResetHash(f.Hash, f.At, taken)
		}
		at := taken.Add(time.Duration(lag) * window)
		want, got := own.NewSketchSum(at), own.NewSketchSum(at)
		for _, sum := range []*SketchSum{want, got} {
			if _, err := sum.AddBinary(must(other.AppendSnapshot(nil, taken))); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := want.AddBinary(must(reset.AppendSnapshot(nil, taken))); err != nil {
			t.Fatal(err)
		}
		e, err := got.AddBinaryForgetting(snap, forget)
		if err != nil || e != WindowNumber(taken, window) {
			t.Fatalf("lag %d: AddBinaryForgetting = %d, %v", lag, e, err)
		}
		if !slices.Equal(got.counts, want.counts) {
			t.Fatalf("lag %d: the sum differs from the reset snapshot's", lag)
		}
		plain := own.NewSketchSum(at)
		_, _ = plain.AddBinary(must(other.AppendSnapshot(nil, taken)))
		_, _ = plain.AddBinary(snap)
		if lag < 2 && slices.Equal(got.counts, plain.counts) {
			t.Fatalf("lag %d: nothing was forgotten", lag)
		}
		// Taken out again, forgetting the same keys, as an instance takes
		// its own snapshot out of an aggregate: the other's sum is left.
		if e, err := got.SubtractBinaryForgetting(snap, forget); err != nil || e != WindowNumber(taken, window) {
			t.Fatalf("lag %d: SubtractBinaryForgetting = %d, %v", lag, e, err)
		}
		alone := own.NewSketchSum(at)
		_, _ = alone.AddBinary(must(other.AppendSnapshot(nil, taken)))
		if !slices.Equal(got.counts, alone.counts) {
			t.Fatalf("lag %d: the sum less the snapshot, forgetting the same keys, is not the other's", lag)
		}
		// MergeBinaryForgetting restores the same reset counts.
		merged := newSumTestSketch(t, 1<<20, window, 4, 128)
		if err := merged.MergeBinaryForgetting(snap, taken, forget); err != nil {
			t.Fatal(err)
		}
		assertSameSketch(t, merged, reset, taken)
	}
	if _, err := own.NewSketchSum(t0).AddBinaryForgetting([]byte("junk"), []Forget{{Hash: 1, At: t0}}); err == nil {
		t.Fatal("junk was added")
	}
	if _, err := own.NewSketchSum(t0).SubtractBinaryForgetting([]byte("junk"), nil); err == nil {
		t.Fatal("junk was taken out")
	}
}

func TestWindowNumber(t *testing.T) {
	for _, tc := range []struct {
		t    time.Time
		w    time.Duration
		want int64
	}{
		{time.Unix(0, 0), time.Second, 0},
		{time.Unix(0, 999_999_999), time.Second, 0},
		{time.Unix(1, 0), time.Second, 1},
		{time.Unix(0, -1), time.Second, -1},
		{time.Unix(-1, 0), time.Second, -1},
		{time.Unix(-1, -1), time.Second, -2},
	} {
		if got := WindowNumber(tc.t, tc.w); got != tc.want {
			t.Errorf("WindowNumber(%v, %v) = %d, want %d", tc.t.UnixNano(), tc.w, got, tc.want)
		}
	}
}
