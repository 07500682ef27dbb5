package zoneconf

import (
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/floodgate-rl/floodgate/limiter"
)

// parse reads every subdirective of a block into a Limit.
func parse(t *testing.T, block string) (Limit, error) {
	t.Helper()
	d := caddyfile.NewTestDispenser("z {\n" + block + "\n}")
	var l Limit
	d.Next()
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		ok, err := l.UnmarshalOption(d, "zone \"z\": ")
		if err != nil {
			return l, err
		}
		if !ok {
			return l, d.Errf("not ours: %s", d.Val())
		}
	}
	return l, nil
}

func TestUnmarshalOptionReadsEverySetting(t *testing.T) {
	l, err := parse(t, "events 5\nwindow 10s\nburst 7\nipv4_prefix 24\nipv6_prefix 56\nsources 1000\nfalse_deny 0.01")
	if err != nil {
		t.Fatal(err)
	}
	v4, v6 := l.Prefixes(32, 64)
	if l.Rate() != (limiter.Limit{Events: 5, Window: 10 * time.Second, Burst: 7}) || v4 != 24 || v6 != 56 ||
		l.Sources != 1000 || l.FalseDeny != 0.01 {
		t.Fatalf("parsed %+v (prefixes %d, %d)", l, v4, v6)
	}
	if err := l.Validate(""); err != nil {
		t.Fatal(err)
	}
	m, err := parse(t, "events 1\nwindow 1m\nmemory 1MiB")
	if err != nil || m.Memory != 1<<20 || m.Lines() != 1<<14 {
		t.Fatalf("memory 1MiB: %+v, %v", m, err)
	}
}

func TestUnmarshalOptionLeavesOtherSubdirectives(t *testing.T) {
	if _, err := parse(t, "key {remote_host}"); err == nil || !strings.Contains(err.Error(), "not ours: key") {
		t.Fatalf("a subdirective that is not a limit setting: %v", err)
	}
}

func TestBadSettingsNameFieldAndValue(t *testing.T) {
	for _, tc := range []struct{ block, want string }{
		{"events 0", `zone "z": events "0": must be a whole number of at least 1`},
		{"events many", `events "many"`},
		{"burst -1", `burst "-1"`},
		{"window soon", `window "soon": not a duration`},
		{"window -1s", `window "-1s": must not be negative`},
		{"ipv4_prefix wide", `ipv4_prefix "wide"`},
		{"memory lots", `memory "lots"`},
		{"sources 0", `sources "0"`},
		{"false_deny 1", `false_deny "1"`},
		{"events", "wrong argument count"},
		{"events 1 2", "wrong argument count"},
	} {
		if _, err := parse(t, tc.block); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one containing %q", tc.block, err, tc.want)
		}
	}
}

func TestValidate(t *testing.T) {
	hour := caddy.Duration(time.Hour)
	p := func(n int) *int { return &n }
	for _, tc := range []struct {
		l    Limit
		want string // "" for valid
	}{
		{Limit{MaxEvents: 1, Window: hour}, ""},
		{Limit{MaxEvents: 1, Window: hour, Memory: 64}, ""},
		{Limit{}, `where: max_events 0: must be at least 1`},
		{Limit{MaxEvents: 1}, "window 0s: must be positive"},
		{Limit{MaxEvents: 1, Window: hour, Burst: -1}, "burst -1"},
		{Limit{MaxEvents: 1, Window: hour, Burst: limiter.MaxBurst + 1}, "burst"},
		{Limit{MaxEvents: 10_000_000, Window: caddy.Duration(time.Second), Burst: 1}, "maximum rate"},
		{Limit{MaxEvents: 1, Window: hour, IPv4Prefix: p(33)}, "ipv4_prefix 33"},
		{Limit{MaxEvents: 1, Window: hour, IPv6Prefix: p(-1)}, "ipv6_prefix -1"},
		{Limit{MaxEvents: 1, Window: hour, Memory: 1 << 20, Sources: 5}, "not both"},
		{Limit{MaxEvents: 1, Window: hour, Memory: 63}, "memory 63"},
		{Limit{MaxEvents: 1, Window: hour, Sources: -1}, "sources -1"},
		{Limit{MaxEvents: 1, Window: hour, FalseDeny: 1.5}, "false_deny 1.5"},
		{Limit{MaxEvents: 1, Window: hour, Sources: 1 << 40, FalseDeny: 1e-9}, "maximum table size"},
	} {
		err := tc.l.Validate("where: ")
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%+v: unexpected error %v", tc.l, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%+v: error %v, want one containing %q", tc.l, err, tc.want)
		}
	}
}

func TestIsZero(t *testing.T) {
	if !(&Limit{}).IsZero() {
		t.Fatal("the zero Limit is not zero")
	}
	p := 24
	for _, l := range []Limit{{MaxEvents: 1}, {Window: 1}, {Burst: 1}, {IPv4Prefix: &p}, {IPv6Prefix: &p}, {Memory: 64}, {Sources: 1}, {FalseDeny: 0.1}} {
		if l.IsZero() {
			t.Errorf("%+v reads as zero", l)
		}
	}
}
