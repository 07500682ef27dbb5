package storage

import (
	"time"
	"unsafe"

	"github.com/floodgate-rl/floodgate/limiter"
)

// What an operator sees of a Cluster (the admin API, /metrics): its memory
// by part, and a key's counts as this instance knows them.

// Memory is what a Cluster holds, in bytes, by part.
type Memory struct {
	// Sketch is this instance's own counts: 16 bytes per cell, two
	// bitmaps of 1 bit per cell, and 4 bytes per cell in use
	// (limiter.Sketch.Bytes).
	Sketch int
	// Sums is the other instances' counts as last read: 8 bytes per cell
	// (32 for a sliding sketch) and a bitmap of 1 bit per cell, once a
	// read has found any, and up to 21 bytes per cell of the sub-window
	// that has just left the view that a peer's clock behind this one's
	// keeps counted (limiter.SketchSum.Linger).
	Sums int
	// Shares is what the shares take when bursts are split: four bitmaps
	// of 1 bit per cell (two of the cells this instance counted, taken
	// apart, the one of those it counts at the last read, and the one of
	// the cells only it counts, derived from them) and, while other
	// instances are live, the copy of Sums decisions read, 8 bytes per
	// cell, with what it leaves them in each cell in use, 16 bytes each
	// (44 for a sliding sketch, which adds 4 bytes per cell: see
	// limiter.SketchSum.WithShares), and made a sub-window after Sums its
	// own copy of what lingers, as in Sums.
	Shares int
	// Mitigation is the cache of blocked keys: MitigationSlots pointers
	// and one entry per key held (MitigationEntryBytes).
	Mitigation int
}

// MitigationEntryBytes is the size of one key's entry in a mitigation
// cache.
const MitigationEntryBytes = int(unsafe.Sizeof(mitEntry{}))

// Memory returns what c holds now. The buffers a sync uses while it runs
// (the snapshots it writes and reads) are not in it.
func (c *Cluster) Memory() Memory {
	m := Memory{Sketch: c.sketch.Bytes(), Mitigation: c.blocks.bytes()}
	peers, shared := c.peers.Load(), c.shared.Load()
	m.Sums = peers.Bytes(false)
	if shared != peers {
		m.Shares = shared.Bytes(true)
	}
	if sole := c.sole.Load(); sole != nil {
		m.Shares += 8 * len(*sole)
	}
	m.Shares += int(c.counted.Load())
	return m
}

// bytes returns what the cache holds: its slots and the entries in them.
func (m *mitigation) bytes() int {
	n := 8 * len(m.slots)
	for i := range m.slots {
		if m.slots[i].Load() != nil {
			n += MitigationEntryBytes
		}
	}
	return n
}

// A KeyView is a key's standing in the cluster as this instance knows it
// now: the estimates are of the rolling window, in the cluster's units
// (requests, or weight), rounded up.
type KeyView struct {
	// Here is what this instance counted; Others what the other
	// instances' snapshots, as last read, counted.
	Here, Others int64
	// LeftToOthers is what this instance leaves the other instances of
	// what the cluster has left for the key (bursts split): it may not
	// grant it, though the others have not used it.
	LeftToOthers int64
	// Blocked is how long the mitigation cache still denies the key (the
	// cluster found it over its limit, here or on another instance); 0 if
	// it does not.
	Blocked time.Duration
}

// View returns the key with hash h's standing at now. It charges nothing.
func (c *Cluster) View(h uint64, now time.Time) KeyView {
	used := func(peers *limiter.SketchSum) int64 { return c.sketch.EstimateWith(h, now, peers) }
	peers, shared := c.peers.Load(), c.shared.Load()
	here := used(nil)
	all := used(peers)
	v := KeyView{Here: here, Others: all - here}
	if shared != peers && c.decisionSum(h) == shared {
		// Never below 0: after a reset the two copies forget the key
		// each from its own counts.
		v.LeftToOthers = max(used(shared)-all, 0)
	}
	if until, ok := c.blocks.blocked(h, now.UnixNano()); ok {
		v.Blocked = time.Duration(until - now.UnixNano())
	}
	return v
}

// Live returns how many instances, this one included, were live at the
// last read: 0 before the first.
func (c *Cluster) Live() int { return int(c.live.Load()) }

// Split reports whether this instance grants a key at most its share of
// what the cluster has left for it (SplitBursts).
func (c *Cluster) Split() bool { return c.split.Load() }
