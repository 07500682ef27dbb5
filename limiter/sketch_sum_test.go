package limiter

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
	"time"
)

func newSumTestSketch(t testing.TB, quota int64, window time.Duration, rows, width int) *Sketch {
	t.Helper()
	s, err := NewSketch(SketchConfig{Quota: quota, Window: window, Rows: rows, Width: width})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// chargeSketch counts n for h in s at now, whatever the quota.
func chargeSketch(t testing.TB, s *Sketch, h uint64, n int64, now time.Time) {
	t.Helper()
	if d, _ := s.TakeHashWith(h, n, now, nil); !d.Allowed {
		t.Fatalf("charge of %d denied", n)
	}
}

// A sketch deciding with a sum of its peers' snapshots decides as one
// sketch that counted everyone's traffic, in the window of the snapshots,
// the next one (their current window is then the previous one) and the
// one after (nothing left).
func TestSketchSumDecidesAsOneSketch(t *testing.T) {
	const window = 10 * time.Second
	t0 := sketchEpoch0.Add(3 * time.Second)
	own := newSumTestSketch(t, 1<<20, window, 4, 512)
	all := newSumTestSketch(t, 1<<20, window, 4, 512)
	peers := []*Sketch{newSumTestSketch(t, 1<<20, window, 4, 512), newSumTestSketch(t, 1<<20, window, 4, 512)}
	rng := rand.New(rand.NewPCG(7, 8))
	traffic := func(now time.Time) {
		for range 5000 {
			h := Hash([]byte{byte(rng.IntN(256)), byte(rng.IntN(4))})
			n := 1 + rng.Int64N(3)
			chargeSketch(t, all, h, n, now)
			switch rng.IntN(3) {
			case 0:
				chargeSketch(t, own, h, n, now)
			default:
				chargeSketch(t, peers[rng.IntN(2)], h, n, now)
			}
		}
	}
	traffic(t0)
	t1 := t0.Add(window)
	traffic(t1)
	sum := own.NewSketchSum(t1)
	for _, p := range peers {
		data, e := p.AppendSnapshot(nil, t1)
		if got, err := sum.AddBinary(data); err != nil || got != e {
			t.Fatalf("AddBinary = %d, %v, want %d", got, err, e)
		}
	}
	for _, at := range []time.Duration{0, 4 * time.Second, window, window + 9*time.Second} {
		now := t1.Add(at)
		if at >= window {
			// The peers have not published since: their counts of window 1
			// are all that is left of them.
			all = newSumTestSketch(t, 1<<20, window, 4, 512)
			for _, s := range append([]*Sketch{own}, peers...) {
				if err := all.mergeBinary(must(s.AppendSnapshot(nil, t1)), t1); err != nil {
					t.Fatal(err)
				}
			}
		}
		for k := range 1024 {
			h := Hash([]byte{byte(k), byte(k >> 8)})
			for _, w := range []int64{1, 50} {
				got := own.PeekHashWith(h, w, now, sum)
				want := all.PeekHashWith(h, w, now, nil)
				if got != want {
					t.Fatalf("at %v, key %d, weight %d: %+v, want %+v", at, k, w, got, want)
				}
			}
		}
	}
	// Two windows on, the sum adds nothing.
	now := t1.Add(2 * window)
	for k := range 64 {
		h := Hash([]byte{byte(k), 0})
		if got, want := own.PeekHashWith(h, 1, now, sum), own.PeekHashWith(h, 1, now, nil); got != want {
			t.Fatalf("two windows on, key %d: %+v, want %+v", k, got, want)
		}
	}
}

func must(b []byte, _ int64) []byte { return b }

// A snapshot one window ahead (a peer's clock slightly ahead) adds its
// previous window as the current one; a snapshot two windows old adds
// nothing.
func TestSketchSumAlignsWindows(t *testing.T) {
	const window = time.Second
	t0 := sketchEpoch0
	own := newSumTestSketch(t, 100, window, 2, 64)
	peer := newSumTestSketch(t, 100, window, 2, 64)
	h := Hash([]byte("k"))
	chargeSketch(t, peer, h, 30, t0.Add(window))  // peer's window 1 (previous)
	chargeSketch(t, peer, h, 5, t0.Add(2*window)) // peer's window 2 (current)
	ahead := must(peer.AppendSnapshot(nil, t0.Add(2*window)))
	sum := own.NewSketchSum(t0.Add(window + window/2))
	if e, err := sum.AddBinary(ahead); err != nil || e != sum.epoch+1 {
		t.Fatalf("AddBinary of a snapshot a window ahead = %d, %v", e, err)
	}
	if d := own.PeekHashWith(h, 70, t0.Add(window+window/2), sum); !d.Allowed || d.Remaining != 70 {
		t.Fatalf("with 30 counted a window ahead, 70 more: %+v", d)
	}
	if d := own.PeekHashWith(h, 71, t0.Add(window+window/2), sum); d.Allowed {
		t.Fatalf("with 30 counted a window ahead, 71 more: %+v", d)
	}
	old := own.NewSketchSum(t0.Add(4 * window))
	if _, err := old.AddBinary(ahead); err != nil {
		t.Fatal(err)
	}
	if d := own.PeekHashWith(h, 100, t0.Add(4*window), old); !d.Allowed {
		t.Fatalf("a snapshot two windows old still counts: %+v", d)
	}
}

// The sum and the sketch's own counts share the quota, and only the sketch
// is charged: rebuilding the sum from the same snapshot never counts it
// twice.
func TestTakeHashWithSharesTheQuota(t *testing.T) {
	const window = time.Minute
	now := sketchEpoch0.Add(time.Second)
	own := newSumTestSketch(t, 10, window, 4, 256)
	peer := newSumTestSketch(t, 10, window, 4, 256)
	h := Hash([]byte("client"))
	chargeSketch(t, peer, h, 7, now)
	snap := must(peer.AppendSnapshot(nil, now))
	granted := 0
	for round := range 3 {
		sum := own.NewSketchSum(now) // a new read of the same snapshot
		if _, err := sum.AddBinary(snap); err != nil {
			t.Fatal(err)
		}
		for range 5 {
			if d, _ := own.TakeHashWith(h, 1, now, sum); d.Allowed {
				granted++
			} else if d.RetryAfter <= 0 || d.Remaining != 0 {
				t.Fatalf("round %d: denial %+v, want a positive RetryAfter and nothing remaining", round, d)
			}
		}
	}
	if granted != 3 {
		t.Fatalf("granted %d beside a peer's 7 of 10, want 3", granted)
	}
	if d, _ := own.TakeHashWith(h, 1, now, nil); !d.Allowed || d.Remaining != 6 {
		t.Fatalf("own counts alone: %+v, want 3 of 10 taken", d)
	}
}

// AddBinary adds nothing from a snapshot it rejects.
func TestSketchSumRejects(t *testing.T) {
	const window = time.Second
	now := sketchEpoch0
	own := newSumTestSketch(t, 100, window, 2, 64)
	h := Hash([]byte("k"))
	good := newSumTestSketch(t, 100, window, 2, 64)
	chargeSketch(t, good, h, 40, now)
	enc := must(good.AppendSnapshot(nil, now))
	for name, tc := range map[string]struct {
		data []byte
		want string
	}{
		"other width":  {must(newSumTestSketch(t, 100, window, 2, 63).AppendSnapshot(nil, now)), "does not fit"},
		"other rows":   {must(newSumTestSketch(t, 100, window, 1, 64).AppendSnapshot(nil, now)), "does not fit"},
		"other window": {must(newSumTestSketch(t, 100, 2*window, 2, 64).AppendSnapshot(nil, now)), "does not fit"},
		"truncated":    {enc[:len(enc)-1], "truncated"},
		"trailing":     {append(bytes.Clone(enc), 0), "trailing"},
		"version 3":    {append([]byte("FGSK\x03"), enc[5:]...), "unsupported version 3"},
		"garbage":      {[]byte("1234567890"), "bad magic"},
	} {
		sum := own.NewSketchSum(now)
		if _, err := sum.AddBinary(tc.data); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", name, err, tc.want)
		}
		if d := own.PeekHashWith(h, 100, now, sum); !d.Allowed {
			t.Errorf("%s: a rejected snapshot counted: %+v", name, d)
		}
	}
}

