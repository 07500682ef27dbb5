// Package testclock is the clock floodgate's tests move by hand. Time is a
// parameter of every rate decision (limiter tables take `now`, the handler
// reads its zones' clocks), so a test sets or advances a Clock instead of
// sleeping. Only tests import it.
package testclock

import (
	"sync/atomic"
	"time"
)

// Clock reads start plus the time it was moved by Advance and Set. It is safe
// for concurrent use: a test may move it while requests it serves read it.
// Now keeps start's monotonic reading, if it has one, so a clock started at
// time.Now().Add(d) compares with the tables' time.Now-based origins as a
// later instant.
type Clock struct {
	start time.Time
	ns    atomic.Int64 // since start
}

// New returns a clock that reads start until it is moved.
func New(start time.Time) *Clock { return &Clock{start: start} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time { return c.start.Add(time.Duration(c.ns.Load())) }

// Advance moves the clock on by d (back, for a negative d).
func (c *Clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// Set moves the clock to t, which may be before its start.
func (c *Clock) Set(t time.Time) { c.ns.Store(int64(t.Sub(c.start))) }
