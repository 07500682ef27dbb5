package zoneconf

import (
	"strings"
	"testing"
)

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

// TestExtraArgsAdviceFitsTheField: a unit is advised only where the field
// takes one of its kind, and digit groups are joined.
func TestExtraArgsAdviceFitsTheField(t *testing.T) {
	for _, tt := range []struct {
		field, v string
		rest     []string
		want     string
	}{
		{"window", "1", []string{"minute"}, "a duration is one word; write window 1m"},
		{"memory", "16", []string{"MiB"}, "a size is one word; write memory 16MiB"},
		{"sources", "100", []string{"000"}, "a number is one word, without spaces; write sources 100000"},
		{"burst", "5", []string{"s"}, "comments start with #, e.g. burst 5 # s"},
		{"events", "100", []string{"h"}, "comments start with #"},
		{"events", "10", []string{"(means", "5", "attempts)"}, "comments start with #, e.g. events 10 # (means 5 attempts)"},
	} {
		if got := extraArgs(tt.field, tt.v, tt.rest); !strings.Contains(got, tt.want) {
			t.Errorf("%s %s %v: %q, want it to contain %q", tt.field, tt.v, tt.rest, got, tt.want)
		}
	}
}
