package limiter

import "math/bits"

// A line is one 64-byte cache line of a token-bucket table: eight words of
// two 32-bit counters each, 16 counters in all. Counter c is lane c&1 of
// word c>>1.
//
// A counter holds a time, not a balance: its theoretical arrival time (the
// GCRA's TAT), in ticks modulo 2³². The counter is full when that time is
// now or past, and "ahead" = TAT − now ticks short of full otherwise: a
// request of cost w·per is granted if ahead + w·per ≤ capT, and charging it
// moves the TAT to max(TAT, now) + w·per. Refill is the passing of time, so
// nothing is written to refill a counter, and a counter's whole state is
// its one 32-bit value: every CAS that changes it validates everything the
// change was computed from.
//
// The value 0 means full (never charged, or swept: see Sweep), so a zeroed
// table is a table of full buckets and a page of untouched lines is never
// written. 0xFFFFFFFF is never stored either, so that a word of two of
// them (frozen) can mark the lines SetLimit has replaced. A charge that
// would store either stores 1: one or two ticks less granted.
// Times compare as serial numbers: a value less than 2³¹ ticks ahead of now
// is ahead, any other is past. A counter is never more than a burst and its
// debt (2³⁰ ticks) ahead of the latest time, so a request whose time is late
// (read before a stall) still reads it as ahead; Sweep zeroes past values
// long before they could wrap round to look ahead again (2³¹ ticks).
type line [8]uint64

const (
	// countersPerLine is how many counters a line holds.
	countersPerLine = 16
)

// laneShift locates counter c in its word.
func laneShift(c uint8) uint64 { return uint64(c&1) * 32 }

// aheadOf is how many ticks counter value v is ahead of now: 0 if the
// counter is full. This is the one reading of a counter: decisions, Sweep,
// SetLimit, snapshots and Stats all use it.
func aheadOf(v, now uint32) uint32 {
	d := v - now
	if v == 0 || int32(d) <= 0 {
		return 0
	}
	return d
}

// store is the value of a counter ahead ticks ahead of now (0 < ahead <
// 2³¹).
func store(now, ahead uint32) uint32 { return valid(now + ahead) }

// valid maps a TAT to one a counter may hold: 0 is reserved for "full" and
// 0xFFFFFFFF for frozen words, so both are stored as 1, a tick or two
// later, against the key.
func valid(v uint32) uint32 {
	if v+1 < 2 {
		return 1
	}
	return v
}

// frozen is the value SetLimit swaps into every word of the lines it
// replaces (see SetLimit; Windows.SetLimit too). No counter holds
// 0xFFFFFFFF (a TAT is stored as 1 instead, see valid; a window's count is
// at most ceil, below its field's all-ones: see windowParamsFor), so no
// live word is frozen, and a CAS computed from a live word fails on a
// frozen one. thawed is what a frozen word that no SetLimit wrote becomes
// (see table.moved): both counters valid(0xFFFFFFFF).
const (
	frozen = ^uint64(0)
	thawed = 1<<32 | 1
)

// lane and withLane read and replace counter c in word w.
func lane(w uint64, c uint8) uint32 { return uint32(w >> laneShift(c)) }

func withLane(w uint64, c uint8, v uint32) uint64 {
	sh := laneShift(c)
	return w&^(0xffffffff<<sh) | uint64(v)<<sh
}

// aheads reads the 16 counters of ln as they stand at tick now, without
// writing. It reports false if a word is frozen: the line was replaced.
func aheads(ln *line, now uint32, out *[countersPerLine]uint32) bool {
	for i := range ln {
		w := loadWord(&ln[i])
		if w == frozen {
			return false
		}
		out[2*i] = aheadOf(uint32(w), now)
		out[2*i+1] = aheadOf(uint32(w>>32), now)
	}
	return true
}

// clearKey zeroes the key's counters (sub) in ln, one CAS per word: Fill
// of both kinds of table. It returns false if it meets a frozen word
// (SetLimit replaced the line); the words before it are cleared, and the
// caller clears the key again in the new table.
func clearKey(ln *line, sub subset) bool {
	for m := sub.words; m != 0; m &= m - 1 {
		wi := bits.TrailingZeros8(m) & 7
		q := &ln[wi]
		for {
			v := loadWord(q)
			if v == frozen {
				return false
			}
			nv := v
			for l := uint8(0); l < 2; l++ {
				if sub.lanes(wi)>>l&1 != 0 {
					nv = withLane(nv, l, 0)
				}
			}
			if nv == v || casWord(q, v, nv) {
				break
			}
		}
	}
	return true
}
