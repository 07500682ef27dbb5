package limiter

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// The reference for Windows: caddy-ratelimit's exact sliding log, with
// weights. The table must never grant a key more than Events in any span
// of Window (checked at every grant, against the limit in force then), and
// a request the log would grant (on the table's own history) must not
// wait more than ExtraWait longer.

// grant is a request a table granted: when, how much, under which limit.
// forgot is when a reload found it older than the window then in force
// (0: never): the table holds no grant older than its window, so a reload
// that lengthens the window counts none of those in the new one.
type grant struct {
	at     int64
	weight int64
	events int64
	window int64
	forgot int64
}

// keyLog is one key's grants, in the order of their times.
type keyLog struct{ grants []grant }

// reload marks the grants a reload at ns to l forgets, under the window
// before it; a held request served after it is served under l.
func (k *keyLog) reload(ns, window int64, l Limit) {
	for i := range k.grants {
		g := &k.grants[i]
		if g.forgot == 0 && ns-g.at >= window {
			g.forgot = ns
		}
		if g.at > ns {
			g.events, g.window = l.Events, int64(l.Window)
		}
	}
}

func (k *keyLog) add(g grant) {
	i := len(k.grants)
	for i > 0 && k.grants[i-1].at > g.at {
		i--
	}
	k.grants = slices.Insert(k.grants, i, g)
}

// worstSpan is the most weight any span of a grant's window holds, ending
// at that grant, over the grants; and by how much that exceeds the
// grant's events (0 or less: the bound holds).
func (k *keyLog) worstSpan() (most, over int64, at grant) {
	over = -1 << 62
	for i, g := range k.grants {
		var sum int64
		for j := i; j >= 0 && g.at-k.grants[j].at < g.window; j-- {
			if f := k.grants[j].forgot; f == 0 || f > g.at {
				sum += k.grants[j].weight
			}
		}
		if sum-g.events > over {
			most, over, at = sum, sum-g.events, g
		}
	}
	return most, over, at
}

// earliest is the first time from t at which an exact sliding log of
// events per window, holding k's grants, would grant weight w: now, or
// when enough of the grants have become a window old.
func (k *keyLog) earliest(t, w, events, window int64) int64 {
	fits := func(at int64) bool {
		var sum int64
		for _, g := range k.grants {
			if g.at <= at && at-g.at < window {
				sum += g.weight
			}
		}
		return sum+w <= events
	}
	if fits(t) {
		return t
	}
	for _, g := range k.grants {
		if at := g.at + window; at > t && fits(at) {
			return at
		}
	}
	return 1 << 62
}

// refHarness drives a Windows table and checks every decision against the
// reference.
type refHarness struct {
	t     *testing.T
	w     *Windows
	logs  map[uint64]*keyLog
	waits int     // denials whose extra wait was checked
	extra float64 // the worst extra wait seen, in ExtraWaits
	// quiet[h] is until when key h's extra waits are not checked: a
	// reported cost or a reload makes it wait longer (see Charge, SetLimit).
	quiet map[uint64]int64
}

func newRefHarness(t *testing.T, l Limit, k int) *refHarness {
	return &refHarness{t: t, w: newWindowTable(t, l, 1<<16, k), logs: map[uint64]*keyLog{}, quiet: map[uint64]int64{}}
}

func (h *refHarness) log(key uint64) *keyLog {
	if h.logs[key] == nil {
		h.logs[key] = &keyLog{}
	}
	return h.logs[key]
}