// AppendSnapshot writes what Snapshot and AppendBinary would: the decoded
// form re-encodes to the same bytes and holds every charge on every row.
func TestAppendSnapshotIsTheSnapshot(t *testing.T) {
	const window = 10 * time.Second
	s := newSumTestSketch(t, 1<<20, window, 4, 1000)
	rng := rand.New(rand.NewPCG(1, 2))
	t0 := sketchEpoch0.Add(2 * time.Second)
	var prev, curr uint64
	for i := range 3000 {
		n := 1 + rng.Int64N(9)
		if i < 1000 {
			chargeSketch(t, s, rng.Uint64(), n, t0)
			prev += uint64(n)
		} else {
			chargeSketch(t, s, rng.Uint64(), n, t0.Add(window))
			curr += uint64(n)
		}
	}
	enc, e := s.AppendSnapshot([]byte("x"), t0.Add(window))
	if string(enc[:1]) != "x" {
		t.Fatal("AppendSnapshot lost dst")
	}
	o, err := DecodeSketchSnapshot(enc[1:], 4*1000)
	if err != nil {
		t.Fatal(err)
	}
	if o.Epoch != e || o.Rows != 4 || o.Width != 1000 || o.Window != window {
		t.Fatalf("header %+v, epoch %d", o, e)
	}
	sum := func(c []uint32) (n uint64) {
		for _, v := range c {
			n += uint64(v)
		}
		return n
	}
	if sum(o.Prev) != 4*prev || sum(o.Curr) != 4*curr {
		t.Fatalf("counts %d and %d, want %d and %d (4 rows)", sum(o.Prev), sum(o.Curr), 4*prev, 4*curr)
	}
	again, err := o.AppendBinary(nil)
	if err != nil || !bytes.Equal(again, enc[1:]) {
		t.Fatalf("re-encoding differs: %v", err)
	}
}

