package layer4

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// concServer is a layer4 server whose first route closes the connections of
// a network that holds max open already (an inline limit named "open", of
// max_concurrent alone), and whose later routes read the first 4 bytes:
// "echo" is echoed until the client closes, "quit" is closed by the close
// handler, anything else matches no route and is closed by the server, and
// a client that sends nothing is closed at the matching timeout (timeout,
// or a minute if "").
func concServer(max int, timeout string) string {
	mt := "1m"
	if timeout != "" {
		mt = timeout
	}
	return withAPI("", fmt.Sprintf(`matching_timeout %s
			@flood rate_limit {
				name open
				max_concurrent %d
			}
			route @flood {
				close
			}
			@quit regexp ^quit 4
			route @quit {
				close
			}
			@echo regexp ^echo 4
			route @echo {
				echo
			}`, mt, max), "")
}

// openEcho connects from src and reports whether the server admitted the
// connection: it echoes what it is sent, and keeps it open until the test
// ends or the caller closes it.
func openEcho(t *testing.T, src string) (net.Conn, bool) {
	t.Helper()
	c, err := dialFrom(src, l4Addr)
	if err != nil {
		t.Fatalf("dial from %s: %v", src, err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(ioDeadline))
	msg := "echo from " + src
	if _, err := c.Write([]byte(msg)); err != nil {
		return c, false
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return c, false
	}
	_ = c.SetDeadline(time.Time{})
	return c, string(got) == msg
}

// ConcurrentCounts is the part of GET /rate_limit/zones/{zone} that says
// its places.
type ConcurrentCounts struct {
	Concurrent *struct {
		MaxConcurrent int64 `json:"max_concurrent"`
		InFlight      int64 `json:"in_flight"`
		Denied        uint64
	}
	Connections *Outcomes
}

func inFlight(t *testing.T, zone string) ConcurrentCounts {
	t.Helper()
	var cc ConcurrentCounts
	adminGet(t, "/rate_limit/zones/"+zone, &cc)
	if cc.Concurrent == nil {
		t.Fatalf("zone %s: the admin API shows no places", zone)
	}
	return cc
}

// waitInFlight waits until zone holds want places, for at most ioDeadline:
// a place comes back within a sweep of its connection's close.
func waitInFlight(t *testing.T, zone string, want int64) {
	t.Helper()
	deadline := time.Now().Add(ioDeadline)
	for {
		got := inFlight(t, zone).Concurrent.InFlight
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("zone %s holds %d places %v on, want %d", zone, got, ioDeadline, want)
		}
		time.Sleep(10 * time.Millisecond) // waiting for the server to close, not for a rate
	}
}

// n + 1 connections of one network open at once: n are served and the
// last is closed, while another network is served; the admin API counts
// the places and the denial.
func TestMaxConcurrentLimitsOpenConnections(t *testing.T) {
	load(t, concServer(2, ""))
	for i := 1; i <= 2; i++ {
		if _, ok := openEcho(t, fmt.Sprintf("127.0.40.%d", i)); !ok {
			t.Fatalf("connection %d of 127.0.40.0/24 was refused with max_concurrent 2", i)
		}
	}
	if _, ok := openEcho(t, "127.0.40.3"); ok {
		t.Fatal("a third connection of 127.0.40.0/24 was served with max_concurrent 2")
	}
	if _, ok := openEcho(t, "127.0.41.1"); !ok {
		t.Fatal("another network was refused while 127.0.40.0/24 held its places")
	}
	cc := inFlight(t, "open")
	if cc.Concurrent.InFlight != 3 || cc.Concurrent.MaxConcurrent != 2 || cc.Concurrent.Denied != 1 ||
		cc.Connections == nil || cc.Connections.Allowed != 3 || cc.Connections.Denied != 1 {
		t.Fatalf("admin API: %+v, connections %+v; want 3 in flight of max 2, 1 denied, 3 allowed", *cc.Concurrent, cc.Connections)
	}
}

