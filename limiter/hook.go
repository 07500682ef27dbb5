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

// loadWord, casWord and swapWord are the only ways a table's words are read
// and written once it is in use.
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

// moved waits until the parameters in force are no longer p (SetLimit froze
// p's lines and is converting them) and returns the new ones.
func (b *Buckets) moved(p *bucketParams) *bucketParams { return movedFrom(&b.p, p) }

// movedFrom waits until a no longer holds p and returns what it holds.
// SetLimit only converts, never waits on anything, so the wait is bounded
// by its copy of the table (about 10 ns a line).
func movedFrom[P any](a *atomic.Pointer[P], p *P) *P {
	for {
		if q := loadParams(a); q != p {
			return q
		}
		if testWait != nil {
			testWait(func() bool { return a.Load() != p })
			continue
		}
		runtime.Gosched()
	}
}
