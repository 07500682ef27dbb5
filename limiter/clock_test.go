package limiter

import (
	"sync/atomic"
	"time"
)

// fakeClock is a clock tests move by hand. It is safe for concurrent use.
type fakeClock struct{ ns atomic.Int64 }

var clockEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func newFakeClock() *fakeClock { return &fakeClock{} }

func (c *fakeClock) Now() time.Time          { return clockEpoch.Add(time.Duration(c.ns.Load())) }
func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }
