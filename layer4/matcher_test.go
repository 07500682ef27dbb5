package layer4

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// fakeConn is a connection with chosen addresses. Its embedded Conn is nil,
// so any read or write panics: the matcher must read nothing.
type fakeConn struct {
	net.Conn
	remote, local net.Addr // local: 127.0.0.1:9580 if nil
}

func (f *fakeConn) RemoteAddr() net.Addr { return f.remote }
func (f *fakeConn) LocalAddr() net.Addr {
	if f.local != nil {
		return f.local
	}
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9580}
}

func tcpConn(ip string) *layer4.Connection {
	a := net.ParseIP(ip)
	if a == nil {
		panic("bad test address " + ip)
	}
	return layer4.WrapConnection(&fakeConn{remote: &net.TCPAddr{IP: a, Port: 40000}}, nil, zap.NewNop())
}

// fakeZones stands in for the rate_limit app: it builds tables directly.
type fakeZones struct {
	global   map[string]Zone
	inline   []Inline
	released int
}

func (f *fakeZones) Layer4Zone(name string) (Zone, error) {
	z, ok := f.global[name]
	if !ok {
		return Zone{}, fmt.Errorf("zone %q is not defined", name)
	}
	return z, nil
}

func (f *fakeZones) Layer4Inline(in Inline) (Zone, func(), error) {
	f.inline = append(f.inline, in)
	b, err := limiter.NewBuckets(limiter.BucketsConfig{Limit: in.Rate(), Bytes: 64 << 10})
	if err != nil {
		return Zone{}, nil, err
	}
	return Zone{Name: in.Name, Buckets: b, IPv4Prefix: *in.IPv4Prefix, IPv6Prefix: *in.IPv6Prefix}, func() { f.released++ }, nil
}

func provisioned(t *testing.T, m *Matcher, zones Zones) *Matcher {
	t.Helper()
	if err := m.provision(zones, zap.NewNop()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Cleanup() })
	return m
}

// threePerHour is an inline limit no test outlives: no token returns.
func threePerHour() *Matcher {
	return &Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour)}}
}

func match(t *testing.T, m *Matcher, cx *layer4.Connection) bool {
	t.Helper()
	over, err := m.Match(cx)
	if err != nil {
		t.Fatalf("Match(%v) returned an error: %v", cx.RemoteAddr(), err)
	}
	return over
}

func TestConnectionIsChargedOnceHoweverOftenMatched(t *testing.T) {
	m := provisioned(t, threePerHour(), &fakeZones{})
	for i := 1; i <= 5; i++ {
		cx := tcpConn(fmt.Sprintf("10.0.0.%d", i))
		want := i > 3
		for run := 0; run < 4; run++ { // caddy-l4 may evaluate a route again after each read
			if got := match(t, m, cx); got != want {
				t.Fatalf("connection %d, evaluation %d: over = %v, want %v", i, run+1, got, want)
			}
		}
	}
}

func TestMatchersKeepSeparateVerdicts(t *testing.T) {
	zones := &fakeZones{}
	loose := provisioned(t, threePerHour(), zones)
	strict := provisioned(t, &Matcher{Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour)}}, zones)
	for i := 1; i <= 2; i++ {
		cx := tcpConn("10.0.0.1")
		if match(t, strict, cx) != (i > 1) || match(t, loose, cx) {
			t.Fatalf("connection %d: one matcher's verdict leaked into the other's", i)
		}
	}
}

func TestSourceNetworkSharesTheLimit(t *testing.T) {
	m := provisioned(t, threePerHour(), &fakeZones{})
	for _, ip := range []string{"192.0.2.1", "192.0.2.200", "192.0.2.77"} {
		if match(t, m, tcpConn(ip)) {
			t.Fatalf("%s: over before the /24 used its 3 connections", ip)
		}
	}
	if !match(t, m, tcpConn("192.0.2.9")) {
		t.Fatal("fourth connection from 192.0.2.0/24 was not over the limit")
	}
	if match(t, m, tcpConn("192.0.3.1")) {
		t.Fatal("192.0.3.1 is in another /24 but was over the limit")
	}
}

