package storage

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap/zapcore"
)

// failingStorage fails every operation while down is set, or only Store
// if writesOnly: an instance whose publishes fail but that keeps reading
// and serving.
type failingStorage struct {
	certmagic.Storage
	down       atomic.Bool
	writesOnly bool
}

func (f *failingStorage) Store(ctx context.Context, k string, v []byte) error {
	if f.down.Load() {
		return errDown
	}
	return f.Storage.Store(ctx, k, v)
}

func (f *failingStorage) Load(ctx context.Context, k string) ([]byte, error) {
	if f.down.Load() && !f.writesOnly {
		return nil, errDown
	}
	return f.Storage.Load(ctx, k)
}

func (f *failingStorage) List(ctx context.Context, p string, r bool) ([]string, error) {
	if f.down.Load() && !f.writesOnly {
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
