package storage

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

var hk = limiter.HashString("k")

// passes reports whether n would let a request of weight w of key k
// through at now, charging nothing.
func (n *node) passes(w int64, now time.Time) bool {
	return n.c.PeekHash(hk, w, now).Allowed
}

// syncAll has every node publish, then every node read, at now.
func syncAll(now time.Time, nodes ...*node) {
	for _, n := range nodes {
		n.s.Write(bg, now)
	}
	for _, n := range nodes {
		n.s.Read(bg, now)
	}
}

// listed returns the resets instance's stored snapshot lists.
func listed(t *testing.T, dir, instance string) []reset {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "rate_limit", "z%2F1", instance))
	if err != nil {
		t.Fatal(err)
	}
	s, err := decodeSnapshot(data, MitigationSlots, MaxResets)
	if err != nil {
		t.Fatal(err)
	}
	return s.resets
}

// A key exhausted cluster-wide passes on the instance that resets it at
// once, and on another after one write of the first and one read of its
// own; it then has its whole limit again, cluster-wide, and no more.
func TestResetPassesHereAtOnceAndThereAfterASync(t *testing.T) {
	a, b, _, dir := newPair(t)
	now := t0.Add(time.Second)
	if a.take("k", 5, now)+b.take("k", 5, now) != 10 {
		t.Fatal("the first 10 were not granted")
	}
	a.take("other", 4, now)
	syncAll(now, a, b)
	if a.take("k", 1, now)+b.take("k", 1, now) != 0 {
		t.Fatal("k passed over its cluster limit")
	}
	a.c.Reset(hk, now)
	if !a.passes(10, now) {
		t.Fatalf("right after the reset a gives k %+v, want its whole limit", a.c.PeekHash(hk, 1, now))
	}
	if b.passes(1, now) {
		t.Fatal("b let k through before hearing of the reset")
	}
	later := now.Add(time.Second)
	a.s.Write(bg, later)
	if got := listed(t, dir, "a"); !slices.Equal(got, []reset{{hash: hk, at: now.UnixNano()}}) {
		t.Fatalf("a published the resets %v", got)
	}
	b.s.Read(bg, later)
	if !b.passes(10, later) {
		t.Fatalf("after a's write and b's read, b gives k %+v, want its whole limit", b.c.PeekHash(hk, 1, later))
	}
	// The limit holds again, shared.
	if got := a.take("k", 6, later); got != 6 {
		t.Fatalf("a granted %d of 6 after the reset", got)
	}
	syncAll(later, a, b)
	if got := b.take("k", 10, later); got != 4 {
		t.Fatalf("b granted %d after a took 6 since the reset, want 4", got)
	}
	syncAll(later, a, b)
	if a.passes(1, later) || b.passes(1, later) {
		t.Fatal("k passed over its limit after the reset")
	}
	other := limiter.HashString("other")
	if d := a.c.PeekHash(other, 6, later); !d.Allowed || a.c.PeekHash(other, 7, later).Allowed {
		t.Fatalf("another key: %+v, want its 4 taken before the reset still counted", d)
	}
}

// A peer whose snapshot predates a reset does not bring the key's counts
// or its block back: not on the instance that reset the key, not on one
// that learned of it, and not on itself once it reads.
func TestResetIgnoresSnapshotsThatPredateIt(t *testing.T) {
	a, b, st, _ := newPair(t)
	c := newNode(t, st, "c")
	now := t0.Add(time.Second)
	if c.take("k", 11, now) != 10 { // 10, then a denial: c blocks k
		t.Fatal("c did not exhaust k")
	}
	c.s.Write(bg, now) // with c's counts and block; c writes no more for now
	a.s.Read(bg, now)
	b.s.Read(bg, now)
	if a.passes(1, now) || b.passes(1, now) {
		t.Fatal("c's counts did not reach a and b")
	}
	a.c.Reset(hk, now)
	if !a.passes(10, now) {
		t.Fatal("a did not pass k right after the reset")
	}
	later := now.Add(500 * time.Millisecond)
	a.s.Read(bg, later) // c's snapshot again, which does not list the reset
	if !a.passes(10, later) {
		t.Fatalf("reading c's old snapshot again brought k back on a: %+v", a.c.PeekHash(hk, 1, later))
	}
	a.s.Write(bg, later)
	b.s.Read(bg, later)
	if !b.passes(10, later) {
		t.Fatalf("b, with c's old snapshot beside a's: %+v", b.c.PeekHash(hk, 1, later))
	}
	if c.passes(1, later) {
		t.Fatal("c let k through before reading")
	}
	c.s.Read(bg, later)
	if !c.passes(10, later) {
		t.Fatalf("c after reading of the reset: %+v", c.c.PeekHash(hk, 1, later))
	}
	// What c takes after it learned of the reset counts everywhere.
	if got := c.take("k", 3, later); got != 3 {
		t.Fatalf("c granted %d of 3", got)
	}
	syncAll(later, a, b, c)
	for name, n := range map[string]*node{"a": a, "b": b, "c": c} {
		if !n.passes(7, later) || n.passes(8, later) {
			t.Errorf("%s: %+v, want 7 left after c's 3", name, n.c.PeekHash(hk, 1, later))
		}
	}
}

