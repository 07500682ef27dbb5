package ops

import (
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

func TestEventCarriesZoneClientAndKeyOnlyWithLogKey(t *testing.T) {
	testcaddy.Events()
	mustLoadJSON(t, fmt.Sprintf(`{
	  "admin": {"listen": "localhost:%d", "config": {"persist": false}},
	  "apps": {
	    "events": {"subscriptions": [{"events": ["rate_limit_exceeded"], "handlers": [{"handler": "floodgate_test_recorder"}]}]},
	    "http": {"servers": {"srv0": {"listen": [":%d"], "routes": [
	      {"match": [{"path": ["/logged"]}], "handle": [
	        {"handler": "rate_limit", "log_key": true, "rate_limits": {"event_logged": {"max_events": 1, "window": "1h", "key": "{http.request.header.X-User}"}}},
	        {"handler": "static_response", "body": "ok"}]},
	      {"handle": [
	        {"handler": "rate_limit", "rate_limits": {"event_quiet": {"max_events": 1, "window": "1h", "key": "{http.request.header.X-User}"}}},
	        {"handler": "static_response", "body": "ok"}]}]}}}}}`, adminPort, httpPort))
	for _, path := range []string{"/logged", "/quiet"} {
		c := from("127.0.40.1")
		for range 2 {
			req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://localhost:%d%s", httpPort, path), nil)
			req.Header.Set("X-User", "erin")
			send(t, c, req)
		}
	}
	events := testcaddy.Events()
	if len(events) != 2 {
		t.Fatalf("events: %v, want one per denial", events)
	}
	for i, zone := range []string{"event_logged", "event_quiet"} {
		e := events[i]
		if e["event"] != "rate_limit_exceeded" || e["zone"] != zone || e["client_ip"] != "127.0.40.1" {
			t.Errorf("event %d: %v", i, e)
		}
		if key, ok := e["key"]; ok != (zone == "event_logged") || (ok && key != "erin") {
			t.Errorf("event %d (%s): key %v present %v", i, zone, key, ok)
		}
	}
}

// denialLog loads a config that logs the rate_limit handler to a JSON file
// and has six zones, each on its own path (/z0 to /z5) and allowing one
// request per client per hour; it sends each path's request from the given
// sources, and returns the log's lines.
func denialLog(t *testing.T, requests map[string][]string) []string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "denials.log")
	var body strings.Builder
	for i := range 6 {
		fmt.Fprintf(&body, "\trate_limit /z%d {\n\t\tzone log_z%d {\n\t\t\tkey {client_ip}\n\t\t\tevents 1\n\t\t\twindow 1h\n\t\t}\n\t}\n", i, i)
	}
	body.WriteString("\trespond \"ok\"")
	mustLoad(t, caddyfile(testcaddy.JSONLog("floodgate", file, "include http.handlers.rate_limit"), body.String()))
	for _, ip := range slices.Sorted(maps.Keys(requests)) {
		c := from(ip)
		for _, path := range requests[ip] {
			resp, err := c.Get(fmt.Sprintf("http://localhost:%d%s", httpPort, path))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
		}
	}
	// The next load closes the log file, so that it is complete.
	mustLoad(t, caddyfile("", `respond "ok"`))
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

// failregex returns the fail2ban filter's failregex as a Go regexp, with
// fail2ban's <ADDR> as a group named addr. Python's re and Go's RE2 read the
// filter's syntax alike (literals, escapes, .*, ^).
func failregex(t *testing.T) *regexp.Regexp {
	t.Helper()
	conf, err := os.ReadFile("../../contrib/fail2ban/floodgate.conf")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(conf), "\n") {
		if re, ok := strings.CutPrefix(line, "failregex = "); ok {
			return regexp.MustCompile(strings.Replace(re, "<ADDR>", `(?P<addr>[0-9A-Fa-f.:]+)`, 1))
		}
	}
	t.Fatal("no failregex in the filter")
	return nil
}

