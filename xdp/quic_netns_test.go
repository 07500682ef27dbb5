//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/netip"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/quic-go/quic-go"
	"golang.org/x/sys/unix"

	"github.com/floodgate-rl/floodgate/internal/netnstest"
	"github.com/floodgate-rl/floodgate/limiter"
)

// TestQUICWaysAroundTheProgramAreClosed runs a real quic-go server behind
// the attached program, a burst of one an hour: a client makes one real
// connection (its network's token), then tries the two ways around the
// program a review found, each of which made quic-go open a connection
// per packet, uncharged:
//   - Initials from the same UDP socket under a garbage token and a 4-byte
//     DCID (quic-go opens a connection for a token it cannot decode), which
//     the program let pass as the charged connection's;
//   - Initials sent as a 56-byte first IPv4 fragment and the rest, which
//     the program did not parse and the kernel reassembled.
//
// Each must be dropped at the program (counted) and quic-go open none.
func TestQUICWaysAroundTheProgramAreClosed(t *testing.T) {
	v := netnstest.NewVethPair(t)
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	port, opened := quicServerBehind(t, v, tb)
	ctr, conn := dialQUIC(t, v, port)
	conn.CloseWithError(0, "")
	srv := &net.UDPAddr{IP: v.ServerAddr.AsSlice(), Port: int(port)}
	c0 := counts(t, tb)
	if c0.InitialsPassed != 1 {
		t.Fatalf("the client's connection: counts %+v, want 1 Initial passed", c0)
	}
	before := opened.Load()

	// settle waits (at most 5 s) until the program has counted want more
	// dropped Initials than c, then a little for quic-go to act on
	// anything that passed, and returns what quic-go opened meanwhile.
	settle := func(c Counts, want uint64) (Counts, int64) {
		t.Helper()
		got := counts(t, tb)
		for deadline := time.Now().Add(5 * time.Second); got.InitialsDropped < c.InitialsDropped+want && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			got = counts(t, tb)
		}
		time.Sleep(200 * time.Millisecond)
		return got, opened.Load() - before
	}

	const n = 50
	for i := range n {
		q := quicPacket{version: quicV1, dcid: []byte{0xaa, 0xbb, 0, byte(i)}, scid: []byte{1, 2, 3, 4}, token: []byte("garbage-token")}
		if _, err := ctr.WriteTo(parseable(q)[8:], srv); err != nil {
			t.Fatal(err)
		}
		if i%16 == 15 {
			time.Sleep(time.Millisecond)
		}
	}
	c1, got := settle(c0, n)
	if c1.InitialsDropped != c0.InitialsDropped+n || c1.InitialsPassed != c0.InitialsPassed || got != 0 {
		t.Fatalf("%d Initials under a garbage token and a 4-byte DCID from the charged connection's socket: program %+v after %+v, quic-go opened %d connections; want all %d dropped, none opened", n, c1, c0, got, n)
	}

	var fd int
	if err := netnstest.In(v.Client, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	src, dst := v.ClientIP.As4(), v.ServerAddr.As4()
	fragment := func(id uint16, off int, data []byte, more bool) []byte {
		ip := make([]byte, 20, 20+len(data))
		ip[0] = 0x45
		binary.BigEndian.PutUint16(ip[2:], uint16(20+len(data)))
		binary.BigEndian.PutUint16(ip[4:], id)
		fo := uint16(off / 8)
		if more {
			fo |= 0x2000
		}
		binary.BigEndian.PutUint16(ip[6:], fo)
		ip[8], ip[9] = 64, 17
		copy(ip[12:], src[:])
		copy(ip[16:], dst[:])
		var s uint32
		for i := 0; i < 20; i += 2 {
			s += uint32(ip[i])<<8 | uint32(ip[i+1])
		}
		for s>>16 != 0 {
			s = s&0xffff + s>>16
		}
		binary.BigEndian.PutUint16(ip[10:], ^uint16(s))
		return append(ip, data...)
	}
	to := &unix.SockaddrInet4{Addr: dst}
	for i := range n {
		q := v1Initial(0xcc, 0xdd, 0, byte(i), 1, 2, 3, 4)
		q.sport, q.dport = 41000, port
		d := parseable(q)
		for _, f := range [][]byte{fragment(uint16(100+i), 0, d[:56], true), fragment(uint16(100+i), 56, d[56:], false)} {
			if err := unix.Sendto(fd, f, 0, to); err != nil {
				t.Fatal(err)
			}
		}
		if i%16 == 15 {
			time.Sleep(time.Millisecond)
		}
	}
	c2, got := settle(c1, n)
	if c2.InitialsDropped != c1.InitialsDropped+n || c2.InitialsPassed != c0.InitialsPassed || got != 0 {
		t.Fatalf("%d Initials in a 56-byte first fragment and the rest: program %+v after %+v, quic-go opened %d connections; want every first fragment dropped, none opened", n, c2, c1, got)
	}
}

