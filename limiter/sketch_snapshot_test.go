package limiter

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/internal/testclock"
)

// The dense snapshot below is the plain reference for the sparse binary form
// that instances exchange: the tests take a SketchSnapshot, encode it with
// AppendBinary and decode it with DecodeSketchSnapshot, and compare what
// Sketch.AppendSnapshot writes and SketchSum reads against it. Nothing
// outside the tests needs the dense copy, so it lives here.

// A SketchSnapshot is a dense copy of a sketch's counts for one window and
// the one before: what Sketch.AppendSnapshot encodes (see AppendBinary) and
// what a sketch adds (see Sketch.Merge). Counts are dense, row by
// row: cell r·Width + c is column c of row r.
type SketchSnapshot struct {
	// Window is the sketch's window length; sketches merge only with equal
	// windows.
	Window time.Duration
	// Epoch is the window number of Curr, floor(UnixNano / Window); Prev
	// counts window Epoch − 1.
	Epoch int64
	// Rows and Width are the sketch's shape; sketches merge only with
	// equal shapes (and equal hashing, which the shape determines).
	Rows, Width int
	// Prev and Curr hold Rows × Width counts each.
	Prev, Curr []uint32
}

// validate reports whether o is a snapshot any sketch could have taken.
func (o *SketchSnapshot) validate() error {
	switch {
	case o == nil:
		return fmt.Errorf("sketch snapshot: nil")
	case o.Rows < 1 || o.Rows > MaxSketchRows:
		return fmt.Errorf("sketch snapshot: rows must be between 1 and %d, got %d", MaxSketchRows, o.Rows)
	case o.Width < 1 || o.Width > MaxSketchWidth:
		return fmt.Errorf("sketch snapshot: width must be between 1 and %d, got %d", MaxSketchWidth, o.Width)
	case o.Window < MinSketchWindow || o.Window > MaxSketchWindow:
		return fmt.Errorf("sketch snapshot: window must be between %v and %v, got %v", MinSketchWindow, MaxSketchWindow, o.Window)
	case len(o.Prev) != o.Rows*o.Width || len(o.Curr) != o.Rows*o.Width:
		return fmt.Errorf("sketch snapshot: %d×%d shape needs %d counts per window, got %d previous and %d current",
			o.Rows, o.Width, o.Rows*o.Width, len(o.Prev), len(o.Curr))
	}
	return nil
}

// Snapshot copies the sketch's counts for the current and previous
// windows. It allocates 8 bytes per cell. Counters are read one by one,
// so a snapshot taken under traffic is not an instant's: it may include a
// charge on one row and miss it on another.
func (s *Sketch) Snapshot(now time.Time) *SketchSnapshot {
	e, _ := s.clock(now)
	cells := s.rows * int(s.width)
	counts := make([]uint32, 2*cells)
	o := &SketchSnapshot{
		Window: time.Duration(s.window),
		Epoch:  e,
		Rows:   s.rows,
		Width:  int(s.width),
		Prev:   counts[:cells:cells],
		Curr:   counts[cells:],
	}
	cp, pp := int(e&1), int((e-1)&1)
	ct, pt := s.tag(e), s.tag(e-1)
	for i := range cells {
		o.Prev[i] = uint32(sketchCount(s.slots[2*i+pp].Load(), pt))
		o.Curr[i] = uint32(sketchCount(s.slots[2*i+cp].Load(), ct))
	}
	return o
}

// Merge adds the counts of another instance's snapshot into this sketch,
// window by window, so that the sketch then limits the sum of both
// instances' traffic. Windows are matched by number: a snapshot of this
// sketch's current window adds to both windows; one a window old adds its
// current counts to this sketch's previous window; an older one adds
// nothing. A snapshot a window ahead (a peer whose clock is slightly
// ahead, at a window boundary) adds its previous counts to this sketch's
// current window and loses its current ones, which at that moment are
// at most the clock skew's worth of traffic.
//
// Merge adds: merging the same snapshot twice counts it twice. Counters
// saturate at MaxSketchQuota. The shape and window must equal the
// sketch's, else Merge returns an error and changes nothing.
func (s *Sketch) Merge(o *SketchSnapshot, now time.Time) error {
	if err := o.validate(); err != nil {
		return err
	}
	if o.Rows != s.rows || o.Width != int(s.width) || o.Window != time.Duration(s.window) {
		return fmt.Errorf("sketch: cannot merge a %d×%d snapshot of %v windows into a %d×%d sketch of %v windows",
			o.Rows, o.Width, o.Window, s.rows, s.width, time.Duration(s.window))
	}
	e, _ := s.clock(now)
	switch o.Epoch {
	case e:
		s.addCells(o.Prev, e-1)
		s.addCells(o.Curr, e)
	case e - 1:
		s.addCells(o.Curr, e-1)
	case e + 1:
		s.addCells(o.Prev, e)
	}
	return nil
}

