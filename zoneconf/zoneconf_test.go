package zoneconf

import (
	"encoding/json"
	"fmt"
	"reflect"
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
	seen := make(Fields)
	d.Next()
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		ok, err := l.UnmarshalOption(d, "zone \"z\": ", seen)
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
		{"window -1s", `window "-1s": must be positive`},
		{"ipv4_prefix wide", `ipv4_prefix "wide"`},
		{"memory lots", `memory "lots"`},
		{"sources 0", `sources "0"`},
		{"false_deny 1", `false_deny "1"`},
		{"events", `zone "z": events needs a value`},
		{"events 1 2", `zone "z": events needs exactly one value, not "1 2": comments start with #`},
		{"window 0", `window "0": must be positive`},
		{"window 36500d", `window "36500d": must be at most 365d`},
		{"memory 100GiB", `memory "100GiB": must be between 64 B and 16 GiB`},
		{"memory 12", `memory "12": must be between 64 B`},
		{"burst 99999999999", `burst "99999999999": must be at most 1048576`},
		{"events 5\nevents 6", `zone "z": events is set twice (first at Testfile:2)`},
		{"window 1m\nburst 2\nwindow 2m", `window is set twice (first at Testfile:2)`},
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
		{Limit{}, `where: max_events is required`},
		{Limit{MaxEvents: -2, Window: hour}, `where: max_events -2: must be at least 1`},
		{Limit{MaxEvents: 1}, `where: window is required`},
		{Limit{MaxEvents: 1, Window: -hour}, "window -1h0m0s: must be positive"},
		{Limit{MaxEvents: 1, Window: hour, Burst: -1}, "burst -1"},
		{Limit{MaxEvents: 10_000_000, Window: caddy.Duration(time.Second), Burst: 1}, "10000000 events per 1s is 1e+07 per second, above the maximum of 1000000 per second"},
		{Limit{MaxEvents: 5, Window: caddy.Duration(time.Millisecond), Burst: 10000}, ""},
		{Limit{MaxEvents: 10_000, Window: caddy.Duration(time.Millisecond)}, "10000 events per 1ms is 1e+07 per second"},
		{Limit{MaxEvents: 1, Window: 3600}, `window 3.6µs: must be at least 1ms (a number in JSON is nanoseconds: write a duration such as "1h", or 3600000000000 for an hour)`},
		{Limit{MaxEvents: 1, Window: caddy.Duration(time.Millisecond - 1)}, "window 999.999µs: must be at least 1ms"},
		{Limit{MaxEvents: MaxPerSecond, Window: caddy.Duration(time.Second)}, ""},
		{Limit{MaxEvents: 5, Window: caddy.Duration(36500 * 24 * time.Hour)}, "window 876000h0m0s: must be at most 365d"},
		{Limit{MaxEvents: 1, Window: caddy.Duration(MaxWindow)}, ""},
		{Limit{MaxEvents: 1_500_000, Window: caddy.Duration(time.Minute), Burst: limiter.MaxBurst}, ""},
		{Limit{MaxEvents: 1_500_000, Window: caddy.Duration(time.Minute)}, "max_events 1500000: at most 1048576 in a window"},
		{Limit{MaxEvents: 99_999_999_999, Window: caddy.Duration(time.Second)}, "99999999999 events per 1s"},
		{Limit{MaxEvents: 1, Window: hour, Burst: limiter.MaxBurst + 1}, fmt.Sprintf("burst %d: must be at most %d", limiter.MaxBurst+1, limiter.MaxBurst)},
		{Limit{MaxEvents: 1, Window: hour, IPv4Prefix: p(33)}, "ipv4_prefix 33"},
		{Limit{MaxEvents: 1, Window: hour, IPv6Prefix: p(-1)}, "ipv6_prefix -1"},
		{Limit{MaxEvents: 1, Window: hour, Memory: 1 << 20, Sources: 5}, "not both"},
		{Limit{MaxEvents: 1, Window: hour, Memory: 63}, "memory 63: must be between 64 B and 16 GiB"},
		{Limit{MaxEvents: 1, Window: hour, Memory: 100 << 30}, "memory 107374182400: must be between 64 B and 16 GiB"},
		{Limit{MaxEvents: 1, Window: hour, FalseDeny: 1e-9}, "where: false_deny 0.000000001 and sources 100000 (the default) need a table larger than the maximum of 16 GiB"},
		{Limit{MaxEvents: 1, Window: hour, Sources: 1 << 40}, "where: sources 1099511627776 and false_deny 0.005 (the default) need a table larger"},
		{Limit{MaxEvents: 1, Window: hour, Sources: -1}, "sources -1"},
		{Limit{MaxEvents: 1, Window: hour, FalseDeny: 1.5}, "false_deny 1.5"},
		{Limit{MaxEvents: 1, Window: hour, Sources: 1 << 40, FalseDeny: 1e-9}, "sources 1099511627776 and false_deny 0.000000001 need a table larger"},
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

// TestWithoutBurstIsAWindow checks that a limit without burst is a window
// (caddy-ratelimit's meaning) of at most limiter.MaxBurst events, refused
// above with a message that says to set burst, and that burst makes it a
// token bucket of any rate.
func TestWithoutBurstIsAWindow(t *testing.T) {
	for _, tc := range []struct {
		events, burst int64
		windowed      bool
		err           string
	}{
		{100, 0, true, ""},
		{limiter.MaxBurst, 0, true, ""},
		{1_500_000, 0, true, "max_events 1500000: at most 1048576 in a window; for more, set burst"},
		{1_500_000, 10, false, ""},
	} {
		l := Limit{MaxEvents: tc.events, Window: caddy.Duration(time.Minute), Burst: tc.burst}
		if l.Windowed() != tc.windowed || l.Rate() != (limiter.Limit{Events: tc.events, Window: time.Minute, Burst: tc.burst}) {
			t.Errorf("events %d burst %d: windowed %v, rate %v", tc.events, tc.burst, l.Windowed(), l.Rate())
		}
		err := l.Validate("")
		if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("events %d burst %d: %v, want %q", tc.events, tc.burst, err, tc.err)
		}
		if err != nil {
			continue
		}
		table, err := newTable(&l)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := table.(*limiter.Windows); ok != tc.windowed {
			t.Errorf("events %d burst %d: table %T", tc.events, tc.burst, table)
		}
	}
}