// Each way a connection ends gives its place back, one at a time: the
// network holds its one place, the connection ends, and the place is there
// for the next connection. caddy-l4 evaluates the rate_limit route again
// after every read of bytes for the later routes: each connection still
// holds one place, not one per evaluation.
func TestEveryWayAConnectionEndsGivesItsPlaceBack(t *testing.T) {
	for _, tt := range []struct {
		name    string
		end     func(t *testing.T, c net.Conn)
		timeout string // the server's matching timeout, if not a minute
	}{
		{"client closes while matched", func(t *testing.T, c net.Conn) { c.Close() }, ""},
		{"client closes while echoed", func(t *testing.T, c net.Conn) {
			_ = c.SetDeadline(time.Now().Add(ioDeadline))
			if _, err := c.Write([]byte("echo")); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
				t.Fatalf("not echoed: %v", err)
			}
			c.Close()
		}, ""},
		{"handler closes", func(t *testing.T, c net.Conn) { _, _ = c.Write([]byte("quit")) }, ""},
		{"no route matches", func(t *testing.T, c net.Conn) { _, _ = c.Write([]byte("nope")) }, ""},
		// Long enough for the checks before it, even under the race
		// detector on a busy machine.
		{"matching times out", func(t *testing.T, c net.Conn) {}, "3s"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			load(t, concServer(1, tt.timeout))
			src := "127.0.42.1"
			c, err := dialFrom(src, l4Addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			waitInFlight(t, "open", 1)
			if _, ok := openEcho(t, src); ok {
				t.Fatal("a second connection was served with max_concurrent 1")
			}
			tt.end(t, c)
			waitInFlight(t, "open", 0)
			if _, ok := openEcho(t, src); !ok {
				t.Fatal("the place given back was not there for the next connection")
			}
			if cc := inFlight(t, "open"); cc.Concurrent.InFlight != 1 {
				t.Fatalf("one connection open holds %d places", cc.Concurrent.InFlight)
			}
		})
	}
}

// A connection admitted under one config gives its place back into the
// table the next config uses, and a reload that changes max_concurrent
// keeps the places in use.
func TestReloadMidConnectionKeepsAndGivesBackPlaces(t *testing.T) {
	load(t, concServer(2, ""))
	var old []net.Conn
	for i := 1; i <= 2; i++ {
		c, ok := openEcho(t, fmt.Sprintf("127.0.43.%d", i))
		if !ok {
			t.Fatalf("connection %d refused", i)
		}
		old = append(old, c)
	}
	load(t, concServer(3, ""))
	if _, ok := openEcho(t, "127.0.43.3"); !ok {
		t.Fatal("max_concurrent raised to 3 with 2 open: the third was refused")
	}
	if _, ok := openEcho(t, "127.0.43.4"); ok {
		t.Fatal("a fourth connection was served: the reload lost the places of the connections open across it")
	}
	for _, c := range old {
		c.Close()
	}
	waitInFlight(t, "open", 1)
	for i := 5; i <= 6; i++ {
		if _, ok := openEcho(t, fmt.Sprintf("127.0.43.%d", i)); !ok {
			t.Fatalf("connection %d refused: the connections of the old config did not give their places back", i)
		}
	}
}

// A flood of connections from many networks, each opened and closed, leaves
// no place held and the heap where it was: what a connection holds goes
// with it.
func TestPlacesOfAFloodAllComeBack(t *testing.T) {
	load(t, concServer(1, ""))
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapInuse
	}
	round := func(r int) {
		for i := 0; i < 500; i++ {
			src := fmt.Sprintf("127.%d.%d.1", 100+r, i%250)
			c, ok := openEcho(t, src)
			if !ok && i < 250 {
				t.Fatalf("round %d: connection %d from %s refused", r, i, src)
			}
			c.Close()
		}
		waitInFlight(t, "open", 0)
	}
	round(0)
	before := heap()
	for r := 1; r <= 3; r++ {
		round(r)
	}
	after := heap()
	if after > before+4<<20 {
		t.Fatalf("heap in use grew from %d to %d bytes over 1500 connections that are all closed", before, after)
	}
}

