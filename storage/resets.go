package storage

import (
	"cmp"
	"math"
	"slices"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Resetting a key across the cluster (the admin API's DELETE of a key).
//
// A reset is the pair (key hash h, time T). Each instance answers for its
// own counts only:
//
//   - The instance that resets the key forgets its own counts of it in the
//     windows that had begun by T (limiter.Sketch.ResetHash), takes the
//     key's counts out of its copy of the peers' sum and lifts the key's
//     block, so the key passes there at once, and records the reset.
//   - Every snapshot lists the resets its instance has applied to the
//     counts in it: its own and those it learned. An instance that reads
//     a reset it does not know yet applies it to its own counts and lifts
//     the key's block, records it, and so publishes it in turn.
//   - Building the peers' sum, a snapshot that does not list a known reset
//     (written before it, or by an instance that has not read it yet) is
//     added less its own counts of the key, and its block of the key is
//     ignored; a snapshot that lists it is taken as it is.
//
// So every instance lets the key through within a write interval of the
// resetting instance and a read interval of its own, and no instance's
// counts are forgotten twice for one reset. Counts a peer took for the key
// after T but before it learned of the reset, in T's window, are forgotten
// too: at most one sync lag's worth, as over-admission already is.
//
// An instance remembers a reset until the window T fell in is two windows
// old (a sliding sketch's sub-window: eight sub-windows, at most a window
// and a sub-window), when every count from before T has aged out anyway, and at most
// MaxResets of them: past that the oldest is forgotten, and may be learned
// (and applied) again from a peer that still lists it.

// MaxResets is how many key resets a distributed zone remembers and lists
// in its snapshot: 1,024 resets within two windows.
const MaxResets = 1024

// A reset lets the key with hash hash pass again as of at (Unix
// nanoseconds): the counts of it from before at are forgotten.
type reset struct {
	hash uint64
	at   int64
}

// resetTable holds the resets a Cluster has applied, in the order it
// applied them.
type resetTable struct {
	list []resetEntry
	set  map[reset]struct{}
	// seq counts the resets ever recorded.
	seq uint64
}

type resetEntry struct {
	reset
	seq uint64
}

// Reset lets the key with hash h through again across the cluster, as of
// now. This instance forgets its counts of the key, takes the key's counts
// out of the peers' sum and lifts its block, so the key passes here at once;
// the next Write publishes the reset, and each other instance applies it at
// its next Read (see resets.go). Keys that share counters with h gain at
// most what h had counted there.
func (c *Cluster) Reset(h uint64, now time.Time) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	n := now.UnixNano()
	c.pruneLocked(n)
	// The order matters to mitigate: resetting is set before the counts
	// change, and the block goes after both the own counts and the sum.
	c.resetting.Store(true)
	c.sketch.ResetHash(h, now, now)
	peers, shared := c.peers.Load(), c.shared.Load()
	c.peers.Store(peers.WithoutHash(h, now))
	if shared != peers {
		c.shared.Store(shared.WithoutHash(h, now))
	} else {
		c.shared.Store(c.peers.Load())
	}
	c.blocks.remove(h, math.MaxInt64)
	if r := (reset{hash: h, at: n}); !c.knownLocked(r) {
		c.recordLocked(r)
	}
}

// OnReset sets f to be called with a key's hash when this instance learns of
// a reset of the key from another instance, in addition to what it does to
// the cluster's counts: a zone fills the key's token buckets, as the
// instance asked for the reset did. It replaces any f set before. f must
// be quick; it is called during a Read.
func (c *Cluster) OnReset(f func(h uint64)) { c.onReset.Store(&f) }

// resetExpiry is when a reset at at has nothing left to forget: once the
// window at fell in is as many windows old as the sketch holds (two, or a
// sliding sketch's eight sub-windows).
func (c *Cluster) resetExpiry(at int64) int64 {
	w, n := int64(c.sketch.Slot()), int64(limiter.SketchSlots(c.sketch.Sliding()))
	e := limiter.WindowNumber(time.Unix(0, at), c.sketch.Slot())
	if e > math.MaxInt64/w-n {
		return math.MaxInt64
	}
	return (e + n) * w
}

func (c *Cluster) knownLocked(r reset) bool {
	_, ok := c.resets.set[r]
	return ok
}

// learnableLocked reports whether a reset read from a peer at now is one to
// apply here: not known, not over, not dated more than MaxClockSkew ahead (a
// broken clock, or not a reset at all).
func (c *Cluster) learnableLocked(r reset, now int64) bool {
	return !c.knownLocked(r) && r.at <= now+int64(MaxClockSkew) && c.resetExpiry(r.at) > now
}

// applyLocked applies a reset learned from a peer to this instance's own
// counts and records it. The caller lifts the key's block once the peers'
// sum no longer counts the key either.
func (c *Cluster) applyLocked(r reset, now time.Time) {
	c.resetting.Store(true)
	c.sketch.ResetHash(r.hash, time.Unix(0, r.at), now)
	c.recordLocked(r)
	if f := c.onReset.Load(); f != nil {
		(*f)(r.hash)
	}
}

// recordLocked adds r, which is not known, to the table, forgetting the
// oldest reset if the table is full.
func (c *Cluster) recordLocked(r reset) {
	t := &c.resets
	if t.set == nil {
		t.set = make(map[reset]struct{})
	}
	if len(t.list) >= MaxResets {
		delete(t.set, t.list[0].reset)
		t.list = append(t.list[:0], t.list[1:]...)
	}
	t.seq++
	t.list = append(t.list, resetEntry{reset: r, seq: t.seq})
	t.set[r] = struct{}{}
	c.resetting.Store(true)
}

// pruneLocked forgets the resets that are over at now.
func (c *Cluster) pruneLocked(now int64) {
	t := &c.resets
	keep := t.list[:0]
	for _, e := range t.list {
		if c.resetExpiry(e.at) > now {
			keep = append(keep, e)
		} else {
			delete(t.set, e.reset)
		}
	}
	clear(t.list[len(keep):])
	t.list = keep
	if len(keep) == 0 {
		c.resetting.Store(false)
	}
}

// latestResetsLocked fills latest with each reset key's latest reset time.
func (c *Cluster) latestResetsLocked(latest map[uint64]int64) {
	clear(latest)
	for _, e := range c.resets.list {
		noteLatest(latest, e.reset)
	}
}

// noteLatest keeps in latest the later of r and the reset of r's key it
// holds.
func noteLatest(latest map[uint64]int64, r reset) {
	if at, ok := latest[r.hash]; !ok || r.at > at {
		latest[r.hash] = r.at
	}
}

// appendResetsLocked appends the resets to publish.
func (c *Cluster) appendResetsLocked(dst []reset) []reset {
	for _, e := range c.resets.list {
		dst = append(dst, e.reset)
	}
	return dst
}

// appendForgets appends, sorted by hash, the keys whose counts a snapshot
// listing the resets listed must be added without: each key of latest (its
// latest known reset) that the snapshot lists no reset of as late. scratch
// is a map to reuse.
func appendForgets(dst []limiter.Forget, latest map[uint64]int64, listed []reset, scratch map[uint64]int64) []limiter.Forget {
	if len(latest) == 0 {
		return dst
	}
	clear(scratch)
	for _, r := range listed {
		noteLatest(scratch, r)
	}
	start := len(dst)
	for h, at := range latest {
		if l, ok := scratch[h]; !ok || l < at {
			dst = append(dst, limiter.Forget{Hash: h, At: time.Unix(0, at)})
		}
	}
	slices.SortFunc(dst[start:], func(a, b limiter.Forget) int { return cmp.Compare(a.Hash, b.Hash) })
	return dst
}

// forgotten reports whether forget, sorted by hash, names h.
func forgotten(forget []limiter.Forget, h uint64) bool {
	_, ok := slices.BinarySearchFunc(forget, h, func(f limiter.Forget, h uint64) int { return cmp.Compare(f.Hash, h) })
	return ok
}
