package storage

import (
	"bytes"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

func TestSnapshotRoundTrip(t *testing.T) {
	c, err := newCluster(Shape{Zone: "z", Window: time.Minute, Width: 64}, 10)
	if err != nil {
		t.Fatal(err)
	}
	now := t0
	c.TakeHash(limiter.HashString("k"), 3, now)
	sk, _ := c.sketch.AppendSnapshot(nil, now)
	blocks := []block{{hash: 1, until: now.UnixNano() + 5}, {hash: 1 << 63, until: -7}}
	data := appendSnapshot([]byte("x"), "inst", now, sk, blocks)[1:]
	s, err := decodeSnapshot(data, 2)
	if err != nil {
		t.Fatal(err)
	}
	if s.instance != "inst" || !s.written.Equal(now) || !bytes.Equal(s.sketch, sk) || len(s.blocks) != 2 || s.blocks[0] != blocks[0] || s.blocks[1] != blocks[1] {
		t.Fatalf("decoded %+v", s)
	}
	if _, err := decodeSnapshot(data, 1); err == nil {
		t.Fatal("more blocks than allowed were accepted")
	}
	for i := range len(data) {
		if _, err := decodeSnapshot(data[:i], 2); err == nil {
			t.Fatalf("a snapshot truncated to %d bytes was accepted", i)
		}
	}
}

// FuzzDecodeSnapshot feeds the decoder of stored snapshots (untrusted: any
// process that can write the storage) arbitrary bytes. It must not panic,
// must respect its block limit, and whatever it accepts must encode back to
// the same bytes; a sum must take or reject its sketch without panicking.
func FuzzDecodeSnapshot(f *testing.F) {
	c, err := newCluster(Shape{Zone: "z", Window: time.Second, Width: 32}, 100)
	if err != nil {
		f.Fatal(err)
	}
	for i := range 40 {
		c.TakeHash(uint64(i)*0x9E3779B97F4A7C15, int64(1+i%3), t0)
	}
	sk, _ := c.sketch.AppendSnapshot(nil, t0)
	f.Add(appendSnapshot(nil, "0b9f1c2e-1111-4c4c-9a9a-000000000001", t0, sk, []block{{hash: 42, until: t0.UnixNano()}}))
	f.Add(appendSnapshot(nil, "a", t0, nil, nil))
	f.Add([]byte("FGCL\x01"))
	f.Add([]byte("FGCL\x02garbage!"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := decodeSnapshot(data, 16)
		if err != nil {
			return
		}
		if len(s.blocks) > 16 {
			t.Fatalf("%d blocks over the limit of 16", len(s.blocks))
		}
		again := appendSnapshot(nil, s.instance, s.written, s.sketch, s.blocks)
		if !bytes.Equal(again, data) {
			// Varints may be non-minimal in the input; what was decoded must
			// at least decode again to the same thing.
			s2, err := decodeSnapshot(again, 16)
			if err != nil || s2.instance != s.instance || !s2.written.Equal(s.written) || !bytes.Equal(s2.sketch, s.sketch) || len(s2.blocks) != len(s.blocks) {
				t.Fatalf("re-encoding is not stable: %v", err)
			}
		}
		sum := c.sketch.NewSketchSum(t0)
		_, _ = sum.AddBinary(s.sketch)
	})
}

func TestMitigation(t *testing.T) {
	var m mitigation
	const now = 1000
	m.add(5, now+10, now, true)
	if u, ok := m.blocked(5, now); !ok || u != now+10 {
		t.Fatalf("blocked(5) = %d, %v", u, ok)
	}
	if _, ok := m.blocked(5, now+10); ok {
		t.Fatal("a block still holds at its end")
	}
	m.add(5, now+5, now, false) // shorter: ignored
	if u, _ := m.blocked(5, now); u != now+10 {
		t.Fatalf("a shorter block replaced a longer one: %d", u)
	}
	// Keys sharing a pair: two fit, a third replaces the one ending first.
	a, b, c := uint64(8), uint64(8+MitigationSlots), uint64(9+2*MitigationSlots)
	m.add(a, now+30, now, false)
	m.add(b, now+20, now, true)
	m.add(c, now+40, now, false)
	if _, ok := m.blocked(b, now); ok {
		t.Fatal("the block ending first was kept")
	}
	for _, h := range []uint64{a, c} {
		if _, ok := m.blocked(h, now); !ok {
			t.Fatalf("key %d lost its block", h)
		}
	}
	own := m.appendOwn(nil, now)
	if len(own) != 1 || own[0].hash != 5 {
		t.Fatalf("own blocks %+v, want key 5 only", own)
	}
	if m.add(7, now, now, true); len(m.appendOwn(nil, now)) != 1 {
		t.Fatal("a block that has already ended was added")
	}
}
