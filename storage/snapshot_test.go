package storage

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"slices"
	"strings"
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
	resets := []reset{{hash: 7, at: now.UnixNano()}, {hash: 1<<64 - 1, at: -3}, {hash: 7, at: 1}}
	data := appendSnapshot([]byte("x"), "inst", now, sk, blocks, resets)[1:]
	s, err := decodeSnapshot(data, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	if s.instance != "inst" || !s.written.Equal(now) || !bytes.Equal(s.sketch, sk) || !slices.Equal(s.blocks, blocks) || !slices.Equal(s.resets, resets) {
		t.Fatalf("decoded %+v", s)
	}
	if _, err := decodeSnapshot(data, 1, 3); err == nil || !strings.Contains(err.Error(), "lists 2 blocked keys, at most 1") {
		t.Fatalf("more blocks than allowed: %v", err)
	}
	if _, err := decodeSnapshot(data, 2, 2); err == nil || !strings.Contains(err.Error(), "lists 3 key resets, at most 2") {
		t.Fatalf("more resets than allowed: %v", err)
	}
	for i := range len(data) {
		if _, err := decodeSnapshot(data[:i], 2, 3); err == nil {
			t.Fatalf("a snapshot truncated to %d bytes was accepted", i)
		}
	}
	// A reset list cut short, with a checksum that matches.
	short := appendSnapshot(nil, "inst", now, sk, nil, resets)
	short = short[:len(short)-4-5]
	short = binary.LittleEndian.AppendUint32(short, crc32.Checksum(short, castagnoli))
	if _, err := decodeSnapshot(short, 2, 3); err == nil || !strings.Contains(err.Error(), "reset") {
		t.Fatalf("a reset list cut short: %v", err)
	}
}

// appendSnapshotV1 writes the stored form of version 1: no resets.
func appendSnapshotV1(instance string, written time.Time, sketch []byte, blocks []block) []byte {
	v2 := appendSnapshot(nil, instance, written, sketch, blocks, nil)
	v1 := append([]byte{}, v2[:len(v2)-5]...) // without the reset count (0) and the checksum
	v1[len(snapshotMagic)] = 1
	return binary.LittleEndian.AppendUint32(v1, crc32.Checksum(v1, castagnoli))
}

// Version 1 snapshots, written before resets were published, are read as
// listing none; unknown versions are rejected.
func TestSnapshotVersions(t *testing.T) {
	blocks := []block{{hash: 9, until: t0.UnixNano()}}
	v1 := appendSnapshotV1("old", t0, []byte("FGSK"), blocks)
	s, err := decodeSnapshot(v1, 4, 4)
	if err != nil {
		t.Fatal(err)
	}
	if s.instance != "old" || !slices.Equal(s.blocks, blocks) || s.resets != nil || string(s.sketch) != "FGSK" {
		t.Fatalf("decoded %+v", s)
	}
	// A version 1 snapshot with a reset list appended is not version 1.
	withResets := appendSnapshot(nil, "old", t0, []byte("FGSK"), blocks, []reset{{hash: 1, at: 2}})
	withResets = withResets[:len(withResets)-4]
	withResets[len(snapshotMagic)] = 1
	withResets = binary.LittleEndian.AppendUint32(withResets, crc32.Checksum(withResets, castagnoli))
	if _, err := decodeSnapshot(withResets, 4, 4); err == nil || !strings.Contains(err.Error(), "trailing bytes") {
		t.Fatalf("a version 1 snapshot with resets: %v", err)
	}
	v3 := appendSnapshot(nil, "new", t0, nil, nil, nil)
	v3 = v3[:len(v3)-4]
	v3[len(snapshotMagic)] = 3
	v3 = binary.LittleEndian.AppendUint32(v3, crc32.Checksum(v3, castagnoli))
	if _, err := decodeSnapshot(v3, 4, 4); err == nil || !strings.Contains(err.Error(), "version 3, want 1 or 2") {
		t.Fatalf("version 3: %v", err)
	}
}

