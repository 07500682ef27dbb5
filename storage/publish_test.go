package storage

import (
	"strings"
	"testing"
	"time"
)

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
