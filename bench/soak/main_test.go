package main

import (
	"math/rand/v2"
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

// The fresh-connection clients tick together, each skipping the ticks its
// last request outlasted. On every tick both use, one sends to /addr and
// the other to /plain, so that a reload resetting that tick's connections
// drops one of each; and in all they send as many to each route.
func TestFreshClientsOnOneTickSendOneOfEachPath(t *testing.T) {
	picks := freshPaths(2)
	rng := rand.New(rand.NewPCG(1, 2))
	sent := map[string]int{}
	shared := 0
	for tick := range 10000 {
		var paths []string
		for _, i := range rng.Perm(2) { // either may run first
			if rng.IntN(10) == 0 {
				continue // this client's request outlasted the tick
			}
			path, as := picks[i]()
			if want := map[string]sentAs{"/addr": freshLimited, "/plain": freshPlain}[path]; as != want {
				t.Fatalf("tick %d: %s counted as %d, want %d", tick, path, as, want)
			}
			sent[path]++
			paths = append(paths, path)
		}
		if len(paths) == 2 {
			shared++
			if paths[0] == paths[1] {
				t.Fatalf("tick %d: both clients sent %s (%d ticks shared before)", tick, paths[0], shared-1)
			}
		}
	}
	if d := sent["/addr"] - sent["/plain"]; d < 0 || d > 1 || shared < 7000 {
		t.Errorf("sent %v over %d shared ticks: want as many to each route, on most ticks", sent, shared)
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
			rs[i].fair = 1
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