// newTable makes l's table as the root package does: a limiter.Windows or a
// limiter.Buckets.
func newTable(l *Limit) (limiter.Table, error) {
	if l.Windowed() {
		return limiter.NewWindows(l.Buckets())
	}
	return limiter.NewBuckets(l.Buckets())
}

func TestRequireNamesTheMissingField(t *testing.T) {
	d := caddyfile.NewTestDispenser("z {\nevents 1\n}")
	seen := make(Fields)
	var l Limit
	d.Next()
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if _, err := l.UnmarshalOption(d, "", seen); err != nil {
			t.Fatal(err)
		}
	}
	if err := seen.Require(d, `zone "z": `, "events", "window"); err == nil || !strings.Contains(err.Error(), `zone "z": window is required`) {
		t.Fatalf("missing window: %v", err)
	}
}

// TestXDPSetting: `xdp <interface> [ports…] [quic <ports…>] [optional]` reads into Limit.XDP,
// and a missing interface or a bad port is an error naming it.
func TestXDPSetting(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want *XDP
		err  string
	}{
		{in: "xdp eth0", want: &XDP{Interface: "eth0"}},
		{in: "xdp eth0 443 8443", want: &XDP{Interface: "eth0", Ports: []uint16{443, 8443}}},
		{in: "xdp eth0 443 optional", want: &XDP{Interface: "eth0", Ports: []uint16{443}, Optional: true}},
		{in: "xdp", err: "xdp needs an interface"},
		{in: "xdp eth0 0", err: `xdp port "0"`},
		{in: "xdp eth0 65536", err: `xdp port "65536"`},
		{in: "xdp eth0 https", err: `xdp port "https"`},
		{in: "xdp eth0 443 quic 443", want: &XDP{Interface: "eth0", Ports: []uint16{443}, QUICPorts: []uint16{443}}},
		{in: "xdp eth0 quic 443 8443 optional", want: &XDP{Interface: "eth0", QUICPorts: []uint16{443, 8443}, Optional: true}},
		{in: "xdp eth0 443 quic", err: "quic needs the UDP ports"},
		{in: "xdp eth0 443 quic optional", err: "quic needs the UDP ports"},
		{in: "xdp eth0 quic 443 quic 8443", err: "quic is written twice"},
		{in: "xdp eth0 quic 0", err: `xdp port "0": must be a UDP port`},
		{in: "xdp eth0 quic 70000", err: `xdp port "70000": must be a UDP port`},
		{in: "xdp eth0 443 443", err: "TCP port 443 is listed twice"},
		{in: "xdp eth0 443 quic 443 443", err: "QUIC (UDP) port 443 is listed twice"},
	} {
		d := caddyfile.NewTestDispenser("zone {\n" + tc.in + "\n}")
		d.Next()
		var l Limit
		var err error
		for nesting := d.Nesting(); d.NextBlock(nesting); {
			var ok bool
			ok, err = l.UnmarshalOption(d, "test: ", make(Fields))
			if !ok {
				t.Fatalf("%q: not recognised", tc.in)
			}
			if err != nil { // the rest of the line is not read
				break
			}
		}
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want one containing %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(l.XDP, tc.want) {
			t.Errorf("%q: %+v, %v; want %+v", tc.in, l.XDP, err, tc.want)
			continue
		}
		if l.IsZero() {
			t.Errorf("%q: a Limit with xdp reads as zero", tc.in)
		}
		if got := l.XDP.String(); got != tc.in {
			t.Errorf("String() = %q, want %q", got, tc.in)
		}
	}
}

