package floodgate

import (
	"bytes"
	"strings"
	"testing"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// TestPrintZonesShowsXDP: `caddy rate-limit zones` prints a zone's XDP
// program and its SYN counts, and nothing about XDP for a zone without one.
func TestPrintZonesShowsXDP(t *testing.T) {
	var out bytes.Buffer
	printZones(&out, []ZoneInfo{
		{Name: "syn", XDP: &XDPInfo{Interface: "eth0", Mode: "native", Passed: 91, Dropped: 150}},
		{Name: "plain"},
	})
	if want := "zone syn: XDP on eth0 (native mode): 91 SYNs passed, 150 dropped\n"; !strings.Contains(out.String(), want) {
		t.Fatalf("output lacks %q:\n%s", want, out.String())
	}
	if strings.Count(out.String(), "XDP") != 1 {
		t.Fatalf("XDP printed for a zone without it:\n%s", out.String())
	}
}

// TestXDPSettingIsPartOfTheTable: a zone keeps its table across a reload
// only while its xdp setting, limit and prefixes stay the same, since a
// table shared with the program cannot change its limit in place.
func TestXDPSettingIsPartOfTheTable(t *testing.T) {
	key := func(x *zoneconf.XDP, events int64, v4 int) string {
		z := &zone{v4: v4, v6: 48}
		z.limit.Events, z.limit.Window = events, 1e9
		return z.xdpSpec(&Zone{Limit: zoneconf.Limit{XDP: x}}).key()
	}
	eth0 := &zoneconf.XDP{Interface: "eth0", Ports: []uint16{443}}
	if key(nil, 3, 24) != "" {
		t.Fatal("a zone without xdp has an xdp table key")
	}
	base := key(eth0, 3, 24)
	for name, other := range map[string]string{
		"limit":     key(eth0, 4, 24),
		"prefix":    key(eth0, 3, 16),
		"interface": key(&zoneconf.XDP{Interface: "eth1", Ports: []uint16{443}}, 3, 24),
		"ports":     key(&zoneconf.XDP{Interface: "eth0"}, 3, 24),
	} {
		if other == base {
			t.Errorf("a changed %s keeps the table key %q", name, base)
		}
	}
	if key(&zoneconf.XDP{Interface: "eth0", Ports: []uint16{443}}, 3, 24) != base {
		t.Error("the same setting gives another table key")
	}
}
