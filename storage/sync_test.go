package storage

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/limiter"
)

// t0 starts a minute window.
var t0 = time.Unix(1_700_000_040, 0)

const testWindow = time.Minute

var testIntervals = Intervals{Read: time.Second, Write: time.Second, PurgeAge: 5 * time.Minute}

type node struct {
	c    *Cluster
	s    *Syncer
	logs *observer.ObservedLogs
}

// newNode returns a Cluster of zone "z" (events 10 per minute) syncing
// through st as instance, with its own state (not from the pool).
func newNode(t *testing.T, st certmagic.Storage, instance string) *node {
	t.Helper()
	c, err := newCluster(Shape{Zone: "z/1", Window: testWindow, Width: 256}, 10)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.DebugLevel)
	n := &node{c: c, logs: logs}
	n.s = NewSyncer(c, st, instance, testIntervals, zap.New(core))
	n.s.proc = newProcess() // each node plays a process of its own
	return n
}

// take asks for k requests of weight 1 of key at now and returns how many
// were granted.
func (n *node) take(key string, k int, now time.Time) int {
	granted := 0
	for range k {
		if d, _ := n.c.TakeHash(limiter.HashString(key), 1, now); d.Allowed {
			granted++
		}
	}
	return granted
}

func fileStorage(t *testing.T) (*certmagic.FileStorage, string) {
	dir := t.TempDir()
	return &certmagic.FileStorage{Path: dir}, dir
}

// newNodes returns n nodes ("a", "b", ...) of zone z/1 (events 10 per
// minute) over st, each a process of its own.
func newNodes(t *testing.T, st certmagic.Storage, n int) []*node {
	t.Helper()
	nodes := make([]*node, n)
	for i := range nodes {
		nodes[i] = newNode(t, st, string(rune('a'+i)))
	}
	return nodes
}

// newPair returns nodes "a" and "b" sharing a fresh file storage, with that
// storage (for a test that adds nodes) and its directory (for one that looks
// at the files).
func newPair(t *testing.T) (a, b *node, st *certmagic.FileStorage, dir string) {
	t.Helper()
	st, dir = fileStorage(t)
	nodes := newNodes(t, st, 2)
	return nodes[0], nodes[1], st, dir
}

var bg = context.Background()

func TestClusterSharesTheLimit(t *testing.T) {
	a, b, _, _ := newPair(t)
	now := t0.Add(time.Second)
	if got := a.take("k", 7, now); got != 7 {
		t.Fatalf("a granted %d of 7", got)
	}
	a.s.Write(bg, now)
	for round := range 3 {
		// Reading the same snapshot again replaces it: b's share stays 3.
		b.s.Read(bg, now)
		if got := b.take("k", 5, now); round == 0 && got != 3 || round > 0 && got != 0 {
			t.Fatalf("round %d: b granted %d, want 3 then none", round, got)
		}
	}
	if got := b.take("other", 10, now); got != 10 {
		t.Fatalf("another key on b: %d of 10", got)
	}
	b.s.Write(bg, now)
	a.s.Read(bg, now)
	if got := a.take("k", 1, now); got != 0 {
		t.Fatal("a granted k after b used the rest of its limit")
	}
	if a.c.Skipped()+b.c.Skipped()+a.c.Failed(OpRead)+b.c.Failed(OpRead)+a.c.Failed(OpWrite)+b.c.Failed(OpWrite) != 0 {
		t.Fatal("well-formed snapshots were skipped or failed")
	}
}

// A key over its cluster limit is blocked, and the block is published: an
// instance that reads it denies the key even though the counts it read
// leave room (they were published before the key went over).
func TestBlocksArePublished(t *testing.T) {
	a, b, st, _ := newPair(t)
	c := newNode(t, st, "c")
	now := t0.Add(10 * time.Second)
	a.take("k", 4, now)
	a.s.Write(bg, now)
	b.take("k", 6, now)
	c.s.Read(bg, now) // sees a's 4, not b's 6
	b.s.Read(bg, now)
	if got := b.take("k", 1, now); got != 0 {
		t.Fatal("b granted k over the cluster limit")
	}
	b.s.Write(bg, now) // publishes the block with b's counts
	if until, ok := b.c.blocks.blocked(limiter.HashString("k"), now.UnixNano()); !ok || until <= now.UnixNano() {
		t.Fatal("b did not block k")
	}
	// c reads only b's snapshot's block: drop b's counts from storage by
	// publishing an empty-sketch snapshot with b's blocks.
	empty, _ := newCluster(Shape{Zone: "z/1", Window: testWindow, Width: 256}, 10)
	sk, _ := empty.sketch.AppendSnapshot(nil, now)
	data := appendSnapshot(nil, "b", now, sk, b.c.blocks.appendOwn(nil, now.UnixNano()), nil)
	if err := st.Store(bg, Key("z/1", "b"), data); err != nil {
		t.Fatal(err)
	}
	c.s.Read(bg, now.Add(time.Second))
	if got := c.take("k", 1, now.Add(time.Second)); got != 0 {
		t.Fatal("c granted a key blocked by b")
	}
	if got := c.take("fresh", 1, now.Add(time.Second)); got != 1 {
		t.Fatal("c denied a fresh key")
	}
}

