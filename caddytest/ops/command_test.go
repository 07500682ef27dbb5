package ops

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/floodgate-rl/floodgate"
)

// rateLimit runs `caddy rate-limit args...` as Caddy's command line would,
// against this package's admin endpoint unless args name another address
// or a config, and returns what it printed.
func rateLimit(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd, ok := caddycmd.Commands()["rate-limit"]
	if !ok {
		t.Fatal("no rate-limit command registered")
	}
	c := &cobra.Command{Use: cmd.Name}
	cmd.CobraFunc(c)
	var out bytes.Buffer
	c.SetOut(&out)
	c.SetErr(&out)
	if a := strings.Join(args, " "); !strings.Contains(a, "--address") && !strings.Contains(a, "--config") {
		args = append(args, "--address", fmt.Sprintf("localhost:%d", adminPort))
	}
	c.SetArgs(args)
	err := c.Execute()
	return out.String(), err
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
