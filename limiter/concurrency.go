package limiter

import (
	"fmt"
	"math"
	"math/bits"
	"sync/atomic"
)

// Concurrency is a counting Bloom filter of places in use: how many of each
// key's requests (or connections) are in flight, in a fixed table of 64-byte
// lines, whatever the number of keys.
//
// A key's hash picks one line and K of its 16 counters, as in Buckets. A
// request is admitted while the smallest of the key's counters is below the
// limit n, and then every one of the K counters counts it; releasing its
// Place takes it off them again. Every counter of a key counts at least the
// key's own places in use, so a key never holds more than n; a counter that
// other keys share counts theirs too, so a collision can only deny a key
// early (a false deny, as likely as a token-bucket table's at the same size:
// see EstimateFalseDeny), never let it over n.
//
// Admission is exact under concurrency: the counters other than the
// smallest are counted first, and the smallest last, with the one CAS that
// admits, checked against n. Every admitted place has been counted on all
// of the key's counters by the time its admitting CAS succeeds, so whichever
// counter admits a request already counts every place admitted before it.
// A request that loses that CAS takes its other counts back and decides
// again.
//
// Concurrency is safe for concurrent use; admissions and releases take no
// lock and allocate nothing. It has no notion of time: a place is held until
// it is released, however long that is.
type Concurrency struct {
	k     int
	subs  []subset
	lines []line
	max   atomic.Int64 // n, the places a key may hold (SetMax)
	// prev is the table this one replaces while places are still in use
	// there (Follow), nil once it has none (Unfollow).
	prev atomic.Pointer[Concurrency]
}

// MaxConcurrent is the largest limit of a Concurrency table: far beyond
// any server's connections, and far enough below a counter's 2³² that the
// places of every key sharing a counter fit in it.
const MaxConcurrent = 1 << 20

// ConcurrencyConfig configures a Concurrency table.
type ConcurrencyConfig struct {
	// Max is how many places a key may hold at once, 1 to MaxConcurrent.
	Max int64
	// Bytes, Sources, FalseDeny and K size the table as they size a
	// Buckets table (see BucketsConfig). Sources here is the number of
	// keys expected to hold all their places at the same time.
	Bytes     int
	Sources   int
	FalseDeny float64
	K         int
}

// NewConcurrency returns a table in which no key holds a place.
func NewConcurrency(cfg ConcurrencyConfig) (*Concurrency, error) {
	if err := validMax(cfg.Max); err != nil {
		return nil, err
	}
	k, n, err := BucketsConfig{Bytes: cfg.Bytes, Sources: cfg.Sources, FalseDeny: cfg.FalseDeny, K: cfg.K}.shapeOf(countersPerLine)
	if err != nil {
		return nil, err
	}
	c := &Concurrency{k: k, subs: subsets(k), lines: newLines(n)}
	c.max.Store(cfg.Max)
	return c, nil
}

func validMax(n int64) error {
	if n < 1 || n > MaxConcurrent {
		return fmt.Errorf("max_concurrent must be between 1 and %d, got %d", MaxConcurrent, n)
	}
	return nil
}

// Max returns the limit in force.
func (c *Concurrency) Max() int64 { return c.max.Load() }

// SetMax puts a new limit in force at once, keeping every place in use: a
// key that holds more places than the new limit is denied until enough of
// them are released. It refuses a limit out of range.
func (c *Concurrency) SetMax(n int64) error {
	if err := validMax(n); err != nil {
		return err
	}
	c.max.Store(n)
	return nil
}

// K returns the number of counters each key draws on.
func (c *Concurrency) K() int { return c.k }

// Lines returns the number of lines in the table.
func (c *Concurrency) Lines() int { return len(c.lines) }

// Bytes returns the memory held by the table's lines.
func (c *Concurrency) Bytes() int { return len(c.lines) * 64 }

// A Place is one place in use in a Concurrency table, from AdmitHash until
// Release. Release gives it back exactly once, however many times and from
// however many goroutines it is called; a copy of a Place would be a second
// claim on the same place, so a Place must not be copied (go vet's copylocks
// check says so: it holds an atomic.Pointer). The zero Place holds nothing.
type Place struct {
	ln  atomic.Pointer[line] // the key's line while the place is held; nil once released
	sub subset
}

