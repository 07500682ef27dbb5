package storage

import (
	"encoding/binary"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// What a peer can impose on this instance: no more than a valid peer of the
// zone could. A peer's snapshot is read only when the storage reports it no
// larger than the largest snapshot of the zone's shape (maxSnapshotSize),
// is refused and purged when it is dated more than MaxClockSkew ahead of
// this instance's clock, and its blocks last at most the zone's window from
// when it was written and are lifted at the first read that no longer finds
// them in its snapshot (peerBlockUntil, mitigation.dropStalePeers). An
// aggregate (aggregate.go) is held to the same: no larger than
// maxAggregateSize, ignored when dated more than MaxClockSkew ahead or
// stale, skipped when its sum is not of its own time's window, its blocks
// capped at a window from when it was written.

// MaxClockSkew is how far ahead of this instance's clock a peer's snapshot
// (its time, its resets) may be dated and still be trusted: clocks kept by
// NTP differ by milliseconds; one a minute ahead is broken, and a snapshot
// from it would weigh on the cluster for as long as its clock stays ahead.
const MaxClockSkew = time.Minute

// maxSnapshotSize is the size of the largest snapshot an instance of a zone
// of shape s can write: the longest instance name, a sketch with every
// cell counted in both windows (at most two 5-byte uvarints per cell), and
// a full mitigation cache and reset list (at most 8 + 10 bytes each).
func maxSnapshotSize(s Shape) int64 {
	const v = binary.MaxVarintLen64
	cells := int64(SketchRows) * int64(s.Width)
	sketch := int64(64) + int64(limiter.SketchSlots(s.Sliding))*(v+cells*2*binary.MaxVarintLen32)
	return int64(len(snapshotMagic)+1) + v + maxInstanceLen + v + v + sketch +
		v + MitigationSlots*(8+v) + v + MaxResets*(8+v) + 4
}

// peerBlockUntil caps a block read from a peer's snapshot written at
// written: it lasts at most a window from then, or from now if the
// snapshot is dated ahead of this instance's clock. A block only speeds up
// what the counts say: past the cap, the counts the peer published still
// deny the key for as long as they hold it over its limit.
func peerBlockUntil(until, written, now int64, window time.Duration) int64 {
	return min(until, min(written, now)+int64(window))
}
