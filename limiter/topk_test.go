package limiter

import (
	"math/rand/v2"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// checkBounds fails unless every reported entry brackets the key's true
// weight, and every key weighing more than total/k is reported.
func checkBounds(t *testing.T, top []TopEntry[string], truth map[uint64]uint64, total uint64, k int) {
	t.Helper()
	seen := make(map[uint64]bool)
	for _, e := range top {
		seen[e.Hash] = true
		w := truth[e.Hash]
		if e.Count < w || e.Count-e.Err > w {
			t.Errorf("key %d (%s): count %d err %d does not bracket its weight %d", e.Hash, e.Label, e.Count, e.Err, w)
		}
	}
	for h, w := range truth {
		if w > total/uint64(k) && !seen[h] {
			t.Errorf("key %d weighs %d > %d/%d but is not reported", h, w, total, k)
		}
	}
}

func TestTopKBracketsEveryWeightAndKeepsHeavyKeys(t *testing.T) {
	const k = 16
	top := NewTopK[string](k, time.Hour)
	rng := rand.New(rand.NewPCG(1, 2))
	zipf := rand.NewZipf(rng, 1.2, 1, 5000)
	truth := make(map[uint64]uint64)
	var total uint64
	for i := range 50_000 {
		h := zipf.Uint64()
		n := uint64(1 + i%3)
		truth[h] += n
		total += n
		if !top.Record(t0, h, n, "") {
			t.Fatal("Record failed with no other goroutine")
		}
	}
	got, since := top.Top(t0, k)
	if len(got) != k || !since.Equal(t0) {
		t.Fatalf("%d entries since %v, want %d since %v", len(got), since, k, t0)
	}
	heavy := 0
	for _, w := range truth {
		if w > total/k {
			heavy++
		}
	}
	if heavy == 0 {
		t.Fatal("the stream has no key above total/k: the test checks nothing")
	}
	checkBounds(t, got, truth, total, k)
	for i := 1; i < len(got); i++ {
		if got[i].Count > got[i-1].Count {
			t.Fatalf("not heaviest first: %v", got)
		}
	}
}

func TestTopKFloodFromOneKeyAmongManyLightOnes(t *testing.T) {
	top := NewTopK[string](8, time.Minute)
	for i := range 1000 {
		top.Record(t0, 1_000_000, 1, "flood")
		top.Record(t0, uint64(i), 1, "light") // 1000 keys, once each
	}
	got, _ := top.Top(t0, 3)
	if len(got) != 3 || got[0].Label != "flood" || got[0].Count-got[0].Err < 1000-8 {
		t.Fatalf("top: %+v, want the flood first with at least 992 certain", got)
	}
	if got[1].Count-got[1].Err > 1 {
		t.Errorf("a light key is certain of more than its one record: %+v", got[1])
	}
}

func TestTopKCoversTheLastOneToTwoWindows(t *testing.T) {
	w := time.Minute
	top := NewTopK[string](4, w)
	if got, since := top.Top(t0, 10); got != nil || !since.IsZero() {
		t.Fatalf("empty sketch: %v since %v", got, since)
	}
	top.Record(t0, 1, 5, "a")
	top.Record(t0.Add(w+time.Second), 1, 2, "a")
	top.Record(t0.Add(w+time.Second), 2, 1, "b")

	got, since := top.Top(t0.Add(w+2*time.Second), 10)
	if !since.Equal(t0) || len(got) != 2 || got[0].Label != "a" || got[0].Count != 7 || got[0].Err != 0 || got[1].Count != 1 {
		t.Fatalf("one window later: %+v since %v; want a=7 (both windows), b=1, since %v", got, since, t0)
	}
	// Two windows after its last record, a key is gone; the window that
	// held only b's record has become the previous one.
	got, since = top.Top(t0.Add(2*w+time.Second), 10)
	if !since.Equal(t0.Add(w)) || len(got) != 2 || got[0].Count != 2 {
		t.Fatalf("after a's first window left: %+v since %v", got, since)
	}
	got, _ = top.Top(t0.Add(4*w), 10)
	if len(got) != 0 {
		t.Fatalf("two idle windows later: %+v, want nothing", got)
	}
}

func TestTopKMergedWindowsStillBracketTheWeight(t *testing.T) {
	const k = 4
	w := time.Minute
	top := NewTopK[string](k, w)
	truth := make(map[uint64]uint64)
	var total uint64
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 4000 {
		now := t0.Add(time.Duration(i) * w / 2000) // two windows
		h := uint64(rng.IntN(12))
		if i%3 == 0 {
			h = 100 // a heavy key across both windows
		}
		truth[h]++
		total++
		top.Record(now, h, 1, "")
	}
	got, _ := top.Top(t0.Add(w+w/2), k)
	if got[0].Hash != 100 {
		t.Fatalf("heaviest: %+v", got[0])
	}
	checkBounds(t, got, truth, total, k)
}

func TestTopKRecordNeverWaits(t *testing.T) {
	top := NewTopK[string](4, time.Minute)
	top.mu.Lock()
	if top.Record(t0, 1, 1, "x") {
		t.Fatal("Record succeeded while the sketch was held")
	}
	top.mu.Unlock()
	if got, _ := top.Top(t0, 4); len(got) != 0 {
		t.Fatalf("a dropped record was counted: %+v", got)
	}
}

func BenchmarkTopKRecord(b *testing.B) {
	b.Run("same_key", func(b *testing.B) {
		top := NewTopK[[48]byte](64, time.Minute)
		for b.Loop() {
			top.Record(t0, 7, 1, [48]byte{})
		}
	})
	b.Run("new_keys", func(b *testing.B) {
		top := NewTopK[[48]byte](64, time.Minute)
		var h uint64
		for b.Loop() {
			h++
			top.Record(t0, h, 1, [48]byte{})
		}
	})
}
