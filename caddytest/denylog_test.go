package caddytest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// A flood from one client writes one INFO line, in the format
// docs/operations.md#the-denial-log gives fail2ban and CrowdSec users, through Caddy's own logging.
func TestDenialLogUnderAFloodIsOneLine(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "rate_limit.log")
	tc := newTester(t)
	start := time.Now() // the wait counts from a moment after this (see TestRateLimitHeaders)
	tc.InitServer(config(`log denials {
		output file `+logFile+`
		format json
		level INFO
		include http.handlers.rate_limit
	}`, `
	rate_limit {
		zone flood_log {
			key {client_ip}
			events 1
			window 1h
		}
	}
	respond "ok"`), "caddyfile")

	if got := codes(t, tc, 41, "/"); got[:8] != "200 429 " || got[len(got)-4:] != " 429" {
		t.Fatalf("requests: %s, want 200 then 429s", got)
	}
	elapsed := time.Since(start)
	f, err := os.Open(logFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var lines []map[string]any
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var line map[string]any
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		lines = append(lines, line)
	}
	if len(lines) != 1 {
		t.Fatalf("40 denials wrote %d lines at INFO, want 1: %v", len(lines), lines)
	}
	l := lines[0]
	want := map[string]any{
		"level": "info", "logger": "http.handlers.rate_limit", "msg": "rate limit exceeded",
		"zone": "flood_log", "client_ip": "127.0.0.1", "source": "127.0.0.1/32", "suppressed": 0.0,
	}
	for k, v := range want {
		if l[k] != v {
			t.Errorf("field %s = %v, want %v (line %v)", k, l[k], v, l)
		}
	}
	if ra, ok := l["retry_after"].(float64); !ok || ra != math.Trunc(ra) {
		t.Errorf("retry_after %v, want whole seconds", l["retry_after"])
	} else {
		checkSeconds(t, "retry_after", fmt.Sprint(ra), time.Hour, elapsed)
	}
}