// A reset learned from a peer is published in turn, so an instance that
// never reads the resetting one's snapshot learns it too; and it is
// applied once: reading it again, from any number of snapshots, never
// forgets what was taken after it.
func TestResetIsGossipedAndAppliedOnce(t *testing.T) {
	a, b, st, dir := newPair(t)
	c := newNode(t, st, "c")
	calls := map[string][]uint64{}
	for name, n := range map[string]*node{"a": a, "b": b, "c": c} {
		n.c.OnReset(func(h uint64) { calls[name] = append(calls[name], h) })
	}
	now := t0.Add(time.Second)
	b.take("k", 4, now)
	c.take("k", 6, now)
	a.c.Reset(hk, now)
	a.s.Write(bg, now)
	b.s.Read(bg, now)
	if !b.passes(10, now) {
		t.Fatal("b did not apply a's reset")
	}
	b.s.Write(bg, now)
	if got := listed(t, dir, "b"); !slices.Equal(got, []reset{{hash: hk, at: now.UnixNano()}}) {
		t.Fatalf("b publishes the resets %v, want a's", got)
	}
	// a goes, and with it its snapshot: c hears of the reset from b only.
	if err := os.Remove(filepath.Join(dir, "rate_limit", "z%2F1", "a")); err != nil {
		t.Fatal(err)
	}
	later := now.Add(time.Second)
	c.s.Read(bg, later)
	if !c.passes(10, later) {
		t.Fatalf("c did not apply the reset it read from b: %+v", c.c.PeekHash(hk, 1, later))
	}
	// Taken after the reset, on b and c; then b reads the reset from c's
	// snapshot, and both read it again from each other's, many times.
	b.take("k", 2, later)
	c.take("k", 3, later)
	a.s.Write(bg, later) // a is back, still listing the reset
	for range 3 {
		syncAll(later, b, c)
	}
	for name, n := range map[string]*node{"b": b, "c": c} {
		if got := n.c.sketch.Estimate(hk, later); got != map[string]float64{"b": 2, "c": 3}[name] {
			t.Errorf("%s's own count of k is %v after reading the reset again, want what it took since", name, got)
		}
		if !n.passes(5, later) || n.passes(6, later) {
			t.Errorf("%s: %+v, want 5 left", name, n.c.PeekHash(hk, 1, later))
		}
		if !slices.Equal(calls[name], []uint64{hk}) {
			t.Errorf("%s called OnReset's function with %v, want k once", name, calls[name])
		}
	}
	if calls["a"] != nil {
		t.Errorf("Reset called OnReset's function: %v", calls["a"])
	}
}

// A reset is forgotten once the window it fell in is two windows old, when
// every count from before it has aged out; until then it is published and
// learned, afterwards neither.
func TestResetExpires(t *testing.T) {
	a, b, st, dir := newPair(t)
	now := t0.Add(30 * time.Second)
	a.c.Reset(hk, now)
	last := t0.Add(2*testWindow - time.Nanosecond)
	a.s.Write(bg, last)
	if len(listed(t, dir, "a")) != 1 {
		t.Fatal("a reset was dropped before it was over")
	}
	over := t0.Add(2 * testWindow)
	b.s.Read(bg, over) // a's snapshot still lists it: too late to learn
	if len(b.c.resets.list) != 0 {
		t.Fatalf("b learned a reset that is over: %v", b.c.resets.list)
	}
	a.s.Write(bg, over)
	if got := listed(t, dir, "a"); len(got) != 0 || a.c.resetting.Load() {
		t.Fatalf("a still publishes %v after the reset is over", got)
	}
	// A reset from over a minute in the future is not a reset.
	c := newNode(t, st, "c")
	data := appendSnapshot(nil, "f", over, nil, nil, []reset{{hash: hk, at: over.Add(2 * time.Minute).UnixNano()}})
	data, _ = c.sketchSnapshot(data, over)
	if err := st.Store(bg, Key("z/1", "f"), data); err != nil {
		t.Fatal(err)
	}
	c.take("k", 5, over)
	c.s.Read(bg, over)
	if len(c.c.resets.list) != 0 || c.c.sketch.Estimate(hk, over) != 5 {
		t.Fatal("a reset from the future was applied")
	}
}

