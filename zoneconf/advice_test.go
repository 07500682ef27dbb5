package zoneconf

import "testing"

func TestNearestIsATypoOrNothing(t *testing.T) {
	known := []string{"key", "match", "weight", "quota", "action", "events", "window", "burst", "ipv4_prefix", "ipv6_prefix", "memory", "sources", "false_deny", "xdp"}
	for _, tt := range []struct{ word, want string }{
		{"evnets", "events"},  // neighbours swapped
		{"Events", "events"},  // case
		{"event", "events"},   // one letter missing
		{"windows", "window"}, // one too many
		{"brust", "burst"},    // swapped
		{"ipv4prefix", "ipv4_prefix"},
		{"ipv5_prefix", ""}, // as near to ipv4_prefix as to ipv6_prefix
		{"kye", "key"},
		{"kb", ""}, // two edits from key: too many for a short word
		{"max_burst", ""},
		{"sweep_interval", ""},
	} {
		if got := Nearest(tt.word, known); got != tt.want {
			t.Errorf("Nearest(%q) = %q, want %q", tt.word, got, tt.want)
		}
	}
}
