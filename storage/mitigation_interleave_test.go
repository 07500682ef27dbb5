package storage

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/floodgate-rl/floodgate/internal/schedtest"
)

// The mitigation cache's changes (add, addPeer, remove, dropStalePeers)
// are compare-and-swap loops on a pair of slots. These tests run two of
// them through every interleaving of their loads and CASes of the pair
// (testPause), and check that none loses what the other did: the
// equivalent, for the cache, of limiter's interleave_test.go.

// runSlotSchedule runs fs, pausing each before every load or CAS of a slot
// watch accepts, following prefix (goroutine ids, one per step) and then
// the lowest live goroutine. It returns the goroutine of each step and the
// live goroutines at it.
func runSlotSchedule(watch func(*atomic.Pointer[mitEntry]) bool, fs []func(), prefix []int) (path []int, live [][]int) {
	release := make([]chan struct{}, len(fs))
	for i := range release {
		release[i] = make(chan struct{})
	}
	back := make(chan bool) // true: finished
	cur := 0
	testPause = func(s *atomic.Pointer[mitEntry]) {
		if !watch(s) {
			return
		}
		id := cur
		back <- false
		<-release[id]
	}
	defer func() { testPause = nil }()
	for i, f := range fs {
		go func() {
			<-release[i]
			f()
			back <- true
		}()
	}
	alive := make([]bool, len(fs))
	for i := range alive {
		alive[i] = true
	}
	for step := 0; ; step++ {
		var ids []int
		for i, ok := range alive {
			if ok {
				ids = append(ids, i)
			}
		}
		if len(ids) == 0 {
			return path, live
		}
		g := ids[0]
		if step < len(prefix) {
			g = prefix[step]
		}
		path, live = append(path, g), append(live, ids)
		cur = g
		release[g] <- struct{}{}
		if <-back {
			alive[g] = false
		}
	}
}

// everySlotSchedule runs the goroutines setup gives, on a fresh cache each
// time, through every interleaving of their steps, and calls check after
// each with the schedule taken (X, Y: who took each step). It returns the
// number of schedules.
func everySlotSchedule(t *testing.T, setup func() (m *mitigation, h uint64, fs []func(), check func(schedule string))) int {
	t.Helper()
	var prefix []int
	for n := 1; ; n++ {
		m, h, fs, check := setup()
		a, b := m.pair(h)
		path, live := runSlotSchedule(func(s *atomic.Pointer[mitEntry]) bool { return s == a || s == b }, fs, prefix)
		check(schedtest.String(path))
		if t.Failed() || n == 10_000 {
			return n
		}
		var more bool
		if prefix, more = schedtest.Next(path, live); !more {
			return n
		}
	}
}

// entryOf returns the key's entry in the cache, if any.
func entryOf(m *mitigation, h uint64) *mitEntry {
	a, b := m.pair(h)
	for _, s := range []*atomic.Pointer[mitEntry]{a, b} {
		if e := s.Load(); e != nil && e.hash == h {
			return e
		}
	}
	return nil
}

const mitNow = int64(1_000)

