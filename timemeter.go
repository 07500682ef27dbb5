// The meter of weight response_time: a zone that charges a request's time
// charges it as it passes, not only when the response ends, so that many
// slow requests of one key (long polls, streams) cannot all run on a
// budget none of them has touched yet. One ticker serves every in-flight
// request of every zone: each tick charges each run the milliseconds it has
// taken since the last charge, and a run's end charges the rest.

package floodgate

import (
	"sync"
	"sync/atomic"
	"time"
)

// meterInterval is how often the meter charges the requests in flight. A
// key is charged for a running request at most this late; a tick costs one
// charge (a zone's tables, its cluster estimate and its quotas) per request
// in flight in a time zone.
const meterInterval = 250 * time.Millisecond

// meterShards spreads the runs over locks, so that requests starting and
// ending on different cores seldom wait for each other or for a tick.
const meterShards = 16

// A timeMeter holds the requests in flight in zones with weight
// response_time. Its memory is one run per such request, which already
// holds a goroutine and a connection: it grows and shrinks with them.
// live counts the runs, so that an idle tick walks no shard.
type timeMeter struct {
	// clock is the time a tick charges at; auto starts the ticker with
	// the first run (tests tick by hand, at the times they choose).
	clock  func() time.Time
	auto   bool
	ticker sync.Once
	next   atomic.Uint32
	live   atomic.Int64
	shards [meterShards]meterShard
}

type meterShard struct {
	mu   sync.Mutex
	runs []*timedRun
	_    [64 - 8 - 24]byte // a cache line of its own
}

// A timedRun is one request in flight in one time zone: what it owes the
// zone (paid: what its admission charged, in ms), when it passed the zone,
// and how many ms have been charged.
type timedRun struct {
	c       afterCharge
	start   time.Time
	charged int64
	shard   *meterShard
	i       int // in shard.runs; -1 once ended
}

// sharedMeter is the meter of every handler: a request started under one
// config and ending under the next is charged once, by the meter that
// holds it, whatever the reload did.
var sharedMeter = &timeMeter{clock: time.Now, auto: true}

// start begins charging c's zone the time of a request that passed it at
// now.
func (m *timeMeter) start(c afterCharge, now time.Time) *timedRun {
	s := &m.shards[m.next.Add(1)%meterShards]
	r := &timedRun{c: c, start: now, charged: c.paid, shard: s}
	s.mu.Lock()
	r.i = len(s.runs)
	s.runs = append(s.runs, r)
	s.mu.Unlock()
	m.live.Add(1)
	if m.auto {
		m.ticker.Do(func() { go m.run() })
	}
	return r
}

// end charges r the rest of its time, up to now, and stops metering it.
func (m *timeMeter) end(r *timedRun, now time.Time) {
	s := r.shard
	s.mu.Lock()
	r.charge(now)
	last := len(s.runs) - 1
	s.runs[r.i] = s.runs[last]
	s.runs[r.i].i = r.i
	s.runs[last] = nil
	s.runs = s.runs[:last]
	if cap(s.runs) > 64 && len(s.runs) < cap(s.runs)/4 {
		// A flood of slow requests is over: give its memory back.
		s.runs = append([]*timedRun(nil), s.runs...)
	}
	r.i = -1
	s.mu.Unlock()
	m.live.Add(-1)
}

// charge charges r's zone the ms r has run by now beyond what it has been
// charged. The caller holds r's shard's lock.
func (r *timedRun) charge(now time.Time) {
	ms := now.Sub(r.start).Milliseconds()
	if ms <= r.charged {
		return
	}
	r.c.settle(r.charged, ms, now)
	r.charged = ms
}

// tickAt charges every run in flight its time up to now.
func (m *timeMeter) tickAt(now time.Time) {
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		for _, r := range s.runs {
			r.charge(now)
		}
		s.mu.Unlock()
	}
}

// run ticks for the life of the process, from the first request in a time
// zone on: an idle tick (no request in flight) reads one counter. (A ticker
// that stopped when idle would need a start and a stop that cannot miss each
// other; four idle wake-ups a second cost less than that proof.)
func (m *timeMeter) run() {
	t := time.NewTicker(meterInterval)
	defer t.Stop()
	for range t.C {
		if m.live.Load() > 0 {
			m.tickAt(m.clock())
		}
	}
}