func TestDenialLogsFeedFail2banAndCrowdSec(t *testing.T) {
	const flood, once, polite = "127.0.42.1", "127.0.42.2", "127.0.42.3"
	twice := func(paths ...string) (out []string) {
		for _, p := range paths {
			out = append(out, p, p)
		}
		return out
	}
	lines := denialLog(t, map[string][]string{
		flood:  twice("/z0", "/z1", "/z2", "/z3", "/z4", "/z5"),
		once:   twice("/z0"),
		polite: {"/z0", "/z1"},
	})
	file := filepath.Join(t.TempDir(), "caddy.log")
	if err := os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Each zone's first denial of a source is logged at INFO; that is what
	// the filter counts.
	want := []string{flood, flood, flood, flood, flood, flood, once}
	re := failregex(t)
	var got []string
	for _, l := range lines {
		if m := re.FindStringSubmatch(l); m != nil {
			got = append(got, m[re.SubexpIndex("addr")])
		}
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("the filter's regexp (in Go) found %q in\n%s\nwant %q", got, strings.Join(lines, "\n"), want)
	}

	if _, err := exec.LookPath("fail2ban-regex"); err != nil {
		t.Log("fail2ban-regex is not installed: the filter was checked with Go's regexp only")
	} else {
		out, err := exec.Command("fail2ban-regex", "-o", "ip", file, "../../contrib/fail2ban/floodgate.conf").Output()
		if err != nil {
			t.Fatalf("fail2ban-regex: %v\n%s", err, out)
		}
		got := strings.Fields(string(out))
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("fail2ban-regex found %q, want %q", got, want)
		}
	}

	if _, err := exec.LookPath("crowdsec"); err != nil {
		t.Log("crowdsec is not installed: the parser and scenario were not run")
		return
	}
	overflows := crowdsecReplay(t, file)
	if !slices.Equal(overflows, []string{flood}) {
		t.Errorf("crowdsec: scenario overflowed for %q, want only %s", overflows, flood)
	}
}

// crowdsecReplay runs crowdsec on a log file with floodgate's parser and
// scenario, and returns the sources for which the scenario overflowed.
// crowdsec's s00-raw parser crowdsecurity/non-syslog is stood in for by its
// two statics, and its s02-enrich parser crowdsecurity/dateparse-enrich
// (which dates events; undated ones are dropped in a replay) is taken from
// the hub copy Debian's package installs; crowdsec sends its alerts to a
// stand-in local API.
func crowdsecReplay(t *testing.T, log string) []string {
	t.Helper()
	dir := t.TempDir()
	lapi := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if strings.HasSuffix(r.URL.Path, "/watchers/login") {
			fmt.Fprint(w, `{"code":200,"expire":"2099-01-01T00:00:00Z","token":"t"}`)
			return
		}
		fmt.Fprint(w, `["1"]`)
	}))
	defer lapi.Close()
	patterns, err := filepath.Glob("/etc/crowdsec/patterns/*")
	if err != nil || len(patterns) == 0 {
		t.Skip("crowdsec's grok patterns (/etc/crowdsec/patterns) are not installed")
	}
	const dateparse = "/usr/share/crowdsec/hub/parsers/s02-enrich/crowdsecurity/dateparse-enrich.yaml"
	if _, err := os.Stat(dateparse); err != nil {
		t.Skip("crowdsec's hub copy (crowdsecurity/dateparse-enrich) is not installed")
	}
	files := map[string]string{
		"config.yaml": fmt.Sprintf(`common: {daemonize: false, log_media: stdout, log_level: info}
config_paths: {config_dir: %[1]s/, data_dir: %[1]s/data/, simulation_path: %[1]s/simulation.yaml, hub_dir: %[1]s/hub/, index_path: %[1]s/hub/.index.json}
crowdsec_service: {acquisition_path: %[1]s/acquis.yaml, parser_routines: 1}
api: {client: {credentials_path: %[1]s/lapi.yaml}}
`, dir),
		"lapi.yaml":       fmt.Sprintf("url: %s/\nlogin: t\npassword: t\n", lapi.URL),
		"simulation.yaml": "simulation: false\n",
		"acquis.yaml":     "",
		"hub/.index.json": `{"parsers":{},"scenarios":{},"postoverflows":{},"collections":{}}`,
		"parsers/s00-raw/non-syslog.yaml": `filter: "evt.Line.Labels.type != 'syslog'"
onsuccess: next_stage
name: test/non-syslog
statics:
  - parsed: message
    expression: evt.Line.Raw
  - parsed: program
    expression: evt.Line.Labels.type
`,
	}
	for name, src := range map[string]string{
		"parsers/s01-parse/floodgate-logs.yaml":    "../../contrib/crowdsec/floodgate-logs.yaml",
		"scenarios/floodgate-denied.yaml":          "../../contrib/crowdsec/floodgate-denied.yaml",
		"parsers/s02-enrich/dateparse-enrich.yaml": dateparse,
	} {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		files[name] = string(b)
	}
	for _, p := range patterns {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		files["patterns/"+filepath.Base(p)] = string(b)
	}
	for name, content := range files {
		path := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("crowdsec", "-c", filepath.Join(dir, "config.yaml"), "-dsn", "file://"+log, "-type", "caddy", "-no-api").CombinedOutput()
	if err != nil {
		t.Fatalf("crowdsec: %v\n%s", err, out)
	}
	performed := regexp.MustCompile(`Ip (\S+) performed 'floodgate/rate-limit-denied'`)
	var sources []string
	for _, m := range performed.FindAllStringSubmatch(string(out), -1) {
		sources = append(sources, m[1])
	}
	return sources
}

