package limiter

import "net/netip"

// A NetKey is the key of a source network: an address masked to a prefix,
// tagged with its family so that IPv4 and IPv6 keys never coincide. It is a
// value, so building one allocates nothing.
type NetKey struct {
	b [17]byte
	n uint8
}

// NetworkKey masks a to its first v4bits (IPv4) or v6bits (IPv6) bits.
// IPv4-mapped IPv6 addresses (::ffff:a.b.c.d, as a dual-stack listener
// reports IPv4 clients) count as IPv4. Prefix lengths outside 0–32 and 0–128
// are clamped. An invalid address gives the empty key; Bytes returns nil.
func NetworkKey(a netip.Addr, v4bits, v6bits int) NetKey {
	var k NetKey
	a = a.Unmap()
	switch {
	case a.Is4():
		k.b[0] = 4
		v4 := a.As4()
		copy(k.b[1:], v4[:])
		mask(k.b[1:5], v4bits)
		k.n = 5
	case a.Is6():
		k.b[0] = 6
		v6 := a.As16()
		copy(k.b[1:], v6[:])
		mask(k.b[1:17], v6bits)
		k.n = 17
	}
	return k
}

// mask zeroes every bit of b after the first bits.
func mask(b []byte, bits int) {
	bits = max(0, min(bits, 8*len(b)))
	full := bits / 8
	if full < len(b) {
		b[full] &= ^byte(0xff >> (bits % 8))
		clear(b[full+1:])
	}
}

// Bytes returns the key's bytes, nil for the empty key. The slice aliases k.
func (k *NetKey) Bytes() []byte {
	if k.n == 0 {
		return nil
	}
	return k.b[:k.n]
}

// Prefix returns the network the key stands for, or the zero Prefix for the
// empty key.
func (k *NetKey) Prefix(v4bits, v6bits int) netip.Prefix {
	switch k.n {
	case 5:
		return netip.PrefixFrom(netip.AddrFrom4([4]byte(k.b[1:5])), max(0, min(v4bits, 32)))
	case 17:
		return netip.PrefixFrom(netip.AddrFrom16([16]byte(k.b[1:17])), max(0, min(v6bits, 128)))
	}
	return netip.Prefix{}
}