// A sum in binary form, loaded back in its own windows, less one of the
// snapshots it summed (added in the same windows), is the sum of the
// others: whatever window the snapshots were of, within one of the sum's.
func TestSketchSumBinaryLessOneSnapshotIsTheOthers(t *testing.T) {
	const window = time.Minute
	at := time.Unix(1_700_000_040, 0).Add(10 * time.Second)
	a, b := newSumTestSketch(t, 1000, window, 4, 64), newSumTestSketch(t, 1000, window, 4, 64)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 50 {
		chargeSketch(t, a, rng.Uint64(), 1+rng.Int64N(5), at.Add(-window))
		chargeSketch(t, a, rng.Uint64(), 1+rng.Int64N(5), at)
		chargeSketch(t, b, rng.Uint64(), 1+rng.Int64N(5), at)
	}
	for _, mine := range []time.Time{at.Add(-window), at, at.Add(window)} { // a's snapshot: a window behind, of the sum's, a window ahead
		sa, _ := a.AppendSnapshot(nil, mine)
		sb, _ := b.AppendSnapshot(nil, at)
		sum := a.NewSketchSum(at)
		for _, s := range [][]byte{sa, sb} {
			if _, err := sum.AddBinary(s); err != nil {
				t.Fatal(err)
			}
		}
		loaded, err := b.SketchSumOfBinary(sum.AppendBinary(nil))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := loaded.SubtractBinaryForgetting(sa, nil); err != nil {
			t.Fatal(err)
		}
		want := a.NewSketchSum(at)
		if _, err := want.AddBinary(sb); err != nil {
			t.Fatal(err)
		}
		if got := loaded.AppendBinary(nil); !bytes.Equal(got, want.AppendBinary(nil)) {
			t.Fatalf("a's snapshot of %v: the sum less it is not b's", mine)
		}
	}
	if _, err := a.SketchSumOfBinary([]byte("FGSK junk")); err == nil {
		t.Fatal("junk loaded as a sum")
	}
}

