package limiter

import "testing"

// TestAheadOfComparesTimesAsSerialNumbers: a counter's value is a time mod
// 2³²; it is ahead of now by less than 2³¹ ticks or it is past, on either
// side of the wrap.
func TestAheadOfComparesTimesAsSerialNumbers(t *testing.T) {
	for _, tt := range []struct {
		v, now, want uint32
	}{
		{0, 5, 0},                             // untouched or swept: full
		{0, 1<<32 - 3, 0},                     // 0 is full even just before the wrap
		{105, 5, 100},                         // ahead
		{5, 5, 0},                             // due now: full
		{4, 5, 0},                             // past
		{1<<31 + 4, 5, 1<<31 - 1},             // as far ahead as a time can be
		{1<<31 + 5, 5, 0},                     // farther: a past time that wrapped
		{3, 1<<32 - 7, 10},                    // ahead across the wrap
		{1<<32 - 7, 3, 0},                     // past across the wrap
		{store(1<<32-10, 10), 1<<32 - 10, 11}, // a TAT of 0 is stored as 1: a tick more
	} {
		if got := aheadOf(tt.v, tt.now); got != tt.want {
			t.Errorf("aheadOf(%d, %d) = %d, want %d", tt.v, tt.now, got, tt.want)
		}
	}
}

// TestChargeLaneStopsAtTheCeiling: a charge lifts a full counter to now and
// adds the cost, up to the ceiling.
func TestChargeLaneStopsAtTheCeiling(t *testing.T) {
	at := at{now: 100}
	for _, tt := range []struct {
		v, cost, wantAhead, wantAdded uint32
	}{
		{0, 50, 50, 50},
		{90, 50, 50, 50},      // past: as full
		{300, 50, 250, 50},    // ahead 200
		{2050, 100, 2000, 50}, // ahead 1950: stops at the ceiling of 2000
		{2100, 100, 2000, 0},
	} {
		v, short := chargeLane(tt.v, tt.cost, 2000, at)
		added := tt.cost - short
		if got := aheadOf(v, at.now); got != tt.wantAhead || added != tt.wantAdded {
			t.Errorf("chargeLane(%d, %d): ahead %d added %d, want %d and %d", tt.v, tt.cost, got, added, tt.wantAhead, tt.wantAdded)
		}
	}
}

// setCounter stores counter c of ln as ahead ticks ahead of now. It is for
// tests that set up a line no other goroutine uses yet.
func setCounter(ln *line, c uint8, now, ahead uint32) {
	var v uint32
	if ahead != 0 {
		v = store(now, ahead)
	}
	setCounterValue(ln, c, v)
}