// TestOperationsPageLinksTheFilters checks that docs/operations.md points
// to every file of contrib/ an operator installs, rather than a copy that
// could drift from what the tests above check.
func TestOperationsPageLinksTheFilters(t *testing.T) {
	page, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"fail2ban/floodgate.conf", "fail2ban/floodgate.local", "crowdsec/floodgate-logs.yaml", "crowdsec/floodgate-denied.yaml", "prometheus/floodgate.rules.yml"} {
		if _, err := os.Stat("../../contrib/" + f); err != nil {
			t.Error(err)
		}
		if !strings.Contains(string(page), "](../contrib/"+f+")") {
			t.Errorf("docs/operations.md does not link contrib/%s", f)
		}
	}
}

// TestRefusedWeightSaysWhy sends requests whose weight placeholder is
// missing or not a number: each is answered 400 with an error that names the
// zone and the weight (for handle_errors), and each source gets one INFO
// line per interval however many it sends, as denials do.
func TestRefusedWeightSaysWhy(t *testing.T) {
	file := filepath.Join(t.TempDir(), "weights.log")
	mustLoad(t, caddyfile(testcaddy.JSONLog("floodgate", file, "include http.handlers.rate_limit"), `	rate_limit {
		zone wlog {
			key {client_ip}
			events 10
			window 1h
			weight {header.X-Cost}
		}
	}
	respond "ok"
	handle_errors 400 {
		respond "{err.message}" 400
	}`))
	for _, c := range []struct {
		ip, cost string
		n        int
		want     string
	}{
		{"127.0.40.1", "", 5, `zone "wlog": weight {http.request.header.X-Cost} is empty: the request must give a whole number of at least 1`},
		{"127.0.41.1", "abc", 2, `zone "wlog": weight {http.request.header.X-Cost} = "abc": must be a whole number of at least 1`},
	} {
		for range c.n {
			req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://localhost:%d/", httpPort), nil)
			if c.cost != "" {
				req.Header.Set("X-Cost", c.cost)
			}
			if code, body := send(t, from(c.ip), req); code != http.StatusBadRequest || body != c.want {
				t.Errorf("from %s with X-Cost %q: %d %q, want 400 %q", c.ip, c.cost, code, body, c.want)
			}
		}
	}
	// The next load closes the log file, so that it is complete.
	mustLoad(t, caddyfile("", `respond "ok"`))
	got := testcaddy.LogEntries(t, file, "rate limit weight refused", "level", "zone", "source", "error")
	want := []string{
		`info wlog 127.0.40.1/32 zone "wlog": weight {http.request.header.X-Cost} is empty: the request must give a whole number of at least 1`,
		`info wlog 127.0.41.1/32 zone "wlog": weight {http.request.header.X-Cost} = "abc": must be a whole number of at least 1`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("log lines:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