// parseable is q's UDP datagram (checksum 0: none) with its Length field
// set to the rest of the datagram, so that quic-go parses the header and
// goes on to open a connection.
func parseable(q quicPacket) []byte {
	d := q.datagram()
	hl := 8 + 1 + 4 + 1 + len(q.dcid) + 1 + len(q.scid) + 2 + len(q.token) // the token's length: a 2-byte varint
	rest := len(d) - hl - 2
	d[hl], d[hl+1] = 0x40|byte(rest>>8), byte(rest)
	return d
}

// selfSigned is a certificate for the test's QUIC server.
func selfSigned(t *testing.T) tls.Certificate {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), DNSNames: []string{"t"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: k}
}

// udpBehind opens a UDP socket in v's server namespace, on a port the
// kernel picks, behind tb's program attached to v's server interface and
// limiting QUIC there, until the test ends; it returns the socket and its
// port.
func udpBehind(t *testing.T, v *netnstest.VethPair, tb *Table) (*net.UDPConn, uint16) {
	t.Helper()
	var spc *net.UDPConn
	if err := netnstest.In(v.Server, func() error {
		var err error
		spc, err = net.ListenUDP("udp4", &net.UDPAddr{IP: v.ServerAddr.AsSlice()}) // a port picked by the kernel
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { spc.Close() })
	port := uint16(spc.LocalAddr().(*net.UDPAddr).Port)
	var att *Attachment
	if err := netnstest.In(v.Server, func() error {
		var err error
		att, err = tb.Attach(v.ServerIf, Ports{QUIC: []uint16{port}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { att.Close() })
	return spc, port
}

// quicServerBehind runs a quic-go server in v's server namespace, on a UDP
// port the kernel picks, behind tb's program attached to v's server
// interface and limiting QUIC there, until the test ends; it returns the
// port and the count of connections quic-go opened.
func quicServerBehind(t *testing.T, v *netnstest.VethPair, tb *Table) (uint16, *atomic.Int64) {
	t.Helper()
	spc, port := udpBehind(t, v, tb)
	opened := new(atomic.Int64) // connections quic-go opened
	str := &quic.Transport{Conn: spc, ConnContext: func(ctx context.Context, _ *quic.ClientInfo) (context.Context, error) {
		opened.Add(1)
		return ctx, nil
	}}
	t.Cleanup(func() { str.Close() })
	ln, err := str.Listen(&tls.Config{Certificates: []tls.Certificate{selfSigned(t)}, NextProtos: []string{"t"}}, &quic.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			if _, err := ln.Accept(context.Background()); err != nil {
				return
			}
		}
	}()
	return port, opened
}

// dialQUIC makes one real quic-go connection from a UDP socket of its own
// in v's client namespace to port, and returns the client's transport
// (closed when the test ends) and the connection.
func dialQUIC(t *testing.T, v *netnstest.VethPair, port uint16) (*quic.Transport, *quic.Conn) {
	t.Helper()
	return dialQUICThrough(t, v, port, func(c net.PacketConn) net.PacketConn { return c })
}

// clientSocket opens a UDP socket in v's client namespace, on a port the
// kernel picks, closed when the test ends.
func clientSocket(t *testing.T, v *netnstest.VethPair) *net.UDPConn {
	t.Helper()
	var cpc *net.UDPConn
	if err := netnstest.In(v.Client, func() error {
		var err error
		cpc, err = net.ListenUDP("udp4", &net.UDPAddr{IP: v.ClientIP.AsSlice()})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cpc.Close() })
	return cpc
}

// dialQUICThrough is dialQUIC with the client's socket wrapped by wrap.
func dialQUICThrough(t *testing.T, v *netnstest.VethPair, port uint16, wrap func(net.PacketConn) net.PacketConn) (*quic.Transport, *quic.Conn) {
	t.Helper()
	ctr := &quic.Transport{Conn: wrap(clientSocket(t, v))}
	t.Cleanup(func() { ctr.Close() })
	srv := &net.UDPAddr{IP: v.ServerAddr.AsSlice(), Port: int(port)}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := ctr.Dial(ctx, srv, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"t"}}, &quic.Config{})
	if err != nil {
		t.Fatalf("the client's connection: %v", err)
	}
	return ctr, conn
}

// TestARealHandshakeEndsItsFreePass: a real quic-go connection through
// the program costs one token, and its client's Handshake packet ends the
// connection's free pass: the program's map latest holds the connection's
// id for the client's address, port and SCID (quic-go's 4 bytes),
// initials no longer holds it, and
// an Initial under the connection's DCID from the client's socket after
// the handshake (what a client that reuses its first DCID sends for its
// next connection) is charged: dropped, on a burst of one, and quic-go
// opens nothing for it. (The entry stayed, and let 16 such Initials pass
// free.) The same holds for a client that hides its Handshake packets
// behind junk 0-RTT packets under its SCID (netnstest.HandshakeHider),
// which quic-go's server reads past.
// (Such a client kept its pass: with a DCID it reused, 17 HTTP/3
// connections a token in Caddy.)
func TestARealHandshakeEndsItsFreePass(t *testing.T) {
	for _, tc := range []struct {
		name string
		wrap func(net.PacketConn) net.PacketConn
	}{
		{"as quic-go sends it", func(c net.PacketConn) net.PacketConn { return c }},
		{"behind a junk 0-RTT packet", func(c net.PacketConn) net.PacketConn { return &netnstest.HandshakeHider{PacketConn: c} }},
	} {
		t.Run(tc.name, func(t *testing.T) { realHandshakeEndsItsFreePass(t, tc.wrap) })
	}
}

func realHandshakeEndsItsFreePass(t *testing.T, wrap func(net.PacketConn) net.PacketConn) {
	v := netnstest.NewVethPair(t)
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	port, opened := quicServerBehind(t, v, tb)
	ctr, conn := dialQUICThrough(t, v, port, wrap)
	defer conn.CloseWithError(0, "")
	if c := counts(t, tb); c != (Counts{InitialsPassed: 1}) {
		t.Fatalf("one real connection: counts %+v, want 1 Initial passed", c)
	}
	if h, ok := ctr.Conn.(*netnstest.HandshakeHider); ok {
		// The client's Handshake packet may leave after Dial returns.
		for deadline := time.Now().Add(5 * time.Second); h.Hidden.Load() == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		}
		if h.Hidden.Load() == 0 {
			t.Fatal("the client sent no Handshake packet to hide")
		}
	}
	sport := uint16(ctr.Conn.LocalAddr().(*net.UDPAddr).Port)
	key, id := latestFrom(t, tb, v.ClientIP, sport)
	if key.ScidLen != 4 {
		t.Fatalf("the connection's SCID in latest: %x, want quic-go's 4 bytes", key.Scid[:key.ScidLen])
	}
	// The client's Handshake packet may leave after Dial returns: wait for
	// its effect, 5 s at most.
	var ps synlimitPass
	var err error
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if err = tb.initials.Lookup(&id, &ps); errors.Is(err, ebpf.ErrKeyNotExist) {
			break
		}
	}
	if !errors.Is(err, ebpf.ErrKeyNotExist) {
		hid := int64(-1)
		if h, ok := ctr.Conn.(*netnstest.HandshakeHider); ok {
			hid = h.Hidden.Load()
		}
		t.Fatalf("after the handshake, the connection's entry in initials: %+v, %v; want none (datagrams hidden: %d)", ps, err, hid)
	}
	q := v1Initial(id.Dcid[:id.DcidLen]...)
	q.dport = port
	before := opened.Load()
	srv := &net.UDPAddr{IP: v.ServerAddr.AsSlice(), Port: int(port)}
	if _, err := ctr.WriteTo(parseable(q)[8:], srv); err != nil {
		t.Fatal(err)
	}
	c := counts(t, tb)
	for deadline := time.Now().Add(5 * time.Second); c.InitialsDropped == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		c = counts(t, tb)
	}
	time.Sleep(200 * time.Millisecond) // for quic-go to act on anything that passed
	if c != (Counts{InitialsPassed: 1, InitialsDropped: 1}) || opened.Load() != before {
		t.Fatalf("an Initial under the connection's DCID from its socket, after its handshake: counts %+v, quic-go opened %d; want 1 Initial passed, 1 dropped, none opened", c, opened.Load()-before)
	}
}