// sketchSnapshot rewrites a stored snapshot with n's (empty) sketch, so
// that it is well formed.
func (n *node) sketchSnapshot(data []byte, now time.Time) ([]byte, error) {
	s, err := decodeSnapshot(data, MitigationSlots, MaxResets)
	if err != nil {
		return nil, err
	}
	empty, _ := newCluster(n.c.shape, 10)
	sk, _ := empty.sketch.AppendSnapshot(nil, now)
	return appendSnapshot(nil, s.instance, s.written, sk, s.blocks, s.resets), nil
}

// A zone remembers at most MaxResets resets; past that the oldest goes.
func TestResetTableIsBounded(t *testing.T) {
	st, dir := fileStorage(t)
	a := newNode(t, st, "a")
	now := t0.Add(time.Second)
	for i := range MaxResets + 5 {
		a.c.Reset(uint64(i), now)
	}
	a.c.Reset(uint64(MaxResets+4), now) // the same reset again is one
	a.s.Write(bg, now)
	got := listed(t, dir, "a")
	if len(got) != MaxResets || got[0].hash != 5 || got[len(got)-1].hash != MaxResets+4 {
		t.Fatalf("published %d resets from %v to %v, want the last %d", len(got), got[0], got[len(got)-1], MaxResets)
	}
}

// Version 1 snapshots (published before resets were) still count, as
// listing no reset; a snapshot listing more resets than a zone keeps is
// skipped whole.
func TestResetsAndOtherSnapshotVersions(t *testing.T) {
	a, b, st, _ := newPair(t)
	now := t0.Add(time.Second)
	old := newNode(t, st, "old")
	old.take("k", 10, now)
	sk, _ := old.c.sketch.AppendSnapshot(nil, now)
	if err := st.Store(bg, Key("z/1", "old"), appendSnapshotV1("old", now, sk, nil)); err != nil {
		t.Fatal(err)
	}
	b.s.Read(bg, now)
	if b.passes(1, now) || b.c.Skipped() != 0 {
		t.Fatalf("a version 1 snapshot did not count (skipped %d)", b.c.Skipped())
	}
	a.c.Reset(hk, now)
	a.s.Write(bg, now)
	b.s.Read(bg, now)
	if !b.passes(10, now) {
		t.Fatal("a version 1 snapshot's counts of k came back after the reset")
	}

	c := newNode(t, st, "c")
	many := make([]reset, MaxResets+1)
	for i := range many {
		many[i] = reset{hash: uint64(i), at: now.UnixNano()}
	}
	many[0].hash = limiter.HashString("j")
	j := newNode(t, st, "j")
	j.take("j", 10, now)
	sk, _ = j.c.sketch.AppendSnapshot(nil, now)
	if err := st.Store(bg, Key("z/1", "j"), appendSnapshot(nil, "j", now, sk, nil, many)); err != nil {
		t.Fatal(err)
	}
	c.s.Read(bg, now)
	if c.c.Skipped() != 1 {
		t.Fatalf("skipped %d entries, want the one with too many resets", c.c.Skipped())
	}
	if !strings.Contains(c.logs.All()[0].ContextMap()["error"].(string), fmt.Sprintf("lists %d key resets, at most %d", MaxResets+1, MaxResets)) {
		t.Fatalf("logged %v", c.logs.All()[0].ContextMap())
	}
	if len(c.c.resets.list) != 1 || !c.c.PeekHash(limiter.HashString("j"), 10, now).Allowed {
		t.Fatalf("c learned %d resets, want only a's", len(c.c.resets.list))
	}
}

