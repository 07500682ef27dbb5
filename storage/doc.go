// Package storage makes rate-limit zones cluster-wide: instances that share a
// Caddy storage (certmagic.Storage: the file system, Redis, ...) count what
// each of them granted and decide on the sum.
//
// Each distributed zone has a Cluster (cluster.go) for its rate, and one for
// each of its quotas, which the root package names apart: a sliding-window
// count-min sketch of the weight this instance granted per key (previous and
// current window, package limiter; for a window zone's rate, a sliding one
// of 8 sub-windows of W/7, so that the cluster too grants no key more than
// its events in any span of the window, plus a sync lag), the sum of the
// other instances' latest snapshots, and a mitigation cache of keys over their cluster limit
// (mitigation.go). A request passes the Cluster when it is not blocked and
// the key's estimate in the own sketch plus the peers' sum, evaluated at the
// request's time, plus its weight stays within the zone's events per window.
// Decisions take no lock and never touch storage.
//
// A Syncer (sync.go) does all the I/O in one background goroutine: every
// write interval it publishes the own sketch, blocks and the key resets it
// applied as one snapshot (publish.go; its stored form in snapshot.go) under
// rate_limit/<zone>/<instance>; every read interval it reads every other
// snapshot under rate_limit/<zone>/ and replaces the sum with a new one built
// from them (read.go), so a snapshot is never counted twice and a dead
// instance's counts age out with its windows. A window zone's reader places
// each peer's snapshot on its own clock (clocks.go): by how far ahead the
// peer's clock has at least been seen, from when the reader found its
// snapshots new, moved by whole sub-windows past a tolerance (a
// sub-window) and, below it, still counted that long into the next
// sub-window (SketchSum.Linger), so that a peer's counts stay in the
// reader's view for at least W, where a reader ahead by s dropped them s
// early (docs/cluster.md, Clocks, says what clocks most of a sub-window
// apart still cost). From AggregateFrom live
// instances on, one of them, elected through the storage's lock and kept the
// only one by its claim (aggregator.go), publishes the sum of every snapshot
// as one aggregate, and the others read that instead and take their own
// snapshot back out of it (aggregate.go), so that what an instance reads per
// interval does not grow with the fleet. With bursts split (SplitBursts),
// each instance grants a key at most its share of what the cluster has left
// for it, over the instances live (share.go); a window zone's instance that
// the others do not count yet (it joined since their reads, for a write and
// two read intervals from its first publish; a restart whose last snapshot
// they may have dropped; one whose publishes failed for long enough that
// they may drop it) takes none, only an allowance
// of events/10 + 1 per key in any span of the window (at most its share),
// so k instances joining at once add at most k allowances to a key's
// bound; it does even when it finds no other live, unless it was alone at
// its last read while it published and finds no peer that may be live on
// a clock behind, nor, none of its publishes having landed, any peer's
// snapshot, of whatever age (an instance whose publishes are stale
// deletes none past purge_age: the snapshots of a cluster whose writes all
// fail stay for the processes started during it to find). One whose publishes went stale after
// it was counted among n instances takes its share of the quota then,
// events/n (the allowance if more), in place of the allowance, unless it
// saw a peer publish a read interval after its own last publish (which may
// have dropped it, and share among fewer): so every instance's writes
// failing gives a key at most events from the n that counted each other
// (n allowances if more), plus an allowance for each other instance, and
// a cluster of one keeps its limit. A key
// only one instance counts is held there to what the others' shares of it
// leave, not let off its share. A key reset (Cluster.Reset,
// resets.go) spreads through the snapshots' lists of resets. A peer is
// trusted no further than a valid peer could go (trust.go): entries are
// size-checked before they are loaded (backend.go), snapshots dated too far
// ahead are purged, and a peer's blocks are capped at a window and go with
// its snapshot; an aggregate is held to the same. Two processes with one
// instance id notice each other and stop overwriting each other's snapshot
// (identity.go).
//
// Start reading at Cluster.TakeHash (a decision) and Syncer.Read (what a
// decision is made against). docs/cluster.md is the operator's account of
// the same; docs/design.md ("Cluster sync: package storage") keeps the
// observations behind some of the constants.
package storage
