package floodgate

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

func TestSourceShowsNetworksAndKeysOnlyWithLogKey(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"src": {Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour), IPv4Prefix: ptr(24), IPv6Prefix: ptr(48)}}})
	z := h.zones[0]
	long := strings.Repeat("k", maxSourceText+10)
	for _, c := range []struct {
		key    string
		logKey bool
		want   string
	}{
		{"192.0.2.77", false, "192.0.2.0/24"},
		{"::ffff:192.0.2.77", false, "192.0.2.0/24"},
		{"2001:db8:1:2::9", false, "2001:db8:1::/48"},
		{"fe80::1%eth0", false, "fe80::/48"},
		{"", false, "(empty key)"},
		{"secret-token", true, "secret-token"},
		{long, true, long[:maxSourceText] + "…"},
	} {
		s, h := shownSource(z, c.key, c.logKey)
		if got := s.format(h); got != c.want {
			t.Errorf("source(%q, log_key %v) = %q, want %q", c.key, c.logKey, got, c.want)
		}
	}
	s, hs := shownSource(z, "secret-token", false)
	if got := s.format(hs); !strings.HasPrefix(got, "key#") || len(got) != 12 || strings.Contains(got, "secret") {
		t.Errorf("a key without log_key shows as %q, want key# and 8 hex digits", got)
	}
	// A whole-address network shows as the address.
	h32 := newTestHandler(t, nil, map[string]*Zone{"src32": {Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour)}}})
	s, _ = shownSource(h32.zones[0], "192.0.2.77", false)
	if got := s.format(0); got != "192.0.2.77" {
		t.Errorf("a /32 source shows as %q", got)
	}
}

// shownSource is what the top sketch shows for a request whose key expanded
// to key, and the hash it is charged under.
func shownSource(z *zone, key string, logKey bool) (source, uint64) {
	c := z.chargeOf(key)
	shown := ""
	if logKey {
		shown = shownKey(key)
	}
	return topSource(c, shown, z.v4, z.v6), c.hash
}

func ptr[T any](v T) *T { return &v }

func TestCountsKeepWeightBeyondOnePerRequest(t *testing.T) {
	var c zoneCounts
	c.count(outcomeDenied, 1)
	c.count(outcomeDenied, 5)
	if r, w := c.requests[outcomeDenied].Load(), c.weight(outcomeDenied); r != 2 || w != 6 {
		t.Errorf("requests %d weight %d, want 2 and 6", r, w)
	}
}

func TestLayer4ZonesCountConnections(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"l4count": {Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour)}}})
	z := h.zones[0]
	if z.info(time.Now()).Connections != nil {
		t.Fatal("connections shown before a layer4 matcher uses the zone")
	}
	l4 := z.layer4()
	l4.Count(false)
	l4.Count(true)
	l4.Count(true)
	if got := z.info(time.Now()).Connections; got == nil || *got != (Connections{Allowed: 1, Denied: 2}) {
		t.Errorf("connections: %+v, want 1 allowed and 2 denied", got)
	}
}

func TestTableStatsAreMeasuredAtMostOncePerInterval(t *testing.T) {
	clock := &fakeClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	h := newTestHandler(t, clock, map[string]*Zone{"statsonce": {Key: "{http.request.header.X-Key}", Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour), Memory: 64 << 10}}})
	z := h.zones[0]
	drain := func(key string) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Key", key)
		_, _ = serve(h, r)
	}
	if s := z.counts.tableStats(z.buckets, clock.now()); s.Busy != 0 {
		t.Fatalf("an unused table is busy: %v", s.Busy)
	}
	drain("a")
	clock.advance(statsEvery - time.Nanosecond)
	if s := z.counts.tableStats(z.buckets, clock.now()); s.Busy != 0 {
		t.Errorf("measured again within %v: busy %v", statsEvery, s.Busy)
	}
	clock.advance(time.Nanosecond)
	if s := z.counts.tableStats(z.buckets, clock.now()); s.Busy == 0 {
		t.Errorf("not measured again after %v", statsEvery)
	}
}
