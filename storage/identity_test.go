package storage

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/floodgate-rl/floodgate/limiter"
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
	if granted > 11 || granted < 10 {
		t.Fatalf("two processes with one instance id granted %d of a limit of 10, asked 40 times: want the limit, hardly more", granted)
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

// In a fleet with an aggregate, the process that switched to its alias
// reads the aggregate like every other instance: the aggregate goes on
// listing the other process under the instance id, a name this one once
// published under, but that snapshot is the other's, a peer's, not this
// process's own state to take out. Read in full at every sync instead, it
// would load every snapshot for the rest of its life.
func TestAnAliasedProcessReadsTheAggregate(t *testing.T) {
	st := newMemStorage()
	nodes := append(newNodes(t, st, 5), newNode(t, st, "x"), newNode(t, st, "x"))
	now := t0.Add(time.Second)
	var early []byte // nodes[5]'s first snapshot, stored under x
	for i := range 4 {
		at := now.Add(time.Duration(i) * time.Second)
		nodes[5].take("x5", 1, at) // the two write snapshots that differ
		nodes[6].take("x6", 1, at)
		if i == 0 {
			nodes[5].s.Write(bg, at)
			st.mu.Lock()
			early = st.data[Key("z/1", "x")]
			st.mu.Unlock()
		}
		syncAll(at, nodes...)
	}
	now = now.Add(4 * time.Second)
	var aliased *node
	for _, n := range nodes[5:] {
		if n.s.proc.name("x") != "x" {
			aliased = n
		}
	}
	if aliased == nil || nodes[5].c.Conflicts()+nodes[6].c.Conflicts() != 1 {
		t.Fatalf("the two processes named x: aliased %v, conflicts %d and %d, want one aliased after one conflict",
			aliased != nil, nodes[5].c.Conflicts(), nodes[6].c.Conflicts())
	}
	for _, n := range nodes {
		n.take("k", 2, now) // 14 of a limit of 10
		n.s.Write(bg, now)
	}
	nodes[0].s.Read(bg, now)
	if got := aggregators(nodes); len(got) != 1 || got[0] != "a" {
		t.Fatalf("aggregators %v, want [a]", got)
	}
	if loads := readsLoad(st, now, []*node{aliased}); loads != 1 {
		t.Errorf("the aliased process loaded %d entries to read, want 1: the aggregate", loads)
	}
	via := aliased.c.peers.Load().AppendBinary(nil)
	if full := fullView(t, st, aliased, now); !bytes.Equal(via, full) {
		t.Error("the aliased process's peers' sum from the aggregate differs from the one read from every snapshot")
	}
	if d := aliased.c.PeekHash(hk, 1, now); d.Allowed {
		t.Errorf("the aliased process grants a key the fleet granted 14 times, of a limit of 10: %+v", d)
	}

	// A store of nodes[5]'s under x, from before its alias, that lands
	// late (a store that timed out): the aggregate lists it under x, but
	// it is nodes[5]'s own past state, which its own counts hold already.
	if aliased != nodes[5] {
		t.Fatal("nodes[6] stored under x last, so nodes[5] should have found it there and taken the alias")
	}
	now = now.Add(time.Second)
	for _, n := range nodes {
		n.s.Write(bg, now)
	}
	st.mu.Lock()
	st.data[Key("z/1", "x")] = early
	st.mu.Unlock()
	nodes[0].s.Read(bg, now)
	aliased.s.Read(bg, now)
	via = aliased.c.peers.Load().AppendBinary(nil)
	if full := fullView(t, st, aliased, now); !bytes.Equal(via, full) {
		t.Error("the aliased process counted its own past snapshot, listed by the aggregate under x, as a peer's")
	}
}

// Nor does the process that took its alias take the other process's claim
// for its own: named by the instance id, the claim is the other's. Two
// aggregators, the other process and the aliased one, are down to one, the
// other (the id sorts before the alias), as any two are.
func TestAnAliasedProcessYieldsToTheOtherProcessesClaim(t *testing.T) {
	st := newMemStorage()
	aliased, keeper := newNode(t, st, "x"), newNode(t, st, "x")
	nodes := []*node{keeper, aliased, newNode(t, st, "y1"), newNode(t, st, "y2"), newNode(t, st, "y3")}
	now := t0.Add(time.Second)
	for i := range 3 {
		now = now.Add(time.Second)
		aliased.take(fmt.Sprint("p", i), 1, now) // the two write snapshots that differ
		keeper.take(fmt.Sprint("k", i), 1, now)
		aliased.s.Write(bg, now) // then the keeper over it: the aliased one finds the keeper's
		for _, n := range nodes {
			if n != aliased {
				n.s.Write(bg, now)
			}
		}
		for _, n := range nodes { // the keeper reads first: the aggregator
			n.s.Read(bg, now)
		}
	}
	if aliased.s.proc.name("x") == "x" || keeper.s.proc.name("x") != "x" {
		t.Fatalf("names %q and %q, want the second process aliased", aliased.s.proc.name("x"), keeper.s.proc.name("x"))
	}
	if !keeper.s.agg.aggregating || aliased.s.agg.aggregating {
		t.Fatalf("aggregating: keeper %v, aliased %v; want the keeper alone", keeper.s.agg.aggregating, aliased.s.agg.aggregating)
	}
	aliased.s.agg.aggregating = true // its Lock succeeded too
	for range 2 {
		now = now.Add(testIntervals.Read)
		syncAll(now, nodes...)
	}
	if !keeper.s.agg.aggregating || aliased.s.agg.aggregating {
		t.Fatalf("aggregating two syncs after the aliased process took the lock too: keeper %v, aliased %v; want the keeper alone",
			keeper.s.agg.aggregating, aliased.s.agg.aggregating)
	}
	if cl, err := decodeClaim(st.data[ClaimKey("z/1")]); err != nil || cl.name != "x" {
		t.Fatalf("the claim names %q (%v), want x, the keeper", cl.name, err)
	}
}

// An aggregator whose process takes an alias (another of its syncers, of
// the config a reload replaces, found the other process) and which then
// stops still knows its claim under the instance id for its own, and
// takes it away with its aggregate: left behind, they would name the other
// process for a while. So it does with a claim whose store timed out but
// landed.
func TestAnAggregatorThatTookAnAliasStillDropsItsOwnClaim(t *testing.T) {
	for _, landedLate := range []bool{false, true} {
		t.Run(fmt.Sprintf("landedLate=%v", landedLate), func(t *testing.T) {
			st := newMemStorage()
			var pst certmagic.Storage = st
			if landedLate {
				pst = &lateStorage{memStorage: st, key: ClaimKey("z/1")}
			}
			p := newNode(t, pst, "x")
			nodes := append([]*node{p}, newNodes(t, st, 4)...)
			now := t0.Add(time.Second)
			syncAll(now, nodes...)
			if !p.s.agg.aggregating {
				t.Fatalf("aggregators %v, want x, which read first", aggregators(nodes))
			}
			p.s.proc.alias()
			p.s.agg.drop(bg, "stopping", 0)
			st.mu.Lock()
			defer st.mu.Unlock()
			if _, ok := st.data[ClaimKey("z/1")]; ok {
				t.Error("the claim x stored is still there after it stopped aggregating")
			}
			if _, ok := st.data[AggregateKey("z/1")]; ok {
				t.Error("the aggregate x published is still there after it stopped aggregating")
			}
		})
	}
}

// lateStorage is a memStorage whose stores under key land but report a
// timeout, as a slow storage's may.
type lateStorage struct {
	*memStorage
	key string
}

func (l *lateStorage) Store(ctx context.Context, k string, v []byte) error {
	if err := l.memStorage.Store(ctx, k, v); err != nil || k != l.key {
		return err
	}
	return context.DeadlineExceeded
}

// landingFailer is a storage whose stores fail while down is set, the
// first failed one of each outage landing all the same (a Redis timeout
// after the write arrived).
type landingFailer struct {
	certmagic.Storage
	down, landed atomic.Bool
}

func (f *landingFailer) Store(ctx context.Context, k string, v []byte) error {
	if f.down.Load() {
		if !f.landed.Swap(true) {
			_ = f.Storage.Store(ctx, k, v)
		}
		return errDown
	}
	f.landed.Store(false)
	return f.Storage.Store(ctx, k, v)
}

// An instance whose first failed store landed, and whose next ones fail,
// finds its own snapshot under its key for as long as the writes fail: it
// remembers every store it tried since the last that landed (process
// writes), so it counts no conflict, keeps its name and counts itself
// once. Before, it remembered the last four tries and the last store that
// succeeded: from the fifth failure on it took its own snapshot for
// another process's (a conflict, an error logged, an alias for good, its
// old state under the id a live peer: 4 live of 3), and a fresh key got
// 19 to 23 of 30 on the three for about 6 s.
func TestAFailedStoreThatLandedIsStillOwn(t *testing.T) {
	const events = 30
	for _, out := range []int{5, 8, 40} {
		st := newMemStorage()
		lf := &landingFailer{Storage: st}
		nodes := []*node{newJoiner(t, st, "a", events, time.Minute, zap.NewNop()), newJoiner(t, st, "b", events, time.Minute, zap.NewNop()),
			newJoiner(t, lf, "c", events, time.Minute, zap.NewNop())}
		now := t0
		for range 6 {
			syncAll(now, nodes...)
			now = now.Add(testIntervals.Read)
		}
		var line []int
		var lives []int
		for s := range out + 20 {
			lf.down.Store(s >= 2 && s < 2+out)
			syncAll(now, nodes...)
			line = append(line, burstOnAll(nodes, limiter.HashString(fmt.Sprint("fresh", out, s)), events, now.Add(testIntervals.Read/2), new([]time.Time)))
			lives = append(lives, max(nodes[0].c.Live(), nodes[1].c.Live(), nodes[2].c.Live()))
			now = now.Add(testIntervals.Read)
		}
		t.Logf("c's writes failing %d s, the first landing: conflicts %d, publishing as %q; a fresh key on all each second %v; most live %v", out, nodes[2].c.Conflicts(), nodes[2].s.proc.name("c"), line, lives)
		if nodes[2].c.Conflicts() != 0 || nodes[2].s.proc.name("c") != "c" {
			t.Errorf("c's writes failing %d s: c took its own snapshot for another process's: %d conflicts, publishing as %q", out, nodes[2].c.Conflicts(), nodes[2].s.proc.name("c"))
		}
		for s, got := range line {
			if lives[s] > 3 {
				t.Errorf("c's writes failing %d s, second %d: %d live of 3 instances", out, s, lives[s])
			}
			if want := events; out < 9 && got != want || got > events*11/10+1 {
				t.Errorf("c's writes failing %d s, second %d: a fresh key got %d of %d", out, s, got, events)
			}
		}
	}
}

// A process remembers every store it tried under a key since the last
// that landed, within purge_age and up to maxTried, and its last few
// besides; no more.
func TestAProcessRemembersItsTriesSinceTheLastThatLanded(t *testing.T) {
	p := newProcess()
	data := []byte("snapshot")
	at := t0
	w := writtenOf(at, data)
	p.noteWrite("k", at, data, time.Hour)
	p.noteLanded("k", w)
	for range 2 * maxTried {
		at = at.Add(time.Second)
		p.noteWrite("k", at, data, time.Hour)
	}
	if n := len(p.writes["k"].tried); n != min(maxTried, 3600+1) {
		t.Errorf("after %d failed tries within the hour: %d remembered, want %d", 2*maxTried, n, min(maxTried, 3601))
	}
	if !p.ours("k", writtenOf(at.Add(-time.Duration(min(maxTried, 3601)-1)*time.Second), data)) || !p.ours("k", w) {
		t.Error("the oldest try within bounds, or the one that landed, is forgotten")
	}
	at = at.Add(time.Second)
	p.noteWrite("k", at, data, time.Minute)
	if n := len(p.writes["k"].tried); n != 61 {
		t.Errorf("tries of the last minute: %d remembered, want 61", n)
	}
	p.noteLanded("k", writtenOf(at, data))
	for range 3 {
		at = at.Add(time.Second)
		p.noteWrite("k", at, data, time.Minute)
	}
	if n := len(p.writes["k"].tried); n != 4 {
		t.Errorf("three tries since one landed: %d remembered, want the last 4", n)
	}
}
