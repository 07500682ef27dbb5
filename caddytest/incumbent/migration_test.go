package incumbent

// floodgate's own tests of what a caddy-ratelimit user meets after
// switching: the window's headers, the series a caddy-ratelimit dashboard
// reads, and both limiters sharing one storage during a rolling upgrade.

import (
	"bytes"
	"context"
	"encoding/gob"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"

	"github.com/floodgate-rl/floodgate/caddytest/incumbent/internal/caddytest"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// load loads a Caddyfile of the global options extra and one site with body.
func load(t *testing.T, extra, body string) {
	t.Helper()
	cfg := testcaddy.Site(caddytest.AdminPort, caddytest.HTTPPort, caddytest.HTTPSPort, extra, body)
	if err := testcaddy.Load(t, caddytest.AdminPort, cfg, "caddyfile", caddytest.AdminPort, caddytest.HTTPPort, caddytest.HTTPSPort); err != nil {
		t.Fatal(err)
	}
}

func get(t *testing.T, url string) (int, http.Header, string) {
	t.Helper()
	code, body, resp := testcaddy.Do(t, http.DefaultClient, testcaddy.Request(t, http.MethodGet, url))
	return code, resp.Header, body
}

func site(path string) string { return fmt.Sprintf("http://localhost:%d%s", caddytest.HTTPPort, path) }

// A window zone's headers: RateLimit-Policy says q=events;w=window, and
// RateLimit's t and Retry-After count down to the end of the key's window.
func TestWindowZoneHeaders(t *testing.T) {
	load(t, "", `rate_limit {
		zone headers_window {
			key {remote_host}
			events 3
			window 1h
		}
	}
	respond ok`)
	for i := range 3 {
		code, h, _ := get(t, site("/"))
		if code != 200 || h.Get("RateLimit-Policy") != `"headers_window";q=3;w=3600` ||
			h.Get("RateLimit") != fmt.Sprintf(`"headers_window";r=%d;t=3600`, 2-i) {
			t.Fatalf("request %d: %d %q %q", i+1, code, h.Get("RateLimit-Policy"), h.Get("RateLimit"))
		}
	}
	code, h, _ := get(t, site("/"))
	if code != 429 || h.Get("Retry-After") != "3600" || h.Get("RateLimit") != `"headers_window";r=0;t=3600` {
		t.Fatalf("fourth request: %d, Retry-After %q, RateLimit %q; want 429 until the hour's end", code, h.Get("Retry-After"), h.Get("RateLimit"))
	}
}

// The series a caddy-ratelimit dashboard reads are on /metrics, by zone,
// with no key label, beside floodgate's own.
//
// The zone is sized for 10,000 sources so that its table (59,000 lines)
// is read whole by the keys estimate, which samples 65,536 lines at most:
// on the default window table (591,000 lines) each sampled key counts for
// nine, and two keys read as 0, 9 or 18.
func TestDashboardSeriesHaveNoKeyLabel(t *testing.T) {
	load(t, "metrics", `rate_limit {
		zone dash_zone {
			key {http.request.header.X-Api-Key}
			events 2
			window 1m
			ipv4_prefix 24
			sources 10000
		}
	}
	respond ok`)
	for _, key := range []string{"secret-a", "secret-a", "secret-a", "secret-b"} {
		req, _ := http.NewRequest(http.MethodGet, site("/"), nil)
		req.Header.Set("X-Api-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	body := testcaddy.Metrics(t, caddytest.AdminPort)
	for _, want := range []string{
		`caddy_rate_limit_declined_requests_total{zone="dash_zone"} 1`,
		`caddy_rate_limit_config{ipv4_prefix="24",ipv6_prefix="64",max_events="2",window="1m0s",zone="dash_zone"} 1`,
		`caddy_rate_limit_keys_total{zone="dash_zone"} 2`,
		`caddy_rate_limit_requests_total{outcome="denied",zone="dash_zone"} 1`,
	} {
		if !strings.Contains(body, want+"\n") {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, "caddy_rate_limit_") && (strings.Contains(line, "key=") || strings.Contains(line, "secret")) {
			t.Errorf("a per-key series: %s", line)
		}
	}
}

// caddy-ratelimit's state file, as its distributed.go writes it (gob of
// rlState under rate_limit/instances/<instance>.rlstate): the same field
// names, which is what gob matches.
type rlStateValue struct {
	Count       int
	OldestEvent time.Time
}

type rlState struct {
	Timestamp time.Time
	Zones     map[string]map[string]rlStateValue
}

// incumbentRead is what caddy-ratelimit's syncDistributedRead does with the
// storage: list rate_limit/instances (not recursively) and gob-decode every
// entry, logging and skipping those that do not decode. It returns the
// states it decoded and the keys it skipped.
func incumbentRead(t *testing.T, st certmagic.Storage) (map[string]rlState, []string) {
	t.Helper()
	keys, err := st.List(context.Background(), "rate_limit/instances", false)
	if err != nil {
		t.Fatal(err)
	}
	states := map[string]rlState{}
	var skipped []string
	for _, k := range keys {
		b, err := st.Load(context.Background(), k)
		var s rlState
		if err == nil {
			err = gob.NewDecoder(bytes.NewReader(b)).Decode(&s)
		}
		if err != nil {
			skipped = append(skipped, k)
			continue
		}
		states[k] = s
	}
	return states, skipped
}

// A rolling upgrade: caddy-ratelimit instances and floodgate instances
// share one storage. caddy-ratelimit keeps its state in
// rate_limit/instances/<id>.rlstate; floodgate in rate_limit/<zone>/<id>.
// Even with a floodgate zone named "instances", whose snapshots land in
// the incumbent's directory, neither deletes, overwrites or misreads the
// other's state: floodgate skips (and counts) entries that are not its
// snapshots and limits as before; the incumbent, whose reader logs and
// skips an entry it cannot decode, still reads its peers' states intact.
func TestRollingMigrationSharesStorage(t *testing.T) {
	dir := t.TempDir()
	// Cleanups run last first: this config, which syncs into dir every
	// 20ms, is replaced before dir is removed, or a last write races the
	// removal ("directory not empty").
	t.Cleanup(func() { load(t, "", `respond ok`) })
	st := &certmagic.FileStorage{Path: dir}
	theirs := rlState{Timestamp: time.Now(), Zones: map[string]map[string]rlStateValue{
		"instances": {"10.0.0.1": {Count: 7, OldestEvent: time.Now().Add(-time.Second)}},
		"login":     {"10.0.0.2": {Count: 3, OldestEvent: time.Now()}},
	}}
	var buf bytes.Buffer
	if err := gob.NewEncoder(&buf).Encode(theirs); err != nil {
		t.Fatal(err)
	}
	theirKey := "rate_limit/instances/11111111-2222-3333-4444-555555555555.rlstate"
	if err := st.Store(context.Background(), theirKey, buf.Bytes()); err != nil {
		t.Fatal(err)
	}
	stored := append([]byte(nil), buf.Bytes()...)

	load(t, "metrics", fmt.Sprintf(`rate_limit {
		zone instances {
			key {remote_host}
			events 3
			window 1h
		}
		zone login {
			key static
			events 2
			window 1h
		}
		distributed {
			read_interval 20ms
			write_interval 20ms
			purge_age 40ms
		}
		storage file_system %s
	}
	respond ok`, dir))
	codes := ""
	for range 4 {
		code, _, _ := get(t, site("/"))
		codes += fmt.Sprint(code, " ")
	}
	if codes != "200 200 429 429 " {
		t.Fatalf("with the incumbent's state in the storage: %s, want 200 200 429 429 (login: 2 in a window)", codes)
	}
	// Wait (bounded) until floodgate has published both zones, read the
	// incumbent's entry at least once, and the incumbent finds a
	// floodgate snapshot among its own: three files in the directory
	// were once taken for that, but they can be the login zone's and
	// the incumbent's while the instances zone's is not written yet.
	skippedRE := regexp.MustCompile(`caddy_rate_limit_cluster_skipped_total\{zone="instances"\} ([1-9][0-9]*)`)
	deadline := time.Now().Add(10 * time.Second)
	var (
		states  map[string]rlState
		skipped []string
	)
	for {
		metrics := testcaddy.Metrics(t, caddytest.AdminPort)
		ours, _ := filepath.Glob(filepath.Join(dir, "rate_limit", "login", "*"))
		states, skipped = incumbentRead(t, st)
		if skippedRE.MatchString(metrics) && len(ours) > 0 && len(skipped) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("within 10s, floodgate did not publish both zones and skip the incumbent's entry, or the incumbent found no floodgate entry in its directory: login zone's files %v, the incumbent skipped %v", ours, skipped)
		}
		time.Sleep(20 * time.Millisecond) // the next sync, not a rate
	}
	// purge_age has passed many times over: the incumbent's entry, which
	// is no snapshot of floodgate's, is still there, byte for byte.
	got, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(theirKey)))
	if err != nil || !bytes.Equal(got, stored) {
		t.Fatalf("the incumbent's state after floodgate ran beside it: %v (changed: %v)", err, !bytes.Equal(got, stored))
	}
	if s, ok := states[theirKey]; !ok || s.Zones["instances"]["10.0.0.1"].Count != 7 || s.Zones["login"]["10.0.0.2"].Count != 3 {
		t.Fatalf("the incumbent reads its peer's state as %+v (ok %v)", s, ok)
	}
	// What it skips is floodgate's entries of its zone named instances
	// (at least one: the wait above).
	for _, k := range skipped {
		if !strings.HasPrefix(k, "rate_limit/instances/") || strings.HasSuffix(k, ".rlstate") {
			t.Errorf("the incumbent skips %s", k)
		}
	}
	// floodgate's login zone is outside the incumbent's directory.
	if _, err := st.Stat(context.Background(), "rate_limit/login"); err != nil {
		t.Fatalf("floodgate's login zone: %v", err)
	}
}
