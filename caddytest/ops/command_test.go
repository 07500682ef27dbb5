package ops

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/floodgate-rl/floodgate"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// rateLimit runs `caddy rate-limit args...` as Caddy's command line would,
// against this package's admin endpoint unless args name another address
// or a config, and returns what it printed.
func rateLimit(t *testing.T, args ...string) (string, error) {
	t.Helper()
	return testcaddy.RateLimit(t, adminPort, args...)
}

func mustRateLimit(t *testing.T, args ...string) string {
	t.Helper()
	out, err := rateLimit(t, args...)
	if err != nil {
		t.Fatalf("caddy rate-limit %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

func cmdConfig(prefix string) string {
	return caddyfile(fmt.Sprintf(`rate_limit {
		zone %s {
			key {client_ip}
			events 3
			window 1h
			memory 1MiB
		}
	}`, prefix), fmt.Sprintf(`	rate_limit %s
	respond "ok"`, prefix))
}

func TestCommandZones(t *testing.T) {
	mustLoad(t, cmdConfig("cmd_zones"))
	if got := codes(t, "127.0.30.1", 4); got != "200 200 200 429" {
		t.Fatalf("requests: %s", got)
	}
	out := mustRateLimit(t, "zones")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !regexp.MustCompile(`^ZONE +LIMIT +KEY +ALLOWED +DENIED +LOGGED +DELAYED +MEMORY +OCCUPANCY +FALSE DENY$`).MatchString(lines[0]) ||
		!regexp.MustCompile(`^cmd_zones +3 in 1h0m0s +\{http\.vars\.client_ip\} +3 +1 +0 +0 +1\.0 MiB +0\.\d\d% +0\.\d{4}%$`).MatchString(lines[1]) {
		t.Errorf("zones table:\n%s", out)
	}
	var zs []floodgate.ZoneInfo
	if err := json.Unmarshal([]byte(mustRateLimit(t, "zones", "--json")), &zs); err != nil || len(zs) != 1 || zs[0].Requests.Denied != 1 {
		t.Errorf("zones --json: %v %+v", err, zs)
	}
}

func TestCommandTop(t *testing.T) {
	mustLoad(t, cmdConfig("cmd_top"))
	for i := range 20 {
		codes(t, fmt.Sprintf("127.0.31.%d", i+1), 2)
	}
	codes(t, "127.0.32.7", 23)
	codes(t, "127.0.32.8", 5)
	out := mustRateLimit(t, "top", "cmd_top")
	if !regexp.MustCompile(`^zone cmd_top: most denied sources since \d\d:\d\d:\d\d\nSOURCE +DENIED +OVERCOUNT UP TO\n127\.0\.32\.7/32 +20 +0\n127\.0\.32\.8/32 +2 +0\n$`).MatchString(out) {
		t.Errorf("top table:\n%s", out)
	}
	var top floodgate.TopInfo
	if err := json.Unmarshal([]byte(mustRateLimit(t, "top", "cmd_top", "--json")), &top); err != nil || len(top.Sources) != 2 || top.Sources[0].Denied != 20 {
		t.Errorf("top --json: %v %+v", err, top)
	}
	if out, err := rateLimit(t, "top", "nope"); err == nil || !strings.Contains(err.Error(), `unknown zone \"nope\"`) {
		t.Errorf("top of an unknown zone: %v\n%s", err, out)
	}
}

func TestCommandKeyChargesNothingAndResetLetsThrough(t *testing.T) {
	mustLoad(t, cmdConfig("cmd_key"))
	if got := codes(t, "127.0.33.1", 2); got != "200 200" {
		t.Fatalf("requests: %s", got)
	}
	for range 3 {
		out := mustRateLimit(t, "key", "cmd_key", "127.0.33.1")
		if !regexp.MustCompile(`^zone cmd_key, source 127\.0\.33\.1/32: a request now would be allowed\nPOLICY +LIMIT +REMAINING +RETRY AFTER +FULL IN\nwindow +3 +1 +0s +\d+s\n$`).MatchString(out) {
			t.Fatalf("key table:\n%s", out)
		}
	}
	if got := codes(t, "127.0.33.1", 2); got != "200 429" {
		t.Fatalf("after three inspections: %s, want 200 429", got)
	}
	var k floodgate.KeyInfo
	if err := json.Unmarshal([]byte(mustRateLimit(t, "key", "cmd_key", "127.0.33.1", "--json")), &k); err != nil || k.Allowed || k.Policies[0].Remaining != 0 {
		t.Errorf("key --json: %v %+v", err, k)
	}
	out := mustRateLimit(t, "reset", "cmd_key", "127.0.33.1")
	if !regexp.MustCompile(`^reset: zone cmd_key, source 127\.0\.33\.1/32: a request now would be allowed\nPOLICY +LIMIT +REMAINING +RETRY AFTER +FULL IN\nwindow +3 +3 +0s +0s\n$`).MatchString(out) {
		t.Errorf("reset table:\n%s", out)
	}
	if got := codes(t, "127.0.33.1", 4); got != "200 200 200 429" {
		t.Errorf("after reset: %s", got)
	}
}

func TestCommandFindsTheAdminAddressInTheConfig(t *testing.T) {
	cfg := cmdConfig("cmd_config")
	mustLoad(t, cfg)
	file := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(file, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	out := mustRateLimit(t, "zones", "--config", file, "--adapter", "caddyfile")
	if !strings.Contains(out, "\ncmd_config ") {
		t.Errorf("zones with --config:\n%s", out)
	}
}

// TestResetTakesWhatTopPrints pastes the sources `top` prints (a masked
// network, key:<hash>) into `reset`, which must reset them, and refuses what
// names no source of the zone instead of reporting a reset that changes
// nothing.
func TestResetTakesWhatTopPrints(t *testing.T) {
	mustLoad(t, twoZones("paste"))
	topSource := func(zone string) string {
		t.Helper()
		var top floodgate.TopInfo
		if err := json.Unmarshal([]byte(mustRateLimit(t, "top", zone, "--json")), &top); err != nil || len(top.Sources) != 1 {
			t.Fatalf("top %s: %v %+v", zone, err, top)
		}
		return top.Sources[0].Source
	}
	// paste_ip allows 3 an hour per /24; each request has its own X-User,
	// so that paste_user does not deny first.
	var got []string
	for i := range 4 {
		got = append(got, codes(t, "127.0.9.1", 1, fmt.Sprintf("X-User: ip%d", i)))
	}
	if strings.Join(got, " ") != "200 200 200 429" {
		t.Fatalf("127.0.9.1: %s", got)
	}
	network := topSource("paste_ip")
	if network != "127.0.9.0/24" {
		t.Fatalf("top paste_ip: %q", network)
	}
	if out := mustRateLimit(t, "reset", "paste_ip", network); !strings.HasPrefix(out, "reset: zone paste_ip, source 127.0.9.0/24: a request now would be allowed\n") {
		t.Errorf("reset %s:\n%s", network, out)
	}
	if got := codes(t, "127.0.9.2", 1, "X-User: ip9"); got != "200" {
		t.Errorf("127.0.9.2 after reset %s: %s", network, got)
	}

	if got := codes(t, "127.0.19.1", 3, "X-User: eve"); got != "200 200 429" {
		t.Fatalf("eve: %s", got)
	}
	hash := topSource("paste_user")
	if !regexp.MustCompile(`^key:[0-9a-f]{16}$`).MatchString(hash) {
		t.Fatalf("top paste_user: %q", hash)
	}
	if out := mustRateLimit(t, "key", "paste_user", hash); !strings.Contains(out, "source "+hash+": a request now would be denied\n") {
		t.Errorf("key %s:\n%s", hash, out)
	}
	mustRateLimit(t, "reset", "paste_user", hash)
	if got := codes(t, "127.0.20.1", 1, "X-User: eve"); got != "200" {
		t.Errorf("eve after reset %s: %s", hash, got)
	}

	for _, c := range []struct{ zone, key, want string }{
		{"paste_ip", "not-an-ip", `key \"not-an-ip\" is not an IP address or network`},
		{"paste_ip", "127.0.0.0/16", "127.0.0.0/16 is not a source of zone \\\"paste_ip\\\": its sources are /24 networks"},
	} {
		for _, cmd := range []string{"key", "reset"} {
			if out, err := rateLimit(t, cmd, c.zone, c.key); err == nil || !strings.Contains(err.Error(), "HTTP 400") || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%s %s %s: %v, want a 400 saying %s\n%s", cmd, c.zone, c.key, err, c.want, out)
			}
		}
	}
}

// TestCommandsShowAndResetEveryPolicy: a zone's quota is one of its
// policies everywhere the tools show the zone or a key, and a reset
// refills it too, so that "a request now would be allowed" is true: the
// next request passes.
func TestCommandsShowAndResetEveryPolicy(t *testing.T) {
	mustLoad(t, caddyfile("", `	rate_limit {
		zone cmd_quota {
			key {http.request.header.X-User}
			events 10
			window 2s
			quota 3 24h
		}
	}
	respond "ok"`))
	if got := codes(t, "127.0.34.1", 4, "X-User: carol"); got != "200 200 200 429" {
		t.Fatalf("carol: %s, want her quota of 3", got)
	}
	if out := mustRateLimit(t, "zones"); !strings.Contains(out, "10 in 2s, quota 3 in 24h0m0s") {
		t.Errorf("zones does not show the quota:\n%s", out)
	}
	out := mustRateLimit(t, "key", "cmd_quota", "carol")
	if !strings.Contains(out, ": a request now would be denied\n") || !regexp.MustCompile(`\nquota 24h0m0s +3 +0 +[1-9]\d*s`).MatchString(out) {
		t.Errorf("key carol, quota spent:\n%s", out)
	}
	out = mustRateLimit(t, "reset", "cmd_quota", "carol")
	if !strings.Contains(out, ": a request now would be allowed\n") || !regexp.MustCompile(`\nquota 24h0m0s +3 +3 +0s`).MatchString(out) {
		t.Errorf("reset carol:\n%s", out)
	}
	if got := codes(t, "127.0.34.1", 1, "X-User: carol"); got != "200" {
		t.Errorf("carol after the reset: %s, want 200", got)
	}
}
