package limiter

import "fmt"

// placeIn returns the line and counters of hash h in lines, where subs
// lists every subset a key may draw on, and where they are as a Reservation
// index: the line in the high bits, the subset in the low 16. The high half
// of the hash picks the line, the low half the subset, each by a
// multiplication rather than a modulo. Buckets and Windows place keys alike.
func placeIn(lines []line, subs []subset, h uint64) (*line, subset, uint64) {
	idx := uint64(uint32(h>>32)) * uint64(len(lines)) >> 32
	s := uint64(uint32(h)) * uint64(len(subs)) >> 32
	return &lines[idx], subs[s], idx<<16 | s
}

// counterIn resolves a Reservation index of placeIn back to its line and
// counters, or nil if it does not fit lines and subs.
func counterIn(lines []line, subs []subset, index uint64) (*line, subset) {
	idx, s := index>>16, index&0xffff
	if idx >= uint64(len(lines)) || s >= uint64(len(subs)) {
		return nil, subset{}
	}
	return &lines[idx], subs[s]
}

// shapeOf checks the number of counters a key draws on (1 to 8, default
// DefaultK) and works out the number of lines the config asks for, in a
// table of m counters to a line (16 for Buckets, 8 for Windows).
func (cfg BucketsConfig) shapeOf(m int) (k, n int, err error) {
	k = cfg.K
	if k == 0 {
		k = DefaultK
	}
	if k < 1 || k > 8 {
		return 0, 0, fmt.Errorf("k must be between 1 and 8, got %d", k)
	}
	n, err = cfg.lines(k, m)
	return k, n, err
}
