package storage

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
	"weak"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap/zapcore"
)

// orderedStorage lists a directory in sorted order, or reversed, and
// counts the loads of other instances' snapshots than skip's.
type orderedStorage struct {
	certmagic.Storage
	reverse bool
	skip    string
	mu      sync.Mutex
	loads   int
}

func (o *orderedStorage) List(ctx context.Context, p string, r bool) ([]string, error) {
	keys, err := o.Storage.List(ctx, p, r)
	slices.Sort(keys)
	if o.reverse {
		slices.Reverse(keys)
	}
	return keys, err
}

func (o *orderedStorage) Load(ctx context.Context, k string) ([]byte, error) {
	if path.Base(k) != o.skip {
		o.mu.Lock()
		o.loads++
		o.mu.Unlock()
	}
	return o.Storage.Load(ctx, k)
}

// A reader adds each snapshot as it loads it. One that lists a reset the
// reader has not learned yet may come after snapshots that count the key,
// already added: the reader then reads again, holding them all, and forgets
// their counts of the key all the same. Whatever the listing's order, a
// key reset on one instance passes on another after one read, and what was
// counted after the reset still counts.
func TestReadLearnsAResetFromAnySnapshotOfTheListing(t *testing.T) {
	for _, reverse := range []bool{false, true} {
		t.Run(fmt.Sprintf("reverse=%v", reverse), func(t *testing.T) {
			st, _ := fileStorage(t)
			// "a" resets the key, "c" counted it before; b reads them in
			// the order a, c or c, a.
			ordered := &orderedStorage{Storage: st, reverse: reverse, skip: "b"}
			a, c := newNode(t, st, "a"), newNode(t, st, "c")
			b := newNode(t, ordered, "b")
			now := t0.Add(time.Second)
			if c.take("k", 11, now) != 10 { // and a denial: c blocks k
				t.Fatal("c did not exhaust k")
			}
			c.s.Write(bg, now)
			a.s.Read(bg, now)
			a.c.Reset(hk, now)
			if a.take("k", 2, now) != 2 { // counted after the reset
				t.Fatal("a did not pass k after its reset")
			}
			a.s.Write(bg, now)
			b.s.Write(bg, now)
			ordered.loads = 0
			b.s.Read(bg, now)
			if !b.passes(8, now) || b.passes(9, now) {
				t.Fatalf("b after one read: %+v, want 8 left (c's 10 forgotten, a's 2 after the reset counted)", b.c.PeekHash(hk, 1, now))
			}
			// c's snapshot listed first makes the read load both again.
			want := 2
			if reverse {
				want = 4
			}
			if ordered.loads != want {
				t.Errorf("b loaded the peers' snapshots %d times, want %d", ordered.loads, want)
			}
			// Learned, the reset sends no further read back: the next
			// one loads each snapshot once, whatever the order.
			ordered.loads = 0
			b.s.Read(bg, now.Add(time.Second))
			if ordered.loads != 2 {
				t.Errorf("the next read loaded %d snapshots, want 2", ordered.loads)
			}
		})
	}
}

// weakStorage keeps every snapshot as stored and hands a fresh copy to
// each load, so that a loaded snapshot lives only as long as its reader
// keeps it; at each load it counts the copies handed out before that are
// still alive after a collection.
type weakStorage struct {
	*memStorage
	own      string
	handed   []weak.Pointer[byte]
	mostHeld int
}

func (w *weakStorage) Load(ctx context.Context, k string) ([]byte, error) {
	v, err := w.memStorage.Load(ctx, k)
	if err != nil || path.Base(k) == w.own {
		return v, err
	}
	runtime.GC()
	held := 0
	for _, p := range w.handed {
		if p.Value() != nil {
			held++
		}
	}
	w.mostHeld = max(w.mostHeld, held)
	cp := slices.Clone(v)
	w.handed = append(w.handed, weak.Make(&cp[0]))
	return cp, nil
}

// A read holds one peer's snapshot at a time: the one it is adding up. So
// the memory a read needs does not grow with the number of instances.
func TestReadHoldsOnePeerSnapshotAtATime(t *testing.T) {
	mem := newMemStorage()
	ws := &weakStorage{memStorage: mem, own: "reader"}
	now := t0.Add(time.Second)
	for i := range 12 {
		n := newNode(t, mem, fmt.Sprintf("peer%02d", i))
		n.take(fmt.Sprint("k", i), 3, now)
		n.s.Write(bg, now)
	}
	r := newNode(t, ws, "reader")
	r.s.Write(bg, now)
	r.s.Read(bg, now)
	if len(ws.handed) != 12 {
		t.Fatalf("the read loaded %d snapshots, want the 12 peers'", len(ws.handed))
	}
	if ws.mostHeld > 0 {
		t.Errorf("while loading a snapshot the read still held %d loaded before it, want none", ws.mostHeld)
	}
	for i := range 12 {
		if got := r.take(fmt.Sprint("k", i), 8, now); got != 7 {
			t.Errorf("k%d: %d of 8 granted, want the 7 the peer's 3 leave", i, got)
		}
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
	// Only an instance whose own publishes land deletes (see
	// sumSnapshots): one whose writes fail may be in an outage on every
	// instance, a's among them.
	purged := now.Add(testIntervals.PurgeAge + time.Second)
	b.s.Read(bg, purged)
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("a's file deleted by b, none of whose publishes landed: %v", err)
	}
	b.s.Write(bg, purged)
	b.s.Read(bg, purged)
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
