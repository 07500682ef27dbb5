package limiter

import (
	"math/bits"
	"testing"
	"time"
	"unsafe"
)

// The paths of issue 16 for Windows: a SetLimit beside decisions (every
// interleaving), a refund that comes late, and a sweep at a later clock
// than a request's.

// A windowSetRace is requests of one key racing a SetLimit from from to
// to at at, through every interleaving, on a one-line table where the key
// took used at 0. The key's window (from 0) runs past end under both
// limits, so every schedule must grant to.Events in all (the used, the
// racers and a drain at end): more is a charge lost, fewer a count kept
// that was given back.
type windowSetRace struct {
	name     string
	from, to Limit
	k        int
	used     int64
	at       time.Duration
	reqs     []raceReq
	end      time.Duration
}

func (rc windowSetRace) run(t *testing.T) {
	const h = 0x1234_5678_9abc_def0
	schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		w := newWindowTable(t, rc.from, 64, rc.k)
		denier := newTable(t, Limit{Events: 1, Window: time.Hour}, 64)
		denier.Charge(h, 2, tm(0))
		for range rc.used {
			if d, _ := w.TakeHash(h, 1, tm(0)); !d.Allowed {
				t.Fatalf("%s: setup denied", rc.name)
			}
		}
		// Steps: SetLimit's load and store of the parameters, and the
		// key's words in the old and the new lines.
		_, sub, _ := placeIn(w.p.Load().lines, w.subs, h)
		watch := watchSetLimit(unsafe.Pointer(&w.p), sub, &w.p.Load().lines[0], func() *line { return &w.p.Load().lines[0] })
		reqs, granted := racers(w, denier, h, rc.reqs)
		fs := append([]func(){func() { noErr(t, w.SetLimit(rc.to, tm(rc.at))) }}, reqs...)
		return watch, fs, func(schedule string) {
			got, sum := granted()
			if total := rc.used + sum + int64(drain(w, h, tm(rc.end))); total != rc.to.Events {
				t.Errorf("%s, schedule %s (X is SetLimit): %d granted in the window (%d by the racers: %v), want %d",
					rc.name, schedule, total, sum, got, rc.to.Events)
			}
		}
	})
	t.Logf("%s: %d schedules", rc.name, schedules)
}

// SetLimit beside decisions: a take that charged the old lines after they
// were copied, or that loaded the old limit before the swap, is neither
// lost nor counted twice. On the old code (plain loads, then stores into
// the new lines) such charges were lost, and the drain granted them again.
func TestWindowsSetLimitRacesAreExact(t *testing.T) {
	ms := time.Millisecond
	two, four := Limit{Events: 2, Window: time.Second}, Limit{Events: 4, Window: time.Second}
	for _, rc := range []windowSetRace{
		{"raised, two takes", two, four, 1, 1, 500 * ms, []raceReq{{500 * ms, 1, false}, {500 * ms, 1, false}}, 900 * ms},
		{"raised, three counters", two, four, 3, 1, 500 * ms, []raceReq{{500 * ms, 1, false}}, 900 * ms},
		{"lowered", four, Limit{Events: 3, Window: time.Second}, 1, 1, 500 * ms, []raceReq{{400 * ms, 2, false}}, 900 * ms},
		{"a longer window", Limit{Events: 3, Window: time.Second}, Limit{Events: 4, Window: 2 * time.Second}, 1, 2, 500 * ms,
			[]raceReq{{500 * ms, 1, false}}, 1500 * ms},
		{"a rollback across it", two, four, 1, 1, 500 * ms, []raceReq{{500 * ms, 1, true}}, 900 * ms},
	} {
		rc.run(t)
	}
}

// A refund that comes after its window ended takes back nothing: the start
// field wraps (2³⁰ ticks at events 1: 16,384 windows), and a window that a
// later request starts at the same start must keep that request's count.
// Events 1 a second: X at 0, sweeps as the Caddy module runs them, Y at
// the wrap, X refunded then, and Z must be denied. On the old code X's
// refund took Y's count, and Z was granted: two in one window of one.
func TestWindowsALateRefundTakesNothingFromALaterWindow(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 1, Window: time.Second}, 1<<12, 0)
	p := w.p.Load()
	wrap := time.Duration(p.nanos(uint64(p.smask) + 1))
	const h = 5
	_, rx := w.TakeHash(h, 1, tm(0))
	for at := w.SweepInterval() / 2; at < wrap; at += w.SweepInterval() / 2 {
		w.Sweep(tm(at))
	}
	y, _ := w.TakeHash(h, 1, tm(wrap))
	w.RefundAt(rx, tm(wrap))
	z, _ := w.TakeHash(h, 1, tm(wrap))
	if !y.Allowed || z.Allowed {
		t.Errorf("events 1: X at 0, Y at %v granted %v, X refunded then, Z granted %v: want Y granted, Z denied", wrap, y.Allowed, z.Allowed)
	}
}