// In the listener wrapper, a connection that goes on to HTTPS holds its
// place while net/http keeps it open, and gives it back when it closes: n
// open TLS connections of a network, and the next is closed before its
// handshake while another network's completes; once one of the n closes,
// the network's next connection is served. Also behind Caddy's
// http_redirect wrapper (the order Caddy's docs show), whose connections
// the matcher sees through to the socket: it refused them all, unable to
// watch their close.
func TestListenerWrapperHoldsPlacesWhileHTTPKeepsConnectionsOpen(t *testing.T) {
	for _, before := range []string{"", "http_redirect"} {
		t.Run("after "+before, func(t *testing.T) { wrapperHoldsPlaces(t, before) })
	}
}

func wrapperHoldsPlaces(t *testing.T, before string) {
	startCaddy(t, httpsCaddyfile("", before+`
			layer4 {
				@flood rate_limit {
					name open
					max_concurrent 2
				}
				route @flood {
					close
				}
			}`, ""))
	dial := func(src string) (*tls.Conn, error) {
		dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: ioDeadline}
		return tls.DialWithDialer(dialer, "tcp", fmt.Sprintf("127.0.0.1:%d", httpsPort),
			&tls.Config{InsecureSkipVerify: true, ServerName: "localhost"})
	}
	var open []*tls.Conn
	for i := 1; i <= 2; i++ {
		c, err := dial(fmt.Sprintf("127.0.44.%d", i))
		if err != nil {
			t.Fatalf("connection %d of 127.0.44.0/24: %v", i, err)
		}
		t.Cleanup(func() { c.Close() })
		open = append(open, c)
	}
	if c, err := dial("127.0.44.3"); err == nil {
		c.Close()
		t.Fatal("a third connection of 127.0.44.0/24 completed its handshake with max_concurrent 2")
	}
	if c, err := dial("127.0.45.1"); err != nil {
		t.Fatalf("another network was refused while 127.0.44.0/24 held its places: %v", err)
	} else {
		c.Close()
	}
	var zc struct {
		Concurrent struct {
			InFlight int64 `json:"in_flight"`
		}
	}
	testcaddy.JSON(t, http.DefaultClient, testcaddy.Request(t, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/rate_limit/zones/open", adminPort)), &zc)
	if zc.Concurrent.InFlight < 2 {
		t.Fatalf("%d places in flight with two TLS connections open", zc.Concurrent.InFlight)
	}
	open[0].Close()
	deadline := time.Now().Add(ioDeadline)
	for i := 4; ; i++ {
		c, err := dial(fmt.Sprintf("127.0.44.%d", i))
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v after one of its connections closed, 127.0.44.0/24 is still refused: %v", ioDeadline, err)
		}
		time.Sleep(20 * time.Millisecond) // waiting for the server to close, not for a rate
	}
}

// Behind a load balancer (documented order 1, an unconditional
// proxy_protocol route first), the places are the clients' networks', not
// the balancer's, and each is given back when its connection closes.
func TestMaxConcurrentBehindProxyProtocolCountsTheClients(t *testing.T) {
	load(t, withAPI(`rate_limit {
		zone behind_lb_conc {
			max_concurrent 1
			ipv4_prefix 24
		}
	}`, `route {
				`+proxyHandler+`
			}
			@flood rate_limit zone behind_lb_conc
			route @flood {
				close
			}
			route {
				echo
			}`, ""))
	through := func(client string) (net.Conn, bool) {
		t.Helper()
		c, err := dialFrom("127.0.66.1", l4Addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(ioDeadline))
		msg := "ping from " + client
		if _, err := c.Write([]byte(header(client) + msg)); err != nil {
			return c, false
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil {
			return c, false
		}
		return c, string(got) == msg
	}
	first, ok := through("192.0.2.1")
	if !ok {
		t.Fatal("the first client connection was refused")
	}
	if _, ok := through("192.0.2.2"); ok {
		t.Fatal("a second connection of 192.0.2.0/24 was served with max_concurrent 1")
	}
	if _, ok := through("198.51.100.1"); !ok {
		t.Fatal("another client network behind the same balancer was refused: the balancer was counted")
	}
	first.Close()
	waitInFlight(t, "behind_lb_conc", 1)
	if _, ok := through("192.0.2.3"); !ok {
		t.Fatal("192.0.2.0/24 was still refused after its connection closed")
	}
}
