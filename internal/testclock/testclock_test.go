package testclock

import (
	"sync"
	"testing"
	"time"
)

func TestClockReadsWhereItWasMoved(t *testing.T) {
	start := time.Unix(1_700_000_000, 0)
	c := New(start)
	if got := c.Now(); !got.Equal(start) {
		t.Fatalf("new clock reads %v, want its start %v", got, start)
	}
	c.Advance(1500 * time.Millisecond)
	if got, want := c.Now(), start.Add(1500*time.Millisecond); !got.Equal(want) {
		t.Fatalf("after Advance(1.5s): %v, want %v", got, want)
	}
	before := time.Unix(-1, 0)
	c.Set(before)
	if got := c.Now(); !got.Equal(before) {
		t.Fatalf("after Set to before the start: %v, want %v", got, before)
	}
}

// TestClockKeepsMonotonicReading: a clock started an hour after time.Now
// reads as later than a time.Now taken afterwards, as the handler tests that
// start their clocks that way rely on.
func TestClockKeepsMonotonicReading(t *testing.T) {
	c := New(time.Now().Add(time.Hour))
	if now := time.Now(); !c.Now().After(now) || c.Now().Sub(now) > time.Hour {
		t.Fatalf("clock %v, time.Now %v: want within the hour after", c.Now(), now)
	}
}

func TestClockConcurrentAdvance(t *testing.T) {
	c := New(time.Time{})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 1000 {
				c.Advance(time.Nanosecond)
				_ = c.Now()
			}
		})
	}
	wg.Wait()
	if got := c.Now().Sub(time.Time{}); got != 8000*time.Nanosecond {
		t.Fatalf("8×1000 advances of 1ns: %v", got)
	}
}
