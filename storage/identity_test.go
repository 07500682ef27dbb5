package storage

import (
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
)

// Two processes with one instance id (one data directory) share the limit
// once they notice each other: the one that finds the other's snapshot
// under its name logs an error once, counts it and publishes under an
// alias from then on.
func TestTwoProcessesWithOneInstanceIDShareTheLimit(t *testing.T) {
	st, _ := fileStorage(t)
	a, b := newNode(t, st, "same"), newNode(t, st, "same")
	now := t0.Add(time.Second)
	granted := 0
	for i := range 20 {
		at := now.Add(time.Duration(i) * 100 * time.Millisecond)
		granted += a.take("k", 1, at) + b.take("k", 1, at)
		syncAll(at, a, b)
	}
	if granted > 11 {
		t.Fatalf("two processes with one instance id granted %d of a limit of 10", granted)
	}
	if got := a.c.Conflicts() + b.c.Conflicts(); got != 1 {
		t.Fatalf("counted %d conflicts, want 1 (one process noticed, then they stopped overwriting each other)", got)
	}
	errs := a.logs.FilterLevelExact(zapcore.ErrorLevel).Len() + b.logs.FilterLevelExact(zapcore.ErrorLevel).Len()
	if errs != 1 {
		t.Fatalf("logged %d errors, want 1", errs)
	}
	// Either one restarting (a new process, the same id) restores a state
	// that counts the key.
	later := now.Add(3 * time.Second)
	a2 := newNode(t, st, "same")
	if err := a2.s.Restore(bg, later); err != nil {
		t.Fatal(err)
	}
	a2.s.Read(bg, later)
	if got := a2.take("k", 10, later); got != 0 {
		t.Fatalf("a restarted process granted %d more of k", got)
	}
}