func TestIPv6NetworksAreGroupedBy48(t *testing.T) {
	m := provisioned(t, threePerHour(), &fakeZones{})
	for _, ip := range []string{"2001:db8:1::1", "2001:db8:1:ffff::1", "2001:db8:1:2:3:4:5:6"} {
		if match(t, m, tcpConn(ip)) {
			t.Fatalf("%s: over before its /48 used 3 connections", ip)
		}
	}
	if !match(t, m, tcpConn("2001:db8:1:9::9")) {
		t.Fatal("fourth connection from 2001:db8:1::/48 was not over")
	}
	if match(t, m, tcpConn("2001:db8:2::1")) {
		t.Fatal("2001:db8:2::1 is in another /48 but was over")
	}
}

// A dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d. Unmapped,
// they count per IPv4 /24; left mapped, all of IPv4 would share ::ffff:0:0/48.
func TestDualStackIPv4SourcesAreUnmapped(t *testing.T) {
	m := provisioned(t, threePerHour(), &fakeZones{})
	for _, ip := range []string{"::ffff:198.51.100.1", "198.51.100.2", "::ffff:198.51.100.3"} {
		if match(t, m, tcpConn(ip)) {
			t.Fatalf("%s: over too early", ip)
		}
	}
	if !match(t, m, tcpConn("198.51.100.4")) {
		t.Fatal("plain and mapped addresses of one /24 did not share its limit")
	}
	for _, ip := range []string{"::ffff:203.0.113.1", "::ffff:10.1.1.1", "::ffff:172.16.0.1", "::ffff:8.8.8.8"} {
		if match(t, m, tcpConn(ip)) {
			t.Fatalf("%s was over: mapped IPv4 sources were grouped as one IPv6 network", ip)
		}
	}
}

// counted is a global zone "edge" of limit l, grouped by /24 and /48, whose
// outcomes are tallied in counts.
func counted(t *testing.T, l limiter.Limit, counts map[Outcome]int) (*fakeZones, *limiter.Buckets) {
	t.Helper()
	b, err := limiter.NewBuckets(limiter.BucketsConfig{Limit: l, Bytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	count := func(o Outcome) { counts[o]++ }
	return &fakeZones{global: map[string]Zone{"edge": {Name: "edge", Buckets: b, IPv4Prefix: 24, IPv6Prefix: 48, Count: count}}}, b
}

func TestUnixSocketPassesUnmetered(t *testing.T) {
	counts := make(map[Outcome]int)
	zones, b := counted(t, limiter.Limit{Events: 1, Burst: 1, Window: time.Hour}, counts)
	m := provisioned(t, &Matcher{Zone: "edge"}, zones)
	for i := 0; i < 5; i++ {
		cx := layer4.WrapConnection(&fakeConn{remote: &net.UnixAddr{Name: "@", Net: "unix"}}, nil, zap.NewNop())
		if match(t, m, cx) {
			t.Fatalf("unix connection %d matched", i+1)
		}
	}
	if len(counts) != 0 {
		t.Errorf("unix connections were counted as decided: %v", counts)
	}
	// The key a source without an address would be charged to, had it one.
	empty := limiter.NetworkKey(netip.Addr{}, 24, 48)
	if d := b.Allow(empty.Bytes(), 1, time.Now()); !d.Allowed {
		t.Fatal("unix connections were charged to the empty key")
	}
}

// Match must work on a connection as caddy-l4 builds it, over a real
// net.Conn, and leave its bytes for the next matcher or handler.
func TestMatchReadsNothingFromAPipe(t *testing.T) {
	m := provisioned(t, &Matcher{Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Hour)}}, &fakeZones{})
	client, server := net.Pipe()
	defer client.Close()
	defer server.Close()
	addr := &net.TCPAddr{IP: net.IPv4(10, 9, 9, 9), Port: 5555}
	cx := layer4.WrapConnection(&addrConn{Conn: server, remote: addr}, []byte{}, zap.NewNop())
	if match(t, m, cx) {
		t.Fatal("first connection was over")
	}
	go func() { _, _ = client.Write([]byte("hi")) }()
	buf := make([]byte, 2)
	_ = cx.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := cx.Read(buf); err != nil || string(buf) != "hi" {
		t.Fatalf("after Match, read %q, %v; want the client's first bytes", buf, err)
	}
}

