package storage

import (
	"testing"
	"time"
)

// A key's view splits what the cluster counts for it into this instance's
// counts, the others' as last read and what this instance leaves them; the
// three are what its decision's Remaining is the quota less. A reset here
// empties this instance's view at once.
func TestViewSplitsAKeysCounts(t *testing.T) {
	now := t0.Add(time.Second)
	st, _ := fileStorage(t)
	nodes := newSplitNodes(t, st, 2, now)
	a, b := nodes[0], nodes[1]
	if a.c.Live() != 2 {
		t.Fatalf("live instances after a read of both: %d, want 2", a.c.Live())
	}
	if a.take("k", 3, now) != 3 || b.take("k", 2, now) != 2 {
		t.Fatal("a fresh key was denied within its shares")
	}
	at := now.Add(testIntervals.Read)
	syncAll(at, a, b)
	v := a.c.View(hk, at)
	d := a.c.PeekHash(hk, 1, at)
	t.Logf("view %+v, decision %+v", v, d)
	if v.Here != 3 || v.Others != 2 || v.Blocked != 0 {
		t.Fatalf("view %+v: want 3 here, 2 by the other, not blocked", v)
	}
	if v.LeftToOthers < 0 || d.Remaining != max(a.c.Quota()-v.Here-v.Others-v.LeftToOthers, 0) {
		t.Fatalf("remaining %d, want the quota %d less %+v", d.Remaining, a.c.Quota(), v)
	}
	// Past the limit, on both: blocked, within a few syncs (each grants
	// at most its share of what is left).
	later := at
	for i := 0; i < 10 && a.c.View(hk, later).Blocked == 0; i++ {
		later = later.Add(testIntervals.Read)
		syncAll(later, a, b)
		a.take("k", 5, later)
		b.take("k", 5, later)
	}
	if v := a.c.View(hk, later); v.Blocked <= 0 || v.Here+v.Others < a.c.Quota() {
		t.Fatalf("over the limit: view %+v, want blocked, counts of at least the quota", v)
	}
	a.c.Reset(hk, later)
	if v := a.c.View(hk, later); v != (KeyView{}) {
		t.Fatalf("after a reset here: view %+v, want nothing counted, left or blocked", v)
	}
}

// What a Cluster reports it holds is its parts as allocated: the sketch's
// counters and bitmaps, the peers' sum once read, the shares' copy once
// another instance is live, and the mitigation cache's slots and entries.
func TestMemoryCountsEveryPart(t *testing.T) {
	now := t0.Add(time.Second)
	st, _ := fileStorage(t)
	nodes := newNodes(t, st, 2)
	a, b := nodes[0], nodes[1]
	cells := SketchRows * 256
	bitmap := 8 * ((cells + 63) / 64)
	sketch := 16*cells + 2*bitmap
	if m := a.c.Memory(); m != (Memory{Sketch: sketch, Mitigation: 8 * MitigationSlots}) {
		t.Fatalf("a new cluster holds %+v, want its sketch %d and the cache's slots", m, sketch)
	}
	for _, n := range nodes {
		n.c.SplitBursts(true, testIntervals.Read)
	}
	syncAll(now, a, b)
	m := a.c.Memory()
	if m.Sums != 8*cells+bitmap || m.Shares < 8*cells || (m.Shares-8*cells)%16 != 0 && (m.Shares-8*cells-bitmap)%16 != 0 {
		t.Fatalf("read, another instance live: %+v, want sums %d, shares %d + 16 per cell in use (+ a bitmap)", m, 8*cells+bitmap, 8*cells)
	}
	// A lone instance (no shares) blocks a key over its limit.
	c := newNode(t, st, "c")
	c.take("k", 20, now)
	if got := c.c.Memory().Mitigation; got != 8*MitigationSlots+MitigationEntryBytes || MitigationEntryBytes != 32 {
		t.Fatalf("one key blocked: the cache holds %d, want %d + one entry of %d (32)", got, 8*MitigationSlots, MitigationEntryBytes)
	}
}
