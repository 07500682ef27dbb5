package limiter

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// snapshotMagic starts every snapshot; the last byte is the format version.
var snapshotMagic = []byte("FGB\x02")

// AppendSnapshot appends the table's state at now to dst: its shape, the
// wall-clock time, the ticks per token, and how far ahead (short of full)
// every counter is, for the lines that have one that is not full. Full
// lines take no space, so the size grows with the number of lines in use,
// at most about 70 bytes a line.
func (b *Buckets) AppendSnapshot(dst []byte, now time.Time) []byte {
	p := b.params()
	start := len(dst)
again:
	dst = dst[:start]
	tick := p.ticks(b.nowNanos(now))
	dst = append(dst, snapshotMagic...)
	dst = binary.AppendUvarint(dst, uint64(len(p.lines)))
	dst = binary.AppendUvarint(dst, uint64(b.k))
	dst = binary.AppendVarint(dst, now.UnixNano())
	dst = binary.AppendUvarint(dst, p.per)
	var a [countersPerLine]uint32
	prev := -1
	for i := range p.lines {
		if !aheads(&p.lines[i], uint32(tick), &a) {
			p = b.moved(p) // SetLimit replaced the table: start over
			goto again
		}
		if a == [countersPerLine]uint32{} {
			continue
		}
		dst = binary.AppendUvarint(dst, uint64(i-prev-1))
		for _, v := range a {
			dst = binary.AppendUvarint(dst, uint64(v))
		}
		prev = i
	}
	return dst
}

// Restore loads a snapshot taken by AppendSnapshot from a table of the same
// shape (lines and K), into a table no request uses yet. What each counter
// had used is kept in tokens, converted to the limit in force (as SetLimit
// does), and the wall-clock time that passed since the snapshot refills it
// at that limit. The input is untrusted: any defect (bad magic, other
// shape, truncation, an index or value out of range, trailing bytes) is an
// error naming what is wrong, and leaves the table unchanged.
func (b *Buckets) Restore(data []byte, now time.Time) error {
	s, err := parseSnapshot(data, b.Lines(), b.k)
	if err != nil {
		return err
	}
	p := b.params()
	tick := p.ticks(b.nowNanos(now))
	var elapsed uint64
	if d := now.UnixNano() - s.wall; d > 0 && s.wall <= now.UnixNano() {
		elapsed = p.ticks(d)
	}
	return s.each(func(i int, a *[countersPerLine]uint64) {
		for c, v := range a {
			if v == 0 {
				continue
			}
			n := uint64(convertAhead(v, s.per, p.clock))
			n -= min(n, elapsed)
			setCounter(&p.lines[i], uint8(c), uint32(tick), uint32(n))
		}
	})
}

type snapshot struct {
	wall int64
	per  uint64
	body []byte
	n    int
}

var errTruncated = errors.New("snapshot is truncated")

func parseSnapshot(data []byte, lines, k int) (snapshot, error) {
	if len(data) < len(snapshotMagic) || string(data[:len(snapshotMagic)]) != string(snapshotMagic) {
		return snapshot{}, errors.New("not a floodgate bucket snapshot (bad magic or version)")
	}
	data = data[len(snapshotMagic):]
	n, data, err := uvarint(data)
	if err != nil {
		return snapshot{}, err
	}
	kk, data, err := uvarint(data)
	if err != nil {
		return snapshot{}, err
	}
	if n != uint64(lines) || kk != uint64(k) {
		return snapshot{}, fmt.Errorf("snapshot is of a table of %d lines with k=%d; this table has %d lines with k=%d", n, kk, lines, k)
	}
	wall, m := binary.Varint(data)
	if m <= 0 {
		return snapshot{}, errTruncated
	}
	per, data, err := uvarint(data[m:])
	if err != nil {
		return snapshot{}, err
	}
	if per < 1 || per > 1<<aheadBits {
		return snapshot{}, fmt.Errorf("snapshot ticks per token is %d, out of the range 1 to %d", per, 1<<aheadBits)
	}
	s := snapshot{wall: wall, per: per, body: data, n: lines}
	// Validate the whole body before anything is written.
	return s, s.each(nil)
}

// each walks the snapshot's lines, calling f (if not nil) for every one.
func (s snapshot) each(f func(int, *[countersPerLine]uint64)) error {
	data := s.body
	var a [countersPerLine]uint64
	i := -1
	for len(data) > 0 {
		gap, rest, err := uvarint(data)
		if err != nil {
			return err
		}
		if gap >= uint64(s.n) || uint64(i+1)+gap >= uint64(s.n) {
			return fmt.Errorf("snapshot lists line %d+%d, beyond the table's %d lines", i+1, gap, s.n)
		}
		i += 1 + int(gap)
		for c := range a {
			if a[c], rest, err = uvarint(rest); err != nil {
				return err
			}
			if a[c] > 1<<(aheadBits+1)+1 {
				return fmt.Errorf("snapshot counter %d of line %d is %d ticks short of full, more than a counter can be (%d)", c, i, a[c], 1<<(aheadBits+1)+1)
			}
		}
		if f != nil {
			f(i, &a)
		}
		data = rest
	}
	return nil
}

func uvarint(b []byte) (uint64, []byte, error) {
	v, n := binary.Uvarint(b)
	if n <= 0 {
		return 0, nil, errTruncated
	}
	return v, b[n:], nil
}