// A Reservation taken before a SetLimit refunds into the new table, into
// the window it was counted in: events 2, X and Y at 0, raised to 3 at
// 100 ms (1 left), X refunded at 200 ms: 2 left. On the old code the
// refund took back nothing.
func TestWindowsARefundAcrossSetLimitTakesBackItsCount(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 2, Window: time.Second}, 1<<12, 0)
	const h = 9
	_, rx := w.TakeHash(h, 1, tm(0))
	w.TakeHash(h, 1, tm(0))
	noErr(t, w.SetLimit(Limit{Events: 3, Window: time.Second}, tm(100*time.Millisecond)))
	w.RefundAt(rx, tm(200*time.Millisecond))
	if got := drain(w, h, tm(200*time.Millisecond)); got != 2 {
		t.Errorf("X refunded after the SetLimit: %d granted, want 2", got)
	}
}

// A sweep run at a later clock than a request's is invisible to it: 10
// granted at 0 use up the window, Sweep(1.5 s), and a request whose time
// is still 0.5 s must be denied. On the old code the sweep cleared the
// window (over at 1.5 s), and 10 more were granted at 0.5 s.
func TestWindowsASweepAtALaterClockReopensNoWindow(t *testing.T) {
	w := newWindowTable(t, Limit{Events: 10, Window: time.Second}, 1<<12, 0)
	const h = 5
	before := drain(w, h, tm(0))
	w.Sweep(tm(1500 * time.Millisecond))
	if after := drain(w, h, tm(500*time.Millisecond)); before != 10 || after != 0 {
		t.Errorf("%d granted at 0, Sweep(1.5 s), then %d more at 0.5 s: want 10 and 0", before, after)
	}
	if got := drain(w, h, tm(1500*time.Millisecond)); got != 10 {
		t.Errorf("at 1.5 s: %d granted, want a new window of 10", got)
	}
}

// No window counter is all ones, whatever Events and Window (the frozen
// marker is a word of them): a counter's top bit is never set, even with
// every group at its ceiling and T all ones.
func TestWindowsNoCounterIsFrozen(t *testing.T) {
	for e := int64(1); e <= MaxBurst; e = e*2 + e%2 {
		for _, ev := range []int64{e - 1, e, e + 1} {
			for _, win := range []time.Duration{time.Microsecond, time.Millisecond, time.Second, 365 * 24 * time.Hour} {
				if ev < 1 || ev > MaxBurst {
					continue
				}
				p := windowParamsFor(Limit{Events: ev, Window: win}, 1)
				_, full := p.look(p.smask<<p.tshift|^uint64(0)>>(64-p.tshift), p.smask, p.ceil)
				if int(p.tshift)+bits.Len64(p.smask) > 63 || full>>63 != 0 || full == frozen {
					t.Fatalf("events %d in %v: %d groups of %d bits and a T of %d bits; a full counter is %#x",
						ev, win, p.g, p.cb, bits.Len64(p.smask), full)
				}
			}
		}
	}
}

// The same across a SetLimit: its conversion keeps a window that had just
// ended as ended (as long ago, and at least a new window ago), so a
// request whose time is before SetLimit's still sees it used up. On the
// old code the conversion dropped it, and 10 more were granted at 0.5 s.
func TestWindowsASetLimitAtALaterClockReopensNoWindow(t *testing.T) {
	for _, to := range []Limit{{Events: 10, Window: time.Second}, {Events: 10, Window: 2 * time.Second}} {
		w := newWindowTable(t, Limit{Events: 10, Window: time.Second}, 1<<12, 0)
		const h = 5
		before := drain(w, h, tm(0))
		noErr(t, w.SetLimit(to, tm(1500*time.Millisecond)))
		if after := drain(w, h, tm(500*time.Millisecond)); before != 10 || after != 0 {
			t.Errorf("to 10 in %v: %d granted at 0, SetLimit at 1.5 s, then %d more at 0.5 s: want 10 and 0", to.Window, before, after)
		}
		// The grants of 0 count for the new window: until 2 s under 2 s.
		if got := drain(w, h, tm(to.Window+w.ExtraWait())); got != 10 {
			t.Errorf("to 10 in %v, a window and a sub-window after 0: %d granted, want 10", to.Window, got)
		}
	}
}