// FuzzDecodeSnapshot feeds the decoder of stored snapshots (untrusted: any
// process that can write the storage) arbitrary bytes. It must not panic,
// must respect its limits of blocks and resets, and whatever it accepts must
// encode back to the same bytes (as version 2); a sum must take or reject its
// sketch without panicking.
func FuzzDecodeSnapshot(f *testing.F) {
	c, err := newCluster(Shape{Zone: "z", Window: time.Second, Width: 32}, 100)
	if err != nil {
		f.Fatal(err)
	}
	for i := range 40 {
		c.TakeHash(uint64(i)*0x9E3779B97F4A7C15, int64(1+i%3), t0)
	}
	sk, _ := c.sketch.AppendSnapshot(nil, t0)
	f.Add(appendSnapshot(nil, "0b9f1c2e-1111-4c4c-9a9a-000000000001", t0, sk, []block{{hash: 42, until: t0.UnixNano()}}, []reset{{hash: 42, at: t0.UnixNano()}}))
	f.Add(appendSnapshot(nil, "a", t0, nil, nil, nil))
	f.Add(appendSnapshotV1("v1", t0, sk, []block{{hash: 1, until: 2}}))
	f.Add([]byte("FGCL\x01"))
	f.Add([]byte("FGCL\x02garbage!"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := decodeSnapshot(data, 16, 8)
		if err != nil {
			return
		}
		if len(s.blocks) > 16 || len(s.resets) > 8 {
			t.Fatalf("%d blocks and %d resets, over the limits of 16 and 8", len(s.blocks), len(s.resets))
		}
		again := appendSnapshot(nil, s.instance, s.written, s.sketch, s.blocks, s.resets)
		if !bytes.Equal(again, data) {
			// Varints may be non-minimal in the input, or the version 1;
			// what was decoded must at least decode again to the same thing.
			s2, err := decodeSnapshot(again, 16, 8)
			if err != nil || s2.instance != s.instance || !s2.written.Equal(s.written) || !bytes.Equal(s2.sketch, s.sketch) ||
				!slices.Equal(s2.blocks, s.blocks) || !slices.Equal(s2.resets, s.resets) {
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
	m.add(5, now+10, now)
	if u, ok := m.blocked(5, now); !ok || u != now+10 {
		t.Fatalf("blocked(5) = %d, %v", u, ok)
	}
	if _, ok := m.blocked(5, now+10); ok {
		t.Fatal("a block still holds at its end")
	}
	m.addPeer(5, now+5, now, 1) // shorter: changes nothing
	if u, _ := m.blocked(5, now); u != now+10 {
		t.Fatalf("a shorter block replaced a longer one: %d", u)
	}
	// Keys sharing a pair: two fit, a third replaces the one ending first.
	a, b, c := uint64(8), uint64(8+MitigationSlots), uint64(9+2*MitigationSlots)
	m.addPeer(a, now+30, now, 1)
	m.add(b, now+20, now)
	m.addPeer(c, now+40, now, 1)
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
	if m.add(7, now, now); len(m.appendOwn(nil, now)) != 1 {
		t.Fatal("a block that has already ended was added")
	}
	// A peer's block on a key blocked here too: the longer holds; a read
	// that no longer sets it lifts the peer's part only.
	m.addPeer(5, now+50, now, 2)
	if u, _ := m.blocked(5, now); u != now+50 {
		t.Fatalf("the peer's longer block: until %d", u)
	}
	m.dropStalePeers(3)
	if u, ok := m.blocked(5, now); !ok || u != now+10 {
		t.Fatalf("after the peer's block went: until %d, %v, want the own block's end", u, ok)
	}
	if _, ok := m.blocked(c, now); ok {
		t.Fatal("a peer's block that no read set any more stands")
	}
}

// The checksum catches any single flipped bit, also one that leaves a
// snapshot well formed (a count, a time, a key hash): nothing in a damaged
// snapshot is trusted.
func TestSnapshotChecksumCatchesEveryFlippedBit(t *testing.T) {
	c, err := newCluster(Shape{Zone: "z", Window: time.Minute, Width: 64}, 10)
	if err != nil {
		t.Fatal(err)
	}
	c.TakeHash(limiter.HashString("k"), 3, t0)
	sk, _ := c.sketch.AppendSnapshot(nil, t0)
	data := appendSnapshot(nil, "inst", t0, sk, []block{{hash: 1, until: t0.UnixNano()}}, []reset{{hash: 2, at: t0.UnixNano()}})
	for i := range len(data) * 8 {
		bad := slices.Clone(data)
		bad[i/8] ^= 1 << (i % 8)
		if s, err := decodeSnapshot(bad, 2, 2); err == nil {
			t.Fatalf("bit %d of byte %d flipped: decoded as %+v", i%8, i/8, s)
		}
	}
}
