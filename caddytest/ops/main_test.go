// Package ops tests operating floodgate inside a real, in-process Caddy: the
// admin API, the `caddy rate-limit` command, metrics across reloads, events
// and the denial logs that fail2ban and CrowdSec read.
//
// Ports: the admin endpoint, HTTP and HTTPS listen on ports picked free when
// the test binary starts (adminPort, httpPort, httpsPort), so that copies of
// the suite run side by side. Tests must not call t.Parallel: each config load replaces the one Caddy's config. Zone names
// are unique per test, because a zone's state and counts deliberately
// survive config loads.
package ops

import (
	"flag"
	"fmt"
	"net/http"
	"os"
	"testing"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/floodgate-rl/floodgate"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// The ports of this process's Caddy, free when the test binary started.
var (
	ports                          = testcaddy.MustFreePorts(3)
	adminPort, httpPort, httpsPort = ports[0], ports[1], ports[2]

	adminURL = fmt.Sprintf("http://localhost:%d", adminPort)
)

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(0)
	}
	os.Exit(testcaddy.Main(m, "ops", adminPort))
}

// caddyfile returns a Caddyfile with the test ports, extra global options and
// one site on the HTTP port with body.
func caddyfile(extra, body string) string {
	return testcaddy.Globals(adminPort, httpPort, httpsPort, extra) + fmt.Sprintf("http://:%d {\n%s\n}\n", httpPort, body)
}

// load posts a config to the admin endpoint; the config alone serves when
// it returns without error.
func load(t *testing.T, cfg, adapter string) error {
	t.Helper()
	return testcaddy.Load(t, adminPort, cfg, adapter, adminPort, httpPort, httpsPort)
}

// mustLoad loads a Caddyfile.
func mustLoad(t *testing.T, cfg string) {
	t.Helper()
	if err := load(t, cfg, "caddyfile"); err != nil {
		t.Fatalf("loading config: %v", err)
	}
}

// mustLoadJSON loads a JSON config.
func mustLoadJSON(t *testing.T, cfg string) {
	t.Helper()
	if err := load(t, cfg, "json"); err != nil {
		t.Fatalf("loading config: %v", err)
	}
}

// send sends req with c and returns the answer's status and body.
func send(t *testing.T, c *http.Client, req *http.Request) (int, string) {
	t.Helper()
	code, body, _ := testcaddy.Do(t, c, req)
	return code, body
}

// from returns an HTTP client whose connections to the test site come from
// the local address ip (all of 127.0.0.0/8 is this host on Linux). It opens
// a new connection per request, so none outlives a config load.
func from(ip string) *http.Client {
	return testcaddy.ClientFrom(ip, fmt.Sprintf("127.0.0.1:%d", httpPort))
}

// codes sends n GETs to the test site from ip with the given headers
// ("Name: value") and returns their status codes, e.g. "200 200 429".
func codes(t *testing.T, ip string, n int, headers ...string) string {
	t.Helper()
	return testcaddy.Codes(t, from(ip), n, http.MethodGet, fmt.Sprintf("http://localhost:%d/", httpPort), headers...)
}

// adminDo sends a request to the admin API and returns its status and body.
func adminDo(t *testing.T, method, path string, headers ...string) (int, string) {
	t.Helper()
	return send(t, http.DefaultClient, testcaddy.Request(t, method, adminURL+path, headers...))
}

// adminJSON sends a request to the admin API, fails unless it answers 200,
// and decodes the answer into v.
func adminJSON(t *testing.T, method, path string, v any) {
	t.Helper()
	testcaddy.JSON(t, http.DefaultClient, testcaddy.Request(t, method, adminURL+path), v)
}

// metrics returns the admin endpoint's /metrics.
func metrics(t *testing.T) string {
	t.Helper()
	return testcaddy.Metrics(t, adminPort)
}