func TestMitigationChangesLoseNothingInAnyInterleaving(t *testing.T) {
	h := uint64(0x40)  // slot 0x40, its pair 0x41
	other := h + 1<<12 // another key of the same pair
	third := h + 2<<12 // and a third
	for _, tc := range []struct {
		name string
		// prepare sets the cache up before the race.
		prepare func(m *mitigation)
		race    func(m *mitigation) []func()
		check   func(m *mitigation) error
	}{
		{
			name: "two own blocks of one key: the longer holds",
			race: func(m *mitigation) []func() {
				return []func(){func() { m.add(h, 5_000, mitNow) }, func() { m.add(h, 7_000, mitNow) }}
			},
			check: func(m *mitigation) error {
				if e := entryOf(m, h); e == nil || e.own != 7_000 {
					return fmt.Errorf("entry %+v, want own 7000", e)
				}
				return nil
			},
		},
		{
			name: "an own block and a peer's of one key: both hold",
			race: func(m *mitigation) []func() {
				return []func(){func() { m.add(h, 5_000, mitNow) }, func() { m.addPeer(h, 7_000, mitNow, 1) }}
			},
			check: func(m *mitigation) error {
				if e := entryOf(m, h); e == nil || e.own != 5_000 || e.peer != 7_000 || e.gen != 1 {
					return fmt.Errorf("entry %+v, want own 5000, peer 7000 of read 1", e)
				}
				return nil
			},
		},
		{
			name: "two keys into a free pair: both blocked",
			race: func(m *mitigation) []func() {
				return []func(){func() { m.add(h, 5_000, mitNow) }, func() { m.add(other, 6_000, mitNow) }}
			},
			check: func(m *mitigation) error {
				if _, ok := m.blocked(h, mitNow); !ok {
					return fmt.Errorf("key lost its block")
				}
				if _, ok := m.blocked(other, mitNow); !ok {
					return fmt.Errorf("other key lost its block")
				}
				return nil
			},
		},
		{
			name: "a lift of a block up to a time and a longer block: the longer holds",
			prepare: func(m *mitigation) {
				m.add(h, 5_000, mitNow)
			},
			race: func(m *mitigation) []func() {
				return []func(){func() { m.remove(h, 5_000) }, func() { m.add(h, 9_000, mitNow) }}
			},
			check: func(m *mitigation) error {
				if until, ok := m.blocked(h, mitNow); !ok || until != 9_000 {
					return fmt.Errorf("blocked until %d (%v), want 9000", until, ok)
				}
				return nil
			},
		},
		{
			name: "dropping stale peers' blocks and an own block: the own holds",
			prepare: func(m *mitigation) {
				m.addPeer(h, 5_000, mitNow, 1)
			},
			race: func(m *mitigation) []func() {
				return []func(){func() { m.dropStalePeers(2) }, func() { m.add(h, 6_000, mitNow) }}
			},
			check: func(m *mitigation) error {
				if e := entryOf(m, h); e == nil || e.own != 6_000 {
					return fmt.Errorf("entry %+v, want own 6000", e)
				}
				return nil
			},
		},
		{
			name: "dropping stale peers' blocks and a peer's block of the new read: the new one holds",
			prepare: func(m *mitigation) {
				m.addPeer(h, 5_000, mitNow, 1)
			},
			race: func(m *mitigation) []func() {
				return []func(){func() { m.dropStalePeers(2) }, func() { m.addPeer(h, 8_000, mitNow, 2) }}
			},
			check: func(m *mitigation) error {
				if e := entryOf(m, h); e == nil || e.peer != 8_000 || e.gen != 2 {
					return fmt.Errorf("entry %+v, want peer 8000 of read 2", e)
				}
				return nil
			},
		},
		{
			name: "a full pair and a new key: the block that ends first goes, the others stay",
			prepare: func(m *mitigation) {
				m.add(h, 5_000, mitNow)
				m.add(other, 9_000, mitNow)
			},
			race: func(m *mitigation) []func() {
				return []func(){func() { m.add(third, 7_000, mitNow) }, func() { m.add(other, 9_500, mitNow) }}
			},
			check: func(m *mitigation) error {
				if until, ok := m.blocked(other, mitNow); !ok || until != 9_500 {
					return fmt.Errorf("the longest block: until %d (%v), want 9500", until, ok)
				}
				if until, ok := m.blocked(third, mitNow); !ok || until != 7_000 {
					return fmt.Errorf("the new block: until %d (%v), want 7000", until, ok)
				}
				return nil
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := everySlotSchedule(t, func() (*mitigation, uint64, []func(), func(string)) {
				m := new(mitigation)
				if tc.prepare != nil {
					tc.prepare(m)
				}
				return m, h, tc.race(m), func(schedule string) {
					if err := tc.check(m); err != nil {
						t.Errorf("schedule %s: %v", schedule, err)
					}
				}
			})
			if n < 2 {
				t.Fatalf("%d schedule: the race has no interleaving to force", n)
			}
			t.Logf("%d schedules", n)
		})
	}
}
