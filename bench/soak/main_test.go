package main

import (
	"context"
	"maps"
	"sync"
	"testing"
	"time"
)

// A key granted half its rate for ten windows and then twice its burst at
// one instant: over the whole run that is well within burst + refill
// (the check this replaced, which measured only since the first grant,
// reads 0.64), but the instant holds twice what a token bucket grants in
// any interval.
func TestBucketExcessFindsABurstTheRunsTotalHides(t *testing.T) {
	const burst, events = 10, 10
	window := time.Second
	t0 := time.Unix(0, 0)
	var grants []time.Time
	for i := range 50 {
		grants = append(grants, t0.Add(time.Duration(i)*200*time.Millisecond)) // 5 a second
	}
	end := t0.Add(10 * time.Second)
	for range 2 * burst {
		grants = append(grants, end)
	}
	sinceFirst := float64(len(grants)) / (burst + events*end.Sub(t0).Seconds()/window.Seconds())
	worst, n, span := bucketExcess(grants, 0, burst, events, window)
	if worst < 1.9 || n < 2*burst || span > time.Second {
		t.Errorf("worst interval %.3f (%d grants in %v), since the first grant %.3f: want about 2 over the final instant", worst, n, span, sinceFirst)
	}
	// At the rate from full, never above 1; measured from a later index,
	// only intervals ending there.
	grants = grants[:0]
	for i := range burst + 3*events {
		at := time.Duration(max(0, i-burst+1)) * window / events
		grants = append(grants, t0.Add(at))
	}
	if worst, n, span := bucketExcess(grants, 0, burst, events, window); worst > 1 {
		t.Errorf("a burst then the rate: worst %.3f (%d grants in %v), want at most 1", worst, n, span)
	}
	if w, _, _ := bucketExcess(grants, len(grants), burst, events, window); w != 0 {
		t.Errorf("no new grants: %.3f, want 0", w)
	}
}

// A request to /addr and its twin to /plain are in flight together, each
// counted as what it is, so that a reload meets both or neither.
func TestTwinsAreSentTogether(t *testing.T) {
	var mu sync.Mutex
	sent := map[string]sentAs{}
	var started sync.WaitGroup
	started.Add(len(twins))
	together := make(chan struct{})
	go func() { started.Wait(); close(together) }()
	sendTwins(func(i int, path string, as sentAs) {
		mu.Lock()
		sent[path] = as
		mu.Unlock()
		started.Done()
		select { // answered only once the other is in flight too
		case <-together:
		case <-time.After(5 * time.Second):
			t.Errorf("twin %d (%s) was alone in flight for 5 s", i, path)
		}
	})
	if want := map[string]sentAs{"/addr": freshLimited, "/plain": freshPlain}; !maps.Equal(sent, want) {
		t.Errorf("sent %v, want %v", sent, want)
	}
}

// A connection to the layer4 server that could not be made is counted on
// its own, not as a request to /addr, and is held to /plain's drops on its
// own: the check compares /addr with /plain at as many requests.
func TestLayer4DialFailureIsNotAnAddrDrop(t *testing.T) {
	var c counters
	c.drop(0, freshLayer4)
	c.drop(1, freshLimited)
	c.drop(2, freshLayer4)
	if got := [4]int64{c.droppedLayer4.Load(), c.droppedAddr.Load(), c.dropped.Load(), c.droppedKilled.Load()}; got != [4]int64{1, 1, 2, 1} {
		t.Fatalf("layer4, /addr, all but killed, killed: %v, want [1 1 2 1]", got)
	}
	rows := func(addr, layer4, limitedKept int64) []sampleRow {
		rs := make([]sampleRow, 3)
		for i := range rs {
			rs[i].fair, rs[i].windowSpan = 1, 1
		}
		rs[1].droppedAddr, rs[1].droppedLayer4 = addr, layer4
		rs[1].dropped = addr + layer4 + limitedKept
		return rs
	}
	// Against no drop on /plain, 2 of each kind are within the allowance:
	// the layer4 ones are neither /addr's nor a kept-alive route's.
	if !verdict(rows(2, 2, 1)) {
		t.Error("2 drops on /addr, 2 on layer4 and 1 kept alive failed the check")
	}
	if verdict(rows(2, 3, 0)) {
		t.Error("3 layer4 connections not made, none on /plain, passed the check")
	}
}

// stillRunning is a context past its deadline whose Err is still nil: the
// moment between the deadline and the timer that cancels a context, in
// which a dial the deadline cut has already failed.
type stillRunning struct {
	context.Context
	end time.Time
}

func (c stillRunning) Deadline() (time.Time, bool) { return c.end, true }

// A request cut by the run's deadline is not counted as dropped, even
// before the run's context says it is done.
func TestRunOverAtItsDeadline(t *testing.T) {
	now := time.Now()
	for _, c := range []struct {
		name string
		ctx  context.Context
		want bool
	}{
		{"past its deadline, Err still nil", stillRunning{context.Background(), now.Add(-time.Millisecond)}, true},
		{"before its deadline", stillRunning{context.Background(), now.Add(time.Hour)}, false},
		{"no deadline", context.Background(), false},
		{"cancelled", func() context.Context {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return ctx
		}(), true},
	} {
		if got := runOver(c.ctx); got != c.want {
			t.Errorf("%s: runOver %v, want %v", c.name, got, c.want)
		}
	}
}

// The window zone's worst span is part of the verdict: within the bound
// it passes; over it (the weighted estimate's 1.6 of events), or with
// nothing granted, it fails.
func TestVerdictHoldsTheWindowZoneToItsBound(t *testing.T) {
	rows := func(span float64) []sampleRow {
		rs := make([]sampleRow, 3)
		for i := range rs {
			rs[i].fair, rs[i].windowSpan = 1, 1
		}
		rs[2].windowSpan = span
		return rs
	}
	if !verdict(rows(windowBound)) {
		t.Errorf("a window zone at its bound %.3f failed the check", windowBound)
	}
	for _, span := range []float64{1.602, windowBound + 0.01} {
		if verdict(rows(span)) {
			t.Errorf("a window zone at %.3f of its events in a span passed the check", span)
		}
	}
	zero := rows(0)
	for i := range zero {
		zero[i].windowSpan = 0
	}
	if verdict(zero) {
		t.Error("a window zone that granted nothing passed the check")
	}
}
