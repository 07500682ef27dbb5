package layer4

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// withAPI returns a Caddyfile whose global options turn on the admin API on
// apiPort and hold extra, with body after the global options' layer4 block
// (one layer4 server on l4Addr with the given routes) and sites.
func withAPI(extra, routes, sites string) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	persist_config off
	%s
	layer4 {
		%s {
			%s
		}
	}
}
%s`, apiPort, extra, l4Addr, routes, sites)
}

// Scenario 1 of issue 22: a global zone with action log, shared by a layer4
// server and an HTTP site, is a dry run for both. Over its limit, the
// connections are echoed, not closed, and counted as logged, as the
// requests are; nothing over the limit is charged.
func TestDryRunZoneClosesNoConnection(t *testing.T) {
	load(t, withAPI(`rate_limit {
		zone dry {
			key {client_ip}
			events 1
			burst 1
			window 1h
			ipv4_prefix 24
			action log
		}
	}`, `@flood rate_limit zone dry
			route @flood {
				close
			}
			route {
				echo
			}`, fmt.Sprintf(`
http://127.0.0.1:%d {
	rate_limit dry
	respond "OK" 200
}
`, httpPort)))
	var got []string
	for _, src := range []string{"127.0.30.1", "127.0.30.2", "127.0.30.3"} {
		if echoes(t, src) {
			got = append(got, "echoed")
		} else {
			got = append(got, "closed")
		}
	}
	for _, src := range []string{"127.0.31.1", "127.0.31.2", "127.0.31.3"} {
		code, err := httpGetFrom(src, fmt.Sprintf("http://127.0.0.1:%d/", httpPort))
		got = append(got, fmt.Sprint(code, err))
	}
	if want := "[echoed echoed echoed 200 <nil> 200 <nil> 200 <nil>]"; fmt.Sprint(got) != want {
		t.Errorf("a dry-run zone: %v, want %s", got, want)
	}
	c := counts(t, "dry")
	if c.Connections == nil || *c.Connections != (Outcomes{Allowed: 1, Logged: 2}) || c.Requests != (Outcomes{Allowed: 1, Logged: 2}) {
		t.Errorf("counted connections %+v and requests %+v, want 1 allowed and 2 logged of each", c.Connections, c.Requests)
	}
	// The logged connections charged nothing: the network has spent the
	// one connection it was allowed, no more (a charge over the limit would
	// be debt, below zero).
	if r := remaining(t, "dry", "127.0.30.1"); r != 0 {
		t.Errorf("127.0.30.0/24 has %d left, want 0", r)
	}
}

// A zone with action delay cannot serve a layer4 matcher: holding a
// connection would keep a socket and a goroutine for every connection of a
// flood. The config fails to load, saying so.
func TestDelayZoneIsRefusedForConnections(t *testing.T) {
	err := tryLoad(withAPI(`rate_limit {
		zone held {
			events 1
			burst 1
			window 1h
			action delay 1s
		}
	}`, `@flood rate_limit zone held
			route @flood {
				close
			}`, ""))
	if err == nil || !strings.Contains(err.Error(), `zone "held" has action delay`) {
		t.Fatalf("loading a layer4 matcher of a delay zone: %v, want an error naming the zone and its action", err)
	}
}

// perNetwork is a global zone of 4 connections per /24 and hour.
const perNetwork = `rate_limit {
		zone per_net {
			events 4
			burst 4
			window 1h
			ipv4_prefix 24
		}
	}`

// Scenario 2 of issue 22: the same @flood in two routes, around a route that
// reads bytes (so the second is asked after the first), costs a connection
// one token: 4 connections of a network pass, the fifth is closed.
func TestOneTokenPerConnectionAcrossRoutes(t *testing.T) {
	load(t, withAPI(perNetwork, `@flood rate_limit zone per_net
			route @flood {
				close
			}
			@http http
			route @http {
				close
			}
			route @flood {
				close
			}
			route {
				echo
			}`, ""))
	fourOfFive(t, "127.0.32")
}

// fourOfFive checks that of 5 connections from the /24 network (each sending
// a line that is not HTTP), the zone per_net echoes the first 4 and closes
// the fifth, and counts them so.
func fourOfFive(t *testing.T, network string) {
	t.Helper()
	var got []bool
	for i := 1; i <= 5; i++ {
		src := fmt.Sprintf("%s.%d", network, i)
		got = append(got, echoesAfter(t, src, "ping from "+src+"\n"))
	}
	if fmt.Sprint(got) != "[true true true true false]" {
		t.Errorf("echoed: %v, want the first 4", got)
	}
	if c := counts(t, "per_net"); c.Connections == nil || *c.Connections != (Outcomes{Allowed: 4, Denied: 1}) {
		t.Errorf("counted %+v, want 4 allowed and 1 denied", c.Connections)
	}
}

// Two matcher sets naming one zone, each asking it (their other matcher
// matches): a connection costs one token, not one per set.
func TestOneTokenPerConnectionAcrossMatcherSets(t *testing.T) {
	load(t, withAPI(perNetwork, `@a {
				remote_ip 127.0.0.0/8
				rate_limit zone per_net
			}
			@b {
				remote_ip 127.0.0.0/16
				rate_limit zone per_net
			}
			route @a @b {
				close
			}
			route {
				echo
			}`, ""))
	fourOfFive(t, "127.0.33")
}

// proxyLimit is a global zone of 2 connections per /24 and hour, and
// proxyHandler caddy-l4's proxy_protocol handler trusting the load balancer
// at 127.0.66.0/24.
const (
	proxyLimit = `rate_limit {
		zone behind_lb {
			events 2
			burst 2
			window 1h
			ipv4_prefix 24
		}
	}`
	proxyHandler = `proxy_protocol {
					allow 127.0.66.0/24
				}`
	floodRoute = `@flood rate_limit zone behind_lb
			route @flood {
				close
			}
			route {
				echo
			}`
)

// header is a PROXY protocol v1 header for a connection from client.
func header(client string) string {
	return fmt.Sprintf("PROXY TCP4 %s 127.0.0.1 40000 %d\r\n", client, l4Port)
}

// throughProxy checks, for connections through the load balancer at
// 127.0.66.1 from three clients, that the clients are limited and the
// balancer is not: 192.0.2.1 gets 2 connections, 198.51.100.1 a first one.
// split sends each header in two pieces, each read by the server on its
// own.
func throughProxy(t *testing.T, split bool) {
	t.Helper()
	var got []bool
	for _, client := range []string{"192.0.2.1", "192.0.2.2", "192.0.2.3", "198.51.100.1"} {
		pieces := []string{header(client), "ping from " + client}
		if split {
			pieces = []string{"PROX", header(client)[4:], "ping from " + client}
		}
		got = append(got, echoesAfter(t, "127.0.66.1", pieces...))
	}
	if fmt.Sprint(got) != "[true true false true]" {
		t.Errorf("echoed: %v, want [true true false true]: two connections from 192.0.2.0/24, one from 198.51.100.0/24", got)
	}
	if r := remaining(t, "behind_lb", "127.0.66.1"); r != 2 {
		t.Errorf("the load balancer's network has %d connections left, want 2: it was charged", r)
	}
	if r := remaining(t, "behind_lb", "198.51.100.1"); r != 1 {
		t.Errorf("198.51.100.0/24 has %d connections left, want 1", r)
	}
}

// Scenario 3 of issue 22, documented order 1: an unconditional
// proxy_protocol route first.
func TestProxyProtocolRouteFirstLimitsTheClient(t *testing.T) {
	load(t, withAPI(proxyLimit, `route {
				`+proxyHandler+`
			}
			`+floodRoute, ""))
	throughProxy(t, false)
}

// Documented order 2: a `@pp proxy_protocol` route first, with the header
// arriving in two pieces, so that the rate_limit route is asked while the
// @pp route still waits for the rest of the header.
func TestProxyProtocolMatcherRouteFirstLimitsTheClient(t *testing.T) {
	load(t, withAPI(proxyLimit, `@pp proxy_protocol
			route @pp {
				`+proxyHandler+`
			}
			`+floodRoute, ""))
	throughProxy(t, true)
}

// An order that limits the load balancer: the rate_limit route before the
// proxy_protocol route. The config loads, with a warning that says how to
// fix it.
func TestRateLimitBeforeProxyProtocolWarns(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	load(t, withAPI(proxyLimit+"\n"+testcaddy.JSONLog("", logFile, "level WARN"), `@flood rate_limit zone behind_lb
			route @flood {
				close
			}
			route {
				`+proxyHandler+`
			}
			route {
				echo
			}`, ""))
	logs, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(logs), "a proxy_protocol handler or listener wrapper comes after a rate_limit matcher") {
		t.Errorf("no warning at load about the order; log:\n%s", logs)
	}
}

// In front of HTTP, the layer4 listener wrapper before the proxy_protocol
// one limits the load balancer too: the config loads with the warning. (No
// connection is made: caddy-l4's wrapper races with net/http under -race.)
func TestLayer4WrapperBeforeProxyProtocolWrapperWarns(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	load(t, fmt.Sprintf(`{
	admin off
	persist_config off
	%s
	%s
	servers 127.0.0.1:%d {
		listener_wrappers {
			layer4 {
				@flood rate_limit zone behind_lb
				route @flood {
					close
				}
			}
			proxy_protocol {
				allow 127.0.66.0/24
			}
			tls
		}
	}
}

