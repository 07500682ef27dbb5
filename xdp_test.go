package floodgate

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// TestPrintZonesShowsXDP: `caddy rate-limit zones` prints a zone's XDP
// program and its SYN and QUIC Initial counts, and nothing about XDP for a zone without one.
func TestPrintZonesShowsXDP(t *testing.T) {
	var out bytes.Buffer
	printZones(&out, []ZoneInfo{
		{Name: "syn", XDP: &XDPInfo{Interface: "eth0", Mode: "native", Passed: 91, Dropped: 150, InitialsPassed: 7, InitialsDropped: 20}},
		{Name: "plain"},
	})
	if want := "zone syn: XDP on eth0 (native mode): 91 SYNs passed, 150 dropped; 7 QUIC Initials passed, 20 dropped\n"; !strings.Contains(out.String(), want) {
		t.Fatalf("output lacks %q:\n%s", want, out.String())
	}
	if strings.Count(out.String(), "XDP") != 1 {
		t.Fatalf("XDP printed for a zone without it:\n%s", out.String())
	}
}

// TestXDPSettingIsPartOfTheTable: a zone keeps its table across a reload
// only while its xdp setting and prefixes stay the same; a new limit keeps
// it (converted, as any table's).
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
		"prefix":     key(eth0, 3, 16),
		"interface":  key(&zoneconf.XDP{Interface: "eth1", Ports: []uint16{443}}, 3, 24),
		"ports":      key(&zoneconf.XDP{Interface: "eth0"}, 3, 24),
		"quic ports": key(&zoneconf.XDP{Interface: "eth0", Ports: []uint16{443}, QUICPorts: []uint16{443}}, 3, 24),
	} {
		if other == base {
			t.Errorf("a changed %s keeps the table key %q", name, base)
		}
	}
	if key(&zoneconf.XDP{Interface: "eth0", Ports: []uint16{443}}, 3, 24) != base {
		t.Error("the same setting gives another table key")
	}
	if key(eth0, 4, 24) != base {
		t.Error("a new limit gives another table key: the counters would restart")
	}
}

// XDP charges each connection a token, which a zone that counts only what
// its responses say (failed logins, milliseconds) does not count in: such a
// zone with xdp is refused at load, naming it, as a layer4 matcher refuses
// it. A reviewer's successful logins spent a failed-login budget through
// their SYNs, and the next client's SYN was dropped.
func TestXDPRefusesAZoneChargedByItsResponses(t *testing.T) {
	for name, edit := range map[string]func(*Zone){
		"by_status": func(z *Zone) { z.WeightResponseStatus = []string{"401"} },
		"by_time":   func(z *Zone) { z.WeightResponseTime = true },
	} {
		zc := &Zone{Key: "{client_ip}", Limit: zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour), XDP: &zoneconf.XDP{Interface: "lo"}}}
		edit(zc)
		err := zc.Validate(name)
		if err == nil || !strings.Contains(err.Error(), `zone "`+name+`"`) || !strings.Contains(err.Error(), "xdp") {
			t.Errorf("%s: %v, want an error naming the zone and xdp", name, err)
		}
	}
}
