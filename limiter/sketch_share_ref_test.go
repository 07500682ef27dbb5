package limiter

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// denseShares is the reference for WithShares: every cell's reservation
// settled one by one, as WithShares did before it settled only the cells
// in use, plus one cell that never counts anything (quiet) for the default
// a quiet cell's hold is taken from.
type denseShares struct {
	epoch              int64
	counts             []uint32 // the sum's counts plus keep, as WithShares' copy
	keep, since, owned []uint32
	quietKeep, quietAt uint32
}

// withSharesDense settles every cell of s against the sum t, carrying prev
// (nil for none), as WithShares must.
func withSharesDense(t *SketchSum, s *Sketch, n, rank int, now time.Time, prev *denseShares, hold time.Duration) *denseShares {
	cells := s.rows * int(s.width)
	e, el := s.clock(now)
	d := &denseShares{epoch: e, counts: slices.Clone(t.counts)}
	if e != t.epoch {
		return d
	}
	carried := prev != nil && prev.keep != nil && prev.epoch == e
	unit := max(int64(time.Millisecond), s.window>>32)
	at, holdUnits := uint32(el/unit), uint32(min(int64(hold)/unit, 1<<32-1))
	q := uint64(s.quota.Load())
	w, rest := uint64(s.window), uint64(s.window)-uint64(el)
	cp, pp := uint64(e&1), uint64((e-1)&1)
	ct, pt := s.tag(e), s.tag(e-1)
	d.keep, d.since, d.owned = make([]uint32, cells), make([]uint32, cells), make([]uint32, cells)
	// settle is the rule for one cell, from its counts and what prev left
	// in it.
	settle := func(ownPrev, ownCurr, peerPrev, peerCurr uint64, pk, ps, po uint32, prevCount uint64) (uint32, uint32) {
		var held uint64
		since := at
		if carried && pk != 0 {
			then := prevCount - min(uint64(pk), prevCount)
			if used := peerCurr - min(peerCurr, then); used != 0 {
				held = uint64(pk) - min(used, uint64(pk))
			} else if ownCurr > uint64(po) {
				held = uint64(pk)
			} else if at-min(at, ps) < holdUnits {
				held, since = uint64(pk), ps
			}
		}
		hi, lo := bits.Mul64(ownPrev+peerPrev, rest)
		h2, l2 := bits.Mul64(ownCurr+peerCurr, w)
		lo, carry := bits.Add64(lo, l2, 0)
		hi, _ = bits.Add64(hi, h2, carry)
		est, rem := bits.Div64(hi, lo, w)
		if rem != 0 {
			est++
		}
		left := q - min(est, q)
		share := left / uint64(n)
		if uint64(rank) < left%uint64(n) {
			share++
		}
		keep := left - share
		if held >= keep {
			keep = held
		} else {
			since = at
		}
		if keep = min(keep, MaxSketchQuota); keep == 0 {
			return 0, 0
		}
		return uint32(keep), since
	}
	var pqk, pqa uint32
	if carried {
		pqk, pqa = prev.quietKeep, prev.quietAt
	}
	d.quietKeep, d.quietAt = settle(0, 0, 0, 0, pqk, pqa, 0, uint64(pqk))
	for i := range cells {
		ownPrev := sketchCount(s.slots[2*i+int(pp)].Load(), pt)
		ownCurr := sketchCount(s.slots[2*i+int(cp)].Load(), ct)
		peerPrev, peerCurr := uint64(t.counts[2*i]), uint64(t.counts[2*i+1])
		var pk, ps, po uint32
		var prevCount uint64
		if carried {
			pk, ps, po, prevCount = prev.keep[i], prev.since[i], prev.owned[i], uint64(prev.counts[2*i+1])
		}
		keep, since := settle(ownPrev, ownCurr, peerPrev, peerCurr, pk, ps, po, prevCount)
		if ownPrev|ownCurr|peerPrev|peerCurr == 0 && keep == d.quietKeep && since <= d.quietAt {
			since = d.quietAt // a quiet cell whose hold began no later takes the quiet one's
		}
		d.keep[i], d.since[i], d.owned[i] = keep, since, uint32(min(ownCurr, MaxSketchQuota))
		d.counts[2*i+1] = uint32(min(peerCurr+uint64(keep), MaxSketchQuota))
	}
	return d
}

// plainCounts returns the sum's counts as the reference holds them: each
// count of the current window with the copy's default added (curr).
func (t *SketchSum) plainCounts() []uint32 {
	c := slices.Clone(t.counts)
	for i := 1; i < len(c); i += 2 {
		c[i] += t.def
	}
	return c
}

