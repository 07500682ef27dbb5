// Package schedtest enumerates the interleavings of a few goroutines, for
// the tests that check lock-free code in every one of them (limiter's
// tables, storage's mitigation cache). Each package's own stepper runs one
// schedule, pausing its goroutines at the operations it watches; this
// package says which schedule to run next, and names it. Only tests import
// it.
package schedtest

import "strings"

// Next returns the prefix of the schedule after path in depth-first order:
// path up to the last step that had a later choice, that step taking it.
// path holds the goroutine of each step, runnable the goroutines that
// could take it (ascending). It reports false after the last schedule.
func Next(path []int, runnable [][]int) ([]int, bool) {
	for i := len(path) - 1; i >= 0; i-- {
		for _, g := range runnable[i] {
			if g > path[i] {
				return append(append([]int(nil), path[:i]...), g), true
			}
		}
	}
	return nil, false
}

// String names a schedule by the goroutine of each step: X for the first,
// Y for the second, and so on.
func String(path []int) string {
	var sb strings.Builder
	for _, g := range path {
		sb.WriteByte(byte('X' + g))
	}
	return sb.String()
}
