package limiter

import "sync/atomic"

// testPause is nil except in tests (interleave_test.go), which set it to run
// concurrent decisions step by step: every atomic load and CAS of a line
// goes through loadWord and casWord, which call it first, so a test can stop
// a decision there, run another request, and resume it, through every
// interleaving. In production it costs one predictable branch.
var testPause func(word *uint64)

func pause(word *uint64) {
	if testPause != nil {
		testPause(word)
	}
}

// loadWord and casWord are the only ways a table's words are read and
// written once it is in use.
func loadWord(p *uint64) uint64 {
	pause(p)
	return atomic.LoadUint64(p)
}

func casWord(p *uint64, old, new uint64) bool {
	pause(p)
	return atomic.CompareAndSwapUint64(p, old, new)
}
