//go:build !unix

package storage

import "time"

// processCPU is not measured here: the benchmark reports no CPU time.
func processCPU() (time.Duration, bool) { return 0, false }
