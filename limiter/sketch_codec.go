package limiter

import (
	"encoding/binary"
	"fmt"
	"iter"
	"math"
	"math/bits"
	"time"
)

// The binary form of a sketch's snapshot (Sketch.AppendSnapshot) is
//
//	"FGSK" version=1
//	uvarint rows, uvarint width, uvarint window (ns), varint epoch
//	previous window: uvarint n, then n × (uvarint index delta, uvarint count)
//	current window:  the same
//
// A sliding sketch's snapshot (SketchConfig.Sliding) is
//
//	"FGSK" version=2
//	uvarint rows, uvarint width, uvarint window (ns, the Window, not the
//	sub-window), uvarint sub-windows (SketchSubWindows), varint epoch
//	(the current sub-window's number)
//	then the lists of sub-windows epoch − 7 to epoch, oldest first
//
// A reader of version 1 only (an instance of an older version) refuses
// version 2 as an unsupported version and skips that snapshot; a sliding
// sum reads a version 1 snapshot of its Window safely (SketchSum.olderSlot).
//
// Only nonzero cells are listed, in increasing index order; each index is
// the previous entry's plus its delta (the first entry's previous index
// being −1), so every delta is at least 1. Varints are minimal. The form
// is canonical: a snapshot has exactly one encoding, so decoding and
// encoding again gives back the same bytes.
const (
	sketchMagic          = "FGSK"
	sketchCodecVersion   = 1
	sketchSlidingVersion = 2
)

// appendSketchHeader appends the header of a snapshot of t's shape and
// windows.
func appendSketchHeader(dst []byte, t *SketchSum) []byte {
	dst = append(dst, sketchMagic...)
	if t.ring > 2 {
		dst = append(dst, sketchSlidingVersion)
	} else {
		dst = append(dst, sketchCodecVersion)
	}
	dst = binary.AppendUvarint(dst, uint64(t.rows))
	dst = binary.AppendUvarint(dst, uint64(t.width))
	dst = binary.AppendUvarint(dst, uint64(t.span))
	if t.ring > 2 {
		dst = binary.AppendUvarint(dst, SketchSubWindows)
	}
	return binary.AppendVarint(dst, t.epoch)
}

// appendSketchCells appends one window's list of nonzero cells, reading
// the count of each of cells (in increasing order, a superset of the
// nonzero ones) once: the entries are written first, after room for the
// longest entry count, and moved back once the count is known. So a live
// sketch's counters, which may change while they are read, still give a
// consistent list.
func appendSketchCells(dst []byte, cells iter.Seq[int], count func(int) uint32) []byte {
	start := len(dst)
	dst = append(dst, make([]byte, binary.MaxVarintLen64)...)
	n, last := 0, -1
	for i := range cells {
		if c := count(i); c != 0 {
			dst = binary.AppendUvarint(dst, uint64(i-last))
			dst = binary.AppendUvarint(dst, uint64(c))
			last = i
			n++
		}
	}
	var head [binary.MaxVarintLen64]byte
	k := binary.PutUvarint(head[:], uint64(n))
	copy(dst[start:], head[:k])
	m := copy(dst[start+k:], dst[start+binary.MaxVarintLen64:])
	return dst[:start+k+m]
}

// everyCell is the cells of a shape of n cells, in order.
func everyCell(n int) iter.Seq[int] {
	return func(yield func(int) bool) {
		for i := range n {
			if !yield(i) {
				return
			}
		}
	}
}

// listedCells is the cells listed, in their order.
func listedCells(list []int32) iter.Seq[int] {
	return func(yield func(int) bool) {
		for _, i := range list {
			if !yield(int(i)) {
				return
			}
		}
	}
}

// setCells is the cells whose bits are set in the bitmap bm, in order.
func setCells(bm []uint64) iter.Seq[int] {
	return func(yield func(int) bool) {
		for w, b := range bm {
			for ; b != 0; b &= b - 1 {
				if !yield(w*64 + bits.TrailingZeros64(b)) {
					return
				}
			}
		}
	}
}

// sketchHeader is what the binary form says before its counts: window is
// the length of the windows its lists count (a sliding sketch's
// sub-window), ring how many lists it has.
type sketchHeader struct {
	rows, width int
	window      time.Duration
	ring        int
	epoch       int64
}