http://127.0.0.1:%d {
	bind 127.0.0.1
	respond "OK" 200
}
`, testcaddy.JSONLog("", logFile, "level WARN"), proxyLimit, httpPort, httpPort))
	logs, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(logs), "a proxy_protocol handler or listener wrapper comes after a rate_limit matcher") {
		t.Errorf("no warning at load about the order; log:\n%s", logs)
	}
}

// A flood of connections is logged as a flood of requests is: one INFO line
// per network and interval, naming the zone, the client and the network,
// with the drops not logged at INFO counted in the next; and `caddy
// rate-limit zones` shows the connections of a zone only layer4 uses.
func TestConnectionFloodIsLoggedAndListed(t *testing.T) {
	file := filepath.Join(t.TempDir(), "l4.log")
	load(t, withAPI(testcaddy.JSONLog("l4", file, "include layer4.matchers.rate_limit"), `@flood rate_limit {
				name l4_logged
				events 2
				burst 2
				window 1h
			}
			route @flood {
				close
			}
			route {
				echo
			}`, ""))
	var got []bool
	for i := range 6 {
		got = append(got, echoes(t, fmt.Sprintf("127.0.50.%d", i+1)))
	}
	if fmt.Sprint(got) != "[true true false false false false]" {
		t.Fatalf("echoed: %v, want the first 2", got)
	}
	out, err := testcaddy.RateLimit(t, apiPort, "zones")
	if err != nil || !strings.Contains(out, "\nzone l4_logged: layer4 connections: 2 allowed, 4 denied, 0 logged\n") {
		t.Errorf("rate-limit zones: %v\n%s", err, out)
	}
	// The denied connections' network heads /top, as an HTTP zone's
	// denied requests would.
	out, err = testcaddy.RateLimit(t, apiPort, "top", "l4_logged")
	if err != nil || !regexp.MustCompile(`\n127\.0\.50\.0/24 +4 +0\n`).MatchString(out) {
		t.Errorf("rate-limit top l4_logged: %v\n%s", err, out)
	}
	_ = caddy.Stop() // closes the log file
	lines := testcaddy.LogEntries(t, file, "connection rate", "level", "msg", "zone", "client_ip", "source", "outcome")
	if want := "[info connection rate exceeded l4_logged 127.0.50.3 127.0.50.0/24 denied]"; fmt.Sprint(lines) != want {
		t.Errorf("log: %v, want %s", lines, want)
	}
}
