package storage

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// openingNode returns a Cluster syncing through a storage that answers
// only once answer is closed, with open counting its tries.
func openingNode(t *testing.T, st certmagic.Storage, answer <-chan struct{}, tries *atomic.Int32) (*Cluster, *Syncer, *observer.ObservedLogs) {
	t.Helper()
	c, err := newCluster(Shape{Zone: "z/1", Window: testWindow, Width: 256}, 10)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.DebugLevel)
	open := func(context.Context) (certmagic.Storage, error) {
		tries.Add(1)
		select {
		case <-answer:
			return st, nil
		default:
			return nil, errors.New("dial tcp 127.0.0.1:1: connect: connection refused")
		}
	}
	s := NewSyncerOpening(c, open, "a", testIntervals, zap.New(core))
	s.proc = newProcess()
	return c, s, logs
}

// A zone whose storage does not answer when it starts (its Redis down as
// the config loads) tries it again after 1 s, then 2, 4 and 8, and at
// most every 10 s, counting each failure as a failed read; it restores
// and publishes nothing meanwhile; once the storage answers it says so
// once, and the storage is its own: Stop publishes its last snapshot
// there.
func TestOpeningRetriesWithBackoffUntilTheStorageAnswers(t *testing.T) {
	st := newMemStorage()
	answer := make(chan struct{})
	var tries atomic.Int32
	c, s, logs := openingNode(t, st, answer, &tries)
	waits, fire := make(chan time.Duration), make(chan time.Time)
	s.after = func(d time.Duration) <-chan time.Time {
		waits <- d
		return fire
	}
	if err := s.Restore(bg, t0); err != nil || tries.Load() != 0 {
		t.Fatalf("Restore before the storage answered: %v, %d tries; want nothing done", err, tries.Load())
	}
	s.Start()
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 10 * time.Second, 10 * time.Second}
	for i, w := range want {
		select {
		case got := <-waits:
			if got != w {
				t.Errorf("wait %d: %v, want %v", i+1, got, w)
			}
		case <-time.After(10 * time.Second): // a bound, should the loop hang
			t.Fatalf("no wait %d within 10s", i+1)
		}
		if got := c.failed[OpRead].Load(); got != uint64(i+1) {
			t.Errorf("after %d failed tries, %d failed reads counted", i+1, got)
		}
		if i == len(want)-1 {
			close(answer)
		}
		fire <- time.Now()
	}
	s.Stop()
	if got := tries.Load(); got != int32(len(want)+1) {
		t.Errorf("the storage was tried %d times, want %d", got, len(want)+1)
	}
	if got := logs.FilterMessage("cluster storage answers: this instance joins the cluster").Len(); got != 1 {
		t.Errorf("logged joining the cluster %d times, want once", got)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if _, ok := st.data[Key("z/1", "a")]; !ok {
		t.Error("no snapshot published once the storage answered (Stop publishes the last)")
	}
}

// Stopped before its storage ever answered, a Syncer returns at once from
// its wait and publishes nothing.
func TestOpeningStoppedBeforeTheStorageAnswers(t *testing.T) {
	st := newMemStorage()
	var tries atomic.Int32
	_, s, logs := openingNode(t, st, make(chan struct{}), &tries)
	waiting := make(chan struct{}, 1)
	s.after = func(time.Duration) <-chan time.Time {
		waiting <- struct{}{}
		return nil // never fires
	}
	s.Start()
	<-waiting
	stopped := make(chan struct{})
	go func() { s.Stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second): // a bound, should Stop hang
		t.Fatal("Stop did not return within 10s while the storage never answered")
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(st.data) != 0 || logs.FilterMessage("cluster storage answers: this instance joins the cluster").Len() != 0 {
		t.Fatalf("stopped before the storage answered: %d entries stored, %v", len(st.data), logs.All())
	}
}