// TestXDPValidate: the JSON form gets the Caddyfile's checks at load: an
// interface, ports from 1 to 65535, none listed twice in a list (a port
// in both lists is two ports, TCP and UDP).
func TestXDPValidate(t *testing.T) {
	for _, tc := range []struct {
		x   XDP
		err string
	}{
		{XDP{Interface: "eth0", Ports: []uint16{443}}, ""},
		{XDP{Ports: []uint16{443}}, "xdp needs an interface"},
		{XDP{Interface: "eth0", Ports: []uint16{0}}, "xdp TCP port: 0 is no port"},
		{XDP{Interface: "eth0", QUICPorts: []uint16{443, 0}}, "xdp QUIC (UDP) port: 0 is no port"},
		{XDP{Interface: "eth0", Ports: []uint16{80, 443, 80}}, "xdp TCP port 80 is listed twice"},
		{XDP{Interface: "eth0", QUICPorts: []uint16{443, 443}}, "xdp QUIC (UDP) port 443 is listed twice"},
	} {
		l := Limit{MaxEvents: 5, Window: caddy.Duration(time.Second), Burst: 5, XDP: &tc.x}
		err := l.Validate("test: ")
		if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%+v: %v, want an error containing %q", tc.x, err, tc.err)
		}
	}
}

// The XDP program implements token buckets only: a zone without burst (a
// window) that asks for xdp fails at load, saying to write burst.
func TestXDPNeedsBurst(t *testing.T) {
	window := Limit{MaxEvents: 5, Window: caddy.Duration(time.Minute), XDP: &XDP{Interface: "eth0"}}
	if err := window.Validate("test: "); err == nil || !strings.Contains(err.Error(), "xdp eth0: needs burst") {
		t.Errorf("xdp on a window zone: %v, want an error saying it needs burst", err)
	}
	bucket := window
	bucket.Burst = 5
	if err := bucket.Validate("test: "); err != nil {
		t.Errorf("xdp on a token-bucket zone: %v", err)
	}
}

// TestZeroPrefixIsNoGrouping: caddy-ratelimit writes ipv4_prefix 0 and
// ipv6_prefix 0 (in its JSON templates too) for "not set", which there
// means no grouping; an unset prefix takes the default of where the zone is
// used.
func TestZeroPrefixIsNoGrouping(t *testing.T) {
	for _, tt := range []struct {
		json           string
		wantV4, wantV6 int
	}{
		{`{"ipv4_prefix": 0, "ipv6_prefix": 0}`, 32, 128},
		{`{"ipv4_prefix": 0}`, 32, 64},
		{`{"ipv6_prefix": 0}`, 24, 128},
		{`{}`, 24, 64},
		{`{"ipv4_prefix": 16, "ipv6_prefix": 56}`, 16, 56},
	} {
		var l Limit
		if err := json.Unmarshal([]byte(tt.json), &l); err != nil {
			t.Fatal(err)
		}
		if v4, v6 := l.Prefixes(24, 64); v4 != tt.wantV4 || v6 != tt.wantV6 {
			t.Errorf("%s with defaults /24 and /64: /%d and /%d, want /%d and /%d", tt.json, v4, v6, tt.wantV4, tt.wantV6)
		}
	}
}
