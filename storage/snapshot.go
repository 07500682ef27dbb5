package storage

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"time"
)

// The stored form of one instance's state for one zone is
//
//	"FGCL" version=2
//	uvarint len(instance), instance
//	varint  written (Unix nanoseconds)
//	uvarint len(sketch), sketch (limiter.Sketch.AppendSnapshot's binary form)
//	uvarint n, then n × (8-byte little-endian key hash, varint blocked until (Unix ns))
//	uvarint m, then m × (8-byte little-endian key hash, varint reset at (Unix ns))
//	4-byte little-endian CRC-32C of everything before it
//
// Version 1 is the same without the resets (m and what follows it); it is
// still read, as listing no reset. The checksum catches a truncated or torn
// file (a storage that is not atomic, a crash mid-write) before anything in
// it is trusted.
const (
	snapshotMagic   = "FGCL"
	snapshotVersion = 2
	// maxInstanceLen bounds the instance name (a UUID is 36 bytes).
	maxInstanceLen = 128
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// A snapshot is one instance's published state of one zone.
type snapshot struct {
	instance string
	written  time.Time
	sketch   []byte // the sketch's binary form, checked when it is added to a sum
	blocks   []block
	// resets lists the key resets the instance had applied to its sketch
	// when it took it (see resets.go).
	resets []reset
	// sum is the stored form's checksum.
	sum uint32
	// shift is by how many sub-windows a read moved its counts to place
	// them on the reader's clock (clockShift); not stored.
	shift int64
	// early is how much earlier than its writer's its counts may still
	// leave this instance's view, so placed (clockShift): they linger
	// that much (limiter.SketchSum.AddBinaryLinger).
	early time.Duration
}

// block is a key over its cluster limit and when it may pass again.
type block struct {
	hash  uint64
	until int64 // Unix nanoseconds
}

// appendSnapshot appends the stored form of a snapshot whose sketch's binary
// form is sketch.
func appendSnapshot(dst []byte, instance string, written time.Time, sketch []byte, blocks []block, resets []reset) []byte {
	start := len(dst)
	dst = append(dst, snapshotMagic...)
	dst = append(dst, snapshotVersion)
	dst = appendSnapshotBody(dst, instance, written, sketch, blocks, resets)
	return binary.LittleEndian.AppendUint32(dst, crc32.Checksum(dst[start:], castagnoli))
}

// appendSnapshotBody appends what follows the version in a snapshot, up to
// the checksum; an aggregate holds the same (aggregate_form.go).
func appendSnapshotBody(dst []byte, instance string, written time.Time, sketch []byte, blocks []block, resets []reset) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(instance)))
	dst = append(dst, instance...)
	dst = binary.AppendVarint(dst, written.UnixNano())
	dst = binary.AppendUvarint(dst, uint64(len(sketch)))
	dst = append(dst, sketch...)
	dst = binary.AppendUvarint(dst, uint64(len(blocks)))
	for _, b := range blocks {
		dst = binary.LittleEndian.AppendUint64(dst, b.hash)
		dst = binary.AppendVarint(dst, b.until)
	}
	dst = binary.AppendUvarint(dst, uint64(len(resets)))
	for _, r := range resets {
		dst = binary.LittleEndian.AppendUint64(dst, r.hash)
		dst = binary.AppendVarint(dst, r.at)
	}
	return dst
}