// latestFrom is the one entry of tb's map latest from addr and port (its
// key holds the SCID of the connection's Initials), and fails the test if
// there is none or more than one.
func latestFrom(t *testing.T, tb *Table, addr netip.Addr, port uint16) (synlimitClient, synlimitInitialId) {
	t.Helper()
	var (
		key, k synlimitClient
		id, v  synlimitInitialId
		n      int
	)
	it := tb.latest.Iterate()
	for it.Next(&k, &v) {
		if k.Saddr == addr.As16() && binary.BigEndian.Uint16(k.Sport[:]) == port {
			key, id = k, v
			n++
		}
	}
	if err := it.Err(); err != nil || n != 1 {
		t.Fatalf("the program's latest Initial from %v port %d: %d entries, %v; want 1", addr, port, n, err)
	}
	return key, id
}

// initialCounter is a client's UDP socket that counts the datagrams it
// sends that start with a first flight's Initial (version 1, type 0, a
// DCID of 8 bytes or more).
type initialCounter struct {
	net.PacketConn
	initials atomic.Int64
}

func (c *initialCounter) WriteTo(b []byte, addr net.Addr) (int, error) {
	if len(b) > 5 && b[0]&0xf0 == 0xc0 && binary.BigEndian.Uint32(b[1:]) == 1 && b[5] >= 8 {
		c.initials.Add(1)
	}
	return c.PacketConn.WriteTo(b, addr)
}

