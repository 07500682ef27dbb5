package limiter

import (
	"runtime"
	"sync/atomic"
	"unsafe"
)

// testPause is nil except in tests (interleave_test.go), which set it to run
// concurrent operations step by step: every atomic load, CAS and swap of a
// line's words, every load and store of a table's parameters, and every
// wait for a SetLimit goes through the functions below, which call it
// first, so a test can stop an operation there, run another, and resume
// it, through every interleaving (and testWait, below, for the waits). In production it costs one predictable
// branch.
var testPause func(addr unsafe.Pointer)

func pause(addr unsafe.Pointer) {
	if testPause != nil {
		testPause(addr)
	}
}

// loadWord, casWord, swapWord and subWord are the only ways a table's words are read
// and written once it is in use, except thawStray's (see there).
func loadWord(p *uint64) uint64 {
	pause(unsafe.Pointer(p))
	return atomic.LoadUint64(p)
}

func casWord(p *uint64, old, new uint64) bool {
	pause(unsafe.Pointer(p))
	return atomic.CompareAndSwapUint64(p, old, new)
}

func swapWord(p *uint64, new uint64) uint64 {
	pause(unsafe.Pointer(p))
	return atomic.SwapUint64(p, new)
}

// subWord subtracts d from the word at p, for a caller that knows no
// counter d takes from is below what it takes (a place's release).
func subWord(p *uint64, d uint64) {
	pause(unsafe.Pointer(p))
	atomic.AddUint64(p, -d)
}

// params and setParams load and replace the parameters in force.
func (b *Buckets) params() *bucketParams { return loadParams(&b.p) }

func (b *Buckets) setParams(p *bucketParams) { storeParams(&b.p, p) }

// loadParams and storeParams are the only ways a table's parameters are
// read and replaced by a decision or a SetLimit (Buckets and Windows alike).
func loadParams[P any](a *atomic.Pointer[P]) *P {
	pause(unsafe.Pointer(a))
	return a.Load()
}

func storeParams[P any](a *atomic.Pointer[P], p *P) {
	pause(unsafe.Pointer(a))
	a.Store(p)
}

// testWait is nil except in tests, which set it with testPause: an
// operation that waits for SetLimit calls it with the condition it waits
// for, and a test's stepper runs it again only once that holds.
var testWait func(ready func() bool)

// moved is what a Buckets operation does on meeting a frozen word in the
// lines of p: it waits while a SetLimit runs, and returns the parameters
// in force once none does. A SetLimit holds setMu from before it freezes
// the first word until the new lines are in force, so a frozen word found
// while p is still in force and setMu is free was written by no
// conversion, but by the other side of a shared table (NewBucketsOver)
// storing 0xFFFFFFFF in both counters of a word, as the XDP program did
// before it had valid. moved thaws such words (see thawStray) and returns
// p, and the operation goes on there: a new table would never come.
func (b *Buckets) moved(p *bucketParams) *bucketParams {
	for {
		if q := loadParams(&b.p); q != p {
			return q
		}
		if q, ok := b.thawStray(p); ok {
			return q
		}
		wait(func() bool { return b.p.Load() != p || b.setIdle() })
	}
}

// thawStray takes setMu if it is free and then, if p is still in force,
// stores in every frozen word of p's lines what valid makes of its two
// counters (1 each: two ticks later, against the key), the value a charge
// would have stored. It returns the parameters in force and false, having
// done nothing, if a SetLimit holds setMu. It scans the table (once: it
// leaves no frozen word), and none of it goes through loadWord or casWord:
// a test's pause there would hold setMu while the test runs a SetLimit,
// which would block on it for good.
func (b *Buckets) thawStray(p *bucketParams) (*bucketParams, bool) {
	if !b.setMu.TryLock() {
		return p, false
	}
	defer b.setMu.Unlock()
	q := b.p.Load()
	if q == p {
		for i := range p.lines {
			for j := range p.lines[i] {
				if w := &p.lines[i][j]; atomic.LoadUint64(w) == frozen {
					atomic.CompareAndSwapUint64(w, frozen, thawed)
				}
			}
		}
	}
	return q, true
}

// setIdle reports whether no SetLimit holds setMu.
func (b *Buckets) setIdle() bool {
	if !b.setMu.TryLock() {
		return false
	}
	b.setMu.Unlock()
	return true
}

// movedFrom waits until a no longer holds p and returns what it holds.
// SetLimit only converts, never waits on anything, so the wait is bounded
// by its copy of the table (about 10 ns a line).
func movedFrom[P any](a *atomic.Pointer[P], p *P) *P {
	for {
		if q := loadParams(a); q != p {
			return q
		}
		wait(func() bool { return a.Load() != p })
	}
}

// wait lets other goroutines run until ready may hold: in tests, the
// stepper runs this one again only once it does.
func wait(ready func() bool) {
	if testWait != nil {
		testWait(ready)
		return
	}
	runtime.Gosched()
}
