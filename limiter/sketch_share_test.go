package limiter

import (
	"testing"
	"time"
)

// The shares of n instances that decide on the same counts add up to what
// the key has left, remainders included, whatever n.
func TestWithSharesAddUpToWhatIsLeft(t *testing.T) {
	now := time.Unix(1_700_000_040, 0).Add(10 * time.Second)
	s, err := NewSketch(SketchConfig{Quota: 10, Window: time.Minute, Rows: 4, Width: 64})
	if err != nil {
		t.Fatal(err)
	}
	h := HashString("k")
	s.TakeHashWith(h, 3, now, nil) // 7 left
	sum := s.NewSketchSum(now)
	for n := 1; n <= 9; n++ {
		total := int64(0)
		for rank := range n {
			total += s.PeekHashWith(h, 1, now, sum.WithShares(s, n, rank, now)).Remaining
		}
		if total != 7 {
			t.Errorf("%d instances: shares add up to %d, want the 7 left", n, total)
		}
	}
	if got := sum.WithShares(s, 1, 0, now); got != sum {
		t.Error("one instance: the sum was copied")
	}
	if !sum.CellZero(0) {
		t.Error("the sum itself was changed")
	}
}
