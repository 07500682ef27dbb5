package storage

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"time"
)

// The stored form of an aggregate is
//
//	"FGAG" version=1
//	the body of a snapshot (snapshot.go): the aggregator's name, the time
//	    of the aggregate, the sum of the snapshots in the binary form of a
//	    sketch snapshot of that time's window, the union of their blocks,
//	    and the resets (each key's latest) applied to the sum
//	uvarint n, then n × (uvarint len(name), name, varint written,
//	    4-byte little-endian checksum of the snapshot summed,
//	    from version 2 varint shift: by how many sub-windows the
//	    aggregator moved its counts, placing them on its clock,
//	    and in version 3 varint early (ns): how much earlier than their
//	    writer's those counts may leave the aggregator's view, clockShift)
//	in version 3, uvarint len(tail), tail: what the sum counts of the
//	    sub-window before its oldest (limiter.SketchSum.AppendTail)
//	4-byte little-endian CRC-32C of everything before it
//
// Version 1, still read (every shift 0), is written when every shift is 0,
// and version 2 when the aggregate is not written within its members'
// linger of its sub-window's start (lingerLost), so that an instance of
// an older version still reads it: one reads neither version 3 nor, from
// version 2 on, an aggregate lingerLost holds of, and reads every snapshot
// instead of either.
const (
	aggregateMagic   = "FGAG"
	aggregateVersion = 3
)

// An aggregate is the sum of a zone's live snapshots, as published by its
// aggregator; the embedded snapshot's sketch is the sum.
type aggregate struct {
	snapshot
	members []member
	// tail is what the sum counts of the sub-window before its oldest,
	// in version 3 (nil before: not known).
	tail []byte
}

// A member is an instance whose snapshot an aggregate summed, and which,
// by how many sub-windows its counts were moved (clockShift), and how
// much earlier than their writer's they may leave the aggregator's view
// as moved (clockShift's early; known from version 3 on, where the
// aggregate's tail is not nil; else 0).
type member struct {
	name  string
	w     written
	shift int64
	early time.Duration
}

func appendAggregate(dst []byte, a *aggregate) []byte {
	start := len(dst)
	v := byte(1)
	for _, m := range a.members {
		if m.shift != 0 {
			v = 2
		}
	}
	if a.tail != nil {
		v = 3
	}
	dst = append(dst, aggregateMagic...)
	dst = append(dst, v)
	dst = appendSnapshotBody(dst, a.instance, a.written, a.sketch, a.blocks, a.resets)
	dst = binary.AppendUvarint(dst, uint64(len(a.members)))
	for _, m := range a.members {
		dst = binary.AppendUvarint(dst, uint64(len(m.name)))
		dst = append(dst, m.name...)
		dst = binary.AppendVarint(dst, m.w.at)
		dst = binary.LittleEndian.AppendUint32(dst, m.w.sum)
		if v > 1 {
			dst = binary.AppendVarint(dst, m.shift)
		}
		if v > 2 {
			dst = binary.AppendVarint(dst, int64(m.early))
		}
	}
	if v > 2 {
		dst = binary.AppendUvarint(dst, uint64(len(a.tail)))
		dst = append(dst, a.tail...)
	}
	return binary.LittleEndian.AppendUint32(dst, crc32.Checksum(dst[start:], castagnoli))
}

// decodeAggregate decodes the stored form of an aggregate. data is
// untrusted: as decodeSnapshot, it never panics and rejects anything
// appendAggregate would not have written, including more than
// MitigationSlots blocks, MaxResets resets or MaxAggregateMembers members.
func decodeAggregate(data []byte) (*aggregate, error) {
	if len(data) < len(aggregateMagic)+1+4 || string(data[:len(aggregateMagic)]) != aggregateMagic {
		return nil, fmt.Errorf("not a floodgate cluster aggregate")
	}
	v := data[len(aggregateMagic)]
	if v < 1 || v > aggregateVersion {
		return nil, fmt.Errorf("aggregate version %d, want 1 to %d", v, aggregateVersion)
	}
	body := data[:len(data)-4]
	if sum := binary.LittleEndian.Uint32(data[len(body):]); sum != crc32.Checksum(body, castagnoli) {
		return nil, fmt.Errorf("aggregate checksum mismatch (truncated or corrupt, %d bytes)", len(data))
	}
	r := reader{data: body, off: len(aggregateMagic) + 1}
	s, err := r.snapshotBody(true, MitigationSlots, MaxResets)
	if err != nil {
		return nil, err
	}
	a := &aggregate{snapshot: *s}
	n, err := r.uvarint("member count")
	if err != nil {
		return nil, err
	}
	if n > MaxAggregateMembers {
		return nil, fmt.Errorf("aggregate lists %d instances, at most %d", n, MaxAggregateMembers)
	}
	a.members = make([]member, 0, n)
	for range n {
		l, err := r.uvarint("member name length")
		if err != nil {
			return nil, err
		}
		if l == 0 || l > maxInstanceLen {
			return nil, fmt.Errorf("aggregate member name length %d: must be between 1 and %d", l, maxInstanceLen)
		}
		name, err := r.bytes(l, "member name")
		if err != nil {
			return nil, err
		}
		at, err := r.varint("member written")
		if err != nil {
			return nil, err
		}
		sum, err := r.bytes(4, "member checksum")
		if err != nil {
			return nil, err
		}
		var shift int64
		if v > 1 {
			if shift, err = r.varint("member shift"); err != nil {
				return nil, err
			}
		}
		var early int64
		if v > 2 {
			if early, err = r.varint("member early"); err != nil {
				return nil, err
			}
			if early < 0 || early > int64(MaxClockSkew) {
				return nil, fmt.Errorf("aggregate member early %v: must be between 0 and %v", time.Duration(early), MaxClockSkew)
			}
		}
		a.members = append(a.members, member{name: string(name), w: written{at: at, sum: binary.LittleEndian.Uint32(sum)}, shift: shift, early: time.Duration(early)})
	}
	if v > 2 {
		l, err := r.uvarint("tail length")
		if err != nil {
			return nil, err
		}
		if a.tail, err = r.bytes(l, "tail"); err != nil {
			return nil, err
		}
		a.tail = append([]byte{}, a.tail...) // non-nil, even empty
	}
	if r.off != len(body) {
		return nil, fmt.Errorf("aggregate has %d trailing bytes", len(body)-r.off)
	}
	return a, nil
}

// maxAggregateSize is the size of the largest aggregate of a zone of shape
// s: a snapshot's largest, the longest list of members, and the longest
// tail (one sub-window's list of cells).
func maxAggregateSize(s Shape) int64 {
	const v = binary.MaxVarintLen64
	tail := v + v + int64(SketchRows)*int64(s.Width)*2*binary.MaxVarintLen32
	return maxSnapshotSize(s) + v + MaxAggregateMembers*(v+maxInstanceLen+v+4+v+v) + tail
}
