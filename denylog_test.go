package floodgate

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

func TestDenialLogNamesZoneAndClientButKeyOnlyWithLogKey(t *testing.T) {
	for _, logKey := range []bool{false, true} {
		core, logs := observer.New(zap.InfoLevel)
		h := newTestHandler(t, nil, map[string]*Zone{
			"logged_" + strconv.FormatBool(logKey): {Key: "{http.request.header.X-Secret}", Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour)}},
		})
		h.logger, h.LogKey = zap.New(core), logKey
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.RemoteAddr = "192.0.2.44:1234"
		req.Header.Set("X-Secret", "hunter2")
		_, _ = serve(h, req)
		if _, err := serve(h, req); status(err) != http.StatusTooManyRequests {
			t.Fatalf("second request: %v", err)
		}
		entries := logs.All()
		if len(entries) != 1 {
			t.Fatalf("log_key %v: %d log lines, want 1", logKey, len(entries))
		}
		fields := entries[0].ContextMap()
		if fields["zone"] != "logged_"+strconv.FormatBool(logKey) || fields["client_ip"] != "192.0.2.44" {
			t.Errorf("log_key %v: fields %v, want zone and client_ip", logKey, fields)
		}
		if key, ok := fields["key"]; ok != logKey || (ok && key != "hunter2") {
			t.Errorf("log_key %v: key field %v (present %v)", logKey, key, ok)
		}
	}
}

func TestDenialLogIsOneInfoLinePerSourceAndInterval(t *testing.T) {
	h, logs := deniedHandler(t, "flooded", "{remote_host}", zapcore.DebugLevel)
	t0 := time.Unix(1_700_000_000, 0).Truncate(denialLogInterval)
	flood := func(remote string, n int, at time.Time) {
		t.Helper()
		for range n {
			if _, err := serveAt(h, requestFrom(remote), at); status(err) != http.StatusTooManyRequests {
				t.Fatalf("%s: %v, want a denial", remote, err)
			}
		}
	}
	debugs := 0
	infos := func() (info []observer.LoggedEntry) {
		debugs = 0
		for _, e := range logs.TakeAll() {
			if e.Level == zapcore.InfoLevel {
				info = append(info, e)
			} else {
				debugs++
			}
		}
		return info
	}
	// Each source's first request is allowed.
	for _, src := range []string{"192.0.2.1:1", "198.51.100.1:1", "203.0.113.1:1"} {
		if _, err := serveAt(h, requestFrom(src), t0); err != nil {
			t.Fatal(err)
		}
	}

	flood("192.0.2.1:1", 500, t0)
	got := infos()
	if len(got) != 1 {
		t.Fatalf("500 denials of one source: %d INFO lines, want 1", len(got))
	}
	f := got[0].ContextMap()
	if got[0].Message != "rate limit exceeded" || f["zone"] != "flooded" || f["client_ip"] != "192.0.2.1" ||
		f["source"] != "192.0.2.0/24" || f["retry_after"] != int64(3600) || f["suppressed"] != int64(0) {
		t.Errorf("first INFO line: %q %v", got[0].Message, f)
	}
	if _, ok := f["key"]; ok {
		t.Errorf("key logged without log_key: %v", f)
	}
	if n := debugs; n != 499 {
		t.Errorf("%d DEBUG lines, want the other 499 denials", n)
	}

	// Another address of the same /24 is the same source.
	flood("192.0.2.99:1", 10, t0.Add(9*time.Second))
	if got := infos(); len(got) != 0 {
		t.Errorf("same network, same interval: %d INFO lines, want 0", len(got))
	}

	// Two more sources: one line each.
	flood("198.51.100.1:1", 50, t0.Add(time.Second))
	flood("203.0.113.1:1", 50, t0.Add(2*time.Second))
	got = infos()
	if len(got) != 2 || got[0].ContextMap()["source"] != "198.51.100.0/24" || got[1].ContextMap()["source"] != "203.0.113.0/24" {
		t.Errorf("two more sources: %d INFO lines %v, want one per source", len(got), got)
	}

	// The next interval: one line per source again, counting what the
	// previous one suppressed.
	flood("192.0.2.1:1", 3, t0.Add(denialLogInterval))
	got = infos()
	if len(got) != 1 || got[0].ContextMap()["suppressed"] != int64(499+10) {
		t.Fatalf("next interval: %v, want 1 INFO line with suppressed 509", got)
	}
	flood("192.0.2.1:1", 1, t0.Add(3*denialLogInterval))
	got = infos()
	if len(got) != 1 || got[0].ContextMap()["suppressed"] != int64(2) {
		t.Errorf("two intervals later: %v, want 1 INFO line with suppressed 2", got)
	}
}

// However many sources flood, a zone writes at most maxInfoPerInterval INFO
// lines per interval, and its bookkeeping stays the same fixed table.
func TestDenialLogIsBoundedUnderManySources(t *testing.T) {
	h, logs := deniedHandler(t, "many", "{http.request.header.X-Key}", zapcore.InfoLevel)
	t0 := time.Unix(1_700_000_000, 0).Truncate(denialLogInterval)
	const sources = 3000
	for i := range sources {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Key", "k"+strconv.Itoa(i))
		for range 3 {
			_, _ = serveAt(h, r, t0)
		}
	}
	if n := logs.Len(); n != maxInfoPerInterval {
		t.Errorf("%d sources denied twice each: %d INFO lines, want the bound %d", sources, n, maxInfoPerInterval)
	}
	if src := logs.All()[0].ContextMap()["source"]; !strings.HasPrefix(src.(string), "key:") || len(src.(string)) != len("key:")+16 {
		t.Errorf("source of a header key %q, want key:<16 hex digits>", src)
	}
}

func TestDenialLogKeyIsCutWithLogKey(t *testing.T) {
	h, logs := deniedHandler(t, "longkey", "{http.request.header.X-Key}", zapcore.InfoLevel)
	h.LogKey = true
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Key", strings.Repeat("s", 900<<10))
	_, _ = serve(h, r)
	if _, err := serve(h, r); status(err) != http.StatusTooManyRequests {
		t.Fatalf("second request: %v", err)
	}
	key, _ := logs.All()[0].ContextMap()["key"].(string)
	if len(key) > maxShownKey || !strings.HasPrefix(key, "sss") {
		t.Errorf("logged key of %d bytes, want at most %d", len(key), maxShownKey)
	}
}