type addrConn struct {
	net.Conn
	remote net.Addr
}

func (a *addrConn) RemoteAddr() net.Addr { return a.remote }

// textAddr is an address type the matcher does not know, as a PROXY protocol
// wrapper might return.
type textAddr string

func (a textAddr) Network() string { return "tcp" }
func (a textAddr) String() string  { return string(a) }

func TestSourceIP(t *testing.T) {
	for _, tc := range []struct {
		addr net.Addr
		want string // "" for none
	}{
		{&net.TCPAddr{IP: net.ParseIP("::ffff:1.2.3.4"), Port: 1}, "1.2.3.4"},
		{&net.TCPAddr{IP: net.ParseIP("1.2.3.4").To4(), Port: 1}, "1.2.3.4"},
		{&net.TCPAddr{IP: net.ParseIP("fe80::1"), Port: 1, Zone: "eth0"}, "fe80::1"},
		{&net.UDPAddr{IP: net.ParseIP("2001:db8::1"), Port: 53}, "2001:db8::1"},
		{textAddr("[::ffff:5.6.7.8]:443"), "5.6.7.8"},
		{textAddr("pipe"), ""},
		{&net.UnixAddr{Name: "/run/caddy.sock", Net: "unix"}, ""},
		{&net.TCPAddr{}, ""},
		{nil, ""},
	} {
		ip, ok := SourceIP(tc.addr)
		got := ""
		if ok {
			got = ip.String()
		}
		if got != tc.want {
			t.Errorf("SourceIP(%v) = %q, want %q", tc.addr, got, tc.want)
		}
	}
}

func TestGlobalZoneGroupsByItsOwnPrefixes(t *testing.T) {
	b, err := limiter.NewBuckets(limiter.BucketsConfig{Limit: limiter.Limit{Events: 1, Window: time.Hour}, Bytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	zones := &fakeZones{global: map[string]Zone{"edge": {Name: "edge", Buckets: b, IPv4Prefix: 32, IPv6Prefix: 64}}}
	m := provisioned(t, &Matcher{Zone: "edge"}, zones)
	if match(t, m, tcpConn("10.0.0.1")) || !match(t, m, tcpConn("10.0.0.1")) {
		t.Fatal("a zone of one connection per hour did not stop the second")
	}
	if match(t, m, tcpConn("10.0.0.2")) {
		t.Fatal("the zone groups by /32, but 10.0.0.2 paid for 10.0.0.1")
	}
	if len(zones.inline) != 0 || m.release != nil {
		t.Fatal("a matcher using a global zone created an inline limit")
	}
}

func TestInlineLimitDefaultsAndRelease(t *testing.T) {
	zones := &fakeZones{}
	m := threePerHour()
	if err := m.provision(zones, zap.NewNop()); err != nil {
		t.Fatal(err)
	}
	if len(zones.inline) != 1 {
		t.Fatalf("%d inline limits asked for, want 1", len(zones.inline))
	}
	in := zones.inline[0]
	if in.Name != "layer4_3_per_1h" || in.Rate() != (limiter.Limit{Events: 3, Window: time.Hour}) ||
		*in.IPv4Prefix != 24 || *in.IPv6Prefix != 48 {
		t.Fatalf("inline limit asked for: %+v (prefixes %d, %d)", in, *in.IPv4Prefix, *in.IPv6Prefix)
	}
	_ = m.Cleanup()
	_ = m.Cleanup()
	if zones.released != 1 {
		t.Fatalf("released %d times, want 1", zones.released)
	}
}

func TestUnknownZoneFailsToLoad(t *testing.T) {
	err := (&Matcher{Zone: "nope"}).provision(&fakeZones{}, zap.NewNop())
	if err == nil || !strings.Contains(err.Error(), `zone "nope"`) {
		t.Fatalf("error = %v, want one naming zone \"nope\"", err)
	}
}

func intp(n int) *int { return &n }

func TestValidationNamesFieldAndValue(t *testing.T) {
	hour := caddy.Duration(time.Hour)
	for _, tc := range []struct {
		m    Matcher
		want string // "" for valid
	}{
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: hour}}, ""},
		{Matcher{Zone: "edge"}, ""},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: hour, Burst: 10, IPv4Prefix: intp(0), IPv6Prefix: intp(128)}}, ""},
		{Matcher{}, "rate_limit: max_events is required"},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: -1, Window: hour}}, "max_events -1"},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3}}, "rate_limit: window is required"},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(-time.Second)}}, "window -1s"},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: hour, Burst: -2}}, "burst -2"},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: hour, IPv4Prefix: intp(33)}}, "ipv4_prefix 33"},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: hour, IPv4Prefix: intp(-1)}}, "ipv4_prefix -1"},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: hour, IPv6Prefix: intp(129)}}, "ipv6_prefix 129"},
		{Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: hour, Burst: limiter.MaxBurst + 1}}, "burst"},
		{Matcher{Zone: "edge", Limit: zoneconf.Limit{MaxEvents: 3}}, `zone edge: uses the global zone's settings`},
		{Matcher{Zone: "edge", Limit: zoneconf.Limit{IPv4Prefix: intp(24)}}, "zone edge"},
	} {
		err := tc.m.validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%+v: unexpected error %v", tc.m, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%+v: error %v, want one containing %q", tc.m, err, tc.want)
		}
	}
}

func TestCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		input, json, err string
	}{
		{"rate_limit {\nzone edge\n}", `{"zone":"edge"}`, ""},
		{`rate_limit zone edge`, `{"zone":"edge"}`, ""},
		{`rate_limit {
			events 3
			window 1m
			burst 5
			ipv4_prefix 24
			ipv6_prefix 48
		}`, `{"max_events":3,"window":60000000000,"burst":5,"ipv4_prefix":24,"ipv6_prefix":48}`, ""},
		{`rate_limit {
			name ssh
			events 10
			window 1s
			memory 1MiB
		}`, `{"name":"ssh","max_events":10,"window":1000000000,"memory":1048576}`, ""},
		{`rate_limit {
			events 10
			window 1s
			sources 1000
			false_deny 0.01
		}`, `{"max_events":10,"window":1000000000,"sources":1000,"false_deny":0.01}`, ""},
		{`rate_limit`, "", "rate_limit: events is required"},
		{"rate_limit {\nevents 3\n}", "", "rate_limit: window is required"},
		{"rate_limit {\nwindow 1m\n}", "", "rate_limit: events is required"},
		{`rate_limit { events three window 1m }`, "", `rate_limit: events needs exactly one value, not "three window 1m }": each setting goes on a line of its own (events three, then window …)`},
		{"rate_limit {\nevents three\nwindow 1m\n}", "", `events "three": must be a whole number`},
		{"rate_limit {\nevents 0\nwindow 1m\n}", "", `events "0"`},
		{"rate_limit {\nevents 3\nwindow soon\n}", "", `window "soon": not a duration`},
		{"rate_limit {\nevents 3\nwindow -1m\n}", "", `window "-1m": must be positive`},
		{"rate_limit {\nevents 3\nwindow 1m\nipv4_prefix x\n}", "", `ipv4_prefix "x"`},
		{"rate_limit {\nevents 3\nwindow 1m\nipv6_prefix 200\n}", "", `ipv6_prefix 200`},
		{"rate_limit {\nevents 3\nwindow 1m\nmemory lots\n}", "", `memory "lots"`},
		{"rate_limit {\nevents 3\nwindow 1m\nfalse_deny 2\n}", "", `false_deny "2"`},
		{"rate_limit {\nevents 3\nwindow 1m\nkey {remote_host}\n}", "", `unrecognized option "key"`},
		{"rate_limit {\nzone edge\nevents 3\n}", "", "zone edge: uses the global zone's settings"},
		{`rate_limit 3 1m`, "", `unexpected argument "3"`},
		{"rate_limit zone a {\nzone b\n}", "", "rate_limit: zone is set twice"},
		{"rate_limit {\nzone a\nzone b\n}", "", "rate_limit: zone is set twice"},
		{"rate_limit {\nname a\nname b\nevents 1\nwindow 1m\n}", "", "rate_limit: name is set twice"},
		{`rate_limit zone`, "", "rate_limit: zone needs a value"},
		{`rate_limit zone a b`, "", "rate_limit: zone needs exactly one value"},
		{"rate_limit {\nzone\n}", "", "rate_limit: zone needs a value"},
	} {
		var m Matcher
		err := m.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: error %v, want one containing %q", tc.input, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.input, err)
			continue
		}
		// caddy-l4 turns the matcher into JSON after parsing it, so every
		// option must survive json.Marshal.
		got, err := json.Marshal(&m)
		if err != nil || string(got) != tc.json {
			t.Errorf("%s: JSON %s (%v), want %s", tc.input, got, err, tc.json)
		}
	}
}