// An instance restarting keeps the resets its last snapshot lists, so it
// does not apply them again to the counts it restores; a reset applied
// before the restore is applied to the restored counts.
func TestRestoreKeepsResets(t *testing.T) {
	a, b, st, _ := newPair(t)
	now := t0.Add(time.Second)
	a.take("k", 10, now)
	a.c.Reset(hk, now)
	later := now.Add(time.Second)
	a.take("k", 3, later)
	syncAll(later, a, b) // b learns the reset
	syncAll(later, a, b) // and lists it
	a2 := newNode(t, st, "a")
	if err := a2.s.Restore(bg, later); err != nil {
		t.Fatal(err)
	}
	a2.s.Read(bg, later)
	if got := a2.c.sketch.Estimate(hk, later); got != 3 {
		t.Fatalf("after a restart a's count of k is %v, want the 3 taken after the reset", got)
	}

	// A reset asked for before the restore is done.
	c := newNode(t, st, "c")
	c.take("k", 10, now)
	c.s.Write(bg, now)
	c2 := newNode(t, st, "c")
	c2.c.Reset(hk, later)
	if err := c2.s.Restore(bg, later); err != nil {
		t.Fatal(err)
	}
	if got := c2.c.sketch.Estimate(hk, later); got != 0 {
		t.Fatalf("a reset before the restore: k counts %v, want 0", got)
	}
}

// A decision that read the counts before a reset forgot them must not
// leave a block behind once the reset has lifted the key's: the block is
// checked against the counts as they are after it.
func TestResetRaceWithABlock(t *testing.T) {
	st, _ := fileStorage(t)
	a := newNode(t, st, "a")
	now := t0.Add(time.Second)
	a.take("k", 10, now)
	peers := a.c.peers.Load()
	d := a.c.sketch.PeekHashWith(hk, 1, now, peers) // read before the reset
	a.c.Reset(hk, now)
	a.c.mitigate(hk, 1, now, peers, d) // blocks after it
	if !a.passes(10, now) {
		t.Fatalf("a block from before the reset stands: %+v", a.c.PeekHash(hk, 1, now))
	}
	// Without a reset since, a denial blocks as before.
	a.take("k", 11, now)
	if until, ok := a.c.blocks.blocked(hk, now.UnixNano()); !ok || until <= now.UnixNano() {
		t.Fatal("no block after a denial")
	}
}

// Resets, decisions and syncs run concurrently without a data race (run
// with -race): a reset never changes the peers' sum that decisions read
// (it replaces it), and once they are over the key passes with its whole
// limit after one more reset.
func TestResetConcurrently(t *testing.T) {
	a, b, _, _ := newPair(t)
	now := t0.Add(time.Second)
	b.take("k", 5, now)
	b.s.Write(bg, now)
	a.s.Read(bg, now)
	// counted is what a peers' sum counts of k, read through an empty
	// sketch of the zone's shape.
	probe, _ := newCluster(a.c.shape, 10)
	counted := func(p *limiter.SketchSum) int64 { return 10 - probe.sketch.PeekHashWith(hk, 1, now, p).Remaining }
	type seen struct {
		sum     *limiter.SketchSum
		counted int64
	}
	first := seen{a.c.peers.Load(), counted(a.c.peers.Load())}
	if first.counted != 5 {
		t.Fatalf("the peers' sum counts %d of k, want b's 5", first.counted)
	}
	done := make(chan []seen)
	go func() {
		var read []seen
		for i := range 200 {
			a.c.TakeHash(uint64(i%7), 1, now)
			a.c.TakeHash(hk, 1, now)
			if i%20 == 0 {
				p := a.c.peers.Load()
				read = append(read, seen{p, counted(p)})
			}
		}
		done <- read
	}()
	for i := range 20 {
		a.c.Reset(hk, now.Add(time.Duration(i)))
		if i%5 == 0 {
			a.s.Read(bg, now)
			a.s.Write(bg, now)
		}
	}
	for _, r := range append(<-done, first) {
		if got := counted(r.sum); got != r.counted {
			t.Fatalf("a peers' sum that decisions read changed under them: counted %d of k, then %d", r.counted, got)
		}
	}
	if got := a.c.resets.seq; got != 20 {
		t.Fatalf("recorded %d resets, want 20", got)
	}
	later := now.Add(time.Millisecond)
	a.c.Reset(hk, later)
	if !a.passes(10, later) {
		t.Fatalf("after the last reset k does not have its whole limit: %+v", a.c.PeekHash(hk, 10, later))
	}
}
