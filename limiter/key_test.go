package limiter

import (
	"net/netip"
	"testing"
)

func TestNetworkKeyMasksAndSeparatesFamilies(t *testing.T) {
	key := func(s string, v4, v6 int) string {
		k := NetworkKey(netip.MustParseAddr(s), v4, v6)
		return string(k.Bytes())
	}
	tests := []struct {
		name   string
		a, b   string
		v4, v6 int
		same   bool
	}{
		{"same /24", "192.0.2.1", "192.0.2.200", 24, 64, true},
		{"different /24", "192.0.2.1", "192.0.3.1", 24, 64, false},
		{"/32 separates hosts", "192.0.2.1", "192.0.2.2", 32, 64, false},
		{"/20 on a non-byte boundary", "10.0.16.1", "10.0.31.255", 20, 64, true},
		{"/20 boundary crossed", "10.0.16.1", "10.0.32.1", 20, 64, false},
		{"same /48", "2001:db8:1::1", "2001:db8:1:ffff::1", 24, 48, true},
		{"different /48", "2001:db8:1::1", "2001:db8:2::1", 24, 48, false},
		{"mapped IPv4 is IPv4", "::ffff:192.0.2.1", "192.0.2.9", 24, 48, true},
		{"families never coincide", "0.0.0.0", "::", 0, 0, false},
		{"out-of-range prefixes are clamped", "192.0.2.1", "192.0.2.1", 99, 999, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := key(tt.a, tt.v4, tt.v6) == key(tt.b, tt.v4, tt.v6); got != tt.same {
				t.Fatalf("same key = %v, want %v", got, tt.same)
			}
		})
	}
}

func TestNetworkKeyOfInvalidAddressIsEmpty(t *testing.T) {
	k := NetworkKey(netip.Addr{}, 24, 48)
	if k.Bytes() != nil || k.Prefix(24, 48).IsValid() {
		t.Fatal("an invalid address must give the empty key")
	}
}

func TestNetworkKeyPrefixRoundTrips(t *testing.T) {
	k := NetworkKey(netip.MustParseAddr("::ffff:198.51.100.77"), 24, 48)
	if got := k.Prefix(24, 48).String(); got != "198.51.100.0/24" {
		t.Fatalf("prefix %s", got)
	}
}

func TestNetworkKeyAllocatesNothing(t *testing.T) {
	a := netip.MustParseAddr("2001:db8::1")
	var h uint64
	if n := testing.AllocsPerRun(1000, func() {
		k := NetworkKey(a, 24, 48)
		h += Hash(k.Bytes())
	}); n != 0 {
		t.Fatalf("%v allocations per key", n)
	}
}

func TestHashStringIsHashOfBytes(t *testing.T) {
	for _, s := range []string{"", "k", "a key longer than thirty-two bytes, which would allocate"} {
		if HashString(s) != Hash([]byte(s)) {
			t.Fatalf("HashString(%q) differs from Hash", s)
		}
	}
}