// decodeSnapshot decodes the stored form, of version 1 or 2. data is
// untrusted: decodeSnapshot never panics, rejects anything appendSnapshot
// (or version 1's) would not have written with an error saying what, and
// allocates only the blocks and resets, at most maxBlocks and maxResets of
// them. The sketch is returned as a sub-slice of data, unchecked.
func decodeSnapshot(data []byte, maxBlocks, maxResets int) (*snapshot, error) {
	if len(data) < len(snapshotMagic)+1+4 || string(data[:len(snapshotMagic)]) != snapshotMagic {
		return nil, fmt.Errorf("not a floodgate cluster snapshot")
	}
	version := data[len(snapshotMagic)]
	if version != 1 && version != snapshotVersion {
		return nil, fmt.Errorf("snapshot version %d, want 1 or %d", version, snapshotVersion)
	}
	body := data[:len(data)-4]
	sum := binary.LittleEndian.Uint32(data[len(body):])
	if sum != crc32.Checksum(body, castagnoli) {
		return nil, fmt.Errorf("snapshot checksum mismatch (truncated or corrupt, %d bytes)", len(data))
	}
	r := reader{data: body, off: len(snapshotMagic) + 1}
	s, err := r.snapshotBody(version >= 2, maxBlocks, maxResets)
	if err != nil {
		return nil, err
	}
	s.sum = sum
	if r.off != len(body) {
		return nil, fmt.Errorf("snapshot has %d trailing bytes", len(body)-r.off)
	}
	return s, nil
}

// snapshotBody decodes what appendSnapshotBody wrote (without the resets
// unless withResets: version 1), allocating at most maxBlocks blocks and
// maxResets resets.
func (r *reader) snapshotBody(withResets bool, maxBlocks, maxResets int) (*snapshot, error) {
	var s snapshot
	n, err := r.uvarint("instance length")
	if err != nil {
		return nil, err
	}
	if n == 0 || n > maxInstanceLen {
		return nil, fmt.Errorf("snapshot instance length %d: must be between 1 and %d", n, maxInstanceLen)
	}
	inst, err := r.bytes(n, "instance")
	if err != nil {
		return nil, err
	}
	s.instance = string(inst)
	written, err := r.varint("written")
	if err != nil {
		return nil, err
	}
	s.written = time.Unix(0, written)
	n, err = r.uvarint("sketch length")
	if err != nil {
		return nil, err
	}
	if s.sketch, err = r.bytes(n, "sketch"); err != nil {
		return nil, err
	}
	n, err = r.uvarint("block count")
	if err != nil {
		return nil, err
	}
	if n > uint64(maxBlocks) {
		return nil, fmt.Errorf("snapshot lists %d blocked keys, at most %d are kept", n, maxBlocks)
	}
	if n > 0 {
		s.blocks = make([]block, 0, n)
	}
	for range n {
		h, err := r.bytes(8, "block hash")
		if err != nil {
			return nil, err
		}
		until, err := r.varint("block time")
		if err != nil {
			return nil, err
		}
		s.blocks = append(s.blocks, block{hash: binary.LittleEndian.Uint64(h), until: until})
	}
	if withResets {
		n, err = r.uvarint("reset count")
		if err != nil {
			return nil, err
		}
		if n > uint64(maxResets) {
			return nil, fmt.Errorf("snapshot lists %d key resets, at most %d are kept", n, maxResets)
		}
		if n > 0 {
			s.resets = make([]reset, 0, n)
		}
		for range n {
			h, err := r.bytes(8, "reset hash")
			if err != nil {
				return nil, err
			}
			at, err := r.varint("reset time")
			if err != nil {
				return nil, err
			}
			s.resets = append(s.resets, reset{hash: binary.LittleEndian.Uint64(h), at: at})
		}
	}
	return &s, nil
}

type reader struct {
	data []byte
	off  int
}

func (r *reader) uvarint(what string) (uint64, error) {
	v, n := binary.Uvarint(r.data[r.off:])
	if n <= 0 {
		return 0, fmt.Errorf("snapshot: bad %s at byte %d", what, r.off)
	}
	r.off += n
	return v, nil
}

func (r *reader) varint(what string) (int64, error) {
	v, n := binary.Varint(r.data[r.off:])
	if n <= 0 {
		return 0, fmt.Errorf("snapshot: bad %s at byte %d", what, r.off)
	}
	r.off += n
	return v, nil
}

func (r *reader) bytes(n uint64, what string) ([]byte, error) {
	if n > uint64(len(r.data)-r.off) {
		return nil, fmt.Errorf("snapshot: %s of %d bytes at byte %d runs past the end", what, n, r.off)
	}
	b := r.data[r.off : r.off+int(n)]
	r.off += int(n)
	return b, nil
}
