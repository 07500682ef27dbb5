package limiter

import (
	"cmp"
	"slices"
	"sync"
	"time"
)

// TopK finds the heaviest keys of a stream in fixed memory, with the
// Space-Saving algorithm (Metwally, Agrawal and El Abbadi, 2005): it keeps k
// counters; a key that has none takes the smallest one over, inheriting its
// count as the key's possible overcount (Err). Any key that makes up more than
// 1/k of the recorded weight is among the k, and each reported Count is at
// least the key's true count and at most Err above it.
//
// Counts age out: the sketch keeps the current window and the one before it,
// so Top reports the last one to two windows and a source that stopped two
// windows ago is gone.
//
// L is what the caller wants to show for a key (an address, a network, a
// truncated name); it is stored when a key enters the sketch.
type TopK[L any] struct {
	mu     sync.Mutex
	window time.Duration
	start  time.Time // start of cur; zero before the first record
	cur    summary[L]
	prev   summary[L]
}

// summary is one window's k counters, in parallel arrays so that the scan
// for a key reads only hashes. For the few dozen counters an operator reads,
// two linear scans cost about what a map and a heap would, with less code.
type summary[L any] struct {
	hashes []uint64
	counts []uint64
	errs   []uint64
	labels []L
	n      int
}

// A TopEntry is one key of a TopK, with bounds on how much it weighed: its
// true weight is between Count-Err and Count.
type TopEntry[L any] struct {
	Hash  uint64
	Label L
	Count uint64
	Err   uint64
}

// NewTopK returns a sketch of k counters per window. k must be positive, and
// so must window.
func NewTopK[L any](k int, window time.Duration) *TopK[L] {
	return &TopK[L]{window: window, cur: newSummary[L](k), prev: newSummary[L](k)}
}

func newSummary[L any](k int) summary[L] {
	return summary[L]{hashes: make([]uint64, k), counts: make([]uint64, k), errs: make([]uint64, k), labels: make([]L, k)}
}

// Record adds n to the weight of the key with hash h at time now. It never
// waits: if another goroutine is using the sketch it drops the record and
// returns false, so that a flood on many cores pays for a failed lock rather
// than a queue, and the sketch becomes a sample of the stream.
func (t *TopK[L]) Record(now time.Time, h uint64, n uint64, label L) bool {
	if !t.mu.TryLock() {
		return false
	}
	t.rotate(now)
	t.cur.add(h, n, label)
	t.mu.Unlock()
	return true
}

// rotate starts a new window if now is past the current one.
func (t *TopK[L]) rotate(now time.Time) {
	if t.start.IsZero() {
		t.start = now
		return
	}
	elapsed := now.Sub(t.start)
	switch {
	case elapsed < t.window:
		return
	case elapsed < 2*t.window:
		t.prev, t.cur = t.cur, t.prev
		t.start = t.start.Add(t.window)
	default:
		t.prev.reset()
		t.start = now
	}
	t.cur.reset()
}

func (s *summary[L]) reset() {
	clear(s.labels[:s.n])
	s.n = 0
}

func (s *summary[L]) add(h, n uint64, label L) {
	for i, x := range s.hashes[:s.n] {
		if x == h {
			s.counts[i] += n
			return
		}
	}
	if s.n < len(s.hashes) {
		i := s.n
		s.hashes[i], s.counts[i], s.errs[i], s.labels[i] = h, n, 0, label
		s.n++
		return
	}
	m := s.smallest()
	s.hashes[m], s.errs[m], s.labels[m] = h, s.counts[m], label
	s.counts[m] += n
}

// smallest returns the slot of the smallest count.
func (s *summary[L]) smallest() int {
	m := 0
	for i, c := range s.counts[:s.n] {
		if c < s.counts[m] {
			m = i
		}
	}
	return m
}

// floor is what a key absent from s may have weighed in its window: nothing
// if s never filled up, else up to its smallest count.
func (s *summary[L]) floor() uint64 {
	if s.n < len(s.hashes) {
		return 0
	}
	return s.counts[s.smallest()]
}

// Top returns up to max keys, heaviest first, and the start of the period
// they cover: the previous window if it holds anything, else the current
// one. A key seen in only one of the two windows may have weighed up to the
// other window's smallest count there, which its Count and Err include.
func (t *TopK[L]) Top(now time.Time, max int) ([]TopEntry[L], time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.start.IsZero() {
		return nil, time.Time{}
	}
	t.rotate(now)
	since := t.start
	if t.prev.n > 0 {
		since = t.start.Add(-t.window)
	}
	out := make([]TopEntry[L], 0, t.cur.n+t.prev.n)
	prevFloor, curFloor := t.prev.floor(), t.cur.floor()
	at := make(map[uint64]int, t.cur.n)
	for i := range t.cur.n {
		at[t.cur.hashes[i]] = len(out)
		out = append(out, TopEntry[L]{
			Hash: t.cur.hashes[i], Label: t.cur.labels[i],
			Count: t.cur.counts[i] + prevFloor, Err: t.cur.errs[i] + prevFloor,
		})
	}
	for i := range t.prev.n {
		h := t.prev.hashes[i]
		if j, ok := at[h]; ok {
			// Seen in both: its previous count replaces the floor
			// assumed above; the current window's label is the newer.
			out[j].Count = out[j].Count - prevFloor + t.prev.counts[i]
			out[j].Err = out[j].Err - prevFloor + t.prev.errs[i]
			continue
		}
		out = append(out, TopEntry[L]{
			Hash: h, Label: t.prev.labels[i],
			Count: t.prev.counts[i] + curFloor, Err: t.prev.errs[i] + curFloor,
		})
	}
	slices.SortStableFunc(out, func(a, b TopEntry[L]) int { return cmp.Compare(b.Count, a.Count) })
	if len(out) > max {
		out = out[:max]
	}
	return out, since
}
