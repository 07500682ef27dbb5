package floodgate

import (
	"math/rand/v2"
	"sync/atomic"
	"time"
)

// The denial log: a flood must not write a line per denied request (that is
// a disk-filling attack of its own), but an operator, fail2ban or CrowdSec
// must still see every source that is being denied. So the first denial of a
// source in each interval is logged at INFO, with the number of its denials
// that were not logged at INFO since its previous INFO line; the others are
// logged at DEBUG. A source is what a zone charged: its hash (see charge).
// The connections a layer4 matcher drops go through the same log
// (layer4.Zone.Note), and the requests refused for their weight through one
// of their own (Handler.logRefusedWeight).
//
// Every denial is also recorded in the zone's top sketch (recordDenied), of
// which the admin API's top reads the sources denied most, shown as the log
// names them (zone.show).

const (
	// denialLogInterval is how often a source that keeps being denied gets
	// an INFO line.
	denialLogInterval = 10 * time.Second
	// logSets × logWays sources are tracked per zone at once: 16 KiB.
	logSetBits = 8
	logSets    = 1 << logSetBits
	logWays    = 4
	// maxInfoPerInterval bounds the INFO lines of a zone per interval,
	// whatever arrives: sources beyond the table's room are logged at
	// INFO, untracked, until this many lines were written.
	maxInfoPerInterval = 1024
)

// A denialLog remembers, for the sources a zone denied recently, when each
// was last logged at INFO and how many of its denials were not. Its memory is
// fixed: a set-associative table indexed by a seeded mix of the source's
// hash, so that an attacker cannot aim many sources at one set. A source
// whose set is full of sources denied in the same interval is logged at INFO
// without being tracked, within maxInfoPerInterval.
//
// It is safe for concurrent use and takes no lock. Counts are exact except
// when two sources race for one entry, where a denial may be counted for
// the wrong one.
type denialLog struct {
	seed uint64
	sets [logSets][logWays]logEntry
	// budget is interval<<32 | INFO lines written in that interval.
	budget atomic.Uint64
}

type logEntry struct {
	// source is the tracked source's hash with its low bit set, so that
	// 0 means free.
	source atomic.Uint64
	// state is interval<<32 | denials not logged at INFO since the
	// source's last INFO line, which was in that interval.
	state atomic.Uint64
}

func newDenialLog() *denialLog {
	return &denialLog{seed: rand.Uint64()}
}

// note records a denial of source at now. It reports whether to log it at
// INFO and, if so, how many of the source's denials were logged at DEBUG
// since its previous INFO line.
func (l *denialLog) note(source uint64, now time.Time) (info bool, suppressed int64) {
	iv := uint64(uint32(now.UnixNano() / int64(denialLogInterval)))
	tag := source | 1
	set := &l.sets[((source^l.seed)*0x9e3779b97f4a7c15)>>(64-logSetBits)]
	for i := range set {
		if e := &set[i]; e.source.Load() == tag {
			return l.count(e, iv)
		}
	}
	if !l.spend(iv) {
		return false, 0
	}
	for i := range set {
		e := &set[i]
		st := e.state.Load()
		if st>>32 == iv {
			continue // another source denied in this interval
		}
		if e.state.CompareAndSwap(st, iv<<32) {
			e.source.Store(tag)
			break
		}
	}
	return true, 0
}

// count records a denial of the source tracked by e.
func (l *denialLog) count(e *logEntry, iv uint64) (info bool, suppressed int64) {
	for {
		st := e.state.Load()
		n := st & 0xffff_ffff
		if st>>32 == iv || !l.spend(iv) {
			// Logged at INFO in this interval already, or the zone
			// has written its share of INFO lines: count it.
			if n == 0xffff_ffff || e.state.CompareAndSwap(st, st+1) {
				return false, 0
			}
			continue
		}
		if e.state.CompareAndSwap(st, iv<<32) {
			return true, int64(n)
		}
	}
}

// spend takes one INFO line from the interval's budget, if any is left.
func (l *denialLog) spend(iv uint64) bool {
	for {
		b := l.budget.Load()
		next := iv<<32 | 1
		if b>>32 == iv {
			if b&0xffff_ffff >= maxInfoPerInterval {
				return false
			}
			next = b + 1
		}
		if l.budget.CompareAndSwap(b, next) {
			return true
		}
	}
}

// logOf returns the log p points to, making it at its first use: a zone's
// denials, or its requests refused for their weight.
func logOf(p *atomic.Pointer[denialLog]) *denialLog {
	if l := p.Load(); l != nil {
		return l
	}
	p.CompareAndSwap(nil, newDenialLog())
	return p.Load()
}

// A source is what a zone's top sketch keeps for a key: the charge, and the
// key's text only with log_key (as logs show it: cut at maxShownKey bytes).
// It is a value, so that recording it allocates nothing.
type source struct {
	c    charge
	text [maxShownKey]byte
	n    uint16
}

// topSource describes charge c for the top sketch; shown is the key's text,
// or empty without log_key.
func topSource(c charge, shown string) source {
	s := source{c: c}
	s.n = uint16(copy(s.text[:], shown))
	return s
}

// show returns a source of z as text: the key with log_key, else what the
// denial log's source field names (z.source).
func (z *zone) show(s *source) string {
	if s.n > 0 {
		return string(s.text[:s.n])
	}
	return z.source(s.c)
}

// recordDenied notes in the zone's top sketch that it denied charge c of
// request q; the text of a key that is not an address is kept only with
// log_key.
func (z *zone) recordDenied(now time.Time, q *request, c charge, logKey bool) {
	var shown string
	if logKey && !c.addr.IsValid() {
		// An address is shown as the network it was charged under.
		shown = z.keyText(q, c)
	}
	z.counts.top.Record(now, c.hash, 1, topSource(c, shown))
}