// take asks for weight at ns and checks a denial's Retry-After: exact for
// the table, at most ExtraWait after the log's, and at most a window and a
// tick.
func (h *refHarness) take(key uint64, weight, ns int64) (Decision, Reservation) {
	l := h.w.Limit()
	d, r := h.w.TakeHash(key, weight, tm(time.Duration(ns)))
	lg := h.log(key)
	if d.Allowed {
		lg.add(grant{at: ns, weight: weight, events: l.Events, window: int64(l.Window)})
		return d, r
	}
	if weight > l.Events {
		return d, r
	}
	ra := int64(d.RetryAfter)
	if !h.w.PeekHash(key, weight, tm(time.Duration(ns+ra))).Allowed || ra > 0 && h.w.PeekHash(key, weight, tm(time.Duration(ns+ra-1))).Allowed {
		h.t.Fatalf("%v, key %x weight %d at %v: Retry-After %v is not when the table grants it", l, key, weight, time.Duration(ns), d.RetryAfter)
	}
	if ns < h.quiet[key] {
		return d, r
	}
	p := h.w.p.Load()
	tick := int64(p.nsPerTick) + 1
	if ra > int64(l.Window)+tick {
		h.t.Fatalf("%v, key %x weight %d at %v: Retry-After %v, more than a window and a tick (%v)", l, key, weight, time.Duration(ns), d.RetryAfter, time.Duration(tick))
	}
	e := lg.earliest(ns, weight, l.Events, int64(l.Window))
	extra := ns + ra - e
	if bound := int64(h.w.ExtraWait()); extra > bound {
		h.t.Fatalf("%v, key %x weight %d at %v: Retry-After %v, the sliding log's %v: %v longer, above ExtraWait %v",
			l, key, weight, time.Duration(ns), d.RetryAfter, time.Duration(e-ns), time.Duration(extra), h.w.ExtraWait())
	}
	h.waits++
	h.extra = max(h.extra, float64(extra)/float64(h.w.ExtraWait()))
	return d, r
}

// check fails the test if any key got more than its events in a span of
// its window, and returns the worst span seen.
func (h *refHarness) check(name string) (most, events int64) {
	for key, lg := range h.logs {
		m, over, at := lg.worstSpan()
		if over > 0 {
			h.t.Fatalf("%s: key %x got %d within a window ending at %v, above its limit of %d", name, key, m, time.Duration(at.at), at.events)
		}
		if m-at.events >= most-events {
			most, events = m, at.events
		}
	}
	return most, events
}

// The adversary of the fixed window, and of sub-windows: a key bursts
// Events on both sides of every sub-window edge and window edge (a
// nanosecond, a tick and half a sub-window each way), with weights.
// On the old table (fixed windows anchored at a key's first request)
// this gave 2·Events − 1 within a window.
func TestWindowsHardBoundAtEveryEdge(t *testing.T) {
	for _, l := range []Limit{
		{Events: 1, Window: time.Second},
		{Events: 3, Window: 4 * time.Second},
		{Events: 5, Window: 10 * time.Minute},
		{Events: 10, Window: time.Minute},
		{Events: 100, Window: time.Second},
		{Events: 1000, Window: time.Hour},
		{Events: 10_000, Window: time.Minute},
		{Events: MaxBurst, Window: time.Hour},
	} {
		t.Run(l.String(), func(t *testing.T) {
			h := newRefHarness(t, l, 0)
			p := h.w.p.Load()
			sub := int64(p.nanos(1 << p.stb))
			tick := int64(p.nsPerTick) + 1
			rng := rand.New(rand.NewPCG(uint64(l.Events), 9))
			const key = 0xfeed
			burst := func(at int64) {
				for left := l.Events; left > 0; {
					w := 1 + rng.Int64N(min(left, 3))
					if l.Events > 1000 {
						w = 1 + rng.Int64N(left)
					}
					left -= w
					h.take(key, w, at)
				}
			}
			var edges []int64
			for j := int64(1); j <= 3*int64(p.s)+2; j++ {
				edges = append(edges, p.nanos(uint64(j)<<p.stb), int64(p.nanos(uint64(j)<<p.stb))+int64(l.Window))
			}
			slices.Sort(edges)
			last := int64(0)
			for _, e := range edges {
				for _, at := range []int64{e - sub/2, e - tick, e - 1, e, e + 1, e + tick, e + sub/2} {
					if at >= last {
						burst(at)
						last = at
					}
				}
			}
			most, events := h.check(l.String())
			t.Logf("%v (s = %d, ExtraWait %v): at most %d within any window (limit %d); %d denials within %.2f ExtraWait of the sliding log",
				l, p.s, h.w.ExtraWait(), most, events, h.waits, h.extra)
			if most != events {
				t.Fatalf("the adversary never filled a window: at most %d of %d (the test proves nothing)", most, events)
			}
		})
	}
}