// walkSketchBinary decodes the binary form of a snapshot without storing
// it: it calls begin with the header (an error from begin stops the walk
// and is returned), then cell for each nonzero cell of each window, oldest
// first (k from 0 to ring − 1), in index order. It returns an error
// for any input AppendSnapshot would not have written, possibly after some
// calls of cell: to act only on valid input, walk it once with a nil cell.
func walkSketchBinary(data []byte, maxCells int, begin func(sketchHeader) error, cell func(k int, i int, c uint32)) error {
	if maxCells < 1 {
		return fmt.Errorf("sketch snapshot: maxCells must be at least 1, got %d", maxCells)
	}
	if len(data) < len(sketchMagic) || string(data[:len(sketchMagic)]) != sketchMagic {
		return fmt.Errorf("sketch snapshot: bad magic, not a sketch snapshot")
	}
	d := sketchDecoder{data: data, off: len(sketchMagic)}
	if d.off == len(data) {
		return fmt.Errorf("sketch snapshot: truncated before the version")
	}
	v := data[d.off]
	if v != sketchCodecVersion && v != sketchSlidingVersion {
		return fmt.Errorf("sketch snapshot: unsupported version %d, want %d or %d", v, sketchCodecVersion, sketchSlidingVersion)
	}
	d.off++
	rows, err := d.uvarint("rows")
	if err != nil {
		return err
	}
	if rows < 1 || rows > MaxSketchRows {
		return fmt.Errorf("sketch snapshot: rows must be between 1 and %d, got %d", MaxSketchRows, rows)
	}
	width, err := d.uvarint("width")
	if err != nil {
		return err
	}
	if width < 1 || width > MaxSketchWidth {
		return fmt.Errorf("sketch snapshot: width must be between 1 and %d, got %d", MaxSketchWidth, width)
	}
	cells := int(rows * width)
	if cells > maxCells {
		return fmt.Errorf("sketch snapshot: %d×%d shape has %d cells, over the limit of %d", rows, width, cells, maxCells)
	}
	window, err := d.uvarint("window")
	if err != nil {
		return err
	}
	if window < uint64(MinSketchWindow) || window > uint64(MaxSketchWindow) {
		return fmt.Errorf("sketch snapshot: window must be between %v and %v, got %d ns", MinSketchWindow, MaxSketchWindow, window)
	}
	h := sketchHeader{rows: int(rows), width: int(width), window: time.Duration(window), ring: 2}
	if v == sketchSlidingVersion {
		subs, err := d.uvarint("sub-windows")
		if err != nil {
			return err
		}
		if subs != SketchSubWindows {
			return fmt.Errorf("sketch snapshot: %d sub-windows, want %d", subs, SketchSubWindows)
		}
		h.window, h.ring = time.Duration(sketchSubWindow(h.window)), SketchSlots(true)
	}
	epoch, err := d.uvarint("epoch")
	if err != nil {
		return err
	}
	h.epoch = sketchUnzigzag(epoch)
	if err := begin(h); err != nil {
		return err
	}
	for k := range h.ring {
		if err := d.cells(cells, k, h.ring, cell); err != nil {
			return err
		}
	}
	if d.off != len(data) {
		return fmt.Errorf("sketch snapshot: %d trailing bytes at byte %d", len(data)-d.off, d.off)
	}
	return nil
}

// sketchUnzigzag undoes the zig-zag encoding of binary.AppendVarint, which is
// read as a uvarint so that its minimality can be checked.
func sketchUnzigzag(u uint64) int64 {
	x := int64(u >> 1)
	if u&1 != 0 {
		x = ^x
	}
	return x
}

type sketchDecoder struct {
	data []byte
	off  int
}

// uvarint reads a minimal uvarint; what names it in errors.
func (d *sketchDecoder) uvarint(what string) (uint64, error) {
	v, n := binary.Uvarint(d.data[d.off:])
	switch {
	case n == 0:
		return 0, fmt.Errorf("sketch snapshot: truncated reading %s at byte %d", what, d.off)
	case n < 0:
		return 0, fmt.Errorf("sketch snapshot: %s at byte %d overflows 64 bits", what, d.off)
	case n > 1 && d.data[d.off+n-1] == 0:
		return 0, fmt.Errorf("sketch snapshot: %s at byte %d is not minimally encoded", what, d.off)
	}
	d.off += n
	return v, nil
}

// sketchWhich names window k of a snapshot of ring windows in errors.
func sketchWhich(k, ring int) string {
	switch {
	case k == -1:
		return "window before the oldest"
	case ring == 2 && k == 0:
		return "previous window"
	case k == ring-1:
		return "current window"
	}
	return fmt.Sprintf("window %d of %d", k, ring)
}

// cells reads the list of nonzero cells of window k of ring, of a shape
// of cells cells, passing each to cell if it is not nil.
func (d *sketchDecoder) cells(cells, k, ring int, cell func(k int, i int, c uint32)) error {
	n, err := d.uvarint("entry count")
	if err != nil {
		return err
	}
	if n > uint64(cells) {
		return fmt.Errorf("sketch snapshot: %s lists %d cells, the shape has only %d", sketchWhich(k, ring), n, cells)
	}
	last := -1
	for j := range int(n) {
		delta, err := d.uvarint("index delta")
		if err != nil {
			return err
		}
		if delta == 0 {
			return fmt.Errorf("sketch snapshot: %s entry %d repeats index %d", sketchWhich(k, ring), j, last)
		}
		if delta > uint64(cells-1-last) {
			return fmt.Errorf("sketch snapshot: %s entry %d: index %d+%d is out of range for %d cells", sketchWhich(k, ring), j, last, delta, cells)
		}
		last += int(delta)
		c, err := d.uvarint("count")
		if err != nil {
			return err
		}
		if c == 0 || c > math.MaxUint32 {
			return fmt.Errorf("sketch snapshot: %s cell %d: count %d is not between 1 and %d", sketchWhich(k, ring), last, c, uint64(math.MaxUint32))
		}
		if cell != nil {
			cell(k, last, uint32(c))
		}
	}
	return nil
}