// expand returns a copy made by WithShares as the reference holds it:
// every cell's reservation, since and own count.
func (t *SketchSum) expand() (keep, since, owned []uint32) {
	st := t.shares
	cells := t.rows * t.width
	keep, since, owned = make([]uint32, cells), make([]uint32, cells), make([]uint32, cells)
	for i := range cells {
		keep[i], since[i] = st.def, st.defSince
	}
	for _, c := range st.cells {
		keep[c.i], since[c.i], owned[c.i] = c.keep, c.since, c.owned
	}
	return keep, since, owned
}

// TestWithSharesMatchesTheReference drives an instance's sketch and its
// peers' sums through charges, refunds, resets, instances coming and
// going and time passing (within a window and across windows), re-balancing
// each time with both WithShares and the dense reference, each carrying its
// own previous copy, and checks that every cell's count, reservation, hold
// and own count agree: settling only the cells in use changes nothing.
func TestWithSharesMatchesTheReference(t *testing.T) {
	for seed := range uint64(12) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 11))
			cfg := SketchConfig{Quota: 1 + rng.Int64N(40), Window: 10 * time.Second, Rows: 3, Width: 61}
			own, _ := NewSketch(cfg)
			peers := []*Sketch{}
			for range 3 {
				p, _ := NewSketch(cfg)
				peers = append(peers, p)
			}
			now := time.Unix(1_700_000_000, 0)
			hold := time.Duration(1+rng.IntN(4)) * time.Second
			var shared *SketchSum
			var ref *denseShares
			var grants []Reservation
			n, rank := 3, 1
			keys := make([]uint64, 3+rng.IntN(30))
			for i := range keys {
				keys[i] = rng.Uint64()
			}
			for step := range 400 {
				for range rng.IntN(6) * rng.IntN(3) { // idle at times, so that cells go quiet
					switch r := rng.IntN(10); {
					case r < 4:
						if _, res := own.TakeHashWith(keys[rng.IntN(len(keys))], 1+rng.Int64N(3), now, shared); res.units > 0 {
							grants = append(grants, res)
						}
					case r < 8:
						peers[rng.IntN(len(peers))].TakeHash(keys[rng.IntN(len(keys))], 1+rng.Int64N(3), now)
					case r < 9 && len(grants) > 0:
						k := rng.IntN(len(grants))
						own.Refund(grants[k])
						grants = slices.Delete(grants, k, k+1)
					default:
						own.ResetHash(keys[rng.IntN(len(keys))], now, now)
					}
				}
				if rng.IntN(3) == 0 {
					now = now.Add(time.Duration(rng.IntN(2500)) * time.Millisecond)
				}
				// A read: the peers' sum as snapshots give it, sometimes
				// less a key (cells listed at zero), then the shares.
				sum := own.NewSketchSum(now)
				for _, p := range peers {
					snap, _ := p.AppendSnapshot(nil, now)
					if _, err := sum.AddBinary(snap); err != nil {
						t.Fatal(err)
					}
				}
				if rng.IntN(5) == 0 {
					sum.ForgetHash(keys[rng.IntN(len(keys))], now)
				}
				if rng.IntN(10) == 0 { // instances come and go
					n = 2 + rng.IntN(3)
					rank = rng.IntN(n)
				}
				if rng.IntN(15) == 0 && shared != nil { // a reset drops what is carried
					shared = shared.WithoutHash(keys[rng.IntN(len(keys))], now)
					ref.keep = nil
				}
				shared = sum.WithShares(own, n, rank, now, shared, hold)
				ref = withSharesDense(sum, own, n, rank, now, ref, hold)
				if !slices.Equal(shared.plainCounts(), ref.counts) {
					t.Fatalf("step %d: the counts differ from the reference's", step)
				}
				if rng.IntN(6) == 0 { // a reset asked for while the sum was built (see storage's replaceView)
					k := keys[rng.IntN(len(keys))]
					shared.ForgetHash(k, now)
					dense := &SketchSum{window: sum.window, rows: sum.rows, width: sum.width, ring: sum.ring, epoch: sum.epoch, counts: ref.counts}
					dense.ForgetHash(k, now)
					if !slices.Equal(shared.plainCounts(), ref.counts) {
						t.Fatalf("step %d: the counts less a key differ from the reference's", step)
					}
				}
				if (shared.shares == nil) != (ref.keep == nil) {
					t.Fatalf("step %d: shares %v, the reference's %v", step, shared.shares != nil, ref.keep != nil)
				}
				if shared.shares == nil {
					continue
				}
				keep, since, owned := shared.expand()
				for i := range keep {
					if keep[i] != ref.keep[i] || since[i] != ref.since[i] || owned[i] != ref.owned[i] {
						t.Fatalf("step %d cell %d: keep %d since %d owned %d, the reference's %d %d %d",
							step, i, keep[i], since[i], owned[i], ref.keep[i], ref.since[i], ref.owned[i])
					}
				}
			}
		})
	}
}
