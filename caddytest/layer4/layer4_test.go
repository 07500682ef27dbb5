// Package layer4 tests floodgate's layer4.matchers.rate_limit in a real Caddy
// on loopback: in process (caddy.Load) for a layer4 server, and as a real
// caddy process built from ./cmd/caddy for the caddy.listeners.layer4
// listener wrapper in front of an HTTPS site, because caddy-l4 v0.1.2's
// wrapper has a data race of its own (layer4/listener.go reads a connection's
// byte counters after handing it to net/http) that would fail `go test
// -race`; out of process, the race detector does not see it.
//
// Ports: admin (of the caddy process; apiPort for the in-process Caddy),
// layer4 listener, HTTPS and HTTP, each picked free when the package starts
// (testcaddy.MustFreePorts), so that two copies of the suite can run side by
// side.
//
// Clients bind to chosen loopback addresses (Linux routes all of 127.0.0.0/8
// to lo), so each test floods from its own /24. Tests do not call
// t.Parallel: caddy.Load replaces the one config. No test sleeps: windows are
// an hour, so no token returns during a test.
//
// Every connection is new, and caddy-l4 closes the replaced config's
// listeners before caddy.Load returns (unlike the HTTP app, whose servers
// close theirs in goroutines; see ../main_test.go's settle), so no connection
// made after a load meets the old config.
package layer4

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/floodgate-rl/floodgate"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

const ioDeadline = 5 * time.Second

// The package's ports, set by TestMain.
var (
	adminPort, apiPort, l4Port, httpsPort, httpPort int
	l4Addr                                          string
)