// A dead instance's counts age out with its windows; its file goes after
// purge_age.
func TestDeadInstanceAgesOutAndIsPurged(t *testing.T) {
	a, b, _, dir := newPair(t)
	now := t0.Add(30 * time.Second)
	a.take("k", 10, now)
	a.s.Write(bg, now) // then a dies
	b.s.Read(bg, now)
	if b.take("k", 1, now) != 0 {
		t.Fatal("b granted k that a exhausted")
	}
	// Half a window later about half of a's count is left: 10·(1−0.5)=5.
	later := t0.Add(testWindow + 30*time.Second)
	b.s.Read(bg, later)
	if got := b.take("k", 10, later); got != 5 {
		t.Fatalf("half a window on, b granted %d, want 5", got)
	}
	gone := t0.Add(2*testWindow + time.Second)
	b.s.Read(bg, gone)
	if got := b.take("j", 10, gone); got != 10 {
		t.Fatalf("two windows on, b granted %d of another key, want 10", got)
	}
	file := filepath.Join(dir, "rate_limit", "z%2F1", "a")
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("a's file went before purge_age: %v", err)
	}
	b.s.Read(bg, now.Add(testIntervals.PurgeAge+time.Second))
	if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a's file after purge_age: %v", err)
	}
}

// Whatever else lies under the zone's directory is skipped and counted,
// and the real snapshots still count.
func TestJunkIsSkipped(t *testing.T) {
	a, b, _, dir := newPair(t)
	now := t0.Add(time.Second)
	a.take("k", 10, now)
	a.s.Write(bg, now)
	good, err := os.ReadFile(filepath.Join(dir, "rate_limit", "z%2F1", "a"))
	if err != nil {
		t.Fatal(err)
	}
	zdir := filepath.Join(dir, "rate_limit", "z%2F1")
	junk := map[string][]byte{
		"1234567890":   good, // a certmagic temporary file: a's bytes under another name
		"truncated":    good[:len(good)/2],
		"empty":        nil,
		"random":       []byte("\x00\xffnot a snapshot at all"),
		"version3":     append([]byte("FGCL\x03"), good[5:]...),
		"badsum":       append(good[:len(good)-1:len(good)-1], good[len(good)-1]^1),
		"sub/inner":    good,
		"other.shape":  appendSnapshot(nil, "other.shape", now, []byte("FGSK\x01\x01\x01\x80\xb0\xe3\x8d\xdf\x01\x00\x00\x00"), nil, nil),
		"bad-sketch-x": appendSnapshot(nil, "bad-sketch-x", now, []byte("junk"), nil, nil),
	}
	for name, data := range junk {
		p := filepath.Join(zdir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Junk outside the zone's directory is never looked at.
	if err := os.WriteFile(filepath.Join(dir, "rate_limit", "stray"), good, 0o600); err != nil {
		t.Fatal(err)
	}
	b.s.Read(bg, now)
	if got := b.take("k", 1, now); got != 0 {
		t.Fatal("with junk beside it, a's snapshot no longer counts")
	}
	if got, want := b.c.Skipped(), uint64(len(junk)); got != want {
		t.Fatalf("skipped %d entries, want %d", got, want)
	}
	if n := b.logs.FilterLevelExact(zapcore.WarnLevel).Len() + b.logs.FilterLevelExact(zapcore.ErrorLevel).Len(); n != 0 {
		t.Fatalf("junk logged %d warnings or errors, want none (debug only)", n)
	}
}

func TestRestartRestoresOwnState(t *testing.T) {
	st, _ := fileStorage(t)
	a := newNode(t, st, "a")
	now := t0.Add(5 * time.Second)
	if got := a.take("k", 11, now); got != 10 {
		t.Fatalf("granted %d of 11", got)
	}
	a.take("half", 5, now)
	a.s.Write(bg, now)
	// The process restarts: a new Cluster, the same instance.
	a2 := newNode(t, st, "a")
	later := now.Add(2 * time.Second)
	if err := a2.s.Restore(bg, later); err != nil {
		t.Fatal(err)
	}
	if got := a2.take("k", 1, later); got != 0 {
		t.Fatal("an exhausted key passed after a restart")
	}
	if got := a2.take("half", 10, later); got != 5 {
		t.Fatalf("a half-used key got %d after a restart, want 5", got)
	}
	if got := a2.take("fresh", 10, later); got != 10 {
		t.Fatalf("a fresh key got %d after a restart, want 10", got)
	}
	// Restoring again (a config reload) adds nothing.
	if err := a2.s.Restore(bg, later); err != nil {
		t.Fatal(err)
	}
	a2.s.Write(bg, later)
	a3 := newNode(t, st, "a")
	if err := a3.s.Restore(bg, later); err != nil {
		t.Fatal(err)
	}
	if got := a3.take("fresh", 1, later); got != 0 {
		t.Fatal("the state published after a restore was not the restored one plus the new counts")
	}
}

// failingStorage fails every operation while down is set.
type failingStorage struct {
	certmagic.Storage
	down atomic.Bool
}

var errDown = errors.New("connection refused")

func (f *failingStorage) Store(ctx context.Context, k string, v []byte) error {
	if f.down.Load() {
		return errDown
	}
	return f.Storage.Store(ctx, k, v)
}

func (f *failingStorage) Load(ctx context.Context, k string) ([]byte, error) {
	if f.down.Load() {
		return nil, errDown
	}
	return f.Storage.Load(ctx, k)
}

func (f *failingStorage) List(ctx context.Context, p string, r bool) ([]string, error) {
	if f.down.Load() {
		return nil, errDown
	}
	return f.Storage.List(ctx, p, r)
}

// While storage fails, decisions go on with what the instance knows, one
// warning is logged per interval, and the cluster comes back by itself.
func TestStorageFailureDegradesAndRecovers(t *testing.T) {
	fs, _ := fileStorage(t)
	st := &failingStorage{Storage: fs}
	nodes := newNodes(t, st, 2)
	a, b := nodes[0], nodes[1]
	now := t0.Add(time.Second)
	a.take("k", 6, now)
	a.s.Write(bg, now)
	b.s.Read(bg, now)
	st.down.Store(true)
	for i := range 20 { // 20 sync rounds, 100ms apart: two intervals
		at := now.Add(time.Duration(i) * 100 * time.Millisecond)
		a.s.Write(bg, at)
		b.s.Read(bg, at)
	}
	// b still knows a's 6 and decides locally: 4 more.
	if got := b.take("k", 10, now.Add(2*time.Second)); got != 4 {
		t.Fatalf("during the outage b granted %d, want 4", got)
	}
	for name, n := range map[string]*node{"a": a, "b": b} {
		if w := n.logs.FilterLevelExact(zapcore.WarnLevel).Len(); w != 2 {
			t.Errorf("%s logged %d warnings over two intervals of failures, want 2", name, w)
		}
		if f := n.c.Failed(OpRead) + n.c.Failed(OpWrite); f != 20 {
			t.Errorf("%s counted %d failures, want 20", name, f)
		}
	}
	// Staleness: the last success is the one before the outage.
	if at, ok := a.c.LastSuccess(OpWrite); !ok || !at.Equal(now) {
		t.Errorf("a's last write: %v %v, want %v", at, ok, now)
	}
	if at, ok := b.c.LastSuccess(OpRead); !ok || !at.Equal(now) {
		t.Errorf("b's last read: %v %v, want %v", at, ok, now)
	}
	if _, ok := a.c.LastSuccess(OpRead); ok {
		t.Error("a never read, yet has a last read")
	}
	st.down.Store(false)
	later := now.Add(3 * time.Second)
	a.take("k", 4, later) // a alone would allow 4 more
	a.s.Write(bg, later)
	b.s.Write(bg, later)
	a.s.Read(bg, later)
	b.s.Read(bg, later)
	if got := a.take("k", 1, later) + b.take("k", 1, later); got != 0 {
		t.Fatalf("after recovery %d more granted over the cluster limit", got)
	}
	if at, ok := b.c.LastSuccess(OpRead); !ok || !at.Equal(later) {
		t.Errorf("b's last read after recovery: %v %v, want %v", at, ok, later)
	}
	for name, n := range map[string]*node{"a": a, "b": b} {
		if n.logs.FilterMessage("cluster storage works again").Len() != 1 {
			t.Errorf("%s did not log its recovery once", name)
		}
	}
}

// Write publishes nothing until the instance's own last state is restored:
// a restart while storage is down must not overwrite it later.
func TestNoWriteBeforeRestore(t *testing.T) {
	fs, _ := fileStorage(t)
	st := &failingStorage{Storage: fs}
	a := newNode(t, st, "a")
	now := t0.Add(time.Second)
	a.take("k", 10, now)
	a.s.Write(bg, now)
	st.down.Store(true)
	a2 := newNode(t, st, "a") // restarts while storage is down
	if err := a2.s.Restore(bg, now); err == nil {
		t.Fatal("Restore succeeded on a failing storage")
	}
	a2.take("k", 3, now)
	a2.s.Write(bg, now)
	st.down.Store(false)
	a2.s.Write(bg, now) // restores, then publishes both
	a3 := newNode(t, st, "a")
	if err := a3.s.Restore(bg, now); err != nil {
		t.Fatal(err)
	}
	if got := a3.take("k", 1, now); got != 0 {
		t.Fatal("the state from before the outage was lost")
	}
	if !strings.Contains(a2.logs.All()[0].ContextMap()["op"].(string), "restore") {
		t.Fatalf("first log %v, want a failed restore", a2.logs.All()[0].ContextMap())
	}
}