// TestAFairClientsRetransmittedInitialsPassFree: a real quic-go client
// whose server never answers (every reply lost) sends its first flight's
// Initials — a ClientHello split over two with Go's default key shares,
// one with X25519 alone — until its handshake times out (5 s, as in Caddy),
// and every one passes the program on its connection's one token: on a
// burst of one, one Initial charged, none dropped. It logs how many it
// sent, the measure of how low FREE_INITIALS (16) could go.
func TestAFairClientsRetransmittedInitialsPassFree(t *testing.T) {
	for _, tc := range []struct {
		name   string
		curves []tls.CurveID
	}{
		{"Go's default key shares", nil},
		{"X25519 alone", []tls.CurveID{tls.X25519}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := netnstest.NewVethPair(t)
			tb := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
			_, port := udpBehind(t, v, tb) // bound, never read: the server that never answers
			ic := &initialCounter{PacketConn: clientSocket(t, v)}
			ctr := &quic.Transport{Conn: ic}
			defer ctr.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			start := time.Now()
			_, err := ctr.Dial(ctx, &net.UDPAddr{IP: v.ServerAddr.AsSlice(), Port: int(port)},
				&tls.Config{InsecureSkipVerify: true, NextProtos: []string{"t"}, CurvePreferences: tc.curves}, &quic.Config{})
			if err == nil {
				t.Fatal("a handshake with a server that never answers succeeded")
			}
			n, c := ic.initials.Load(), counts(t, tb)
			t.Logf("%s: %d first-flight Initials in %v (%v); program %+v", tc.name, n, time.Since(start).Round(time.Millisecond), err, c)
			if n < 2 || c != (Counts{InitialsPassed: 1}) {
				t.Fatalf("%d Initials of one connection: counts %+v, want 1 Initial charged and passed, none dropped", n, c)
			}
		})
	}
}

// slowReader is a UDP socket whose reader gets each datagram delay late: a
// host slow to answer (load, a busy event loop), seen after the program.
type slowReader struct {
	net.PacketConn
	delay atomic.Int64 // nanoseconds
}

func (s *slowReader) ReadFrom(b []byte) (int, net.Addr, error) {
	n, a, err := s.PacketConn.ReadFrom(b)
	time.Sleep(time.Duration(s.delay.Load()))
	return n, a, err
}

