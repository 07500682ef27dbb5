package storage

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"net/url"
	"time"
)

// ClaimKey is where the instance that aggregates a zone's cluster state
// names itself. It is in a directory of its own, so that no zone's name
// can make it another zone's aggregate or snapshot.
func ClaimKey(zone string) string { return Prefix + "_aggregator/" + url.PathEscape(zone) }

// The stored form of a claim is
//
//	"FGAC" version=1
//	uvarint len(name), name, varint at (Unix nanoseconds)
//	4-byte little-endian CRC-32C of everything before it
const (
	claimMagic   = "FGAC"
	claimVersion = 1
	maxClaimSize = len(claimMagic) + 1 + binary.MaxVarintLen64 + maxInstanceLen + binary.MaxVarintLen64 + 4
)

// A claim is the aggregator's name and when it claimed the role.
type claim struct {
	name string
	at   int64 // Unix nanoseconds
}

func appendClaim(dst []byte, name string, at time.Time) []byte {
	start := len(dst)
	dst = append(dst, claimMagic...)
	dst = append(dst, claimVersion)
	dst = binary.AppendUvarint(dst, uint64(len(name)))
	dst = append(dst, name...)
	dst = binary.AppendVarint(dst, at.UnixNano())
	return binary.LittleEndian.AppendUint32(dst, crc32.Checksum(dst[start:], castagnoli))
}

// decodeClaim decodes the stored form of a claim. data is untrusted: it
// never panics and rejects anything appendClaim would not have written.
func decodeClaim(data []byte) (claim, error) {
	if len(data) < len(claimMagic)+1+4 || string(data[:len(claimMagic)]) != claimMagic {
		return claim{}, fmt.Errorf("not a floodgate aggregator claim")
	}
	if v := data[len(claimMagic)]; v != claimVersion {
		return claim{}, fmt.Errorf("aggregator claim version %d, want %d", v, claimVersion)
	}
	body := data[:len(data)-4]
	if sum := binary.LittleEndian.Uint32(data[len(body):]); sum != crc32.Checksum(body, castagnoli) {
		return claim{}, fmt.Errorf("aggregator claim checksum mismatch (truncated or corrupt, %d bytes)", len(data))
	}
	r := reader{data: body, off: len(claimMagic) + 1}
	n, err := r.uvarint("claim name length")
	if err != nil {
		return claim{}, err
	}
	if n == 0 || n > maxInstanceLen {
		return claim{}, fmt.Errorf("aggregator claim name length %d: must be between 1 and %d", n, maxInstanceLen)
	}
	b, err := r.bytes(n, "claim name")
	if err != nil {
		return claim{}, err
	}
	ns, err := r.varint("claim time")
	if err != nil {
		return claim{}, err
	}
	if r.off != len(body) {
		return claim{}, fmt.Errorf("aggregator claim has %d trailing bytes", len(body)-r.off)
	}
	return claim{name: string(b), at: ns}, nil
}