func TestEveryDecisionIsCountedOnce(t *testing.T) {
	counts := make(map[Outcome]int)
	zones, _ := counted(t, limiter.Limit{Events: 3, Burst: 3, Window: time.Hour}, counts)
	m := provisioned(t, &Matcher{Zone: "edge"}, zones)
	for range 4 {
		cx := tcpConn("10.0.0.1")
		match(t, m, cx)
		match(t, m, cx) // caddy-l4 asking again about the same connection
	}
	match(t, m, tcpConn("::ffff:10.0.0.9"))
	if want := map[Outcome]int{Allowed: 3, Denied: 2}; fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Fatalf("counted %v, want %v", counts, want)
	}
}

// However many matchers of one zone ask about a connection (the same @name
// in several routes, several matcher sets naming the zone), it costs the
// zone one token, and every one of them gets the same answer.
func TestZoneChargesAConnectionOnceAcrossMatchers(t *testing.T) {
	counts := make(map[Outcome]int)
	zones, _ := counted(t, limiter.Limit{Events: 2, Burst: 2, Window: time.Hour}, counts)
	first := provisioned(t, &Matcher{Zone: "edge"}, zones)
	second := provisioned(t, &Matcher{Zone: "edge"}, zones)
	for i := 1; i <= 3; i++ {
		cx := tcpConn("10.0.0.1")
		want := i > 2
		for _, m := range []*Matcher{first, second, first, second} {
			if got := match(t, m, cx); got != want {
				t.Fatalf("connection %d: over = %v, want %v", i, got, want)
			}
		}
	}
	if want := map[Outcome]int{Allowed: 2, Denied: 1}; fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Fatalf("counted %v, want %v", counts, want)
	}
}

// A dry-run zone (action log) closes nothing: a connection over its limit is
// not matched, charges nothing and is counted as logged. Under the limit it
// is charged as in any zone, so the dry run shows what enforcing would do.
func TestDryRunZoneMatchesNothingAndChargesNothing(t *testing.T) {
	counts := make(map[Outcome]int)
	zones, b := counted(t, limiter.Limit{Events: 2, Burst: 2, Window: time.Hour}, counts)
	z := zones.global["edge"]
	z.DryRun = true
	zones.global["edge"] = z
	m := provisioned(t, &Matcher{Zone: "edge"}, zones)
	for i := 1; i <= 4; i++ {
		cx := tcpConn("10.0.0.1")
		if match(t, m, cx) || match(t, m, cx) {
			t.Fatalf("connection %d matched in a dry-run zone", i)
		}
	}
	if want := map[Outcome]int{Allowed: 2, Logged: 2}; fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Fatalf("counted %v, want %v", counts, want)
	}
	key := limiter.NetworkKey(netip.MustParseAddr("10.0.0.1"), 24, 48)
	if d := b.Allow(key.Bytes(), 1, time.Now()); d.Allowed || d.Remaining != 0 {
		t.Fatalf("after 2 allowed and 2 logged connections: %+v, want the 2 allowed charged", d)
	}
}

// A verdict recorded before routing (an XDP program that charged the SYN)
// is the zone's answer: the matcher charges nothing more.
func TestChargedVerdictIsTakenWithoutCharging(t *testing.T) {
	counts := make(map[Outcome]int)
	zones, _ := counted(t, limiter.Limit{Events: 1, Burst: 1, Window: time.Hour}, counts)
	m := provisioned(t, &Matcher{Zone: "edge"}, zones)
	for _, over := range []bool{false, true, false} {
		cx := tcpConn("10.0.0.1")
		Charged(cx, "edge", over)
		if got := match(t, m, cx); got != over {
			t.Fatalf("recorded over = %v, matcher said %v", over, got)
		}
	}
	if len(counts) != 0 {
		t.Fatalf("connections charged before routing were decided again: %v", counts)
	}
	if match(t, m, tcpConn("10.0.0.1")) {
		t.Fatal("the first connection the matcher decides itself was over: a recorded verdict was charged")
	}
}

