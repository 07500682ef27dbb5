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
// first (testWait, below, for the waits), so a test can stop an operation
// there, run another, and resume it, through every interleaving. In
// production it costs one predictable branch.
var testPause func(addr unsafe.Pointer)

func pause(addr unsafe.Pointer) {
	if testPause != nil {
		testPause(addr)
	}
}

// loadWord, casWord, swapWord and subWord are the only ways a table's words
// are read and written once it is in use, except thawStray's (see there).
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

// loadParams and storeParams are the only ways a table's parameters are
// read and replaced by a decision or a SetLimit (Buckets and Windows alike,
// through table.params and table.setParams).
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

// wait lets other goroutines run until ready may hold: in tests, the
// stepper runs this one again only once it does.
func wait(ready func() bool) {
	if testWait != nil {
		testWait(ready)
		return
	}
	runtime.Gosched()
}
