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
// Only nonzero cells are listed, in increasing index order; each index is
// the previous entry's plus its delta (the first entry's previous index
// being −1), so every delta is at least 1. Varints are minimal. The form
// is canonical: a snapshot has exactly one encoding, so decoding and
// encoding again gives back the same bytes.
const (
	sketchMagic        = "FGSK"
	sketchCodecVersion = 1
)

func appendSketchHeader(dst []byte, rows, width int, window time.Duration, epoch int64) []byte {
	dst = append(dst, sketchMagic...)
	dst = append(dst, sketchCodecVersion)
	dst = binary.AppendUvarint(dst, uint64(rows))
	dst = binary.AppendUvarint(dst, uint64(width))
	dst = binary.AppendUvarint(dst, uint64(window))
	return binary.AppendVarint(dst, epoch)
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

// sketchHeader is what the binary form says before its counts.
type sketchHeader struct {
	rows, width int
	window      time.Duration
	epoch       int64
}

// walkSketchBinary decodes the binary form of a snapshot without storing
// it: it calls begin with the header (an error from begin stops the walk
// and is returned), then cell for each nonzero cell of the previous window
// (curr false) and of the current one, in index order. It returns an error
// for any input AppendSnapshot would not have written, possibly after some
// calls of cell: to act only on valid input, walk it once with a nil cell.
func walkSketchBinary(data []byte, maxCells int, begin func(sketchHeader) error, cell func(curr bool, i int, c uint32)) error {
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
	if v := data[d.off]; v != sketchCodecVersion {
		return fmt.Errorf("sketch snapshot: unsupported version %d, want %d", v, sketchCodecVersion)
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
	epoch, err := d.uvarint("epoch")
	if err != nil {
		return err
	}
	h := sketchHeader{rows: int(rows), width: int(width), window: time.Duration(window), epoch: sketchUnzigzag(epoch)}
	if err := begin(h); err != nil {
		return err
	}
	if err := d.cells(cells, false, cell); err != nil {
		return err
	}
	if err := d.cells(cells, true, cell); err != nil {
		return err
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

// cells reads one window's list of nonzero cells, of a shape of cells
// cells, passing each to cell if it is not nil.
func (d *sketchDecoder) cells(cells int, curr bool, cell func(curr bool, i int, c uint32)) error {
	which := "previous"
	if curr {
		which = "current"
	}
	n, err := d.uvarint("entry count")
	if err != nil {
		return err
	}
	if n > uint64(cells) {
		return fmt.Errorf("sketch snapshot: %s window lists %d cells, the shape has only %d", which, n, cells)
	}
	last := -1
	for k := range int(n) {
		delta, err := d.uvarint("index delta")
		if err != nil {
			return err
		}
		if delta == 0 {
			return fmt.Errorf("sketch snapshot: %s window entry %d repeats index %d", which, k, last)
		}
		if delta > uint64(cells-1-last) {
			return fmt.Errorf("sketch snapshot: %s window entry %d: index %d+%d is out of range for %d cells", which, k, last, delta, cells)
		}
		last += int(delta)
		c, err := d.uvarint("count")
		if err != nil {
			return err
		}
		if c == 0 || c > math.MaxUint32 {
			return fmt.Errorf("sketch snapshot: %s window cell %d: count %d is not between 1 and %d", which, last, c, uint64(math.MaxUint32))
		}
		if cell != nil {
			cell(curr, last, uint32(c))
		}
	}
	return nil
}
