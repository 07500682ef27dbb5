package storage

import "sync/atomic"

// MitigationSlots is how many keys a zone's mitigation cache holds: 4096
// pointers (32 KiB) plus at most as many entries of MitigationEntryBytes
// (32), whatever the traffic.
const MitigationSlots = 1 << 12

// mitigation is the Cloudflare-style cache of keys over their cluster limit:
// "blocked until T", checked before anything else, so a key that the
// cluster as a whole has exhausted is denied at once, here and, once the
// block is published, on every other instance before their counts catch up.
//
// It is a fixed, two-way set-associative table: a key may sit in slot
// h mod n or its neighbour. When both hold other live blocks the one that
// ends first is replaced; a key whose block is lost that way is still
// denied by its counts wherever they are known. Entries are immutable and
// swapped in atomically, so readers take no lock.
type mitigation struct {
	slots [MitigationSlots]atomic.Pointer[mitEntry]
}

// A mitEntry is one key's block: the one this instance decided (own, which
// it publishes) and the one read from peers (peer, only enforced), each a
// time in Unix nanoseconds, 0 if none. They are kept apart so that a read
// can lift what the peers no longer publish without lifting what this
// instance decided.
type mitEntry struct {
	hash      uint64
	own, peer int64
	// gen is the read that last set peer (mitigation.dropStalePeers).
	gen uint64
}

func (e *mitEntry) until() int64 { return max(e.own, e.peer) }

// testPause is nil except in tests (mitigation_interleave_test.go), which
// set it to run concurrent changes of the cache step by step: every load
// and compare-and-swap of a slot goes through loadSlot and casSlot, which
// call it first, so a test can stop a change there, run another, and
// resume it, through every interleaving. In production it costs one
// predictable branch.
var testPause func(slot *atomic.Pointer[mitEntry])

func loadSlot(s *atomic.Pointer[mitEntry]) *mitEntry {
	if testPause != nil {
		testPause(s)
	}
	return s.Load()
}

func casSlot(s *atomic.Pointer[mitEntry], old, new *mitEntry) bool {
	if testPause != nil {
		testPause(s)
	}
	return s.CompareAndSwap(old, new)
}

func (m *mitigation) pair(h uint64) (*atomic.Pointer[mitEntry], *atomic.Pointer[mitEntry]) {
	i := h & (MitigationSlots - 1)
	return &m.slots[i], &m.slots[i^1]
}

// blocked returns when the key with hash h may pass again, if it is
// blocked at now (Unix nanoseconds).
func (m *mitigation) blocked(h uint64, now int64) (until int64, ok bool) {
	a, b := m.pair(h)
	for _, s := range [2]*atomic.Pointer[mitEntry]{a, b} {
		if e := loadSlot(s); e != nil && e.hash == h && e.until() > now {
			return e.until(), true
		}
	}
	return 0, false
}

// add blocks the key with hash h until until, by this instance's own
// decision, unless it is already so blocked at least as long. now tells
// which entries have expired.
func (m *mitigation) add(h uint64, until, now int64) {
	m.put(h, until, now, func(e *mitEntry) bool {
		if e.own >= until {
			return false
		}
		e.own = until
		return true
	})
}

// addPeer blocks the key with hash h until until, as a peer's snapshot
// read in read number gen says. Within one read the longest of the peers'
// blocks holds; a later read replaces what earlier ones set.
func (m *mitigation) addPeer(h uint64, until, now int64, gen uint64) {
	m.put(h, until, now, func(e *mitEntry) bool {
		if e.gen == gen && e.peer >= until {
			return false
		}
		if e.gen != gen || until > e.peer {
			e.peer = until
		}
		e.gen = gen
		return true
	})
}

// put changes the key's entry with set, a copy of its entry or a new one,
// unless set reports no change. A new entry takes a free or expired slot of
// the pair, or else the one whose block ends first.
func (m *mitigation) put(h uint64, until, now int64, set func(*mitEntry) bool) {
	if until <= now {
		return
	}
	a, b := m.pair(h)
	for {
		ea, eb := loadSlot(a), loadSlot(b)
		slot, old := a, ea
		switch {
		case ea != nil && ea.hash == h:
		case eb != nil && eb.hash == h:
			slot, old = b, eb
		case ea == nil || ea.until() <= now:
		case eb == nil || eb.until() <= now || eb.until() < ea.until():
			slot, old = b, eb
		}
		next := mitEntry{hash: h}
		if old != nil && old.hash == h {
			next = *old
		}
		if !set(&next) {
			return
		}
		if casSlot(slot, old, &next) {
			return
		}
	}
}

// appendOwn appends the blocks this instance decided that are still in force
// at now.
func (m *mitigation) appendOwn(dst []block, now int64) []block {
	for i := range m.slots {
		if e := m.slots[i].Load(); e != nil && e.own > now {
			dst = append(dst, block{hash: e.hash, until: e.own})
		}
	}
	return dst
}

// dropStalePeers lifts the peers' blocks that read number gen did not set:
// their snapshots are gone, or no longer list them.
func (m *mitigation) dropStalePeers(gen uint64) {
	for i := range m.slots {
		s := &m.slots[i]
		for {
			e := loadSlot(s)
			if e == nil || e.peer == 0 || e.gen >= gen {
				break
			}
			var next *mitEntry
			if e.own != 0 {
				next = &mitEntry{hash: e.hash, own: e.own}
			}
			if casSlot(s, e, next) {
				break
			}
		}
	}
}

// dropOwn lifts every block this instance decided, keeping the peers'.
func (m *mitigation) dropOwn() {
	for i := range m.slots {
		s := &m.slots[i]
		for {
			e := loadSlot(s)
			if e == nil || e.own == 0 {
				break
			}
			var next *mitEntry
			if e.peer != 0 {
				next = &mitEntry{hash: e.hash, peer: e.peer, gen: e.gen}
			}
			if casSlot(s, e, next) {
				break
			}
		}
	}
}

// remove lifts the block of the key with hash h if it ends by upTo (Unix
// nanoseconds): a longer block added meanwhile stays.
func (m *mitigation) remove(h uint64, upTo int64) {
	a, b := m.pair(h)
	for _, s := range [2]*atomic.Pointer[mitEntry]{a, b} {
		for {
			e := loadSlot(s)
			if e == nil || e.hash != h || e.until() > upTo || casSlot(s, e, nil) {
				break
			}
		}
	}
}
