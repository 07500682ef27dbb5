package floodgate

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/layer4"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// provisionedApp is a rate_limit app of one config with the given global
// zones, cleaned up when the test ends, and its log.
func provisionedApp(t *testing.T, zones map[string]*Zone) (*App, *observer.ObservedLogs) {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	a := &App{Zones: zones}
	if err := a.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Cleanup() })
	core, logs := observer.New(zap.InfoLevel)
	a.logger = zap.New(core)
	return a, logs
}

func inlineLimit(name string) layer4.Inline {
	v4, v6 := 24, 48
	return layer4.Inline{Name: name, Limit: zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour), IPv4Prefix: &v4, IPv6Prefix: &v6}}
}

// tableRefs returns how many configs hold the table of the inline limit in,
// 0 if none does.
func tableRefs(t *testing.T, in layer4.Inline) int {
	t.Helper()
	zc := &Zone{Limit: in.Limit}
	n, _ := tables.References(tableKey{zone: in.Name, lines: zc.Lines(), k: limiter.DefaultK})
	return n
}

// An inline limit's table is held once per config that has it, and given
// back by the matcher that created it in that config, once: never kept
// after the last config, never given back by a matcher that only shares it
// (which would free it under the config still running).
func TestLayer4InlineTableIsReleasedByItsOwnerOnly(t *testing.T) {
	in := inlineLimit("l4release")
	running, _ := provisionedApp(t, nil)
	_, releaseRunning, err := running.Layer4Inline(in)
	if err != nil {
		t.Fatal(err)
	}
	// The next config has two matchers with the same limit.
	next, _ := provisionedApp(t, nil)
	_, releaseFirst, err := next.Layer4Inline(in)
	if err != nil {
		t.Fatal(err)
	}
	_, releaseSecond, err := next.Layer4Inline(in)
	if err != nil {
		t.Fatal(err)
	}
	if n := tableRefs(t, in); n != 2 {
		t.Fatalf("two configs hold the table %d times, want 2", n)
	}
	// The next config fails and is cleaned up: the running one keeps it.
	releaseFirst()
	releaseSecond()
	if n := tableRefs(t, in); n != 1 {
		t.Fatalf("after the next config's matchers gave it back, the table is held %d times, want 1 (the running config's)", n)
	}
	releaseRunning()
	if n := tableRefs(t, in); n != 0 {
		t.Fatalf("after every config gave it back, the table is held %d times, want 0", n)
	}
}

// A zone with action delay cannot serve a layer4 matcher: the config fails
// to load, saying why, rather than connections being closed by a zone that
// says it delays.
func TestLayer4RefusesADelayZone(t *testing.T) {
	a, _ := provisionedApp(t, map[string]*Zone{"held": {
		Limit:  zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour)},
		Action: "delay", MaxDelay: caddy.Duration(time.Second),
	}})
	_, err := a.Layer4Zone("held")
	if err == nil || !strings.Contains(err.Error(), `zone "held" has action delay`) || !strings.Contains(err.Error(), "deny or log") {
		t.Fatalf("error %v, want one naming the zone, its action and what to use", err)
	}
}

// A zone that charges responses' statuses or time cannot serve a layer4
// matcher: a connection has neither, so it would be charged in a unit the
// zone does not count in.
func TestLayer4RefusesAZoneChargedByItsResponses(t *testing.T) {
	for name, edit := range map[string]func(*Zone){
		"by_status": func(z *Zone) { z.WeightResponseStatus = []string{"401"} },
		"by_time":   func(z *Zone) { z.WeightResponseTime = true },
	} {
		zc := &Zone{Limit: zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour)}}
		edit(zc)
		a, _ := provisionedApp(t, map[string]*Zone{name: zc})
		_, err := a.Layer4Zone(name)
		if err == nil || !strings.Contains(err.Error(), `zone "`+name+`" charges only what an HTTP response says`) {
			t.Errorf("error %v, want one naming the zone and why", err)
		}
	}
}