// addCells adds counts to window e, cell by cell.
func (s *Sketch) addCells(counts []uint32, e int64) {
	p := int(e & 1)
	for i, c := range counts {
		if c != 0 {
			sketchAddSlot(&s.slots[2*i+p], s.tag(e), uint64(c))
			s.live.mark(uint64(i))
		}
	}
}

// AppendBinary appends the compact binary form of o to dst: at most 39
// bytes of header and entry counts, then at most 9 bytes per nonzero cell
// (typically 2 to 4). It returns dst unchanged and an error if o's shape, window or
// count slices are inconsistent, since a peer would reject them.
func (o *SketchSnapshot) AppendBinary(dst []byte) ([]byte, error) {
	if err := o.validate(); err != nil {
		return dst, err
	}
	dst = appendSketchHeader(dst, &SketchSum{rows: o.Rows, width: o.Width, span: o.Window, ring: 2, epoch: o.Epoch})
	dst = appendSketchCells(dst, everyCell(len(o.Prev)), func(i int) uint32 { return o.Prev[i] })
	dst = appendSketchCells(dst, everyCell(len(o.Curr)), func(i int) uint32 { return o.Curr[i] })
	return dst, nil
}

// DecodeSketchSnapshot decodes the binary form written by AppendBinary.
// It treats data as untrusted: it never panics, and rejects with an error
// saying what and where any input that AppendBinary would not have written,
// including a shape of more than maxCells cells (rows × width), which must
// be at least 1.
//
// It allocates 8 bytes per cell of the shape the header claims, at most
// 8 × maxCells bytes, plus under 1 KiB for the snapshot and any error,
// whatever the length of data: a few bytes can claim an empty sketch of
// maxCells cells. Set maxCells to the cells of the sketch the snapshot
// is for. Input rejected before the counts are reached allocates only the
// error.
func DecodeSketchSnapshot(data []byte, maxCells int) (*SketchSnapshot, error) {
	var o *SketchSnapshot
	err := walkSketchBinary(data, maxCells, func(h sketchHeader) error {
		if h.ring != 2 {
			return fmt.Errorf("sketch snapshot: a sliding sketch's snapshot has no SketchSnapshot form")
		}
		cells := h.rows * h.width
		counts := make([]uint32, 2*cells)
		o = &SketchSnapshot{
			Window: h.window,
			Epoch:  h.epoch,
			Rows:   h.rows,
			Width:  h.width,
			Prev:   counts[:cells:cells],
			Curr:   counts[cells:],
		}
		return nil
	}, func(k int, i int, c uint32) {
		if k == 1 {
			o.Curr[i] = c
		} else {
			o.Prev[i] = c
		}
	})
	if err != nil {
		return nil, err
	}
	return o, nil
}

// mergeBinary is MergeBinaryForgetting with nothing to forget.
func (s *Sketch) mergeBinary(data []byte, now time.Time) error {
	return s.MergeBinaryForgetting(data, now, nil)
}

// MergeBinaryForgetting, which instances use to restore what they
// published, adds what the reference Merge adds: the same counts into the
// same windows, whether the snapshot is of the merging sketch's window, one
// or two windows old, or one window ahead (a peer whose clock leads).
func TestMergeBinaryMatchesTheReferenceMerge(t *testing.T) {
	const window = 10 * time.Second
	rng := rand.New(rand.NewPCG(5, 6))
	for _, tc := range []struct {
		name    string
		mergeAt time.Duration // after the snapshot's window starts
	}{
		{"same window", 3 * time.Second},
		{"one window old", window + 3*time.Second},
		{"two windows old", 2*window + 3*time.Second},
		{"one window ahead", -window + 3*time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := testclock.New(sketchEpoch0.Add(2 * window))
			peer := newTestSketch(t, 1000, window, clk)
			for _, at := range []time.Time{clk.Now().Add(-window), clk.Now()} {
				for range 2000 {
					peer.Add(rng.Uint64()%500, 1+rng.Int64N(3), at)
				}
			}
			snap := peer.Snapshot(clk.Now())
			if !slices.ContainsFunc(snap.Prev, func(c uint32) bool { return c != 0 }) || !slices.ContainsFunc(snap.Curr, func(c uint32) bool { return c != 0 }) {
				t.Fatal("the peer's snapshot should count both its windows")
			}
			enc, err := snap.AppendBinary(nil)
			if err != nil {
				t.Fatal(err)
			}
			at := sketchEpoch0.Add(2*window + tc.mergeAt)
			reference, restored := newTestSketch(t, 1000, window, clk), newTestSketch(t, 1000, window, clk)
			if err := reference.Merge(snap, at); err != nil {
				t.Fatal(err)
			}
			if err := restored.mergeBinary(enc, at); err != nil {
				t.Fatal(err)
			}
			assertSameSketch(t, restored, reference, at)
		})
	}
}
