package limiter

import (
	"bytes"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/internal/testclock"
)

// FuzzDecodeSketchSnapshot feeds the decoder arbitrary bytes. It must not
// panic nor allocate more than it documents, and whatever it accepts must
// be canonical: encoding it again gives the same bytes, which decode to
// the same snapshot.
func FuzzDecodeSketchSnapshot(f *testing.F) {
	const maxCells = 1 << 12
	rng := rand.New(rand.NewPCG(9, 10))
	for _, o := range []*SketchSnapshot{
		randomSketchSnapshot(rng, 1, 1, 1),
		randomSketchSnapshot(rng, 2, 3, 0),
		randomSketchSnapshot(rng, 4, 1024, 0.02),
		randomSketchSnapshot(rng, 16, 256, 0.5),
		randomSketchSnapshot(rng, 3, 5, 1),
	} {
		enc, err := o.AppendBinary(nil)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(enc)
	}
	clk := testclock.New(sketchEpoch0)
	s, err := NewSketch(SketchConfig{Quota: 50, Window: time.Second, Rows: 4, Width: 1024})
	if err != nil {
		f.Fatal(err)
	}
	for i := range 500 {
		s.Add(uint64(i)*0x9E3779B97F4A7C15, int64(1+i%7), clk.Now())
	}
	clk.Advance(time.Second)
	s.Add(7, 3, clk.Now())
	enc, err := s.Snapshot(clk.Now()).AppendBinary(nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(enc)
	f.Add([]byte("FGSK\x01"))
	f.Add([]byte{})

	f.Fuzz(func(t *testing.T, data []byte) {
		// TotalAlloc counts the fuzzing engine's allocations too; they only
		// add, so the least of a few measurements is the decoder's.
		var o *SketchSnapshot
		var err error
		least := uint64(math.MaxUint64)
		for range 3 {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			o, err = DecodeSketchSnapshot(data, maxCells)
			runtime.ReadMemStats(&after)
			if least = min(least, after.TotalAlloc-before.TotalAlloc); least <= sketchDecodeAllocBound(maxCells) {
				break
			}
		}
		if least > sketchDecodeAllocBound(maxCells) {
			t.Fatalf("decoding %d bytes allocated %d bytes, bound %d", len(data), least, sketchDecodeAllocBound(maxCells))
		}
		if err != nil {
			if o != nil {
				t.Fatalf("error %v with a snapshot", err)
			}
			return
		}
		enc, err := o.AppendBinary(nil)
		if err != nil {
			t.Fatalf("decoded snapshot does not encode: %v", err)
		}
		if !bytes.Equal(enc, data) {
			t.Fatalf("encoding is not canonical:\n in  %x\n out %x", data, enc)
		}
		again, err := DecodeSketchSnapshot(enc, maxCells)
		if err != nil {
			t.Fatalf("re-encoding does not decode: %v", err)
		}
		if !equalSketchSnapshots(o, again) {
			t.Fatal("decode, encode, decode changed the snapshot")
		}
	})
}
