package incumbent

import (
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/floodgate-rl/floodgate/caddytest/incumbent/internal/caddytest"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// TestApplyNetworkPrefix is caddy-ratelimit's table of the same name
// (handler_test.go on main at 5625512), ported black-box: its test calls
// the unexported applyNetworkPrefix(key, ipv4Prefix, ipv6Prefix) and
// compares the key it returns; here each row is a zone keyed by a header
// holding the row's key, with the row's prefixes written out in the
// Caddyfile, zeros included (caddy-ratelimit writes 0 for "not set": no
// grouping). What the incumbent's key names is then what shares a bucket:
// after the row's key spends the zone's one event, another value of the
// expected network is denied and a value outside it passes; a key that
// passes through unchanged shares its bucket with nothing else.
func TestApplyNetworkPrefix(t *testing.T) {
	tests := []struct {
		name       string
		key        string
		ipv4Prefix int
		ipv6Prefix int
		expected   string
	}{
		// IPv6 with /64 prefix - different addresses in the same /64 produce the same key
		{"ipv6 /64 full addr", "2001:db8:1234:5678:9abc:def0:1234:5678", 0, 64, "2001:db8:1234:5678::/64"},
		{"ipv6 /64 all ones host", "2001:db8:1234:5678:ffff:ffff:ffff:ffff", 0, 64, "2001:db8:1234:5678::/64"},
		{"ipv6 /64 short addr", "2001:db8:1234:5678::1", 0, 64, "2001:db8:1234:5678::/64"},

		// IPv6 with other prefix lengths
		{"ipv6 /48", "2001:db8:1234:5678::1", 0, 48, "2001:db8:1234::/48"},
		{"ipv6 /128", "2001:db8:1234:5678::1", 0, 128, "2001:db8:1234:5678::1/128"},

		// IPv4 with prefix configured
		{"ipv4 /24", "192.168.1.100", 24, 0, "192.168.1.0/24"},
		{"ipv4 /8", "10.0.0.50", 8, 0, "10.0.0.0/8"},
		{"ipv4 /32", "172.16.5.4", 32, 0, "172.16.5.4/32"},

		// Both prefixes configured - each applies to its own address family
		{"ipv6 with both configured", "2001:db8::1", 24, 64, "2001:db8::/64"},
		{"ipv4 with both configured", "192.168.1.100", 24, 64, "192.168.1.0/24"},

		// Only IPv6 prefix configured - IPv4 addresses pass through unchanged
		{"ipv4 unchanged when only ipv6 configured", "192.168.1.100", 0, 64, "192.168.1.100"},

		// Only IPv4 prefix configured - IPv6 addresses pass through unchanged
		{"ipv6 unchanged when only ipv4 configured", "2001:db8::1", 24, 0, "2001:db8::1"},

		// No prefixes configured - everything passes through unchanged
		{"ipv6 no prefix", "2001:db8::1", 0, 0, "2001:db8::1"},
		{"ipv4 no prefix", "192.168.1.100", 0, 0, "192.168.1.100"},

		// Non-IP keys always pass through unchanged
		{"static key", "static", 0, 64, "static"},
		{"placeholder key", "{http.request.uri}", 0, 64, "{http.request.uri}"},
		{"empty key", "", 0, 64, ""},
	}

	// One zone per row, chosen by the X-Row header, so that one config
	// serves the whole table.
	var zones strings.Builder
	for i, tt := range tests {
		fmt.Fprintf(&zones, `
		zone prefix_row%d {
			match header X-Row %d
			key {header.X-Key}
			events 1
			window 1h
			ipv4_prefix %d
			ipv6_prefix %d
		}`, i, i, tt.ipv4Prefix, tt.ipv6Prefix)
	}
	load(t, "", "rate_limit {"+zones.String()+"\n\t}\n\trespond \"ok\"")
	// The config metric says what is in force: 0 is no grouping.
	metrics := testcaddy.Metrics(t, caddytest.AdminPort)
	for i, tt := range tests {
		v4, v6 := tt.ipv4Prefix, tt.ipv6Prefix
		if v4 == 0 {
			v4 = 32
		}
		if v6 == 0 {
			v6 = 128
		}
		if want := fmt.Sprintf(`ipv4_prefix="%d",ipv6_prefix="%d",max_events="1",window="1h0m0s",zone="prefix_row%d"} 1`, v4, v6, i); !strings.Contains(metrics, want) {
			t.Errorf("row %q: no series caddy_rate_limit_config{…%s", tt.name, want)
		}
	}

	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			send := func(key string) int {
				headers := []string{fmt.Sprintf("X-Row: %d", i)}
				if key != "" {
					headers = append(headers, "X-Key: "+key)
				}
				code, _, _ := testcaddy.Do(t, http.DefaultClient, testcaddy.Request(t, http.MethodGet, site("/"), headers...))
				return code
			}
			if code := send(tt.key); code != 200 {
				t.Fatalf("%q first: %d, want 200", tt.key, code)
			}
			if code := send(tt.key); code != 429 {
				t.Errorf("%q again: %d, want 429: its one event is spent", tt.key, code)
			}
			inside, outside := neighbours(t, tt.expected)
			if inside != "" {
				if code := send(inside); code != 429 {
					t.Errorf("%q, in %s: %d, want 429 (the same bucket as %q)", inside, tt.expected, code, tt.key)
				}
			}
			if code := send(outside); code != 200 {
				t.Errorf("%q, outside %s: %d, want 200 (a bucket of its own)", outside, tt.expected, code)
			}
		})
	}
}

// neighbours returns, for what caddy-ratelimit keys a request by, a key of
// another request it puts in the same bucket ("" if none: an address or
// text that passes through unchanged) and one it puts in another.
func neighbours(t *testing.T, expected string) (inside, outside string) {
	t.Helper()
	if p, err := netip.ParsePrefix(expected); err == nil {
		last := lastOf(p)
		if last != p.Addr() {
			inside = last.String()
		}
		next := last.Next()
		if !next.IsValid() {
			t.Fatalf("no network after %s", p)
		}
		return inside, next.String()
	}
	if a, err := netip.ParseAddr(expected); err == nil {
		return "", a.Next().String()
	}
	return "", expected + "-other"
}

// lastOf returns the last address of p.
func lastOf(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().AsSlice()
	for i := range b {
		if bit := p.Bits() - 8*i; bit < 8 {
			b[i] |= byte(0xff >> max(bit, 0))
		}
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}