func TestProxyHeader(t *testing.T) {
	v2 := "\r\n\r\n\x00\r\nQUIT\n"
	for _, tc := range []struct {
		bytes string
		want  int
	}{
		{"", proxyHeaderNone},
		{"P", proxyHeaderBegun},
		{"PROXY", proxyHeaderBegun},
		{"PROXY TCP4 127.0.66.1", proxyHeaderUnread},
		{"PROXY UNKNOWN\r\n", proxyHeaderUnread},
		{"PROXYX", proxyHeaderNone},
		{"POST / HTTP/1.1\r\n", proxyHeaderNone},
		{"\r\n\r", proxyHeaderBegun},
		{v2[:11], proxyHeaderBegun},
		{v2, proxyHeaderUnread},
		{v2 + "\x21\x11", proxyHeaderUnread},
		{"\r\n\r\nX", proxyHeaderNone},
		{"\x16\x03\x01", proxyHeaderNone},
	} {
		if got := proxyHeader([]byte(tc.bytes)); got != tc.want {
			t.Errorf("proxyHeader(%q) = %d, want %d", tc.bytes, got, tc.want)
		}
	}
}

// A connection whose first bytes begin a PROXY protocol header is not
// charged to the proxy while an earlier route may still read the header:
// the matcher asks for more bytes instead. A whole header no earlier route
// read is charged to the proxy, with a warning, once per matcher.
func TestMatchWaitsForAPartialProxyHeader(t *testing.T) {
	counts := make(map[Outcome]int)
	zones, _ := counted(t, limiter.Limit{Events: 5, Burst: 5, Window: time.Hour}, counts)
	core, logs := observer.New(zap.WarnLevel)
	m := &Matcher{Zone: "edge"}
	if err := m.provision(zones, zap.New(core)); err != nil {
		t.Fatal(err)
	}
	proxy := &fakeConn{remote: &net.TCPAddr{IP: net.ParseIP("127.0.66.1"), Port: 40000}}
	cx := layer4.WrapConnection(proxy, []byte("PROX"), zap.NewNop())
	if over, err := m.Match(cx); over || !errors.Is(err, layer4.ErrConsumedAllPrefetchedBytes) {
		t.Fatalf("a partial PROXY header: %v, %v; want false and ErrConsumedAllPrefetchedBytes", over, err)
	}
	if len(counts) != 0 || logs.Len() != 0 {
		t.Fatalf("a partial PROXY header was charged (%v) or warned about (%d lines)", counts, logs.Len())
	}
	for range 2 {
		cx = layer4.WrapConnection(proxy, []byte("PROXY TCP4 192.0.2.1 127.0.0.1 5000 443\r\n"), zap.NewNop())
		if over := match(t, m, cx); over {
			t.Fatal("over on the first connections")
		}
	}
	if counts[Allowed] != 2 || logs.FilterMessageSnippet("PROXY protocol header").Len() != 1 {
		t.Fatalf("whole unread headers: counted %v, %d warnings; want 2 allowed and 1 warning", counts, logs.Len())
	}
}

// proxiedConn is a connection whose source a PROXY protocol header replaced,
// as go-proxyproto's Conn presents it: Raw is the accepted socket.
type proxiedConn struct {
	*fakeConn
	raw net.Conn
}

func (p *proxiedConn) Raw() net.Conn { return p.raw }

