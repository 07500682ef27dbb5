package limiter

// A line is one 64-byte cache line of a token-bucket table: a clock word and
// seven counter words holding two 31-bit counters each, 14 counters in all.
//
// Counters hold a deficit, not a balance: how many units the counter is
// short of full. Zero is a full counter, so a zeroed table is a table of full
// buckets, a changed capacity applies at once (balance = capacity − deficit),
// and "refill, capped at capacity" becomes "subtract, floored at zero", which
// SWAR does on both lanes of a word at once.
//
//	word 0:    bits 0–31 tick | bits 32–62 pending refill | bit 63 generation
//	word 1–7:  bits 0–30 counter | bit 31 zero | bits 32–62 counter | bit 63 generation
//
// Refill is lock-free and exact. A goroutine that finds the line's tick
// behind the clock claims the refill with one CAS on word 0: it advances the
// tick, stores the amount every counter is owed, and flips the generation.
// A counter word whose generation bit differs from word 0's still owes that
// amount; whoever next writes the word (a charge, a refund, or the next
// refill) pays it in the same CAS. A new refill is only claimed once every
// non-zero word has paid the previous one, so one pending amount per line is
// enough. A zero word never needs paying (zero minus anything is zero), which
// is why claiming a refill of an idle line costs a single CAS.
type line [8]uint64

const (
	laneBits  = 31
	laneMask  = 1<<laneBits - 1
	valueMask = laneMask | laneMask<<32 // both counters of a word
	guardBits = 1<<31 | 1<<63           // the top bit of each 32-bit lane
	genBit    = 1 << 63
	// countersPerLine is how many counters a line holds.
	countersPerLine = 14
)

// counterWord and counterShift locate counter c (0–13) of a line.
func counterWord(c uint8) int     { return 1 + int(c>>1) }
func counterShift(c uint8) uint64 { return uint64(c&1) * 32 }

// subSat subtracts amount (0 ≤ amount < 2³¹) from both 31-bit counters in v,
// flooring each at zero. v must have its guard bits clear.
//
// Setting each lane's guard bit before subtracting keeps every lane's result
// positive, so no borrow crosses a lane; the guard bit survives exactly in
// the lanes that did not go below zero, and becomes their keep-mask.
func subSat(v uint64, amount uint64) uint64 {
	t := (v | guardBits) - (amount | amount<<32)
	ge := t & guardBits
	keep := ge - ge>>laneBits // 31 one-bits in every lane that did not underflow
	return t & keep
}

// subSatRef is the obvious per-lane version of subSat, the reference the
// SWAR code is tested against.
func subSatRef(v uint64, amount uint64) uint64 {
	var out uint64
	for shift := uint64(0); shift < 64; shift += 32 {
		lane := v >> shift & laneMask
		if lane > amount {
			out |= (lane - amount) << shift
		}
	}
	return out
}

// clockWord packs word 0.
func clockWord(tick uint32, pending uint64, gen uint64) uint64 {
	return uint64(tick) | pending<<32 | gen<<63
}

// unpackClock splits word 0 into tick, pending refill and generation.
func unpackClock(w uint64) (tick uint32, pending uint64, gen uint64) {
	return uint32(w), w >> 32 & laneMask, w >> 63
}

// settle returns counter word w with any refill it owes paid, stamped with
// the current generation.
func settle(w, pending, gen uint64) uint64 {
	v := w & valueMask
	if w>>63 != gen && v != 0 {
		v = subSat(v, pending)
	}
	return v | gen<<63
}

// owes reports whether word w still owes the pending refill of generation
// gen. Zero words never owe anything.
func owes(w, gen uint64) bool { return w>>63 != gen && w&valueMask != 0 }