// Held reports whether p holds a place that Release would give back.
func (p *Place) Held() bool { return p.ln.Load() != nil }

// Release gives the place back and reports true, the first time it is
// called on a held Place; it does nothing and reports false after that, or
// on a Place that holds nothing.
func (p *Place) Release() bool {
	ln := p.ln.Swap(nil)
	if ln == nil {
		return false
	}
	uncount(ln, p.sub, p.sub.words)
	return true
}

// AdmitHash admits a request of the key with hash h if the key holds fewer
// than Max places, and records the place it takes in p. The Decision's
// Limit is Max and Remaining the places the key has left (the smallest of
// its counters says how many it holds, over-counted by collisions); a
// denied request takes no place and its RetryAfter is 0, since no table
// can say when a place will be released. p must not hold a place; one that
// does is released first, so that no place is ever lost.
//
// While c follows a table it replaces (Follow), the key's places still in
// use there count against Max too.
func (c *Concurrency) AdmitHash(h uint64, p *Place) Decision {
	p.Release()
	n := c.max.Load()
	d := Decision{Limit: n}
	if prev := c.prev.Load(); prev != nil {
		// Its counts only fall (nothing is admitted there any more), so a
		// count read before the admitting CAS can only be too high: the
		// key may be denied a place being given back there, never let
		// over n.
		if n -= prev.InFlight(h); n <= 0 {
			return d
		}
	}
	ln, sub, _ := placeIn(c.lines, c.subs, h)
	var vals [8]uint64
	for {
		least, fw, fl := c.least(ln, sub, &vals)
		if int64(least) >= n {
			return d
		}
		// The others first, the least last with the CAS that admits.
		others := sub.words &^ (1 << fw)
		if !countWords(ln, sub, others) {
			return d // a counter is full: 2³² places, a deny
		}
		after, res := admitLeast(&ln[fw], vals[fw], fl, sub.lanes(fw), uint32(n))
		if res == admitted {
			p.sub = sub
			p.ln.Store(ln)
			d.Allowed = true
			d.Remaining = n - int64(after)
			return d
		}
		// The least counter reached n meanwhile (or its word's other
		// counter is full): take back the others' counts and decide
		// again (deny).
		uncount(ln, sub, others)
		if res == admitFull {
			return d
		}
	}
}

// InFlight is how many places the key with hash h holds, as the table sees
// it: the smallest of its counters, which collisions can only make larger.
// It changes nothing.
func (c *Concurrency) InFlight(h uint64) int64 {
	ln, sub, _ := placeIn(c.lines, c.subs, h)
	var vals [8]uint64
	least, _, _ := c.least(ln, sub, &vals)
	if prev := c.prev.Load(); prev != nil {
		return int64(least) + prev.InFlight(h)
	}
	return int64(least)
}

// Follow makes c, a table that replaces old (a zone's table of another
// size, after a reload), count each key's places still in use in old as
// its own, until Unfollow finds none left there: the requests admitted
// into old give their places back to it, and a key must not hold n in
// each meanwhile. Nothing may be admitted into old any more, or a key
// could get n between the two tables. A table never follows itself.
func (c *Concurrency) Follow(old *Concurrency) {
	if old != c {
		c.prev.Store(old)
	}
}

// Unfollow stops following the table c replaced once no place is in use
// (InUse counts the tables it still follows too), and reports whether c
// follows none. It reads every line of the tables followed (InUse), so it
// is for a periodic check, never for a decision.
func (c *Concurrency) Unfollow() bool {
	prev := c.prev.Load()
	if prev == nil {
		return true
	}
	if prev.InUse() == 0 {
		c.prev.CompareAndSwap(prev, nil)
	}
	return c.prev.Load() == nil
}

// PeekHash answers whether AdmitHash would admit a request of the key with
// hash h now, taking nothing.
func (c *Concurrency) PeekHash(h uint64) Decision {
	n := c.max.Load()
	held := c.InFlight(h)
	return Decision{Allowed: held < n, Limit: n, Remaining: max(n-held, 0)}
}