// TestDialsOverOneSocketPayOneTokenEach: a real quic-go client that dials
// connection after connection over one UDP socket (as quic-go's http3
// client does), each resuming with a session ticket and sending a 20 KB
// request as 0-RTT data, pays one token a dial, with the client or the
// server reading every datagram 150 ms late. Each connection has an SCID
// of its own, and the previous connection's Handshake packets that arrive
// after the next one's first Initial (its close, its answers to the
// server's retransmissions: the late reader confirms the handshake late)
// end no pass of the new connection, whose retransmitted first Initial
// passes free. (They ended the pass of whichever connection's Initial
// passed latest from the socket's address and port: up to 4 tokens a
// dial, 32 for the 10 dials with the client reading late, 33 with the
// server.)
func TestDialsOverOneSocketPayOneTokenEach(t *testing.T) {
	const dials = 10
	for _, tc := range []struct {
		name           string
		server, client time.Duration
	}{
		{"the client reading 150 ms late", 0, 150 * time.Millisecond},
		{"the server reading 150 ms late", 150 * time.Millisecond, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := netnstest.NewVethPair(t)
			tb := newTestTable(t, testConfig(limiter.Limit{Events: 1000, Window: time.Hour}))
			spc, port := udpBehind(t, v, tb)
			sr := &slowReader{PacketConn: spc}
			str := &quic.Transport{Conn: sr}
			t.Cleanup(func() { str.Close() })
			ln, err := str.ListenEarly(&tls.Config{Certificates: []tls.Certificate{selfSigned(t)}, NextProtos: []string{"t"}}, &quic.Config{Allow0RTT: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ln.Close() })
			go func() {
				for {
					c, err := ln.Accept(context.Background())
					if err != nil {
						return
					}
					go func() {
						s, err := c.AcceptStream(context.Background())
						if err != nil {
							return
						}
						_, _ = io.Copy(io.Discard, s)
						_, _ = s.Write([]byte("ok"))
						s.Close()
					}()
				}
			}()
			cr := &slowReader{PacketConn: clientSocket(t, v)}
			ctr := &quic.Transport{Conn: cr}
			t.Cleanup(func() { ctr.Close() })
			srv := &net.UDPAddr{IP: v.ServerAddr.AsSlice(), Port: int(port)}
			tlsConf := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"t"}, ServerName: "t",
				ClientSessionCache: tls.NewLRUClientSessionCache(4), CurvePreferences: []tls.CurveID{tls.X25519}}
			// dial makes one connection, sends 20 KB on a stream (0-RTT data
			// when it resumes), reads the answer, and closes.
			dial := func() (used0RTT bool, err error) {
				ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
				defer cancel()
				conn, err := ctr.DialEarly(ctx, srv, tlsConf, &quic.Config{HandshakeIdleTimeout: 4 * time.Second})
				if err != nil {
					return false, err
				}
				defer conn.CloseWithError(0, "")
				s, err := conn.OpenStream()
				if err != nil {
					return false, err
				}
				if _, err := s.Write(make([]byte, 20000)); err != nil {
					return false, err
				}
				s.Close()
				if b, err := io.ReadAll(s); err != nil || string(b) != "ok" {
					return false, fmt.Errorf("the answer %q: %v", b, err)
				}
				return conn.ConnectionState().Used0RTT, nil
			}
			// The first dial, with no delay, gets the session ticket the
			// others resume with.
			if _, err := dial(); err != nil {
				t.Fatalf("the first dial: %v", err)
			}
			time.Sleep(300 * time.Millisecond)
			sr.delay.Store(int64(tc.server))
			cr.delay.Store(int64(tc.client))
			prev, resumed := counts(t, tb).InitialsPassed, 0
			var tokens []uint64
			for i := range dials {
				used, err := dial()
				if err != nil {
					t.Fatalf("dial %d: %v (tokens of the dials before: %v)", i+1, err, tokens)
				}
				if used {
					resumed++
				}
				time.Sleep(200 * time.Millisecond) // for the connection's last packets
				c := counts(t, tb)
				tokens = append(tokens, c.InitialsPassed-prev)
				prev = c.InitialsPassed
			}
			c := counts(t, tb)
			t.Logf("%s: %d dials over one socket (and a first), %d with 0-RTT data; tokens a dial %v; program %+v", tc.name, dials, resumed, tokens, c)
			if resumed == 0 {
				t.Fatal("no dial sent 0-RTT data")
			}
			if !slices.Equal(tokens, slices.Repeat([]uint64{1}, dials)) || c != (Counts{InitialsPassed: 1 + dials}) {
				t.Fatalf("tokens a dial %v, program %+v; want 1 a dial, %d Initials passed, none dropped", tokens, c, 1+dials)
			}
		})
	}
}
