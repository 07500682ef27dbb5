package limiter

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"
)

// SetLimit changes the rate and burst of every counter at once, keeping what
// each key has consumed: counters hold deficits, so a key that used 3 of
// "events 3" has 2 tokens under "events 5", and a key that used 4 of 5 has
// none under "events 3" (it refills from a deficit of 4).
//
// When the new rate is a whole number of units per existing tick (to within
// 0.05%), SetLimit is a single atomic swap. Otherwise it moves the counters
// to a table with a new tick in one pass over the lines (about 20 ns a
// line); charges made to the old table during that pass may be lost.
// Concurrent SetLimit calls are serialised by the caller's config loading;
// two racing calls leave one of the two limits in force.
func (b *Buckets) SetLimit(l Limit, now time.Time) error {
	if err := l.Validate(); err != nil {
		return err
	}
	tp, _ := l.ticks()
	old := b.p.Load()
	rate := float64(l.Events) * UnitsPerToken / float64(l.Window)
	exact := rate * float64(old.t.tick)
	if r := math.Round(exact); r >= 1 && math.Abs(exact-r) <= 5e-4*exact && int64(r) <= tp.capUnits {
		b.p.Store(newParams(l, tickParams{tick: old.t.tick, refill: int64(r), capUnits: tp.capUnits}, old.t))
		return nil
	}
	nowNs := b.nowNanos(now)
	oldTick, newTick := nowNs/int64(old.t.tick), nowNs/int64(tp.tick)
	nt := newLineTable(len(old.t.lines), tp.tick)
	nt.lastSweep.Store(newTick)
	var defs [countersPerLine]uint64
	for i := range old.t.lines {
		old.deficits(&old.t.lines[i], oldTick, &defs)
		storeLine(&nt.lines[i], &defs, uint32(newTick))
	}
	b.p.Store(newParams(l, tp, nt))
	return nil
}

// deficits reads the 14 counters of ln as they stand at nowTick, refill
// included, without writing.
func (p *bucketParams) deficits(ln *line, nowTick int64, out *[countersPerLine]uint64) {
	tick, pending, gen := unpackClock(atomic.LoadUint64(&ln[0]))
	var owed uint64
	if elapsed := int32(uint32(nowTick) - tick); elapsed > 0 {
		owed = min(uint64(elapsed)*uint64(p.refill), laneMask)
	}
	for c := uint8(0); c < countersPerLine; c++ {
		w := atomic.LoadUint64(&ln[counterWord(c)])
		def := w >> counterShift(c) & laneMask
		if owes(w, gen) {
			def = subSat(def, pending)
		}
		out[c] = subSat(def, owed)
	}
}

// storeLine overwrites ln with the given deficits, stamped at tick. It is
// for lines no other goroutine writes yet (a table being built or restored
// before use).
func storeLine(ln *line, defs *[countersPerLine]uint64, tick uint32) {
	for w := 1; w < len(ln); w++ {
		atomic.StoreUint64(&ln[w], min(defs[2*w-2], laneMask)|min(defs[2*w-1], laneMask)<<32)
	}
	atomic.StoreUint64(&ln[0], clockWord(tick, 0, 0))
}

// snapshotMagic starts every snapshot; the last byte is the format version.
var snapshotMagic = []byte("FGB\x01")

// AppendSnapshot appends the table's state to dst: its shape, the wall-clock
// time, and the deficit of every counter that is not full, refilled to now.
// Full lines take no space, so the size grows with the number of lines in
// use, at most about 60 bytes a line.
func (b *Buckets) AppendSnapshot(dst []byte, now time.Time) []byte {
	p := b.p.Load()
	nowTick := b.nowNanos(now) / int64(p.t.tick)
	dst = append(dst, snapshotMagic...)
	dst = binary.AppendUvarint(dst, uint64(len(p.t.lines)))
	dst = binary.AppendUvarint(dst, uint64(b.k))
	dst = binary.AppendVarint(dst, now.UnixNano())
	var defs [countersPerLine]uint64
	prev := -1
	for i := range p.t.lines {
		p.deficits(&p.t.lines[i], nowTick, &defs)
		if defs == [countersPerLine]uint64{} {
			continue
		}
		dst = binary.AppendUvarint(dst, uint64(i-prev-1))
		for _, d := range defs {
			dst = binary.AppendUvarint(dst, d)
		}
		prev = i
	}
	return dst
}

// Restore loads a snapshot taken by AppendSnapshot from a table of the same
// shape (lines and K), into a table no request uses yet. Counters the
// snapshot lists are overwritten; time that passed since the snapshot
// refills them at the current limit. The input is untrusted: any defect (bad
// magic, other shape, truncation, an index out of range, trailing bytes) is
// an error and leaves the table unchanged.
func (b *Buckets) Restore(data []byte, now time.Time) error {
	s, err := parseSnapshot(data, b.Lines(), b.k)
	if err != nil {
		return err
	}
	p := b.p.Load()
	nowTick := b.nowNanos(now) / int64(p.t.tick)
	var owed uint64 = math.MaxUint64
	if elapsed := now.UnixNano() - s.wall; elapsed < int64(p.capUnits/p.refill+1)*int64(p.t.tick) {
		owed = uint64(max(0, elapsed)/int64(p.t.tick)) * uint64(p.refill)
	}
	var defs [countersPerLine]uint64
	return s.each(func(i int, raw *[countersPerLine]uint64) {
		for c := range raw {
			defs[c] = raw[c] - min(raw[c], owed)
		}
		storeLine(&p.t.lines[i], &defs, uint32(nowTick))
	})
}

type snapshot struct {
	wall int64
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
	s := snapshot{wall: wall, body: data[m:], n: lines}
	// Validate the whole body before anything is written.
	return s, s.each(nil)
}

// each walks the snapshot's lines, calling f (if not nil) for every one.
func (s snapshot) each(f func(int, *[countersPerLine]uint64)) error {
	data := s.body
	var defs [countersPerLine]uint64
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
		for c := range defs {
			if defs[c], rest, err = uvarint(rest); err != nil {
				return err
			}
			if defs[c] > laneMask {
				return fmt.Errorf("snapshot counter %d of line %d is %d, beyond the 31-bit range", c, i, defs[c])
			}
		}
		if f != nil {
			f(i, &defs)
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
