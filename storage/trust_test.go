package storage

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap/zapcore"
)

// A peer cannot impose more than a valid peer could: a block it publishes
// lasts at most the zone's window, and goes when its snapshot goes.
func TestPeerBlockIsCappedAndGoesWithItsSnapshot(t *testing.T) {
	st, dir := fileStorage(t)
	a := newNode(t, st, "a")
	now := t0.Add(time.Second)
	empty, _ := newCluster(a.c.shape, 10)
	sk, _ := empty.sketch.AppendSnapshot(nil, now)
	forever := now.Add(100_000 * time.Hour).UnixNano()
	if err := st.Store(bg, Key("z/1", "b"), appendSnapshot(nil, "b", now, sk, []block{{hash: hk, until: forever}}, nil)); err != nil {
		t.Fatal(err)
	}
	a.s.Read(bg, now)
	d := a.c.PeekHash(hk, 1, now)
	if d.Allowed {
		t.Fatal("a peer's block was not enforced at all")
	}
	if d.RetryAfter > testWindow {
		t.Fatalf("a peer's block holds for %v, more than the zone's window (%v)", d.RetryAfter, testWindow)
	}
	// The peer's file goes (purged, or its instance removed by hand): so
	// does its block, at the next read.
	if err := os.Remove(filepath.Join(dir, "rate_limit", "z%2F1", "b")); err != nil {
		t.Fatal(err)
	}
	later := now.Add(time.Second)
	a.s.Read(bg, later)
	if d := a.c.PeekHash(hk, 1, later); !d.Allowed {
		t.Fatalf("a block outlived its snapshot: RetryAfter %v", d.RetryAfter)
	}
	// An own block is not the peers' to lift: it stays, and is published.
	a.take("k", 11, later)
	a.s.Read(bg, later)
	if a.passes(1, later) || len(a.c.blocks.appendOwn(nil, later.UnixNano())) != 1 {
		t.Fatal("a read lifted this instance's own block")
	}
}

// A snapshot dated further in the future than MaxClockSkew comes from a
// broken clock: it is refused and purged, and the purge is logged. One
// within the bound counts as usual.
func TestFutureSnapshotIsRefusedAndPurged(t *testing.T) {
	st, dir := fileStorage(t)
	a := newNode(t, st, "a")
	now := t0.Add(10 * time.Second)
	within, beyond := newNode(t, st, "within"), newNode(t, st, "beyond")
	soon, far := now.Add(MaxClockSkew/2), now.Add(MaxClockSkew+time.Second)
	within.take("k", 4, soon)
	within.s.Write(bg, soon)
	beyond.take("k", 6, far)
	beyond.take("k", 11, far) // and blocks it, at its time
	beyond.s.Write(bg, far)
	a.s.Read(bg, now)
	if got := a.take("k", 10, now); got != 6 {
		t.Fatalf("granted %d of k, want 6 (the 4 within the skew bound count, the rest is refused)", got)
	}
	if _, err := os.Stat(filepath.Join(dir, "rate_limit", "z%2F1", "beyond")); !os.IsNotExist(err) {
		t.Fatalf("a snapshot from %v in the future was not purged: %v", far.Sub(now), err)
	}
	if _, err := os.Stat(filepath.Join(dir, "rate_limit", "z%2F1", "within")); err != nil {
		t.Fatalf("a snapshot within the skew bound was purged: %v", err)
	}
	if a.logs.FilterMessage("deleted the snapshot of an instance whose clock is ahead by more than the tolerated skew").FilterLevelExact(zapcore.WarnLevel).Len() != 1 {
		t.Fatalf("the purge of a future snapshot was not logged once: %v", a.logs.All())
	}
}

// loadCounter is a storage that counts the bytes Load returns per key.
type loadCounter struct {
	certmagic.Storage
	mu     sync.Mutex
	loaded map[string]int
}

func (l *loadCounter) Load(ctx context.Context, k string) ([]byte, error) {
	b, err := l.Storage.Load(ctx, k)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.loaded == nil {
		l.loaded = make(map[string]int)
	}
	l.loaded[k] += len(b)
	return b, err
}

// An entry larger than any snapshot of the zone's shape could be is
// refused before it is loaded: its size comes from Stat.
func TestOversizedEntryIsNotLoaded(t *testing.T) {
	fs, dir := fileStorage(t)
	st := &loadCounter{Storage: fs}
	nodes := newNodes(t, st, 2)
	a, b := nodes[0], nodes[1]
	now := t0.Add(time.Second)
	b.take("k", 10, now)
	b.s.Write(bg, now)
	// A sparse file: 64 MiB that take no disk.
	huge := filepath.Join(dir, "rate_limit", "z%2F1", "huge")
	f, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(64 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	a.s.Read(bg, now)
	if n := st.loaded[Key("z/1", "huge")]; n != 0 {
		t.Fatalf("loaded %d bytes of an entry larger than any snapshot of the zone (%d bytes at most)", n, maxSnapshotSize(a.c.shape))
	}
	if a.c.Skipped() != 1 {
		t.Fatalf("skipped %d entries, want the oversized one", a.c.Skipped())
	}
	if a.passes(1, now) {
		t.Fatal("the real snapshot beside the oversized entry no longer counts")
	}
	// The bound admits the largest snapshot a peer may write: every cell
	// counted in both windows, every block and reset slot used.
	full, _ := newCluster(a.c.shape, 1<<30)
	for h := range uint64(4 * 256 * 8) {
		full.TakeHash(h*0x9e3779b97f4a7c15, 1<<20, now)
	}
	sk, _ := full.sketch.AppendSnapshot(nil, now)
	blocks := make([]block, MitigationSlots)
	resets := make([]reset, MaxResets)
	for i := range blocks {
		blocks[i] = block{hash: ^uint64(i), until: -1 << 62}
	}
	for i := range resets {
		resets[i] = reset{hash: ^uint64(i), at: -1 << 62}
	}
	data := appendSnapshot(nil, string(slices.Repeat([]byte("i"), maxInstanceLen)), now, sk, blocks, resets)
	if max := maxSnapshotSize(a.c.shape); int64(len(data)) > max {
		t.Fatalf("a valid snapshot of %d bytes is over the bound of %d", len(data), max)
	}
}
