package limiter

import (
	"time"

	"github.com/floodgate-rl/floodgate/internal/testclock"
)

var clockEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// newFakeClock returns a clock tests move by hand, at clockEpoch.
func newFakeClock() *testclock.Clock { return testclock.New(clockEpoch) }
