package main

import (
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
