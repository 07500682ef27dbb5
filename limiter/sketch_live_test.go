package limiter

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// countedCells is the reference liveCells must cover: every cell with a
// count in window e − 1 of now or later, found by reading them all.
func (s *Sketch) countedCells(now time.Time) []int32 {
	e, _ := s.clock(now)
	var out []int32
	for i := range s.rows * int(s.width) {
		for p := range 2 {
			word := s.slots[2*i+p].Load()
			if word&sketchCountMask == 0 {
				continue
			}
			// The window the word holds: its tag and the counter's parity.
			if w := int64(word>>32)<<1 | int64(p); w >= e-1 {
				out = append(out, int32(i))
				break
			}
		}
	}
	return out
}

// TestLiveCellsCoverEveryCountedCell drives a sketch through charges (some
// with a clock ahead of the walk's, as a decision racing a sync at a
// window's end has), refunds, resets, restores and the windows passing,
// and checks at each walk that the cells listed cover every cell that
// counts something, that the snapshot written from them is the one a walk
// of every cell gives, and that cells whose windows have passed leave the
// list.
func TestLiveCellsCoverEveryCountedCell(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 3))
		s, err := NewSketch(SketchConfig{Quota: 50, Window: time.Second, Rows: 3, Width: 97})
		if err != nil {
			t.Fatal(err)
		}
		now := time.Unix(1_700_000_000, 0)
		var grants []Reservation
		for step := range 400 {
			switch r := rng.IntN(10); {
			case r < 5:
				at := now
				if rng.IntN(4) == 0 {
					at = now.Add(time.Duration(rng.IntN(1500)) * time.Millisecond) // ahead of the walk
				}
				if _, res := s.TakeHash(rng.Uint64N(300), 1+rng.Int64N(3), at); res.units > 0 {
					grants = append(grants, res)
				}
			case r < 6 && len(grants) > 0:
				k := rng.IntN(len(grants))
				s.Refund(grants[k])
				grants = slices.Delete(grants, k, k+1)
			case r < 7:
				s.ResetHash(rng.Uint64N(300), now, now)
			case r < 8:
				snap, _ := s.AppendSnapshot(nil, now)
				if err := s.MergeBinaryForgetting(snap, now, nil); err != nil {
					t.Fatal(err)
				}
			default:
				now = now.Add(time.Duration(rng.IntN(1200)) * time.Millisecond)
			}
			want := s.countedCells(now)
			got := s.liveCells(now)
			for _, c := range want {
				if _, ok := slices.BinarySearch(got, c); !ok {
					t.Fatalf("seed %d step %d: cell %d counts something and is not listed", seed, step, c)
				}
			}
			if !slices.IsSorted(got) || len(slices.Compact(slices.Clone(got))) != len(got) {
				t.Fatalf("seed %d step %d: the list is not sorted without repeats: %v", seed, step, got)
			}
			// A walk of every cell is the reference for the snapshot.
			ref, err := s.Snapshot(now).AppendBinary(nil)
			if err != nil {
				t.Fatal(err)
			}
			if snap, _ := s.AppendSnapshot(nil, now); !bytes.Equal(snap, ref) {
				t.Fatalf("seed %d step %d: the snapshot from the listed cells differs from a walk of every cell", seed, step)
			}
		}
		// Two windows after the last charge's (which may have been up to
		// 1.5 s ahead), nothing is listed.
		now = now.Add(5 * time.Second)
		s.liveCells(now)
		if got := s.liveCells(now); len(got) != 0 {
			t.Fatalf("seed %d: %d cells still listed two windows after the last charge", seed, len(got))
		}
	}
}

// TestLiveCellsChargeDuringAWalk forces each order of a charge's two steps
// (its count, then its mark) around a walk's two (taking the marks, then
// reading the counts): in every order the charged cell is in this walk's
// list or the next one's.
func TestLiveCellsChargeDuringAWalk(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	const cell = 5
	// The walk split at the point between taking the marks and reading
	// the counts: liveCells with hooks is more than this needs, so each
	// order is written out.
	orders := []struct {
		name string
		run  func(s *Sketch, e int64) (listedNow bool)
	}{
		{"charge, then walk", func(s *Sketch, e int64) bool {
			sketchAddSlot(&s.slots[2*cell+int(e&1)], s.tag(e), 1)
			s.live.mark(cell)
			return slices.Contains(s.liveCells(now), cell)
		}},
		{"count, walk, mark", func(s *Sketch, e int64) bool {
			sketchAddSlot(&s.slots[2*cell+int(e&1)], s.tag(e), 1)
			listed := slices.Contains(s.liveCells(now), cell)
			s.live.mark(cell)
			return listed
		}},
		{"walk, then charge", func(s *Sketch, e int64) bool {
			listed := slices.Contains(s.liveCells(now), cell)
			sketchAddSlot(&s.slots[2*cell+int(e&1)], s.tag(e), 1)
			s.live.mark(cell)
			return listed
		}},
	}
	for _, o := range orders {
		s, err := NewSketch(SketchConfig{Quota: 10, Window: time.Second, Rows: 2, Width: 8})
		if err != nil {
			t.Fatal(err)
		}
		e, _ := s.clock(now)
		listed := o.run(s, e)
		if !listed && !slices.Contains(s.liveCells(now), cell) {
			t.Errorf("%s: the charged cell is in neither this walk's list nor the next one's", o.name)
		}
	}
}

// A walk whose clock is in an earlier window than the last walk's (a sync
// that read the clock before another took the lock, or a clock stepped
// back) still lists what that window counts, though the index has dropped
// it, and its snapshot is the one a walk of every cell gives.
func TestLiveCellsWalkBehindTheLastOne(t *testing.T) {
	s, err := NewSketch(SketchConfig{Quota: 50, Window: time.Second, Rows: 3, Width: 97})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1_700_000_000, 0)
	s.TakeHash(12345, 1, t0)
	s.liveCells(t0)
	s.liveCells(t0.Add(2 * time.Second)) // two windows on: the charge is dropped
	behind := t0.Add(1900 * time.Millisecond)
	got := s.liveCells(behind)
	for _, c := range s.countedCells(behind) {
		if _, ok := slices.BinarySearch(got, c); !ok {
			t.Errorf("cell %d counts in the window before and is not listed: %v", c, got)
		}
	}
	ref, err := s.Snapshot(behind).AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	if snap, _ := s.AppendSnapshot(nil, behind); !bytes.Equal(snap, ref) {
		t.Error("the snapshot of a walk behind the last one differs from a walk of every cell")
	}
}
