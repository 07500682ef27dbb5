package caddytest

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// TestLoadSaysWhatEachZoneMeansAndWarnsOfTraps: a config that operators
// wrote expecting something else is explained at load: one INFO line per
// zone in words, and a WARN for a global zone no site uses (the global
// option defines zones, it applies none), a zone without key (one bucket for
// everyone), a weight read from every request (a 400 without it) and a
// burst that makes a caddy-ratelimit config (it has sweep_interval) ten
// times stricter at once.
func TestLoadSaysWhatEachZoneMeansAndWarnsOfTraps(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	cfg := globals(testcaddy.JSONLog("", logFile, "level INFO")+`
	rate_limit {
		zone explain_everything {
			key {client_ip}
			events 100
			window 1m
		}
		zone explain_also_unused {
			key {client_ip}
			events 100
			window 1m
		}
		zone explain_shared {
			key {header.X-API-Key} {client_ip}
			events 10
			window 2s
			ipv4_prefix 24
			quota 3 24h
		}
	}`) + `
http://localhost:HTTP_PORT {
	rate_limit explain_shared
	rate_limit /login {
		zone explain_login {
			events 5
			window 10m
		}
	}
	rate_limit /costly {
		sweep_interval 1m
		zone explain_cost {
			key {client_ip}
			events 100
			window 1m
			weight {header.X-Cost}
		}
		zone explain_burst {
			key {client_ip}
			events 1000
			window 300s
			burst 100
		}
	}
	rate_limit /api {
		zone explain_failed {
			key {client_ip}
			events 5
			window 10m
			weight response_status 401 4xx
		}
		zone explain_time {
			key {client_ip}
			events 60000
			window 1m
			weight response_time
		}
	}
	respond "ok"
}
`
	if err := load(t, cfg, "caddyfile"); err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, e := range testcaddy.LogEntries(t, logFile, "", "logger", "level", "msg") {
		if l, ok := strings.CutPrefix(e, "rate_limit "); ok {
			lines = append(lines, l)
		}
	}
	for _, want := range []string{
		`info zone "explain_shared": at most 10 in any 2 seconds per X-Api-Key header or client address (networks of /24 for IPv4, /64 for IPv6); and at most 3 in any day`,
		`info zone "explain_login": at most 5 in any 10 minutes for all its requests together (no key)`,
		`info zone "explain_burst": 1000 per 5 minutes sustained, up to 100 at once per client address`,
		`info zone "explain_failed": at most 5 in any 10 minutes (responses with status 401, 4xx only) per client address`,
		`info zone "explain_time": at most 60000 in any minute (milliseconds of response time) per client address`,
		`warn the rate_limit global option defines zones "explain_also_unused", "explain_everything", which no site, route or layer4 matcher uses, so nothing is limited by it: the global option only defines zones; to apply one, write rate_limit explain_also_unused explain_everything in each site (or route) it limits`,
		`warn zone "explain_login": has no key, so every request it applies to shares one bucket, whoever sends it; to limit each client, add key {client_ip}`,
		`warn zone "explain_cost": its weight rule {http.request.header.X-Cost} prices every request, so a request without it (or with anything but a whole number of at least 1) is answered 400`,
		`warn zone "explain_burst": burst 100 makes events 1000 window 5m0s a token bucket: 100 at once, then one every 300ms; caddy-ratelimit has no burst and allows 1000 in any 5 minutes`,
	} {
		n := 0
		for _, l := range lines {
			if strings.HasPrefix(l, want) {
				n++
			}
		}
		if n != 1 {
			t.Errorf("logged %d times, want once: %s\nrate_limit's lines:\n%s", n, want, strings.Join(lines, "\n"))
		}
	}
	for _, l := range lines {
		if strings.Contains(l, `"explain_everything": `) || strings.Contains(l, `"explain_shared": has no key`) {
			t.Errorf("unexpected: %s", l)
		}
	}
}
