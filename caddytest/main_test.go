// Package caddytest tests floodgate inside a real, in-process Caddy
// (github.com/caddyserver/caddy/v2/caddytest) on loopback.
//
// Ports: the admin endpoint, HTTP and HTTPS listen on ports picked free when
// the test binary starts (adminPort, httpPort, httpsPort), so that packages
// run in parallel by `go test ./...`, and copies of the suite run side by
// side, never meet on a port. A config written out as text names them with
// ADMIN_PORT, HTTP_PORT and HTTPS_PORT, replaced by withPorts.
//
// Tests here must not call t.Parallel: every InitServer replaces the one
// Caddy's whole config. Zone names are unique per test, because a zone's
// state deliberately survives config loads. No test sleeps: windows are long
// enough that no token returns during a test, and a value that depends on
// how long the requests took (Retry-After, t=) is checked against the time
// the test measured around them (see checkSeconds).
//
// After a config load, the next request must reach the new config, on a new
// connection: every client of this process opens a connection per request
// (TestMain), and every load waits until the old config's sockets are closed
// (testcaddy.Settle).
package caddytest

import (
	"fmt"
	"math"
	"net/http"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	_ "github.com/floodgate-rl/floodgate"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// The ports of this process's Caddy, free when the test binary started.
var (
	ports                          = testcaddy.MustFreePorts(3)
	adminPort, httpPort, httpsPort = ports[0], ports[1], ports[2]

	adminURL = fmt.Sprintf("http://localhost:%d", adminPort)
	baseURL  = fmt.Sprintf("http://localhost:%d", httpPort)
)

// withPorts returns s, a config or URL, with ADMIN_PORT, HTTP_PORT and
// HTTPS_PORT replaced by this process's ports.
func withPorts(s string) string {
	return testcaddy.WithPorts(s, adminPort, httpPort, httpsPort)
}

func TestMain(m *testing.M) {
	os.Exit(testcaddy.Main(m, "caddytest", adminPort))
}

// globals returns the global options block every test config needs, with
// extra options (e.g. a rate_limit global option) inside it.
func globals(extra string) string {
	return testcaddy.Globals(adminPort, httpPort, httpsPort, extra)
}

// config returns a Caddyfile: the global options with extra, then one
// http://localhost site with body.
func config(extra, body string) string {
	return testcaddy.Site(adminPort, httpPort, httpsPort, extra, body)
}

// tester is a caddytest.Tester whose client opens a new connection for every
// request, and whose InitServer returns once the new config alone serves.
type tester struct {
	*caddytest.Tester
	t *testing.T
}

func newTester(t *testing.T) *tester {
	t.Helper()
	tc := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: adminPort})
	tc.Client.Transport.(*http.Transport).DisableKeepAlives = true
	return &tester{Tester: tc, t: t}
}

// InitServer loads cfg ("caddyfile" or "json") and fails the test if Caddy
// refuses it. It replaces caddytest's, which polls GET /config/ and sleeps a
// second whenever that request meets the old admin endpoint's socket.
func (tc *tester) InitServer(cfg, adapter string) {
	tc.t.Helper()
	if testing.Short() {
		tc.t.Skip("starts Caddy")
	}
	if err := load(tc.t, cfg, adapter); err != nil {
		tc.t.Fatalf("loading the config: %v", err)
	}
}

// get sends a GET to path on the test site with the given headers
// ("Name: value") and returns the status, the body and the response.
func get(t *testing.T, tc *tester, path string, headers ...string) (int, string, *http.Response) {
	t.Helper()
	return do(t, tc.Client, testcaddy.Request(t, http.MethodGet, baseURL+path, headers...))
}

func do(t *testing.T, c *http.Client, req *http.Request) (int, string, *http.Response) {
	t.Helper()
	return testcaddy.Do(t, c, req)
}

// codes sends n GETs and returns their status codes, e.g. "200 200 429".
func codes(t *testing.T, tc *tester, n int, path string, headers ...string) string {
	t.Helper()
	return testcaddy.Codes(t, tc.Client, n, http.MethodGet, baseURL+path, headers...)
}

// load posts a config (its ports named as withPorts reads them) to the admin
// endpoint, waits until the config that serves afterwards is the only one
// listening, and returns the error Caddy reports, if any.
func load(t *testing.T, cfg, adapter string) error {
	t.Helper()
	return testcaddy.Load(t, adminPort, withPorts(cfg), adapter, adminPort, httpPort, httpsPort)
}

// checkSeconds parses got, a whole number of seconds that a server computed
// as the ceiling of full less the time since some moment, and fails the test
// unless it is within what that allows when that time is between 0 and
// elapsed, which the test measured from before that moment until after the
// answer. It returns the number.
func checkSeconds(t *testing.T, what, got string, full, elapsed time.Duration) int64 {
	t.Helper()
	if elapsed >= full-time.Second {
		t.Fatalf("%s: the test took %v, too close to the %v being measured", what, elapsed, full)
	}
	lo, hi := int64(math.Ceil((full - elapsed).Seconds())), int64(math.Ceil(full.Seconds()))
	n, err := strconv.ParseInt(got, 10, 64)
	if err != nil || n < lo || n > hi {
		t.Errorf("%s = %q, want %d to %d (%v less at most the %v measured)", what, got, lo, hi, full, elapsed)
	}
	return n
}

// clientFrom returns an HTTP client whose connections come from the local
// address ip (any address in 127.0.0.0/8 is this host on Linux).
func clientFrom(ip string) *http.Client {
	return testcaddy.ClientFrom(ip, fmt.Sprintf("127.0.0.1:%d", httpPort))
}
