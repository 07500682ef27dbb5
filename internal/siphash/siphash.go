// Package siphash is SipHash-2-4 (Aumasson and Bernstein, 2012) of one
// 64-bit word: a pseudorandom function of the word under a 128-bit key.
// floodgate hashes a key's value with xxhash, then passes the result
// through Sum64 keyed by a secret and the key's placeholder, so that the
// counters a value lands on, and the hash an operator's tools show, say
// nothing of the secret: a mixer such as murmur3's finaliser can be run
// backwards from one shown hash of a known value to the secret.
package siphash

import "math/bits"

// Sum64 returns SipHash-2-4 under the key (k0, k1) of the 8-byte message
// holding m in little-endian order.
func Sum64(k0, k1, m uint64) uint64 {
	v0 := k0 ^ 0x736f6d6570736575
	v1 := k1 ^ 0x646f72616e646f6d
	v2 := k0 ^ 0x6c7967656e657261
	v3 := k1 ^ 0x7465646279746573

	v3 ^= m
	v0, v1, v2, v3 = round(v0, v1, v2, v3)
	v0, v1, v2, v3 = round(v0, v1, v2, v3)
	v0 ^= m

	// The last block: the message's length (8) in its top byte, and no
	// bytes left over.
	const b = 8 << 56
	v3 ^= b
	v0, v1, v2, v3 = round(v0, v1, v2, v3)
	v0, v1, v2, v3 = round(v0, v1, v2, v3)
	v0 ^= b

	v2 ^= 0xff
	v0, v1, v2, v3 = round(v0, v1, v2, v3)
	v0, v1, v2, v3 = round(v0, v1, v2, v3)
	v0, v1, v2, v3 = round(v0, v1, v2, v3)
	v0, v1, v2, v3 = round(v0, v1, v2, v3)
	return v0 ^ v1 ^ v2 ^ v3
}

func round(v0, v1, v2, v3 uint64) (uint64, uint64, uint64, uint64) {
	v0 += v1
	v1 = bits.RotateLeft64(v1, 13)
	v1 ^= v0
	v0 = bits.RotateLeft64(v0, 32)
	v2 += v3
	v3 = bits.RotateLeft64(v3, 16)
	v3 ^= v2
	v0 += v3
	v3 = bits.RotateLeft64(v3, 21)
	v3 ^= v0
	v2 += v1
	v1 = bits.RotateLeft64(v1, 17)
	v1 ^= v2
	v2 = bits.RotateLeft64(v2, 32)
	return v0, v1, v2, v3
}