// InUse is how many places are in use in the whole table: every place
// counts once on each of its key's K counters, so the counters' sum is
// exactly K times the places, whatever the collisions; with the places
// still in use in the tables c follows (Follow). It reads every line, so it
// is for gauges and tests, never for a decision.
func (c *Concurrency) InUse() int64 {
	var sum uint64
	for i := range c.lines {
		for j := range c.lines[i] {
			w := atomic.LoadUint64(&c.lines[i][j])
			sum += uint64(uint32(w)) + w>>32
		}
	}
	n := int64(sum / uint64(c.k))
	if prev := c.prev.Load(); prev != nil {
		n += prev.InUse()
	}
	return n
}

// least loads the key's words into vals and returns its smallest counter,
// the first of equals, and where it is: word fw, lane fl.
func (c *Concurrency) least(ln *line, sub subset, vals *[8]uint64) (least uint32, fw int, fl uint8) {
	least = math.MaxUint32
	for m := sub.words; m != 0; m &= m - 1 {
		w := bits.TrailingZeros8(m) & 7
		v := loadWord(&ln[w])
		vals[w] = v
		lanes := sub.lanes(w)
		if lanes&1 != 0 && uint32(v) < least {
			least, fw, fl = uint32(v), w, 0
		}
		if lanes&2 != 0 && uint32(v>>32) < least {
			least, fw, fl = uint32(v>>32), w, 1
		}
	}
	return least, fw, fl
}

// Outcomes of admitLeast.
const (
	admitLost = iota // the counter has reached n
	admitted
	admitFull // the key's other counter in the word holds 2³²−1
)

// admitLeast adds one to lane fl of the word at p (last seen as w) if that
// counter is still below n, together with the key's other lane of the word,
// in one CAS, and returns the counter's new value. Anything but admitted
// changed nothing.
func admitLeast(p *uint64, w uint64, fl, lanes uint8, n uint32) (uint32, int) {
	for {
		v := lane(w, fl)
		if v >= n {
			return v, admitLost
		}
		nw := withLane(w, fl, v+1)
		if o := fl ^ 1; lanes>>o&1 != 0 {
			if lane(w, o) == math.MaxUint32 {
				return v, admitFull
			}
			nw = withLane(nw, o, lane(w, o)+1)
		}
		if casWord(p, w, nw) {
			return v + 1, admitted
		}
		w = loadWord(p)
	}
}

// uncount takes one off each of the key's counters in the words of mask,
// one atomic subtraction per word, for a place they all count: a place
// released (counted on every counter of its key when admitted, and
// released once) or an admission's counts taken back. Each of those
// counters is at least 1, so no subtraction borrows from the word's other
// counter; a subtraction needs no load and no retry, which a
// compare-and-swap would under contention.
func uncount(ln *line, sub subset, mask uint8) {
	for m := mask; m != 0; m &= m - 1 {
		w := bits.TrailingZeros8(m) & 7
		lanes := sub.lanes(w)
		subWord(&ln[w], uint64(lanes&1)|uint64(lanes>>1)<<32)
	}
}

// countWords adds one to the key's counters in the words of mask, one CAS
// per word. An addition that would overflow a counter changes nothing in
// its word, takes back what it added to the words before it, and reports
// false.
func countWords(ln *line, sub subset, mask uint8) bool {
	var done uint8
	for m := mask; m != 0; m &= m - 1 {
		w := bits.TrailingZeros8(m) & 7
		q := &ln[w]
		lanes := sub.lanes(w)
		for {
			v := loadWord(q)
			nv := v
			for l := uint8(0); l < 2; l++ {
				if lanes>>l&1 == 0 {
					continue
				}
				x := lane(v, l)
				if x == math.MaxUint32 {
					uncount(ln, sub, done)
					return false
				}
				nv = withLane(nv, l, x+1)
			}
			if casWord(q, v, nv) {
				break
			}
		}
		done |= 1 << w
	}
	return true
}