func TestMain(m *testing.M) {
	ports := testcaddy.MustFreePorts(5)
	adminPort, apiPort, l4Port, httpsPort, httpPort = ports[0], ports[1], ports[2], ports[3], ports[4]
	l4Addr = fmt.Sprintf("127.0.0.1:%d", l4Port)
	// Keep Caddy's instance ID, autosave and local CA out of $HOME.
	dir, err := os.MkdirTemp("", "floodgate-layer4-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Setenv("XDG_DATA_HOME", dir)
	os.Setenv("XDG_CONFIG_HOME", dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// echoServer returns a Caddyfile with a layer4 echo server on l4Port whose
// first route closes connections the matcher (a Caddyfile matcher body)
// matches, and extra global options.
func echoServer(extra, matcher string) string {
	return fmt.Sprintf(`{
	admin off
	persist_config off
	%s
	layer4 {
		%s {
			@flood rate_limit %s
			route @flood {
				close
			}
			route {
				echo
			}
		}
	}
}
`, extra, l4Addr, matcher)
}

// load runs a Caddyfile in this process, replacing any config, and stops it
// when the test ends.
func load(t *testing.T, caddyfile string) {
	t.Helper()
	if err := tryLoad(caddyfile); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
}

func tryLoad(caddyfile string) error {
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		return fmt.Errorf("adapt: %v", err)
	}
	return caddy.Load(cfg, true)
}

// dialFrom connects to addr from the loopback address src.
func dialFrom(src, addr string) (net.Conn, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: ioDeadline}
	return d.Dial("tcp", addr)
}

// echoes reports whether a connection from src gets its bytes back; false
// means the server closed it without a word.
func echoes(t *testing.T, src string) bool {
	t.Helper()
	return echoesAfter(t, src, "ping from "+src)
}

// echoesAfter reports whether a connection from src that sends the pieces
// gets back the last of them: the earlier ones are for the server's routes
// to read (a PROXY protocol header). Each piece but the last is read by the
// server before the next is sent, so the routes see them one at a time.
func echoesAfter(t *testing.T, src string, pieces ...string) bool {
	t.Helper()
	c, err := dialFrom(src, l4Addr)
	if err != nil {
		t.Fatalf("dial from %s: %v", src, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(ioDeadline))
	for _, p := range pieces[:len(pieces)-1] {
		if _, err := c.Write([]byte(p)); err != nil {
			return false
		}
		if !readByServer(t, c) {
			return false
		}
	}
	msg := []byte(pieces[len(pieces)-1])
	if _, err := c.Write(msg); err != nil {
		return false // reset before the write: closed
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("connection from %s neither echoed nor closed within %v", src, ioDeadline)
		}
		return false
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("connection from %s: echo %q, want %q", src, got, msg)
	}
	return true
}

// expectEchoes checks, in order, which sources are echoed.
func expectEchoes(t *testing.T, want map[string]bool, order ...string) {
	t.Helper()
	for i, src := range order {
		if got := echoes(t, src); got != want[src] {
			t.Fatalf("connection %d from %s: echoed = %v, want %v", i+1, src, got, want[src])
		}
	}
}

func TestLayer4ServerClosesFloodingNetwork(t *testing.T) {
	load(t, echoServer("", `{
				events 3
				window 1h
				burst 3
				ipv4_prefix 24
				ipv6_prefix 48
			}`))
	expectEchoes(t, map[string]bool{"127.0.9.1": true, "127.0.9.2": true, "127.0.9.3": true, "127.0.10.1": true},
		"127.0.9.1", "127.0.9.2", "127.0.9.3", "127.0.9.4", "127.0.9.5", "127.0.10.1")
	// The network stays closed for its first address too.
	expectEchoes(t, nil, "127.0.9.1")
}

func TestGlobalZoneLimitsLayer4Connections(t *testing.T) {
	load(t, echoServer(`rate_limit {
		zone l4_global {
			events 3
			window 1h
			ipv4_prefix 24
		}
	}`, "zone l4_global"))
	expectEchoes(t, map[string]bool{"127.0.11.1": true, "127.0.11.2": true, "127.0.11.3": true, "127.0.12.1": true},
		"127.0.11.1", "127.0.11.2", "127.0.11.3", "127.0.11.4", "127.0.12.1")
}

// A reload keeps what each network consumed; a raised limit gives an
// exhausted network the difference at once, when the new config starts; a
// reload that fails to load changes nothing.
func TestInlineLimitSurvivesReloads(t *testing.T) {
	limit := func(events int, extra string) string {
		return echoServer("", fmt.Sprintf(`{
				name l4_reload
				events %d
				window 1h
			}
			%s`, events, extra))
	}
	load(t, limit(3, ""))
	expectEchoes(t, map[string]bool{"127.0.13.1": true, "127.0.13.2": true, "127.0.13.3": true},
		"127.0.13.1", "127.0.13.2", "127.0.13.3", "127.0.13.4")

	// Same settings, forced reload: still exhausted.
	load(t, limit(3, ""))
	expectEchoes(t, nil, "127.0.13.5")

	// A failed reload that would raise the limit: the unknown zone fails
	// the config after the new inline limit was provisioned.
	err := tryLoad(limit(10, `@other rate_limit zone no_such_zone
			route @other {
				close
			}`))
	if err == nil || !strings.Contains(err.Error(), `zone "no_such_zone"`) {
		t.Fatalf("loading a config with an unknown zone: %v, want an error naming it", err)
	}
	expectEchoes(t, nil, "127.0.13.6")

	// Raised to 4: one more connection, then closed again.
	load(t, limit(4, ""))
	expectEchoes(t, map[string]bool{"127.0.13.7": true}, "127.0.13.7", "127.0.13.8")
}

// Two layer4 matchers with the same settings and no name share one limit (the
// settings are their identity): each checks its half of 127.0.14.0/24, and
// with 3 per hour for the /24, the fourth connection is closed whichever
// half it comes from. Separate limits would give each half three.
func TestIdenticalUnnamedLimitsShareState(t *testing.T) {
	load(t, fmt.Sprintf(`{
	admin off
	persist_config off
	layer4 {
		%s {
			@low {
				remote_ip 127.0.14.0/25
				rate_limit {
					events 3
					burst 3
					window 1h
				}
			}
			@high {
				remote_ip 127.0.14.128/25
				rate_limit {
					events 3
					burst 3
					window 1h
				}
			}
			route @low @high {
				close
			}
			route {
				echo
			}
		}
	}
}
`, l4Addr))
	expectEchoes(t, map[string]bool{"127.0.14.1": true, "127.0.14.129": true, "127.0.14.2": true},
		"127.0.14.1", "127.0.14.129", "127.0.14.2", "127.0.14.130")
}

// Two unnamed limits that differ only in their table's size are two zones,
// each named by its settings and size: the config loads, and each limit
// counts on its own. Before, both got the name layer4_3_per_1h_burst_3 and
// the config was refused as one zone defined twice, with advice for HTTP
// zones.
func TestUnnamedLimitsDifferingInSizeAreTwoZones(t *testing.T) {
	load(t, fmt.Sprintf(`{
	admin off
	persist_config off
	layer4 {
		%s {
			@small {
				remote_ip 127.0.15.0/25
				rate_limit {
					events 3
					burst 3
					window 1h
					memory 4KiB
				}
			}
			@large {
				remote_ip 127.0.15.128/25
				rate_limit {
					events 3
					burst 3
					window 1h
					memory 8KiB
				}
			}
			route @small @large {
				close
			}
			route {
				echo
			}
		}
	}
}
`, l4Addr))
	// Each network's first three connections echo, whatever the other's.
	expectEchoes(t, map[string]bool{"127.0.15.1": true, "127.0.15.129": true},
		"127.0.15.1", "127.0.15.129")
}

// Configs that must fail to load, with an error naming the field and value.
func TestInvalidConfigsFailToLoad(t *testing.T) {
	for _, tc := range []struct {
		name, match, apps, want string
	}{
		{"unknown zone", `{"zone":"nope"}`, "", `zone "nope" is not defined`},
		{"no limit", `{}`, "", "rate_limit: max_events is required"},
		{"no window", `{"max_events":3}`, "", "rate_limit: window is required"},
		{"bad prefix", `{"max_events":3,"window":"1h","ipv4_prefix":40}`, "", "ipv4_prefix 40"},
		{"zone and limit", `{"zone":"z","max_events":3}`, "", "zone z: uses the global zone's settings"},
		{"memory and sources", `{"max_events":3,"window":"1h","memory":65536,"sources":10}`, "", "memory 65536"},
		{"memory too small", `{"max_events":3,"window":"1h","memory":10}`, "", "memory 10"},
		{"name taken by another zone", `{"name":"taken","max_events":3,"window":"1h"}`,
			`"rate_limit":{"zones":{"taken":{"max_events":5,"window":"1m"}}},`, `zone "taken" is defined twice, differently (ipv4_prefix unset and 24, ipv6_prefix unset and 48, max_events 5 and 3, window 1m0s and 1h0m0s)`},
		{"bad name", `{"name":"a b","max_events":3,"window":"1h"}`, "", `zone name "a b"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfgJSON := fmt.Sprintf(`{"admin":{"disabled":true,"config":{"persist":false}},"apps":{%s
				"layer4":{"servers":{"s":{"listen":[%q],"routes":[
					{"match":[{"rate_limit":%s}],"handle":[{"handler":"close"}]}]}}}}}`,
				tc.apps, l4Addr, tc.match)
			var cfg caddy.Config
			if err := json.Unmarshal([]byte(cfgJSON), &cfg); err != nil {
				t.Fatal(err)
			}
			err := caddy.Validate(&cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}
