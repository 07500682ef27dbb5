//go:build unix

package storage

import (
	"syscall"
	"time"
)

// processCPU returns the CPU time (user and system) this process has used
// on every core: what a benchmark that runs on one goroutine's clock would
// miss, such as the garbage collector's work on the other cores.
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
