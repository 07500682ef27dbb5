// Package integration tests floodgate inside a real, in-process Caddy
// (github.com/caddyserver/caddy/v2/caddytest) on loopback.
//
// Ports: admin localhost:2419, HTTP 9480, HTTPS 9481. Other packages of this
// repository that start Caddy must use other ports: `go test ./...` runs
// packages in parallel, one Caddy per process.
//
// Tests here must not call t.Parallel: every InitServer replaces the one
// Caddy's whole config. Zone names are unique per test, because a zone's
// state deliberately survives config loads. No test sleeps: windows are long
// enough that no token returns during a test.
package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"

	_ "github.com/floodgate-rl/floodgate"
)

const (
	adminPort = 2419
	httpPort  = 9480
	httpsPort = 9481
)

var (
	adminURL = fmt.Sprintf("http://localhost:%d", adminPort)
	baseURL  = fmt.Sprintf("http://localhost:%d", httpPort)
)

func TestMain(m *testing.M) {
	// Keep the in-process Caddy's instance ID and autosave out of $HOME.
	dir, err := os.MkdirTemp("", "floodgate-caddytest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Setenv("XDG_DATA_HOME", dir)
	os.Setenv("XDG_CONFIG_HOME", dir)
	// Start the in-process Caddy here rather than in the first InitServer,
	// which polls for it once a second for at most 10 s: on a loaded machine
	// that was not always enough. caddy.Load returns once the admin
	// endpoint listens.
	admin := fmt.Sprintf(`{"admin": {"listen": "localhost:%d", "config": {"persist": false}}}`, adminPort)
	if err := caddy.Load([]byte(admin), false); err != nil {
		fmt.Fprintln(os.Stderr, "starting Caddy:", err)
		os.Exit(1)
	}
	code := m.Run()
	_ = caddy.Stop()
	os.RemoveAll(dir)
	os.Exit(code)
}

// globals returns the global options block every test config needs, with
// extra options (e.g. a rate_limit global option) inside it.
func globals(extra string) string {
	return fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	http_port %d
	https_port %d
	grace_period 1ns
	persist_config off
	%s
}
`, adminPort, httpPort, httpsPort, extra)
}

// config returns a Caddyfile: the global options with extra, then one
// http://localhost site with body.
func config(extra, body string) string {
	return globals(extra) + fmt.Sprintf("http://localhost:%d {\n%s\n}\n", httpPort, body)
}

func newTester(t *testing.T) *caddytest.Tester {
	t.Helper()
	return caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: adminPort})
}

// get sends a GET to path on the test site with the given headers
// ("Name: value") and returns the status, the body and the response.
func get(t *testing.T, tc *caddytest.Tester, path string, headers ...string) (int, string, *http.Response) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, baseURL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ": ")
		req.Header.Set(name, value)
	}
	return do(t, tc.Client, req)
}

func do(t *testing.T, c *http.Client, req *http.Request) (int, string, *http.Response) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body), resp
}

// codes sends n GETs and returns their status codes, e.g. "200 200 429".
func codes(t *testing.T, tc *caddytest.Tester, n int, path string, headers ...string) string {
	t.Helper()
	var out []string
	for range n {
		code, _, _ := get(t, tc, path, headers...)
		out = append(out, fmt.Sprint(code))
	}
	return strings.Join(out, " ")
}

// load posts a config to the admin endpoint and returns the error Caddy
// reports, if any. Unlike caddytest.AssertLoadError it uses this package's
// admin port, and it does not wait for the config to be running.
func load(t *testing.T, cfg, adapter string) error {
	t.Helper()
	ct := "application/json"
	if adapter == "caddyfile" {
		ct = "text/caddyfile"
	}
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, adminURL+"/load", bytes.NewBufferString(cfg))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", ct)
	req.Header.Set("Cache-Control", "must-revalidate")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%d: %s", resp.StatusCode, body)
	}
	return nil
}

// clientFrom returns an HTTP client whose connections come from the local
// address ip (any address in 127.0.0.0/8 is this host on Linux).
func clientFrom(ip string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, fmt.Sprintf("127.0.0.1:%d", httpPort))
		},
		DisableKeepAlives: true,
	}}
}