// A zone with max_concurrent serves a layer4 matcher, alone or beside a
// rate, global or inline: the matcher gets the zone's own table of places
// (the one its HTTP requests and the admin API count in) and counts its
// denials for want of a place where the zone's metrics read them.
func TestLayer4ZoneCarriesItsPlaces(t *testing.T) {
	a, _ := provisionedApp(t, map[string]*Zone{
		"alone":  {Limit: zoneconf.Limit{MaxConcurrent: 3, Memory: 1 << 12}},
		"beside": {Limit: zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour), MaxConcurrent: 3, Memory: 1 << 12}},
	})
	for _, name := range []string{"alone", "beside"} {
		lz, err := a.Layer4Zone(name)
		if err != nil {
			t.Fatalf("zone %s: %v", name, err)
		}
		z := a.global[name]
		if lz.Places == nil || lz.Places != z.conc || lz.PlaceDenied == nil {
			t.Fatalf("zone %s: the matcher got places %p, want the zone's %p", name, lz.Places, z.conc)
		}
		lz.PlaceDenied()
		if n := z.counts.concDenied.Load(); n != 1 {
			t.Fatalf("zone %s: %d denials for want of a place counted, want 1", name, n)
		}
	}
	lz, release, err := a.Layer4Inline(layer4.Inline{Name: "l4_conc", Limit: zoneconf.Limit{MaxConcurrent: 2, Memory: 1 << 12}})
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if lz.Places == nil || lz.Places.Max() != 2 {
		t.Fatalf("inline: places %v, want a table of max 2", lz.Places)
	}
}

// A zone with action log is a dry run for connections too.
func TestLayer4DryRunZone(t *testing.T) {
	a, _ := provisionedApp(t, map[string]*Zone{
		"dry":  {Limit: zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour)}, Action: "log"},
		"wet":  {Limit: zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour)}},
		"deny": {Limit: zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour)}, Action: "deny"},
	})
	for name, want := range map[string]bool{"dry": true, "wet": false, "deny": false} {
		z, err := a.Layer4Zone(name)
		if err != nil {
			t.Fatal(err)
		}
		if z.DryRun != want {
			t.Errorf("zone %q: DryRun %v, want %v", name, z.DryRun, want)
		}
	}
}

// An inline layer4 limit has no HTTP handler: it gets no HTTP key, says
// nothing about one at load, and the admin API lists no key. A global zone
// without a key that a matcher uses is keyed by {client_ip}, and says so.
func TestOnlyGlobalZonesSharedWithLayer4GetAnHTTPKey(t *testing.T) {
	a, logs := provisionedApp(t, map[string]*Zone{"shared": {Limit: zoneconf.Limit{MaxEvents: 3, Burst: 3, Window: caddy.Duration(time.Hour)}}})
	if _, release, err := a.Layer4Inline(inlineLimit("l4nokey")); err != nil {
		t.Fatal(err)
	} else {
		t.Cleanup(release)
	}
	if _, err := a.Layer4Zone("shared"); err != nil {
		t.Fatal(err)
	}
	inline, global := a.inline["l4nokey"], a.global["shared"]
	if len(inline.keys) != 0 || len(inline.info(time.Now()).Key) != 0 {
		t.Errorf("inline layer4 limit: keys %v, admin key %q; want none", inline.keys, inline.info(time.Now()).Key)
	}
	if got := global.info(time.Now()).Key; len(global.keys) != 1 || len(got) != 1 || got[0] != "{client_ip}" {
		t.Errorf("shared global zone: keys %v, admin key %q; want {client_ip}", global.keys, got)
	}
	if msgs := logs.FilterMessageSnippet("has no key").All(); len(msgs) != 1 || !strings.Contains(msgs[0].Message, `zone "shared"`) {
		t.Errorf("load log about keys: %v, want one line, for zone \"shared\"", msgs)
	}
}
