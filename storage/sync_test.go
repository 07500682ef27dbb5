package storage

import (
	"context"
	"errors"
	"slices"
	"sync"
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

var errDown = errors.New("connection refused")

// listTimes is a memStorage that notes when each List began (a Syncer's
// read lists the zone's snapshots; no aggregate here), taking slow that
// long to answer.
type listTimes struct {
	*memStorage
	slow  time.Duration
	mu    sync.Mutex
	times []time.Time
}

func (l *listTimes) List(ctx context.Context, path string, recursive bool) ([]string, error) {
	l.mu.Lock()
	l.times = append(l.times, time.Now())
	l.mu.Unlock()
	time.Sleep(l.slow)
	return l.memStorage.List(ctx, path, recursive)
}

// The running Syncer reads at gaps drawn by readGap, counted from when each
// read was due: with reads every 100 ms, answered at once or after 50 ms,
// the median gap between two reads is under 0.95 of the interval (7/8 of
// it, drawn: a ticker's is the interval, and a loaded machine only makes
// it longer; counted from the end of a 50 ms read it would be 1.4), the
// shortest tenth of the gaps are at least 0.6 of it (3/4 at least, drawn;
// not more reads than that), and the gaps differ (their middle half spans
// more than a 20th of the interval: 1/8 drawn, where one period drawn
// once would give them all the same). Medians and quantiles, not the
// extremes: a read stalled on a busy machine lengthens one gap and
// shortens the next. (window_skew_test.go has what the drawn gaps are
// for; nextRead's test, the slow read.)
func TestSyncerReadsAtDrawnGaps(t *testing.T) {
	const iv = 100 * time.Millisecond
	for _, slow := range []time.Duration{0, iv / 2} {
		st := &listTimes{memStorage: newMemStorage(), slow: slow}
		c, err := newCluster(Shape{Zone: "z/1", Window: testWindow, Width: 256}, 10)
		if err != nil {
			t.Fatal(err)
		}
		s := NewSyncer(c, st, "a", Intervals{Read: iv, Write: time.Hour, PurgeAge: time.Hour}, zap.NewNop())
		s.Start()
		deadline := time.Now().Add(20 * time.Second)
		for {
			st.mu.Lock()
			n := len(st.times)
			st.mu.Unlock()
			if n > 41 || time.Now().After(deadline) {
				break
			}
			time.Sleep(iv)
		}
		s.Stop()
		st.mu.Lock()
		times := slices.Clone(st.times)
		st.mu.Unlock()
		if len(times) < 21 {
			t.Fatalf("reads taking %v: %d reads in 20 s, want at least 21", slow, len(times))
		}
		gaps := make([]time.Duration, len(times)-1)
		for i := range gaps {
			gaps[i] = times[i+1].Sub(times[i])
		}
		q := slices.Clone(gaps)
		slices.Sort(q)
		at := func(f float64) time.Duration { return q[int(f*float64(len(q)-1))] }
		t.Logf("reads taking %v, %d reads, interval %v: gaps 10th percentile %v, quartiles %v %v %v", slow, len(times), iv, at(0.1), at(0.25), at(0.5), at(0.75))
		if at(0.5) > iv*95/100 || at(0.1) < iv*6/10 || at(0.75)-at(0.25) <= iv/20 {
			t.Errorf("reads taking %v: gaps between reads: median %v, want at most %v; 10th percentile %v, want at least %v; quartiles %v apart, want more than %v (gaps %v)",
				slow, at(0.5), iv*95/100, at(0.1), iv*6/10, at(0.75)-at(0.25), iv/20, gaps)
		}
	}
}

// A read is due a drawn gap after the one before was due, not after it
// ended: a read that takes most of the gap delays the next by nothing, one
// that runs over it by what it ran over (the next comes at once).
func TestNextReadCountsFromWhenTheReadWasDue(t *testing.T) {
	due := t0
	for _, c := range []struct {
		took, gap time.Duration
		want      time.Time
	}{
		{10 * time.Millisecond, 900 * time.Millisecond, t0.Add(900 * time.Millisecond)},
		{850 * time.Millisecond, 900 * time.Millisecond, t0.Add(900 * time.Millisecond)},
		{900 * time.Millisecond, 900 * time.Millisecond, t0.Add(900 * time.Millisecond)},
		{1200 * time.Millisecond, 900 * time.Millisecond, t0.Add(1200 * time.Millisecond)},
	} {
		if got := nextRead(due, due.Add(c.took), c.gap); !got.Equal(c.want) {
			t.Errorf("read due at t0 took %v, gap %v: next due %v after t0, want %v", c.took, c.gap, got.Sub(t0), c.want.Sub(t0))
		}
	}
}