// A connection whose SYN the zone's XDP program charged (SYNCharged says so
// for its socket's addresses) is counted as allowed and charges the zone
// nothing more; one it did not charge, or whose source a PROXY header
// replaced (the SYN was the proxy's), is charged by the matcher.
func TestConnectionChargedOnItsSYNIsNotChargedAgain(t *testing.T) {
	counts := make(map[Outcome]int)
	zones, _ := counted(t, limiter.Limit{Events: 1, Burst: 1, Window: time.Hour}, counts)
	server := &net.TCPAddr{IP: net.ParseIP("::ffff:10.99.0.1"), Port: 443}
	var asked []string
	z := zones.global["edge"]
	z.SYNCharged = func(local, remote netip.AddrPort) bool {
		asked = append(asked, local.String()+" <- "+remote.String())
		return local.Port() == 443
	}
	zones.global["edge"] = z
	m := provisioned(t, &Matcher{Zone: "edge"}, zones)
	conn := func(local *net.TCPAddr) *fakeConn {
		return &fakeConn{remote: &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 40000}, local: local}
	}

	for i := range 3 {
		cx := layer4.WrapConnection(conn(server), nil, zap.NewNop())
		if match(t, m, cx) || match(t, m, cx) {
			t.Fatalf("connection %d, charged on its SYN, is over a limit of 1", i+1)
		}
	}
	if counts[Allowed] != 3 || len(counts) != 1 {
		t.Fatalf("counted %v, want 3 allowed", counts)
	}
	if want := "10.99.0.1:443 <- 192.0.2.7:40000"; len(asked) != 3 || asked[0] != want {
		t.Fatalf("SYNCharged was asked %q, want %q once per connection", asked, want)
	}

	// Behind PROXY protocol the client is charged: its network's one token
	// is still there, so the first such connection passes and the next is
	// over.
	proxy := conn(server)
	for i, want := range []bool{false, true} {
		client := &fakeConn{remote: &net.TCPAddr{IP: net.ParseIP("198.51.100.9"), Port: 5000}, local: server}
		cx := layer4.WrapConnection(&proxiedConn{fakeConn: client, raw: proxy}, nil, zap.NewNop())
		if got := match(t, m, cx); got != want {
			t.Fatalf("client behind PROXY protocol, connection %d: over = %v, want %v", i+1, got, want)
		}
	}
	// Another port: the program did not see the SYN.
	other := &net.TCPAddr{IP: net.ParseIP("10.99.0.1"), Port: 8080}
	for i, want := range []bool{false, true} {
		if got := match(t, m, layer4.WrapConnection(conn(other), nil, zap.NewNop())); got != want {
			t.Fatalf("connection %d to a port the program does not limit: over = %v, want %v", i+1, got, want)
		}
	}
	if counts[Allowed] != 5 || counts[Denied] != 2 {
		t.Fatalf("counted %v, want 5 allowed and 2 denied", counts)
	}
}

// An unnamed limit's sizing, where set, is part of its derived name.
func TestDerivedNamesSayTheSizingThatIsSet(t *testing.T) {
	name := func(l zoneconf.Limit) string { return (&Matcher{Limit: l}).inline().Name }
	rate := zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour)}
	sized := rate
	sized.Memory, sized.Sources, sized.FalseDeny = 4096, 100, 0.001
	if got, want := name(rate), "layer4_3_per_1h"; got != want {
		t.Errorf("no sizing: %q, want %q", got, want)
	}
	if got, want := name(sized), "layer4_3_per_1h_memory_4096_sources_100_false_deny_0.001"; got != want {
		t.Errorf("sized: %q, want %q", got, want)
	}
}

// TestDerivedNamesAreShortAndSayOnlyWhatIsSet: an unnamed inline limit is
// named by its settings, those at their defaults left out, so that the
// name is short to type and never claims a burst the zone does not have.
func TestDerivedNamesAreShortAndSayOnlyWhatIsSet(t *testing.T) {
	for _, tt := range []struct {
		l      limiter.Limit
		v4, v6 int
		want   string
	}{
		{limiter.Limit{Events: 3, Window: time.Minute}, 24, 48, "layer4_3_per_1m"},
		{limiter.Limit{Events: 3, Window: time.Hour}, 24, 48, "layer4_3_per_1h"},
		{limiter.Limit{Events: 100, Window: 90 * time.Minute, Burst: 20}, 16, 48, "layer4_100_per_1h30m_burst_20_v4_16"},
		{limiter.Limit{Events: 5, Window: 1500 * time.Millisecond}, 24, 64, "layer4_5_per_1.5s_v6_64"},
	} {
		if got := DerivedName(tt.l, 0, tt.v4, tt.v6); got != tt.want {
			t.Errorf("DerivedName(%+v, %d, %d) = %q, want %q", tt.l, tt.v4, tt.v6, got, tt.want)
		}
	}
}