// caddy-ratelimit's TestCount, black-box: events 4 in a 4 s window, one
// request each at 0, 1, 2 and 3 s, then at 5.5 s the log still holds the
// requests of 2 s and 3 s, so allows 2. The fixed window allowed 4.
func TestWindowsAgreeWithTheIncumbentsRing(t *testing.T) {
	h := newRefHarness(t, Limit{Events: 4, Window: 4 * time.Second}, 0)
	for i := range 4 {
		if d, _ := h.take(1, 1, int64(i)*int64(time.Second)); !d.Allowed {
			t.Fatalf("request %d at %ds denied", i+1, i)
		}
	}
	got := 0
	for range 4 {
		if d, _ := h.take(1, 1, int64(5500*time.Millisecond)); d.Allowed {
			got++
		}
	}
	if got != 2 {
		t.Fatalf("at 5.5 s, %d requests were allowed; the log holds 2 in the last 4 s, so allows 2", got)
	}
	h.check("TestCount")
}

// A long random trace of several keys: bursts and trickles at random
// times, weights, rollbacks, reported costs, sweeps, and reloads that
// raise and lower Events and Window mid-way. Every grant is checked
// against the limit in force, every denial's wait against the log.
func TestWindowsMatchTheSlidingLogOnARandomTrace(t *testing.T) {
	limits := []Limit{
		{Events: 10, Window: time.Minute},
		{Events: 4, Window: time.Minute},
		{Events: 25, Window: 2 * time.Minute},
		{Events: 10, Window: 30 * time.Second},
	}
	n := 200_000
	if testing.Short() || raceEnabled {
		n = 20_000
	}
	h := newRefHarness(t, limits[0], 3)
	rng := rand.New(rand.NewPCG(5, 6))
	var keys []uint64
	for i := range 6 {
		keys = append(keys, HashString(fmt.Sprint("key", i)))
	}
	var ns, swept int64
	var denied, granted, reloads int
	for i := range n {
		l := h.w.Limit()
		switch r := rng.IntN(100); {
		case r < 60:
			ns += rng.Int64N(int64(l.Window) / 50)
		case r < 90:
			// a burst: no time passes
		default:
			ns += rng.Int64N(2 * int64(l.Window))
		}
		// Sweeps as the Caddy module runs them (tables.go), and more.
		for ns >= swept+int64(h.w.SweepInterval()/2) {
			swept += int64(h.w.SweepInterval() / 2)
			h.w.Sweep(tm(time.Duration(swept)))
		}
		key := keys[rng.IntN(len(keys))]
		w := 1 + rng.Int64N(3)
		switch op := rng.IntN(1000); {
		case op < 2:
			nl := limits[rng.IntN(len(limits))]
			noErr(t, h.w.SetLimit(nl, tm(time.Duration(ns))))
			reloads++
			// A reload lets the key wait up to the coarser of the two
			// sub-windows longer, for as long as the longer window.
			for _, k := range keys {
				h.quiet[k] = max(h.quiet[k], ns+int64(max(l.Window, nl.Window)))
				h.log(k).reload(ns, int64(l.Window), nl)
			}
		case op < 15:
			h.w.Sweep(tm(time.Duration(ns)))
		case op < 20:
			// A cost reported after the response: counted from now, not
			// checked (it is no grant), and it makes the key wait.
			h.w.Charge(key, rng.Int64N(3*l.Events), tm(time.Duration(ns)))
			h.quiet[key] = max(h.quiet[key], ns+int64(l.Window+h.w.ExtraWait()))
		case op < 60:
			// A Txn that a later policy denied: its charge comes back at
			// once.
			if d, r := h.take(key, w, ns); d.Allowed {
				lg := h.log(key)
				for j := len(lg.grants) - 1; j >= 0; j-- {
					if lg.grants[j].at == ns && lg.grants[j].weight == w {
						lg.grants = slices.Delete(lg.grants, j, j+1)
						break
					}
				}
				h.w.RefundAt(r, tm(time.Duration(ns)))
			}
		default:
			if d, _ := h.take(key, w, ns); d.Allowed {
				granted++
			} else {
				denied++
			}
		}
		if i%10_000 == 0 {
			h.check(fmt.Sprintf("after %d operations", i))
		}
	}
	most, events := h.check("the trace")
	t.Logf("%d operations over %v: %d granted, %d denied, %d reloads; worst span %d of its limit %d; %d denials within %.2f ExtraWait of the sliding log",
		n, time.Duration(ns), granted, denied, reloads, most, events, h.waits, h.extra)
	if h.waits < n/100 || granted < n/10 {
		t.Fatalf("%d denials checked, %d grants: the trace tests little", h.waits, granted)
	}
}
