package limiter

import (
	"math/rand/v2"
	"testing"
	"time"
)

// Between two reads a decision's counts change only with time: so a
// request denied on a copy made by WithShares, told to retry after r, is
// granted on that copy r later (with no traffic between), whatever the
// room that freed meanwhile leaves the others (addFreed: the others'
// shares of what left the view, of what stopped lingering, of a raise).
// Random schedules: a peer (the others, summed) and this instance grant
// a key at random times of the last window, the sum lingering up to 0.9
// sub-window, a copy made with 2 to 5 instances (carrying a previous
// one's reservations), a quota maybe raised since; then requests of
// weight 1 to 3 at random times up to 8 sub-windows after the copy.
// Before, the wait counted what left the view as freed whole, where the
// copy left the others all but this instance's share of it: 189 of 842
// denials were denied again at their Retry-After. The wait is never
// more than the view's 8 sub-windows (what the copy counts has all left
// it by then).
func TestSlidingCopyRetryAfterPassesOnTheCopy(t *testing.T) {
	const quota = 30
	early, checked := 0, 0
	for seed := range uint64(400) {
		rng := rand.New(rand.NewPCG(seed, 29))
		peer, own, L, start, h := fourSecondPair(t, quota)
		at := func(span time.Duration) time.Time {
			return start.Add(time.Duration(rng.Int64N(int64(span))))
		}
		for range 1 + rng.IntN(6) {
			peer.TakeHashWith(h, 1+rng.Int64N(12), at(8*L), nil)
			own.TakeHashWith(h, 1+rng.Int64N(8), at(8*L), nil)
		}
		n := 2 + rng.IntN(4)
		linger := time.Duration(rng.Int64N(int64(L) * 9 / 10))
		copyAt := func(now time.Time, prev *SketchSum) *SketchSum {
			sum := own.NewSketchSum(now)
			snap, _ := peer.AppendSnapshot(nil, now)
			if _, err := sum.AddBinaryLinger(snap, nil, 0, linger); err != nil {
				t.Fatal(err)
			}
			return sum.WithShares(own, n, rng.IntN(n), now, prev, 4*time.Second)
		}
		made := start.Add(8 * L).Add(time.Duration(rng.Int64N(int64(L))))
		shared := copyAt(made, copyAt(made.Add(-time.Duration(rng.Int64N(int64(2*L)))), nil))
		if rng.IntN(4) == 0 {
			if err := own.SetQuota(quota + 1 + rng.Int64N(10)); err != nil {
				t.Fatal(err)
			}
		}
		for range 10 {
			now := made.Add(time.Duration(rng.Int64N(int64(8 * L))))
			w := 1 + rng.Int64N(3)
			d := own.PeekHashWith(h, w, now, shared)
			if d.Allowed || d.RetryAfter == Never {
				continue
			}
			checked++
			if d.RetryAfter > 8*L {
				t.Errorf("seed %d: told to retry after %v, more than the view's 8 sub-windows", seed, d.RetryAfter)
			}
			if !own.PeekHashWith(h, w, now.Add(d.RetryAfter), shared).Allowed {
				if early++; early <= 5 {
					t.Logf("seed %d: %d instances, weight %d denied %v after the copy, told to retry after %v, denied then", seed, n, w, now.Sub(made), d.RetryAfter)
				}
			}
		}
	}
	t.Logf("%d denials on a copy, %d of them denied again at their Retry-After", checked, early)
	if checked == 0 || early > 0 {
		t.Errorf("%d of %d denials on a copy denied again at their Retry-After, want none (and some denials)", early, checked)
	}
}
