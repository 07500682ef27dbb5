package storage

import "sync/atomic"

// MitigationSlots is how many keys a zone's mitigation cache holds: 4096
// pointers (32 KiB) plus at most as many 24-byte entries, whatever the
// traffic.
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

type mitEntry struct {
	block
	// own marks a block this instance decided, which it publishes; blocks
	// read from peers are only enforced.
	own bool
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
		if e := s.Load(); e != nil && e.hash == h && e.until > now {
			return e.until, true
		}
	}
	return 0, false
}

// add blocks the key with hash h until until, unless it is already blocked
// at least as long. now tells which entries have expired.
func (m *mitigation) add(h uint64, until, now int64, own bool) {
	if until <= now {
		return
	}
	a, b := m.pair(h)
	next := &mitEntry{block: block{hash: h, until: until}, own: own}
	for {
		ea, eb := a.Load(), b.Load()
		slot, old := a, ea
		switch {
		case ea != nil && ea.hash == h:
		case eb != nil && eb.hash == h:
			slot, old = b, eb
		case ea == nil || ea.until <= now:
		case eb == nil || eb.until <= now || eb.until < ea.until:
			slot, old = b, eb
		}
		if old != nil && old.hash == h {
			if old.until >= until {
				return
			}
			next.own = own || old.own
		}
		if slot.CompareAndSwap(old, next) {
			return
		}
	}
}

// appendOwn appends the blocks this instance decided that are still in force
// at now.
func (m *mitigation) appendOwn(dst []block, now int64) []block {
	for i := range m.slots {
		if e := m.slots[i].Load(); e != nil && e.own && e.until > now {
			dst = append(dst, e.block)
		}
	}
	return dst
}

// remove lifts the block of the key with hash h if it ends by upTo (Unix
// nanoseconds): a longer block added meanwhile stays.
func (m *mitigation) remove(h uint64, upTo int64) {
	a, b := m.pair(h)
	for _, s := range [2]*atomic.Pointer[mitEntry]{a, b} {
		for {
			e := s.Load()
			if e == nil || e.hash != h || e.until > upTo || s.CompareAndSwap(e, nil) {
				break
			}
		}
	}
}
