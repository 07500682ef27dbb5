package layer4

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
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

// loopback is a TCP listener on 127.0.0.1 whose accepted sockets the tests
// hand to the matcher, as a layer4 server does.
type loopback struct {
	t  *testing.T
	ln *net.TCPListener
}

func newLoopback(t *testing.T) *loopback {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return &loopback{t: t, ln: ln}
}

// accept connects from the loopback address src and returns the client's
// end and the server's, wrapped as caddy-l4 wraps an accepted connection.
func (l *loopback) accept(src string) (client net.Conn, server *net.TCPConn, cx *layer4.Connection) {
	l.t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	client, err := d.Dial("tcp", l.ln.Addr().String())
	if err != nil {
		l.t.Fatal(err)
	}
	_ = l.ln.SetDeadline(time.Now().Add(5 * time.Second))
	server, err = l.ln.AcceptTCP()
	if err != nil {
		l.t.Fatal(err)
	}
	l.t.Cleanup(func() { client.Close(); server.Close() })
	return client, server, layer4.WrapConnection(server, nil, zap.NewNop())
}

// placesZone is a global zone "edge" that lets a /24 hold max connections
// open, with a rate of rate connections an hour if rate > 0, its outcomes
// tallied in counts; the matcher's places are swept by the test alone.
func placesZone(t *testing.T, max int64, rate int64, counts map[Outcome]int) (*Matcher, *limiter.Concurrency) {
	t.Helper()
	c, err := limiter.NewConcurrency(limiter.ConcurrencyConfig{Max: max, Bytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	var b limiter.Table = everyConnection{}
	if rate > 0 {
		if b, err = limiter.NewBuckets(limiter.BucketsConfig{Limit: limiter.Limit{Events: rate, Burst: rate, Window: time.Hour}, Bytes: 64 << 10}); err != nil {
			t.Fatal(err)
		}
	}
	z := Zone{Name: "edge", Buckets: b, IPv4Prefix: 24, IPv6Prefix: 48, Places: c,
		Count: func(o Outcome) { counts[o]++ }, PlaceDenied: func() { counts[placeDenied]++ }}
	m := provisioned(t, &Matcher{Zone: "edge"}, &fakeZones{global: map[string]Zone{"edge": z}})
	m.watch = &closeWatch{}
	return m, c
}

// placeDenied tallies PlaceDenied calls beside the outcomes.
const placeDenied Outcome = 100

// everyConnection is the rate of a zone with max_concurrent alone: it
// grants everything (the root package's noRate).
type everyConnection struct{ limiter.Table }

func (everyConnection) Allow([]byte, int64, time.Time) limiter.Decision {
	return limiter.Decision{Allowed: true}
}

// n + 1 connections of a network open at once: n hold a place, the last is
// matched (to be closed) and takes none, while another network is admitted.
// Each connection takes one place however often caddy-l4 evaluates the
// matcher, and keeps it until its socket closes; the sweep after that close
// gives it back, once.
func TestConnectionHoldsItsPlaceUntilItsSocketCloses(t *testing.T) {
	counts := make(map[Outcome]int)
	m, c := placesZone(t, 2, 0, counts)
	lb := newLoopback(t)
	var servers []*net.TCPConn
	for i, want := range []bool{false, false, true} {
		_, server, cx := lb.accept("127.0.0.1")
		for run := 0; run < 3; run++ { // caddy-l4 may evaluate a route again after each read
			if got := match(t, m, cx); got != want {
				t.Fatalf("connection %d, evaluation %d: over = %v, want %v", i+1, run+1, got, want)
			}
		}
		servers = append(servers, server)
	}
	if _, _, cx := lb.accept("127.0.0.2"); !match(t, m, cx) { // 127.0.0.0/24 too: the same network
		t.Fatal("a third connection of 127.0.0.0/24 was admitted with max_concurrent 2")
	}
	if _, _, cx := lb.accept("127.0.1.1"); match(t, m, cx) {
		t.Fatal("another network was refused while the first held its places")
	}
	if got := c.InUse(); got != 3 {
		t.Fatalf("%d places in use, want 3 (2 of 127.0.0.0/24, 1 of 127.0.1.0/24)", got)
	}
	if n := m.watch.sweep(); n != 3 || c.InUse() != 3 {
		t.Fatalf("a sweep with no socket closed: %d held, %d in use, want 3 and 3", n, c.InUse())
	}
	servers[0].Close()
	if n := m.watch.sweep(); n != 2 || c.InUse() != 2 {
		t.Fatalf("after one socket closed: %d held, %d in use, want 2 and 2", n, c.InUse())
	}
	if n := m.watch.sweep(); n != 2 || c.InUse() != 2 {
		t.Fatalf("a second sweep gave back again: %d held, %d in use, want 2 and 2", n, c.InUse())
	}
	if _, _, cx := lb.accept("127.0.0.1"); match(t, m, cx) {
		t.Fatal("the place given back was not there for the next connection")
	}
	// Allowed: the first two, 127.0.1.1 and the last; denied: the third
	// and 127.0.0.2.
	if counts[Allowed] != 4 || counts[Denied] != 2 || counts[placeDenied] != 2 {
		t.Fatalf("counted %v, want 4 allowed, 2 denied, 2 for want of a place", counts)
	}
}

// A client that goes away closes its end only: the place is the server's
// socket's, held until whoever serves the connection closes it.
func TestClientCloseAloneKeepsThePlace(t *testing.T) {
	m, c := placesZone(t, 1, 0, make(map[Outcome]int))
	client, server, cx := newLoopback(t).accept("127.0.0.1")
	if match(t, m, cx) {
		t.Fatal("the first connection was refused")
	}
	client.Close()
	m.watch.sweep()
	if c.InUse() != 1 {
		t.Fatalf("%d places in use once the client closed, want 1 until the server closes", c.InUse())
	}
	server.Close()
	m.watch.sweep()
	if c.InUse() != 0 {
		t.Fatalf("%d places in use once the server closed, want 0", c.InUse())
	}
}

// A connection the rate refuses holds no place: the place it took is given
// back at once, not at its close, and is not watched.
func TestRateDenialTakesNoPlace(t *testing.T) {
	counts := make(map[Outcome]int)
	m, c := placesZone(t, 5, 1, counts)
	lb := newLoopback(t)
	for i, want := range []bool{false, true, true} {
		if _, _, cx := lb.accept("127.0.0.1"); match(t, m, cx) != want {
			t.Fatalf("connection %d: over = %v, want %v", i+1, !want, want)
		}
	}
	if c.InUse() != 1 || m.watch.holding() != 1 {
		t.Fatalf("%d places in use, %d watched, want 1 and 1: the rate's denials kept places", c.InUse(), m.watch.holding())
	}
	if counts[placeDenied] != 0 {
		t.Fatalf("rate denials counted as for want of a place: %v", counts)
	}
}

// A connection refused a place charges nothing of the rate.
func TestPlaceDenialChargesNoRate(t *testing.T) {
	m, c := placesZone(t, 1, 2, make(map[Outcome]int))
	lb := newLoopback(t)
	_, first, cx := lb.accept("127.0.0.1")
	if match(t, m, cx) {
		t.Fatal("the first connection was refused")
	}
	if _, _, cx := lb.accept("127.0.0.1"); !match(t, m, cx) {
		t.Fatal("a second connection was admitted with max_concurrent 1")
	}
	first.Close()
	m.watch.sweep()
	if c.InUse() != 0 {
		t.Fatalf("%d places in use after the only admitted connection closed", c.InUse())
	}
	if _, _, cx := lb.accept("127.0.0.1"); match(t, m, cx) {
		t.Fatal("the rate's second token went to the connection refused a place")
	}
}

// A dry run (action log) admits and counts places as enforcing would, and
// matches nothing: a connection it would refuse is logged, takes no place.
func TestDryRunCountsPlacesAndMatchesNothing(t *testing.T) {
	counts := make(map[Outcome]int)
	m, c := placesZone(t, 1, 0, counts)
	m.zone.DryRun = true
	lb := newLoopback(t)
	for i := 1; i <= 3; i++ {
		if _, _, cx := lb.accept("127.0.0.1"); match(t, m, cx) {
			t.Fatalf("connection %d matched in a dry-run zone", i)
		}
	}
	if c.InUse() != 1 || counts[Allowed] != 1 || counts[Logged] != 2 || counts[placeDenied] != 0 {
		t.Fatalf("%d places in use, counted %v; want 1, 1 allowed and 2 logged", c.InUse(), counts)
	}
}

// A connection whose close the matcher cannot see (no socket under it: a
// UDP flow, an unknown wrapper) is refused, once warned about, and takes
// no place: a place it took could never be given back.
//
// Its network is over no limit: the connection is counted as denied, but
// not logged as a denial, nor noted among the zone's top sources or its
// place denials, where it would blame a client for the matcher's blind spot.
func TestUnwatchableConnectionIsRefusedAPlace(t *testing.T) {
	counts := make(map[Outcome]int)
	m, c := placesZone(t, 5, 0, counts)
	var noted []netip.Addr
	m.zone.Denied = func(ip netip.Addr, _ time.Time) { noted = append(noted, ip) }
	core, logs := observer.New(zap.DebugLevel)
	m.logger = zap.New(core)
	for i := 0; i < 2; i++ {
		if !match(t, m, tcpConn("10.0.0.1")) {
			t.Fatal("a connection without a socket was admitted: its place would never be given back")
		}
	}
	if c.InUse() != 0 || m.watch.holding() != 0 {
		t.Fatalf("%d places in use, %d watched, want none", c.InUse(), m.watch.holding())
	}
	if n := logs.FilterMessageSnippet("cannot see").Len(); n != 1 {
		t.Fatalf("%d warnings, want 1", n)
	}
	if n := logs.FilterMessageSnippet("exceeded").Len(); n != 0 {
		t.Fatalf("%d denials logged for connections over no limit: %v", n, logs.FilterMessageSnippet("exceeded").All()[0].ContextMap())
	}
	if counts[Denied] != 2 || counts[placeDenied] != 0 || len(noted) != 0 {
		t.Fatalf("counted %v, noted %v among the top sources; want 2 denied, none for want of a place, none noted", counts, noted)
	}
}

// A connection's denial says which of its zone's limits it is over: the
// rate, or max_concurrent.
func TestADenialNamesItsLimit(t *testing.T) {
	m, _ := placesZone(t, 1, 2, make(map[Outcome]int)) // 1 open, 2 an hour
	core, logs := observer.New(zap.DebugLevel)
	m.logger = zap.New(core)
	lb := newLoopback(t)
	if _, _, cx := lb.accept("127.0.0.1"); match(t, m, cx) {
		t.Fatal("the first connection was refused")
	}
	if _, _, cx := lb.accept("127.0.0.1"); !match(t, m, cx) {
		t.Fatal("a second connection open at once was admitted with max_concurrent 1")
	}
	for i := 1; i <= 2; i++ { // one at a time: a place each, and a token
		_, server, cx := lb.accept("127.0.1.1")
		if match(t, m, cx) {
			t.Fatalf("connection %d of 127.0.1.1, alone, was refused", i)
		}
		server.Close()
		m.watch.sweep()
	}
	if _, _, cx := lb.accept("127.0.1.1"); !match(t, m, cx) {
		t.Fatal("a third connection in an hour was admitted with a rate of 2")
	}
	var limits []string
	for _, e := range logs.FilterMessage("connection rate exceeded").All() {
		limits = append(limits, fmt.Sprint(e.ContextMap()["limit"]))
	}
	if !slices.Equal(limits, []string{"max_concurrent", "rate"}) {
		t.Fatalf("denials logged with limits %q, want max_concurrent, then rate", limits)
	}
}

// A connection already closed when it is matched takes no place: no sweep
// would see it close.
func TestClosedConnectionTakesNoPlace(t *testing.T) {
	m, c := placesZone(t, 5, 0, make(map[Outcome]int))
	_, server, cx := newLoopback(t).accept("127.0.0.1")
	server.Close()
	if !match(t, m, cx) || c.InUse() != 0 || m.watch.holding() != 0 {
		t.Fatalf("a closed connection: %d places in use, %d watched", c.InUse(), m.watch.holding())
	}
}

// The watch's goroutine runs while it holds a place, and stops once every
// place is given back, so that a server at rest runs none.
func TestWatchRunsOnlyWhileItHoldsPlaces(t *testing.T) {
	c, err := limiter.NewConcurrency(limiter.ConcurrencyConfig{Max: 1, Bytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	_, server, _ := newLoopback(t).accept("127.0.0.1")
	rc, err := server.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	w := &closeWatch{every: time.Millisecond}
	h := &heldPlace{socket: rc}
	if !c.AdmitHash(1, &h.place).Allowed {
		t.Fatal("no place")
	}
	w.hold(h)
	server.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		w.mu.Lock()
		running := w.running
		w.mu.Unlock()
		if !running {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the watch still runs 5s after its only connection closed")
		}
		time.Sleep(time.Millisecond) // waiting for the watch's goroutine, not for a rate
	}
	if c.InUse() != 0 {
		t.Fatalf("%d places in use after the watch stopped", c.InUse())
	}
}

// An inline limit may have max_concurrent alone; its derived name says so.
func TestInlineMaxConcurrentAlone(t *testing.T) {
	var m Matcher
	d := caddyfile.NewTestDispenser(`rate_limit {
		max_concurrent 10
	}`)
	if err := m.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if m.MaxConcurrent != 10 {
		t.Fatalf("max_concurrent %d, want 10", m.MaxConcurrent)
	}
	if got, want := m.inline().Name, "layer4_concurrent_10"; got != want {
		t.Fatalf("derived name %q, want %q", got, want)
	}
	both := Matcher{Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), MaxConcurrent: 4}}
	if got, want := both.inline().Name, "layer4_3_per_1h_concurrent_4"; got != want {
		t.Fatalf("derived name %q, want %q", got, want)
	}
}

// Connections admitted while sweeps run are neither lost nor given back
// twice: the watch's record of places is swapped out under its lock, so
// every place held is in it once, and every closed one is released once.
func TestHoldsDuringSweepsAreKeptAndReleasedOnce(t *testing.T) {
	const conns = 64
	c, err := limiter.NewConcurrency(limiter.ConcurrencyConfig{Max: conns, Bytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	lb := newLoopback(t)
	servers := make([]*net.TCPConn, conns)
	held := make([]*heldPlace, conns)
	for i := range servers {
		_, servers[i], _ = lb.accept("127.0.0.1")
		rc, err := servers[i].SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		held[i] = &heldPlace{socket: rc}
		if !c.AdmitHash(7, &held[i].place).Allowed {
			t.Fatalf("place %d refused", i)
		}
	}
	w := &closeWatch{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range held {
			w.hold(held[i])
			if i%2 == 0 {
				servers[i].Close()
			}
		}
	}()
	for sweeping := true; sweeping; {
		select {
		case <-done:
			sweeping = false
		default:
			w.sweep()
		}
	}
	w.sweep()
	if n, in := w.holding(), c.InFlight(7); n != conns/2 || in != conns/2 {
		t.Fatalf("%d held, %d in flight, want %d and %d", n, in, conns/2, conns/2)
	}
	for _, s := range servers {
		s.Close()
	}
	if n := w.sweep(); n != 0 || c.InFlight(7) != 0 {
		t.Fatalf("after every socket closed: %d held, %d in flight", n, c.InFlight(7))
	}
}

// BenchmarkSweep is one sweep of the watch over 1000 open connections: its
// cost per held place is what the watch adds, every sweepInterval, per
// connection open in a zone with max_concurrent.
func BenchmarkSweep(b *testing.B) {
	const conns = 1000
	c, err := limiter.NewConcurrency(limiter.ConcurrencyConfig{Max: conns, Bytes: 64 << 10})
	if err != nil {
		b.Fatal(err)
	}
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	w := &closeWatch{}
	for i := 0; i < conns; i++ {
		client, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			b.Fatal(err)
		}
		defer client.Close()
		server, err := ln.AcceptTCP()
		if err != nil {
			b.Fatal(err)
		}
		defer server.Close()
		rc, err := server.SyscallConn()
		if err != nil {
			b.Fatal(err)
		}
		h := &heldPlace{socket: rc}
		if !c.AdmitHash(uint64(i), &h.place).Allowed {
			b.Fatal("no place")
		}
		w.hold(h)
	}
	b.ReportAllocs()
	for b.Loop() {
		if w.sweep() != conns {
			b.Fatal("a place was given back with its socket open")
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/conns, "ns/place")
}
