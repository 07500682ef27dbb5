//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"time"
	_ "unsafe" // for go:linkname
)

// nanotime is the runtime's clock: CLOCK_MONOTONIC read through the vDSO on
// Linux, the same reading time.Now takes for its monotonic part (time.Now's
// monotonic reading is nanotime() minus a constant fixed when the time
// package starts, so t.Sub(u) of two such times is exactly the difference
// of their nanotime readings).
//
//go:linkname nanotime runtime.nanotime
func nanotime() int64

// epochSamples bounds how many readings monoEpoch brackets base with.
const epochSamples = 64

// monoEpoch returns the CLOCK_MONOTONIC reading, in nanoseconds, at which
// base (a time.Now reading) was taken, and how far it may be from the exact
// value. The time package hides the constant between its monotonic reading
// and CLOCK_MONOTONIC, so it is bracketed: for every t = time.Now() read
// between nanotime readings m1 and m2, the epoch lies in [m1 − d, m2 − d]
// with d = t.Sub(base) exact; the intersection of epochSamples such
// intervals is usually a few tens of nanoseconds wide, and the midpoint is
// within half of it.
func monoEpoch(base time.Time) (epoch int64, slack time.Duration) {
	lo, hi := int64(-1<<63), int64(1<<63-1)
	for range epochSamples {
		m1 := nanotime()
		t := time.Now()
		m2 := nanotime()
		d := int64(t.Sub(base))
		lo, hi = max(lo, m1-d), min(hi, m2-d)
	}
	return lo + (hi-lo)/2, time.Duration(hi-lo+1) / 2
}
