package limiter

import (
	"errors"
	"fmt"
	"runtime"
	"time"
	"unsafe"
)

// NewBucketsOver returns a table whose lines are mem, memory that something
// besides this process's Go code also decides on: an XDP program's BPF map
// (package xdp) maps its counters here, and both charge them with 64-bit
// compare-and-swap, so each side's decisions see the other's charges
// exactly as those of another goroutine. mem must be a whole number of
// 64-byte lines, 64-byte aligned, and stay mapped as long as the table is
// used; its contents are taken as they are (zero is full). Ticks count from
// base, which the other side must share (see Geometry). cfg.Bytes,
// cfg.Sources and cfg.FalseDeny are ignored: the table is as large as mem.
//
// SetLimit refuses to run on such a table: it would copy the counters into
// new lines the other side never sees (see ErrExternalLimit); SetLimitOver
// converts them into memory the caller gives, which the other side then
// decides on.
func NewBucketsOver(cfg BucketsConfig, mem []byte, base time.Time) (*Buckets, error) {
	if len(mem) < 64 || len(mem)%64 != 0 || len(mem) > MaxBytes {
		return nil, fmt.Errorf("table memory must be a whole number of 64-byte lines, at most %d bytes, got %d bytes", MaxBytes, len(mem))
	}
	if uintptr(unsafe.Pointer(&mem[0]))&63 != 0 {
		return nil, errors.New("table memory must be aligned to 64 bytes")
	}
	b, err := newBuckets(BucketsConfig{Limit: cfg.Limit, Bytes: 64, K: cfg.K}, base)
	if err != nil {
		return nil, err
	}
	p := *b.p.Load()
	p.lines = unsafe.Slice((*line)(unsafe.Pointer(&mem[0])), len(mem)/64)
	b.p.Store(&p)
	b.external = true
	return b, nil
}

// ErrExternalLimit is SetLimit's error on a table made by NewBucketsOver.
var ErrExternalLimit = errors.New("the limit of a table shared with an XDP program cannot change in place; use SetLimitOver")

// SetLimitOver is SetLimit for a table made by NewBucketsOver: it converts
// the counters into mem, memory of the same size that is all zero, as
// SetLimit does into new lines, and decides on mem from then on. The other
// side must never store 0xFFFFFFFF in a counter (see valid), must meanwhile
// treat a word of the old memory that holds the frozen marker (all ones)
// as one it may neither grant from nor write, and move to mem with the new
// limit's Geometry when the conversion is over (SetLimitOver returns
// then). release is called once nothing in this process reads the old
// memory any more (a decision that met a frozen word has moved on), so the
// caller may unmap it then, not before.
func (b *Buckets) SetLimitOver(l Limit, now time.Time, mem []byte, release func()) error {
	if err := l.Validate(); err != nil {
		return err
	}
	if !b.external {
		return errors.New("SetLimitOver is for a table made by NewBucketsOver")
	}
	b.setMu.Lock()
	defer b.setMu.Unlock()
	n := len(b.params().lines)
	if len(mem) != 64*n || uintptr(unsafe.Pointer(&mem[0]))&63 != 0 {
		return fmt.Errorf("the new memory must be %d bytes (the table's), aligned to 64 bytes, got %d bytes", 64*n, len(mem))
	}
	for _, c := range mem {
		if c != 0 {
			return errors.New("the new memory must be zero")
		}
	}
	old := b.convertInto(l, now, unsafe.Slice((*line)(unsafe.Pointer(&mem[0])), n))
	runtime.AddCleanup(old, func(f func()) { f() }, release)
	return nil
}

// Geometry is everything a decision reads besides a table's words, as plain
// numbers, for a program outside Go that decides on the same memory (the
// XDP program of package xdp) exactly as Buckets does: the same line and
// counters for a hash, the same ticks for a time, the same charge.
type Geometry struct {
	// Lines is the number of lines. A hash h picks line
	// ⌊uint32(h>>32)·Lines / 2³²⌋ and subset ⌊uint32(h)·len(Subsets) / 2³²⌋.
	Lines uint32
	// Subsets lists every K-subset of a line's counters, in the order
	// Buckets picks them: the counters in bits 0–15 (counter c is lane c&1
	// of word c>>1), the words that hold them in bits 16–23.
	Subsets []uint32
	// Cost is one token in ticks; Cap how far ahead of now a counter may
	// be and still grant (burst × Cost); Ceil how far ahead a charge may
	// push it (2 × Cap).
	Cost, Cap, Ceil uint32
	// A time of ns nanoseconds after the table's base is ⌊ns·PE/W⌋ ticks,
	// computed as the high half of ns·Mult, plus one if (that + 1)·W ≤
	// ns·PE (128-bit products).
	Mult, PE, W uint64
}

// Geometry returns the table's geometry under the limit in force.
func (b *Buckets) Geometry() Geometry { return b.geometry(b.p.Load()) }

// GeometryFor returns the geometry the table will have once l is in force
// (SetLimitOver): for the other side, to be ready before the conversion.
func (b *Buckets) GeometryFor(l Limit) Geometry {
	p := *b.p.Load()
	p.clock, p.limit = clockFor(l), l
	return b.geometry(&p)
}

func (b *Buckets) geometry(p *bucketParams) Geometry {
	g := Geometry{Lines: uint32(len(p.lines)), Cost: uint32(p.per), Cap: uint32(p.capT), Ceil: uint32(p.ceil),
		Mult: p.mult, PE: p.pe, W: p.w}
	for _, s := range b.subs {
		g.Subsets = append(g.Subsets, uint32(s.counters)|uint32(s.words)<<16)
	}
	return g
}

// Base returns the time the table's ticks count from.
func (b *Buckets) Base() time.Time { return b.base }

// TableLines is the number of lines NewBuckets would give cfg, or the error
// it would return about the size: for callers that allocate the memory
// themselves (NewBucketsOver).
func (cfg BucketsConfig) TableLines() (int, error) {
	k := cfg.K
	if k == 0 {
		k = DefaultK
	}
	if k < 1 || k > 8 {
		return 0, fmt.Errorf("k must be between 1 and 8, got %d", k)
	}
	return cfg.lines(k, countersPerLine)
}
