package floodgate

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/layer4"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

func TestTopSourcesAreNamedAsTheDenialLogNamesThem(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"src": {Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour), IPv4Prefix: ptr(24), IPv6Prefix: ptr(48)}}})
	z := h.zones[0]
	long := strings.Repeat("k", maxShownKey+10)
	for _, c := range []struct {
		key    string
		logKey bool
		want   string
	}{
		{"192.0.2.77", false, "192.0.2.0/24"},
		{"::ffff:192.0.2.77", false, "192.0.2.0/24"},
		{"2001:db8:1:2::9", false, "2001:db8:1::/48"},
		{"fe80::1%eth0", false, "fe80::/48"},
		{"", false, "none"},
		{"secret-token", true, "secret-token"},
		{"secret-token", false, fmt.Sprintf("key:%016x", limiter.HashString("secret-token"))},
		{long, true, long[:maxShownKey-len("…")] + "…"},
	} {
		ch := z.chargeOf(c.key)
		shown := ""
		if c.logKey {
			shown = shownKey(c.key)
		}
		s := topSource(ch, shown)
		if got := z.show(&s); got != c.want {
			t.Errorf("source of %q (log_key %v) = %q, want %q", c.key, c.logKey, got, c.want)
		}
		if !c.logKey && z.show(&s) != z.source(ch) {
			t.Errorf("source of %q: /top says %q, the denial log %q", c.key, z.show(&s), z.source(ch))
		}
	}
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
	l4.Count(layer4.Allowed)
	l4.Count(layer4.Denied)
	l4.Count(layer4.Denied)
	l4.Count(layer4.Logged)
	l4.Count(layer4.Logged)
	l4.Count(layer4.Logged)
	if got := z.info(time.Now()).Connections; got == nil || *got != (Connections{Allowed: 1, Denied: 2, Logged: 3}) {
		t.Errorf("connections: %+v, want 1 allowed, 2 denied and 3 logged", got)
	}
}

func TestTableStatsAreMeasuredAtMostOncePerInterval(t *testing.T) {
	clock := testclock.New(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	h := newTestHandler(t, clock, map[string]*Zone{"statsonce": {Key: "{http.request.header.X-Key}", Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour), Memory: 64 << 10}}})
	z := h.zones[0]
	drain := func(key string) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Key", key)
		_, _ = serve(h, r)
	}
	if s := z.counts.tableStats(z.buckets, clock.Now()); s.Busy != 0 {
		t.Fatalf("an unused table is busy: %v", s.Busy)
	}
	drain("a")
	clock.Advance(statsEvery - time.Nanosecond)
	if s := z.counts.tableStats(z.buckets, clock.Now()); s.Busy != 0 {
		t.Errorf("measured again within %v: busy %v", statsEvery, s.Busy)
	}
	clock.Advance(time.Nanosecond)
	if s := z.counts.tableStats(z.buckets, clock.Now()); s.Busy == 0 {
		t.Errorf("not measured again after %v", statsEvery)
	}
}

// TestKeysNameASourceOrFail: the admin API takes a key as a request carries
// it or a source as /top prints it, and refuses what names no source of the
// zone rather than answer for a bucket no request uses.
func TestKeysNameASourceOrFail(t *testing.T) {
	limit := zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour), IPv4Prefix: ptr(24), IPv6Prefix: ptr(48)}
	h := newTestHandler(t, nil, map[string]*Zone{
		"by_ip":   {Key: "{client_ip}", Limit: limit},
		"by_user": {Key: "{http.request.header.X-User}", Limit: limit},
		"keyless": {Limit: limit},
	})
	zones := map[string]*zone{}
	for _, z := range h.zones {
		zones[z.name] = z
	}
	user := zones["by_user"].chargeOf("alice")
	for _, c := range []struct {
		zone, key, source, err string
	}{
		{"by_ip", "192.0.2.77", "192.0.2.0/24", ""},
		{"by_ip", "192.0.2.0/24", "192.0.2.0/24", ""},
		{"by_ip", "2001:db8:1::/48", "2001:db8:1::/48", ""},
		{"by_ip", "none", "none", ""},
		{"by_ip", "192.0.0.0/16", "", `192.0.0.0/16 is not a source of zone "by_ip": its sources are /24 networks for IPv4 and /48 for IPv6`},
		{"by_ip", "not-an-ip", "", `key "not-an-ip" is not an IP address or network: zone "by_ip" is keyed by the client's address`},
		{"by_user", "alice", zones["by_user"].source(user), ""},
		{"by_user", zones["by_user"].source(user), zones["by_user"].source(user), ""},
		{"keyless", "none", "none", ""},
		{"keyless", "alice", "", `zone "keyless" has no key`},
	} {
		z := zones[c.zone]
		ch, err := z.sourceCharge(c.key)
		switch {
		case c.err != "":
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%s %q: %v, want an error with %q", c.zone, c.key, err, c.err)
			}
		case err != nil || z.source(ch) != c.source:
			t.Errorf("%s %q: %q %v, want %q", c.zone, c.key, z.source(ch), err, c.source)
		}
	}
	if ch, _ := zones["by_user"].sourceCharge(zones["by_user"].source(user)); ch.hash != user.hash {
		t.Errorf("key:<hash> names hash %x, want alice's %x", ch.hash, user.hash)
	}
}
