package limiter

import (
	"errors"
	"runtime"
	"testing"
	"time"
	"unsafe"
)

// alignedMem returns n zeroed lines of memory, 64-byte aligned.
func alignedMem(n int) []byte {
	raw := make([]byte, 64*n+64)
	off := (64 - int(uintptr(unsafe.Pointer(&raw[0]))&63)) & 63
	return raw[off : off+64*n]
}

// overAndOwn returns a table of limit l over 4 lines of memory, the memory,
// and a table of its own of the same size.
func overAndOwn(t *testing.T, l Limit, base time.Time) (ext, own *Buckets, mem []byte) {
	t.Helper()
	mem = alignedMem(4)
	ext, err := NewBucketsOver(BucketsConfig{Limit: l}, mem, base)
	if err != nil {
		t.Fatal(err)
	}
	own, err = newBuckets(BucketsConfig{Limit: l, Bytes: len(mem)}, base)
	if err != nil {
		t.Fatal(err)
	}
	return ext, own, mem
}

// TestBucketsOverDecideOnTheGivenMemory: a table over external memory
// charges that memory, exactly as a table of its own would, and refuses a
// limit change, which would move its counters to memory the other side
// never sees.
func TestBucketsOverDecideOnTheGivenMemory(t *testing.T) {
	l := Limit{Events: 3, Window: time.Second}
	base := time.Now()
	ext, own, mem := overAndOwn(t, l, base)
	for i := range 10 {
		now := base.Add(time.Duration(i) * 50 * time.Millisecond)
		key := []byte{4, 192, 0, 2, byte(i % 3)}
		if a, b := ext.Allow(key, 1, now), own.Allow(key, 1, now); a != b {
			t.Fatalf("request %d: external %+v, own %+v", i, a, b)
		}
	}
	words := unsafe.Slice((*uint64)(unsafe.Pointer(&mem[0])), len(mem)/8)
	lines := own.p.Load().lines
	for i, w := range words {
		if w != lines[i/8][i%8] {
			t.Fatalf("word %d: memory holds %#x, a table of its own %#x", i, w, lines[i/8][i%8])
		}
	}
	if err := ext.SetLimit(Limit{Events: 5, Window: time.Second}, base); !errors.Is(err, ErrExternalLimit) {
		t.Fatalf("SetLimit on external memory: %v, want ErrExternalLimit", err)
	}
	if &ext.p.Load().lines[0][0] != &words[0] {
		t.Fatal("SetLimit moved the table off its memory")
	}
	for _, bad := range [][]byte{nil, make([]byte, 63), alignedMem(2)[8:72]} {
		if _, err := NewBucketsOver(BucketsConfig{Limit: l}, bad, base); err == nil {
			t.Fatalf("NewBucketsOver accepted %d bytes at %p", len(bad), bad)
		}
	}
}

// TestSetLimitOverConvertsIntoTheGivenMemory: SetLimitOver converts a table
// over external memory into the memory it is given exactly as SetLimit
// converts a table of its own, decides there from then on, leaves every
// old word frozen (for the other side), and releases the old memory once
// nothing reads it. Memory of the wrong size or not zero is refused.
func TestSetLimitOverConvertsIntoTheGivenMemory(t *testing.T) {
	l, next := Limit{Events: 3, Window: time.Second}, Limit{Events: 5, Window: time.Second}
	base := time.Now()
	ext, own, mem := overAndOwn(t, l, base)
	for i := range 10 {
		key := []byte{4, 192, 0, 2, byte(i % 3)}
		ext.Allow(key, 1, base)
		own.Allow(key, 1, base)
	}
	dirty := alignedMem(4)
	dirty[100] = 1
	for _, bad := range [][]byte{alignedMem(2), dirty} {
		if err := ext.SetLimitOver(next, base, bad, func() {}); err == nil {
			t.Fatalf("SetLimitOver accepted %d bytes, byte 100 = %d", len(bad), bad[100])
		}
	}
	if g := ext.GeometryFor(next); g.Cost == ext.Geometry().Cost && g.Cap == ext.Geometry().Cap {
		t.Fatalf("GeometryFor(%v) is the geometry in force: %+v", next, g)
	}
	want := ext.GeometryFor(next)
	at := base.Add(100 * time.Millisecond)
	released := make(chan struct{})
	nmem := alignedMem(4)
	if err := ext.SetLimitOver(next, at, nmem, func() { close(released) }); err != nil {
		t.Fatal(err)
	}
	if err := own.SetLimit(next, at); err != nil {
		t.Fatal(err)
	}
	if g := ext.Geometry(); g.Cost != want.Cost || g.Cap != want.Cap || g.Mult != want.Mult {
		t.Fatalf("geometry after SetLimitOver %+v, GeometryFor said %+v", g, want)
	}
	for i, w := range unsafe.Slice((*uint64)(unsafe.Pointer(&mem[0])), len(mem)/8) {
		if w != frozen {
			t.Fatalf("old word %d holds %#x, not the frozen marker", i, w)
		}
	}
	words := unsafe.Slice((*uint64)(unsafe.Pointer(&nmem[0])), len(nmem)/8)
	lines := own.p.Load().lines
	for i, w := range words {
		if w != lines[i/8][i%8] {
			t.Fatalf("word %d: new memory holds %#x, SetLimit's table %#x", i, w, lines[i/8][i%8])
		}
	}
	for i := range 10 {
		now := at.Add(time.Duration(i) * 50 * time.Millisecond)
		key := []byte{4, 192, 0, 2, byte(i % 3)}
		if a, b := ext.Allow(key, 1, now), own.Allow(key, 1, now); a != b {
			t.Fatalf("request %d after the change: external %+v, own %+v", i, a, b)
		}
	}
	for range 50 {
		runtime.GC()
		select {
		case <-released:
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
	t.Fatal("the old memory was never released")
}