// A sum's Bytes counts the tail it keeps of a sub-window that has left
// its view (Linger) at no less than the heap the tail holds, in the sum
// and in a copy made by WithShares a sub-window later (shifted, with a
// tail of its own), and not again in a copy made in the sum's
// sub-window, whose tail is the sum's. Before, a map entry was counted
// 16 bytes where it holds about 19, and a later copy's tail not at all.
func TestSlidingSumBytesCountsItsTail(t *testing.T) {
	const width = 4096
	newSk := func() *Sketch {
		s, err := NewSketch(SketchConfig{Quota: 30, Window: time.Minute, Rows: 4, Width: width, Sliding: true})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	peer, reader := newSk(), newSk()
	sub := peer.Slot()
	start := time.Unix(0, WindowNumber(time.Unix(1_700_000_000, 0), sub)*int64(sub))
	for k := range 4 * width { // a flood of distinct keys: a tail over most cells
		peer.TakeHashWith(HashString(fmt.Sprint("flood", k)), 1, start.Add(sub-time.Millisecond), nil)
	}
	edge := start.Add(8 * sub) // the flood leaves the view
	snap, _ := peer.AppendSnapshot(nil, edge.Add(-time.Millisecond))
	lingering := func(made time.Time) *SketchSum {
		sum := reader.NewSketchSum(made)
		if _, err := sum.AddBinaryLinger(snap, nil, 0, 500*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		return sum
	}
	var sum, later, same *SketchSum
	sumHeld := heldBy(func() { sum = lingering(edge.Add(time.Millisecond)) })
	before := lingering(edge.Add(-sub / 2))
	deciders := []*Sketch{newSk(), newSk()} // each copy's own: a sketch keeps what it last shared
	sameHeld := heldBy(func() { same = sum.WithShares(deciders[0], 2, 0, edge.Add(2*time.Millisecond), nil, time.Second) })
	laterHeld := heldBy(func() { later = before.WithShares(deciders[1], 2, 0, edge.Add(time.Millisecond), nil, time.Second) })
	if len(sum.tail) < width || len(later.tail) < width {
		t.Fatalf("tails of %d and %d cells, want the flood's", len(sum.tail), len(later.tail))
	}
	t.Logf("a sum with a tail of %d cells: Bytes %d, heap %d; a copy a sub-window later: Bytes %d, heap %d; one in its sub-window: Bytes %d, heap %d",
		len(sum.tail), sum.Bytes(false), sumHeld, later.Bytes(true), laterHeld, same.Bytes(true), sameHeld)
	for _, c := range []struct {
		name  string
		bytes int
		held  int64
	}{{"the sum", sum.Bytes(false), sumHeld}, {"a copy a sub-window later", later.Bytes(true), laterHeld}, {"a copy in its sub-window", same.Bytes(true), sameHeld}} {
		if int64(c.bytes) < c.held-1024 || int64(c.bytes) > c.held*5/4+4096 { // its structs' fixed fields, under a kilobyte, are not counted
			t.Errorf("%s: Bytes %d, holds %d of heap", c.name, c.bytes, c.held)
		}
	}
	runtime.KeepAlive(before)
	runtime.KeepAlive(peer) // nothing collected within a measure
	runtime.KeepAlive(snap)
	runtime.KeepAlive(deciders)
}

// heldBy returns the heap that what f makes (and its caller keeps) holds.
func heldBy(f func()) int64 {
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	f()
	runtime.GC()
	runtime.ReadMemStats(&m1)
	return int64(m1.HeapAlloc) - int64(m0.HeapAlloc)
}
