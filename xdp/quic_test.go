//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"encoding/binary"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/floodgate-rl/floodgate/limiter"
)

// QUIC versions (RFC 9000, RFC 9369).
const (
	quicV1 = 0x00000001
	quicV2 = 0x6b3343cf
)

// A quicPacket is the first QUIC packet of a UDP datagram, as a client
// sends it: a long header unless short is set.
type quicPacket struct {
	short   bool
	version uint32
	typ     byte // the long header's type bits: Initial is 0 in v1, 1 in v2
	dcid    []byte
	scid    []byte
	token   []byte
	size    int    // the UDP payload's size; 0: 1200, as a client pads it
	sport   uint16 // 0: 50000
	dport   uint16 // 0: 443
	// then, if not nil, is a long-header packet coalesced behind this one,
	// whose Length then covers 40 bytes of payload.
	then *quicPacket
	// length, if not 0 and then is nil, is the Length field's value (a
	// two-byte varint); 0: 1232, beyond the datagram.
	length int
}

// clientSCID is the source connection ID (SCID) of the tests' client
// connections, on every long-header packet they send (RFC 9000 §7.2: a
// client keeps its SCID through the handshake; quic-go's is 4 random
// bytes a connection).
var clientSCID = []byte{1, 2, 3, 4}

// handshakeBehind is the datagram a client sends once it has the server's
// first Initial and Handshake packets (RFC 9000 §7.2, §12.2): an Initial
// under the server's connection ID (here 4 bytes, as quic-go's), no
// token, acknowledging the server's, coalesced before a Handshake packet
// with its Finished, padded to 1200 bytes, both under clientSCID; of the
// given version (the Handshake type is 2 in version 1, 3 in version 2).
func handshakeBehind(version uint32, sport uint16) quicPacket {
	initial, handshake := byte(0), byte(2)
	if version == quicV2 {
		initial, handshake = 1, 3
	}
	return quicPacket{version: version, typ: initial, dcid: []byte{0x5e, 0x7e, 0x70, 0x01}, scid: clientSCID, sport: sport,
		then: &quicPacket{version: version, typ: handshake, dcid: []byte{0x5e, 0x7e, 0x70, 0x01}, scid: clientSCID}}
}

// handshake is a client's Handshake packet alone in its datagram, as it
// sends one after its first, under clientSCID.
func handshake(version uint32, sport uint16) quicPacket {
	typ := byte(2)
	if version == quicV2 {
		typ = 3
	}
	return quicPacket{version: version, typ: typ, dcid: []byte{0x5e, 0x7e, 0x70, 0x01}, scid: clientSCID, sport: sport, size: 60}
}

// under is q with every packet in its datagram under SCID scid (q's own
// Length, if set, is kept: zeroRTT's are made with their SCID).
func (q quicPacket) under(scid []byte) quicPacket {
	q.scid = scid
	if q.then != nil {
		then := q.then.under(scid)
		q.then = &then
	}
	return q
}

// typeIn is the long-header type bits of v1type (numbered as in version
// 1: Initial 0, 0-RTT 1, Handshake 2) in version: version 2 numbers them
// one up, mod 4.
func typeIn(version uint32, v1type byte) byte {
	if version == quicV2 {
		return (v1type + 1) & 3
	}
	return v1type
}

// passEnders are the datagrams a client's connection sends from its
// address and port, under its SCID scid, that open no connection but start
// with a long-header packet, each of which ends the free pass of the
// connection latest from there under scid: a Handshake packet alone or
// behind the Initial that acknowledges
// the server's (as quic-go sends them), and the shapes that hide one from a
// program that looks for it by type and place (quic-go's server reads every
// packet of a datagram under the DCID, whatever their order): behind a
// 0-RTT packet, behind two Initials, and a 0-RTT packet with a byte behind
// it (quic-go reads it as a packet coalesced behind), an Initial under a
// short DCID and no token, an Initial in a datagram under 1200 bytes. A
// 0-RTT packet alone in its datagram ends no pass, nor does a datagram
// too short for quic-go to decrypt anything in (TestAResumingClients0RTTKeepsItsPass).
func passEnders(version uint32, sport uint16, scid []byte) map[string]quicPacket {
	server := []byte{0x5e, 0x7e, 0x70, 0x01}
	hs := handshake(version, sport)
	hidden := quicPacket{version: version, typ: typeIn(version, 1), dcid: server, sport: sport}
	hidden.then = &quicPacket{version: version, typ: typeIn(version, 2), dcid: server}
	ack := handshakeBehind(version, sport)
	twice := ack
	twice.then = &quicPacket{version: version, typ: ack.typ, dcid: server, then: ack.then}
	short := quicPacket{version: version, typ: typeIn(version, 0), dcid: server, sport: sport}
	small := quicPacket{version: version, typ: typeIn(version, 0), dcid: dcid(8, 1), sport: sport, size: 1199}
	return map[string]quicPacket{
		"a Handshake packet alone":                        hs.under(scid),
		"a Handshake packet behind the Initial ACK":       ack.under(scid),
		"a Handshake packet behind a 0-RTT packet":        hidden.under(scid),
		"a Handshake packet behind the Initial ACK twice": twice.under(scid),
		"a 0-RTT packet with a byte behind it":            zeroRTT(version, sport, scid, 1200, 1),
		"an Initial under a 4-byte DCID and no token":     short.under(scid),
		"an Initial under an 8-byte DCID in 1199 bytes":   small.under(scid),
	}
}

// zeroRTT is a resuming client's 0-RTT packet (under its first DCID, as
// quic-go sends it before the server's reply) under SCID scid in a
// datagram of size bytes, its Length covering all of it but the last
// behind bytes.
func zeroRTT(version uint32, sport uint16, scid []byte, size, behind int) quicPacket {
	q := quicPacket{version: version, typ: typeIn(version, 1), dcid: dcid(8, 1), scid: scid, sport: sport, size: size}
	q.length = size - behind - (7 + len(q.dcid) + len(q.scid) + 2) // the header, a two-byte Length
	return q
}

// tooShort is q in a datagram that ends 20 bytes after its SCID: too
// short to hold anything quic-go decrypts (a Length, and a packet's 20
// bytes after it, RFC 9001 §5.4.2).
func tooShort(q quicPacket) quicPacket {
	return endingAfterSCID(q, 20)
}

// endingAfterSCID is q in a datagram that ends n bytes after its SCID.
func endingAfterSCID(q quicPacket, n int) quicPacket {
	q.size = 7 + len(q.dcid) + len(q.scid) + n // 1+4+1+DCID+1 bytes before the SCID
	return q
}

// endsPass is one of passEnders under scid, picked at random, to either
// QUIC port of quicTable.
func endsPass(r *rand.Rand, version uint32, sport uint16, scid []byte) quicPacket {
	m := passEnders(version, sport, scid)
	names := slices.Sorted(maps.Keys(m))
	q := m[names[r.IntN(len(names))]]
	q.dport = uint16(443 + 8000*r.IntN(2))
	return q
}

// v1Initial is a version 1 Initial of connection dcid, as a client sends
// its first (DCID of 8 bytes or more, no token, padded to 1200 bytes).
func v1Initial(dcid ...byte) quicPacket {
	return quicPacket{version: quicV1, dcid: dcid, scid: clientSCID}
}

// datagram is q's UDP datagram (header and payload).
func (q quicPacket) datagram() []byte {
	size, sport, dport := q.size, q.sport, q.dport
	if size == 0 {
		size = 1200
	}
	if sport == 0 {
		sport = 50000
	}
	if dport == 0 {
		dport = 443
	}
	p := q.packet()
	for len(p) < size {
		p = append(p, 0xa5) // the encrypted rest, as far as the program sees
	}
	udp := make([]byte, 8, 8+len(p))
	binary.BigEndian.PutUint16(udp[0:], sport)
	binary.BigEndian.PutUint16(udp[2:], dport)
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(p)))
	return append(udp, p[:size]...)
}

// packet is q's packet as it starts the datagram, and any coalesced
// behind it.
func (q quicPacket) packet() []byte {
	if q.short {
		return append([]byte{0x40}, q.dcid...) // fixed bit, then the DCID
	}
	p := []byte{0x80 | 0x40 | q.typ<<4}
	p = binary.BigEndian.AppendUint32(p, q.version)
	p = append(p, byte(len(q.dcid)))
	p = append(p, q.dcid...)
	p = append(p, byte(len(q.scid)))
	p = append(p, q.scid...)
	if initial := q.typ == 0 && q.version == quicV1 || q.typ == 1 && q.version == quicV2; initial {
		p = append(p, 0x40|byte(len(q.token)>>8), byte(len(q.token))) // a two-byte varint
		p = append(p, q.token...)
	}
	if q.then == nil && q.length > 0 {
		return append(p, 0x40|byte(q.length>>8), byte(q.length))
	}
	if q.then == nil {
		return append(p, 0x44, 0xd0) // Length: 1232, beyond the datagram as garbage is
	}
	p = append(p, 0x40, 40) // Length: 40, as a two-byte varint
	p = append(p, make([]byte, 40)...)
	return append(p, q.then.packet()...)
}

// frame is q's datagram from src in shape s.
func (q quicPacket) frame(src netip.Addr, s shape) []byte {
	return framed(src, 17, q.datagram(), s)
}

func dcid(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i)
	}
	return b
}

// quicTable is a table with a burst of two an hour, limiting SYNs to
// TCP 443 and QUIC Initials to UDP 443 and 8443.
func quicTable(t *testing.T) *Table {
	t.Helper()
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 2, Window: time.Hour}))
	if err := tb.enable(Ports{TCP: []uint16{443}, QUIC: []uint16{443, 8443}}); err != nil {
		t.Fatal(err)
	}
	return tb
}

// quicZone is a table with a burst of burst an hour, limiting QUIC
// Initials to UDP 443 and no TCP port.
func quicZone(t *testing.T, burst int64) *Table {
	t.Helper()
	tb := newTestTable(t, testConfig(limiter.Limit{Events: burst, Window: time.Hour}))
	if err := tb.enable(Ports{QUIC: []uint16{443}}); err != nil {
		t.Fatal(err)
	}
	return tb
}

func counts(t *testing.T, tb *Table) Counts {
	t.Helper()
	c, err := tb.Counts()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestProgramChargesQUICInitials: on a UDP port named for QUIC, an Initial
// that can open a connection — version 1 with type 0 or version 2 with
// type 1, in a datagram of 1200 bytes or more, with a DCID of 8 to 20 bytes
// or a token — takes one token from its source network, in every shape the
// program parses but a fragment's; every other packet passes and charges
// nothing.
func TestProgramChargesQUICInitials(t *testing.T) {
	v2 := v1Initial(dcid(8, 1)...)
	v2.version, v2.typ = quicV2, 1
	shortUnderToken := v1Initial(dcid(4, 1)...)
	shortUnderToken.token = []byte("a retry's token")
	charged := map[string]quicPacket{
		"v1 Initial":                 v1Initial(dcid(8, 1)...),
		"v1 Initial, 20-byte DCID":   v1Initial(dcid(20, 1)...),
		"v2 Initial":                 v2,
		"short DCID under a token":   shortUnderToken,
		"larger datagram":            {version: quicV1, dcid: dcid(12, 1), size: 1452},
		"v1 Initial on another port": {version: quicV1, dcid: dcid(9, 1), dport: 8443},
		"fixed bit clear (RFC 9287)": {version: quicV1, dcid: dcid(8, 1), typ: 0},
	}
	v1Type1 := v1Initial(dcid(8, 1)...)
	v1Type1.typ = 1 // 0-RTT in v1
	v2Type0 := v2
	v2Type0.typ = 0 // Retry in v2
	small := v1Initial(dcid(8, 1)...)
	small.size = 1199
	long := v1Initial(dcid(21, 1)...)
	longSCID := v1Initial(dcid(8, 1)...)
	longSCID.scid = dcid(21, 1)
	shortDCID := v1Initial(dcid(7, 1)...)
	otherPort := v1Initial(dcid(8, 1)...)
	otherPort.dport = 80
	passed := map[string]quicPacket{
		"v1 0-RTT":              v1Type1,
		"v1 Handshake":          {version: quicV1, typ: 2, dcid: dcid(8, 1)},
		"v1 Retry":              {version: quicV1, typ: 3, dcid: dcid(8, 1)},
		"v2 Retry":              v2Type0,
		"v2 Handshake":          {version: quicV2, typ: 3, dcid: dcid(8, 1)},
		"version negotiation":   {version: 0, dcid: dcid(8, 1)},
		"unknown version":       {version: 0xff00001d, dcid: dcid(8, 1)},
		"short header":          {short: true, dcid: dcid(8, 1)},
		"1199 bytes":            small,
		"21-byte DCID":          long,
		"21-byte SCID":          longSCID,
		"7-byte DCID, no token": shortDCID,
		"UDP port not named":    otherPort,
		"truncated to 40 bytes": {version: quicV1, dcid: dcid(8, 1), size: 40},
		"4-byte DCID, no token": {version: quicV1, dcid: dcid(4, 1)},
	}
	// The packet "fixed bit clear" is built with the bit set; clear it.
	fixedClear := func(f []byte) []byte { f[len(f)-1200] &^= 0x40; return f }
	// One table (loading the program takes a second), a network for each
	// case: IPv6 behind extension headers, IPv4 otherwise.
	tb := quicTable(t)
	network := 0
	for name, q := range charged {
		for _, s := range parsedShapes {
			if s.moreFragments { // dropped uncharged: TestProgramDropsFragmentedQUIC
				continue
			}
			network++
			src := netip.AddrFrom4([4]byte{10, byte(network >> 8), byte(network), 7})
			if len(s.ext) > 0 {
				src = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, byte(network >> 8), byte(network), 15: 7})
			}
			t.Run(name+"/"+s.name, func(t *testing.T) {
				before := counts(t, tb)
				frame := func(q quicPacket) []byte {
					f := q.frame(src, s)
					if name == "fixed bit clear (RFC 9287)" {
						f = fixedClear(f)
					}
					return f
				}
				other := q
				other.dcid = dcid(len(q.dcid), 100) // another connection
				if len(q.dcid) < 8 {
					other.sport = 50001
				}
				third := q
				third.dcid = dcid(len(q.dcid), 200)
				third.sport = 50002
				for i, want := range []uint32{xdpPass, xdpPass, xdpDrop} {
					p := []quicPacket{q, other, third}[i]
					if v := runAt(t, tb, frame(p), 1e9); v != want {
						t.Fatalf("connection %d: verdict %d, want %d (a burst of two)", i+1, v, want)
					}
				}
				if c := counts(t, tb); c != (Counts{InitialsPassed: before.InitialsPassed + 2, InitialsDropped: before.InitialsDropped + 1}) {
					t.Fatalf("counts %+v after %+v, want 2 more Initials passed and 1 more dropped", c, before)
				}
			})
		}
	}
	untouched := quicTable(t)
	for name, q := range passed {
		t.Run(name, func(t *testing.T) {
			tb := untouched
			for _, src := range []netip.Addr{netip.MustParseAddr("192.0.2.7"), netip.MustParseAddr("2001:db8:7::7")} {
				for range 3 {
					if v := runAt(t, tb, q.frame(src, shape{}), 1e9); v != xdpPass {
						t.Fatalf("verdict %d, want pass", v)
					}
				}
			}
			if c := counts(t, tb); c != (Counts{}) || slices.ContainsFunc(words(tb.mem), func(w uint64) bool { return w != 0 }) {
				t.Fatalf("a packet that opens no QUIC connection was counted (%+v) or charged the table", c)
			}
		})
	}
}

// TestSplitClientHelloCostsOneToken: the Initials of one connection (its
// source address and port, and DCID) cost one token however many the
// client sends — a ClientHello split over two, a retransmission — while
// another connection from the same source address and port costs another.
// The Initials after the server's, under the server's shorter connection
// ID and a token (a Retry's or NEW_TOKEN's), are the one case that costs a
// connection a second token: the program cannot tell them from a new
// connection's (TestAChargedConnectionFreesNoOther).
func TestSplitClientHelloCostsOneToken(t *testing.T) {
	tb := quicZone(t, 4)
	src := netip.MustParseAddr("198.51.100.7")
	first := v1Initial(dcid(8, 1)...)
	second := first                                                                                     // the ClientHello's second half: the same DCID
	afterServer := quicPacket{version: quicV1, dcid: dcid(4, 50), token: []byte("a NEW_TOKEN's token")} // DCID: the server's
	another := v1Initial(dcid(8, 9)...)                                                                 // a new connection from the same address and port
	table := func() []uint64 { return slices.Clone(words(tb.mem)) }
	steps := []struct {
		name   string
		q      quicPacket
		charge bool
	}{
		{"first Initial", first, true},
		{"second Initial of the ClientHello", second, false},
		{"retransmitted first Initial", first, false},
		{"Initial after the server's, under a token", afterServer, true},
		{"its retransmission", afterServer, false},
		{"another connection", another, true},
		{"its retransmission", another, false},
	}
	passed := uint64(0)
	for _, st := range steps {
		before := table()
		if v := runAt(t, tb, st.q.frame(src, shape{}), 1e9); v != xdpPass {
			t.Fatalf("%s: verdict %d, want pass", st.name, v)
		}
		if changed := !slices.Equal(before, table()); changed != st.charge {
			t.Fatalf("%s: table charged %v, want %v", st.name, changed, st.charge)
		}
		if st.charge {
			passed++
		}
		if c := counts(t, tb); c != (Counts{InitialsPassed: passed}) {
			t.Fatalf("%s: counts %+v, want %d Initials passed", st.name, c, passed)
		}
	}
	// The network has one token left: a third connection takes it, a
	// fourth is dropped, and the first's retransmission still passes.
	for i, want := range []uint32{xdpPass, xdpDrop, xdpPass} {
		q := []quicPacket{v1Initial(dcid(8, 30)...), v1Initial(dcid(8, 40)...), first}[i]
		if v := runAt(t, tb, q.frame(src, shape{}), 1e9); v != want {
			t.Fatalf("after two connections, packet %d: verdict %d, want %d", i, v, want)
		}
	}
	if c := counts(t, tb); c != (Counts{InitialsPassed: 4, InitialsDropped: 1}) {
		t.Fatalf("counts %+v, want 4 Initials passed, 1 dropped", c)
	}
}

// TestQUICAndSYNsShareABudget: a network's SYNs and QUIC connections take
// from the same counters: a burst of two is two connections, of either
// kind.
func TestQUICAndSYNsShareABudget(t *testing.T) {
	tb := quicTable(t)
	src := netip.MustParseAddr("203.0.113.5")
	for i, tc := range []struct {
		frame []byte
		want  uint32
	}{
		{packet(src, 443, flagSYN), xdpPass},
		{v1Initial(dcid(8, 1)...).frame(src, shape{}), xdpPass},
		{v1Initial(dcid(8, 2)...).frame(src, shape{}), xdpDrop},
		{packet(src, 443, flagSYN), xdpDrop},
	} {
		if v := runAt(t, tb, tc.frame, 1e9); v != tc.want {
			t.Fatalf("attempt %d: verdict %d, want %d", i, v, tc.want)
		}
	}
	if c := counts(t, tb); c != (Counts{Passed: 1, Dropped: 1, InitialsPassed: 1, InitialsDropped: 1}) {
		t.Fatalf("counts %+v", c)
	}
}

// drainedQUICTable is a table with a burst of one an hour, limiting QUIC
// Initials to UDP 443, whose network of src has spent its token on a
// connection of its own.
func drainedQUICTable(t *testing.T, src netip.Addr) *Table {
	t.Helper()
	tb := quicZone(t, 1)
	if v := runAt(t, tb, v1Initial(dcid(8, 1)...).frame(src, shape{}), 1e9); v != xdpPass {
		t.Fatalf("the network's first connection: verdict %d, want pass", v)
	}
	return tb
}

// TestAChargedConnectionFreesNoOther: Initials under a token and a DCID
// shorter than 8 bytes open a connection at quic-go each (it opens one
// even for a token it cannot decode), so the one connection the program
// charged from an address and port must not let them pass: each new DCID
// is charged, and dropped once the network is drained. (The program once
// remembered a charged connection by its address and port alone too, and
// let every such Initial from them pass free.)
func TestAChargedConnectionFreesNoOther(t *testing.T) {
	src := netip.MustParseAddr("198.51.100.7")
	tb := drainedQUICTable(t, src)
	passed := 0
	for i := range 100 {
		q := quicPacket{version: quicV1, dcid: dcid(1+i%7, byte(i)), scid: []byte{1}, token: []byte{0xde, 0xad, byte(i)}}
		if runAt(t, tb, q.frame(src, shape{}), 1e9) == xdpPass {
			passed++
		}
	}
	if c := counts(t, tb); passed > 0 || c != (Counts{InitialsPassed: 1, InitialsDropped: 100}) {
		t.Fatalf("%d of 100 Initials under a token and a short DCID, from the address and port of a charged connection, passed a drained network; counts %+v, want 1 passed, 100 dropped", passed, c)
	}
}

// TestTheInitialsMapHoldsItsEntries: the map of charged connections holds
// about its 65,536 entries (docs/xdp.md), one per charged connection: a
// client's split ClientHello still passes uncharged after 60,000 spoofed
// connections from other networks were charged since its first Initial.
// (With two entries per connection, it was evicted after some 34,000 and
// its second half was charged again: dropped, on a burst of one.)
func TestTheInitialsMapHoldsItsEntries(t *testing.T) {
	cfg := testConfig(limiter.Limit{Events: 1, Window: time.Hour})
	cfg.Buckets.Bytes = 64 << 20 // room for the spoofed networks: few false denies
	tb := newTestTable(t, cfg)
	if err := tb.enable(Ports{QUIC: []uint16{443}}); err != nil {
		t.Fatal(err)
	}
	client := netip.MustParseAddr("203.0.113.5")
	first := v1Initial(dcid(8, 1)...)
	if v := runAt(t, tb, first.frame(client, shape{}), 1e9); v != xdpPass {
		t.Fatalf("the client's first Initial: verdict %d, want pass", v)
	}
	const spoofed = 60000
	for i := range spoofed { // a /24 each
		src := netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 1})
		runAt(t, tb, v1Initial(dcid(8, byte(i))...).frame(src, shape{}), 1e9)
	}
	c := counts(t, tb)
	if c.InitialsPassed < spoofed*99/100 {
		t.Fatalf("only %d of %d spoofed connections were charged: the test needs them remembered", c.InitialsPassed-1, spoofed)
	}
	if v := runAt(t, tb, first.frame(client, shape{}), 1e9); v != xdpPass {
		t.Fatalf("the second half of the client's ClientHello, after %d connections charged since its first: verdict %d, want pass (its connection forgotten, charged again)", c.InitialsPassed-1, v)
	}
}

// TestProgramDropsFragmentedQUIC: a first fragment of a UDP datagram to a
// QUIC port is dropped uncharged and counted as a dropped Initial, in IPv4
// and IPv6, whatever it holds: RFC 9000 §14 forbids fragmenting QUIC, and a
// first fragment too short to parse, passed, let the kernel reassemble an
// Initial nothing charged. A first fragment to another UDP port, or of a
// TCP SYN, is what it was; in a zone without QUIC ports every UDP
// fragment passes.
func TestProgramDropsFragmentedQUIC(t *testing.T) {
	tb := quicTable(t)
	whole := v1Initial(dcid(8, 1)...).datagram()
	other := v1Initial(dcid(8, 1)...)
	other.dport = 80
	for i, s := range []shape{
		{name: "ipv4", moreFragments: true},
		{name: "ipv4 with options", ipv4Opts: 2, moreFragments: true},
		{name: "ipv6", ext: []byte{ipv6Fragment}, moreFragments: true},
		{name: "ipv6 behind hop-by-hop", ext: []byte{ipv6HopByHop, ipv6Fragment}, moreFragments: true},
	} {
		t.Run(s.name, func(t *testing.T) {
			src := netip.AddrFrom4([4]byte{10, 9, byte(i), 7})
			if !s.v4() {
				src = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 9, byte(i), 15: 7})
			}
			before, table := counts(t, tb), slices.Clone(words(tb.mem))
			for _, l4 := range [][]byte{
				whole[:8+48], // the UDP header and 48 bytes: too short to parse as an Initial
				whole,        // a whole Initial, the rest of the datagram to follow
				whole[:4],    // not even the UDP header
			} {
				for range 3 {
					if v := runAt(t, tb, framed(src, 17, l4, s), 1e9); v != xdpDrop {
						t.Fatalf("a first fragment of %d bytes to a QUIC port: verdict %d, want drop", len(l4), v)
					}
				}
			}
			if v := runAt(t, tb, other.frame(src, s), 1e9); v != xdpPass {
				t.Fatalf("a first fragment to UDP port 80: verdict %d, want pass", v)
			}
			want := before
			want.InitialsDropped += 9
			if c := counts(t, tb); c != want || !slices.Equal(table, words(tb.mem)) {
				t.Fatalf("counts %+v after %+v, want 9 more Initials dropped, and the table uncharged", c, before)
			}
			// The network's burst is whole: a SYN in the same shape takes
			// one token as before, as does an unfragmented Initial.
			for _, f := range [][]byte{shaped(src, 443, flagSYN, s), v1Initial(dcid(8, 1)...).frame(src, shape{})} {
				if v := runAt(t, tb, f, 1e9); v != xdpPass {
					t.Fatalf("verdict %d, want pass", v)
				}
			}
			if v := runAt(t, tb, v1Initial(dcid(8, 2)...).frame(src, shape{}), 1e9); v != xdpDrop {
				t.Fatalf("a third connection, on a burst of two: verdict %d, want drop", v)
			}
		})
	}
	tcpOnly := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	if err := tcpOnly.enable(Ports{TCP: []uint16{443}}); err != nil {
		t.Fatal(err)
	}
	for _, src := range []netip.Addr{netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")} {
		s := shape{moreFragments: true}
		if src.Is6() {
			s.ext = []byte{ipv6Fragment}
		}
		if v := runAt(t, tcpOnly, framed(src, 17, whole[:8+48], s), 1e9); v != xdpPass {
			t.Fatalf("a first UDP fragment from %v in a zone without QUIC ports: verdict %d, want pass", src, v)
		}
	}
	if c := counts(t, tcpOnly); c != (Counts{}) {
		t.Fatalf("counts %+v in a zone without QUIC ports, want none", c)
	}
}

// TestIPv6UDPLengthZeroIsTheRestOfThePayload: Linux delivers an IPv6 UDP
// datagram whose length field is 0 as the rest of the IPv6 payload (the
// jumbogram convention), so an Initial in one is charged by that length:
// dropped from a drained network. (The program took the field for the
// length, and let every such Initial pass as too small to be one.)
func TestIPv6UDPLengthZeroIsTheRestOfThePayload(t *testing.T) {
	src := netip.MustParseAddr("2001:db8:99::7")
	tb := drainedQUICTable(t, src)
	for i := range 10 {
		d := v1Initial(dcid(8, byte(i+10))...).datagram()
		binary.BigEndian.PutUint16(d[4:], 0)
		if v := runAt(t, tb, framed(src, 17, d, shape{}), 1e9); v != xdpDrop {
			t.Fatalf("Initial %d with a UDP length of 0 from a drained network: verdict %d, want drop", i, v)
		}
	}
	// One whose IPv6 payload is short of 1,208 bytes is no Initial.
	small := v1Initial(dcid(8, 99)...)
	small.size = 1199
	d := small.datagram()
	binary.BigEndian.PutUint16(d[4:], 0)
	if v := runAt(t, tb, framed(src, 17, d, shape{}), 1e9); v != xdpPass {
		t.Fatalf("a 1,207-byte datagram with a UDP length of 0: verdict %d, want pass", v)
	}
	if c := counts(t, tb); c != (Counts{InitialsPassed: 1, InitialsDropped: 10}) {
		t.Fatalf("counts %+v, want 1 Initial passed, 10 dropped", c)
	}
}

// TestQUICZoneDropsWhatItCannotWalk: in a zone that limits QUIC, a packet
// whose headers the program cannot walk to its transport header (a third
// VLAN tag, more IPv6 extension headers than it walks) is dropped and
// counted as a dropped Initial, whatever it carries: nothing charges an
// Initial behind the program, and the kernel delivers them (a TCP-only
// zone passes them for the matcher: TestProgramChargesEverySYNItParses).
// Headers the kernel delivers no UDP behind without a security
// association (ESP), and later fragments (dropped with their first), pass.
func TestQUICZoneDropsWhatItCannotWalk(t *testing.T) {
	tb := quicTable(t)
	for i, s := range notParsed {
		t.Run(s.name, func(t *testing.T) {
			src := netip.AddrFrom4([4]byte{10, 77, byte(i), 7})
			if !s.v4() && len(s.vlans) == 0 {
				src = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0x77, byte(i), 15: 7})
			}
			lost := len(s.vlans) > 2 || len(s.ext) > 6
			want := uint32(xdpPass)
			if lost {
				want = xdpDrop
			}
			before, table := counts(t, tb), slices.Clone(words(tb.mem))
			frames := [][]byte{v1Initial(dcid(8, 1)...).frame(src, s), shaped(src, 443, flagSYN, s), shaped(src, 443, flagACK, s)}
			for _, f := range frames {
				if v := runAt(t, tb, f, 1e9); v != want {
					t.Fatalf("verdict %d, want %d", v, want)
				}
			}
			wantCounts := before
			if lost {
				wantCounts.InitialsDropped += uint64(len(frames))
			}
			if c := counts(t, tb); c != wantCounts || !slices.Equal(table, words(tb.mem)) {
				t.Fatalf("counts %+v after %+v (want %+v), or the table was charged", c, before, wantCounts)
			}
		})
	}
}

// TestQUICPortsAloneLimitNoTCPPort: a zone that names QUIC ports and no
// TCP port (`xdp eth0 quic 443`) limits no SYN: an SSH SYN neither is
// dropped nor spends the network's HTTP/3 budget; a zone that names no
// port at all limits SYNs to every TCP port, as before.
func TestQUICPortsAloneLimitNoTCPPort(t *testing.T) {
	src := netip.MustParseAddr("198.51.100.50")
	for _, tc := range []struct {
		ports Ports
		want  Counts // after a SYN to TCP 22, an Initial, another SYN
	}{
		{Ports{QUIC: []uint16{443}}, Counts{InitialsPassed: 1}},
		{Ports{}, Counts{Passed: 1, Dropped: 1}},
	} {
		tb := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
		if err := tb.enable(tc.ports); err != nil {
			t.Fatal(err)
		}
		var v []uint32
		for _, f := range [][]byte{packet(src, 22, flagSYN), v1Initial(dcid(8, 1)...).frame(src, shape{}), packet(src, 22, flagSYN)} {
			v = append(v, runAt(t, tb, f, 1e9))
		}
		if c := counts(t, tb); c != tc.want || v[0] != xdpPass {
			t.Errorf("%+v: a SYN to TCP 22, an Initial to UDP 443, a SYN to TCP 22: verdicts %v, counts %+v, want %+v", tc.ports, v, c, tc.want)
		}
	}
}

// TestAConnectionsEntryPassesAFewInitialsFree: the Initials found among
// the connections charged pass free 16 times; the next is charged as a new
// connection's (and, granted, starts the count again). A client that
// opens connection after connection under the same address, port and DCID
// — quic-go retires a client's first DCID a few round trips after the
// handshake, and then takes an Initial under it for a new connection —
// paid for the first alone before.
func TestAConnectionsEntryPassesAFewInitialsFree(t *testing.T) {
	tb := quicZone(t, 2)
	src := netip.MustParseAddr("198.51.100.7")
	f := v1Initial(dcid(8, 1)...).frame(src, shape{})
	var v []uint32
	for range 1 + 16 + 1 + 16 + 1 {
		v = append(v, runAt(t, tb, f, 1e9))
	}
	want := slices.Repeat([]uint32{xdpPass}, 34)
	want = append(want, xdpDrop)
	if c := counts(t, tb); !slices.Equal(v, want) || c != (Counts{InitialsPassed: 2, InitialsDropped: 1}) {
		t.Fatalf("35 Initials of one address, port and DCID, on a burst of two: verdicts %v, counts %+v; want 34 passed (the 1st and 18th charged), the 35th dropped", v, c)
	}
}

// passClock is the time the program's pass_clock reads now: the coarse
// CLOCK_MONOTONIC on the table's clock.
func passClock(tb testing.TB, t *Table) uint64 {
	tb.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts); err != nil {
		tb.Fatal(err)
	}
	return uint64(ts.Nano()) - t.params.Epoch
}

// chargedBy runs frame through the program at ns and reports its verdict
// and whether it charged the table.
func chargedBy(t *testing.T, tb *Table, frame []byte, ns int64) (uint32, bool) {
	t.Helper()
	before := slices.Clone(words(tb.mem))
	v := runAt(t, tb, frame, ns)
	return v, !slices.Equal(before, words(tb.mem))
}

// TestAClientsLongHeaderPacketEndsTheFreePass: any datagram from the
// address and port of a charged connection that starts with a long-header
// packet and opens no connection (passEnders: a Handshake packet alone or
// behind the Initial ACK, as a client sends them, or hidden behind a 0-RTT
// packet or two Initials; a 0-RTT packet; an Initial under a short DCID or
// in a short datagram) ends the connection's free pass, in version 1 and
// 2: the next Initial under the connection's DCID is charged as a new
// connection's. Such datagrams from another port or another address (in
// the same network) end nothing, and charge nothing. (A pass ended only
// after 16 free Initials, so a client that reused its DCID for connection
// after connection — quic-go lets it, once it retired the DCID — opened up
// to 16 for a token: a review served 9 to 17 HTTP/3 connections a token in
// Caddy. Then it ended only at a Handshake packet first in its datagram or
// behind one Initial, and a client that put a junk 0-RTT packet or a
// second Initial in front of it got 17 again.)
func TestAClientsLongHeaderPacketEndsTheFreePass(t *testing.T) {
	tb := quicZone(t, 100)
	type endCase struct {
		name    string
		version uint32
		ends    func(sport uint16) quicPacket
	}
	var cases []endCase
	for _, version := range []uint32{quicV1, quicV2} {
		for _, name := range slices.Sorted(maps.Keys(passEnders(version, 0, clientSCID))) {
			v := "v1"
			if version == quicV2 {
				v = "v2"
			}
			cases = append(cases, endCase{v + ", " + name, version,
				func(sport uint16) quicPacket { return passEnders(version, sport, clientSCID)[name] }})
		}
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			src := netip.AddrFrom4([4]byte{198, 51, byte(100 + i), 7})
			neighbour := netip.AddrFrom4([4]byte{198, 51, byte(100 + i), 8})
			initial := v1Initial(dcid(8, 1)...)
			if tc.version == quicV2 {
				initial.version, initial.typ = quicV2, 1
			}
			ns := int64(1e9)
			steps := []struct {
				name   string
				frame  []byte
				charge bool
			}{
				{"the connection's first Initial", initial.frame(src, shape{}), true},
				{"its second", initial.frame(src, shape{}), false},
				{"the packet from another port", tc.ends(50001).frame(src, shape{}), false},
				{"the packet from another address", tc.ends(50000).frame(neighbour, shape{}), false},
				{"an Initial under the DCID after those", initial.frame(src, shape{}), false},
				{"the packet from the connection's address and port", tc.ends(50000).frame(src, shape{}), false},
				{"an Initial under the DCID after it: a new connection", initial.frame(src, shape{}), true},
				{"that one's second", initial.frame(src, shape{}), false},
				{"the packet again", tc.ends(50000).frame(src, shape{}), false},
				{"a third connection under the DCID", initial.frame(src, shape{}), true},
			}
			for _, st := range steps {
				ns += 1e6
				v, charged := chargedBy(t, tb, st.frame, ns)
				if v != xdpPass || charged != st.charge {
					t.Fatalf("%s: verdict %d, charged %v; want pass, charged %v", st.name, v, charged, st.charge)
				}
			}
		})
	}
	if c, want := counts(t, tb), uint64(3*len(cases)); c != (Counts{InitialsPassed: want}) {
		t.Fatalf("counts %+v, want %d Initials passed (3 connections in each of %d cases)", c, want, len(cases))
	}
}

// TestAResumingClients0RTTKeepsItsPass: a 0-RTT packet alone in its
// datagram from a charged connection's address and port — its Length
// covers the datagram to its end, or runs past it — ends no free pass, so
// the client's retransmitted first Initial after it passes free; one with
// anything behind it (a byte: quic-go reads what follows a packet's Length
// as a coalesced packet, which could be a Handshake packet) ends it, in
// version 1 and 2, from IPv4 and IPv6. (Any 0-RTT packet ended the pass:
// a resuming client that sent 0-RTT data in datagrams of their own paid a
// token for each retransmission of its first Initial, which quic-go sends
// before the server's first reply when its stored RTT is short; a review
// counted up to 4 tokens a dial.) Nor does a datagram that ends less than
// 21 bytes after its first packet's SCID, 0-RTT or Handshake: it holds
// nothing quic-go decrypts (TestADatagramQUICGoCannotReadEndsNoPass).
func TestAResumingClients0RTTKeepsItsPass(t *testing.T) {
	tb := quicZone(t, 100)
	n := 0
	for _, version := range []uint32{quicV1, quicV2} {
		for _, src := range []netip.Addr{netip.MustParseAddr("198.51.90.7"), netip.MustParseAddr("2001:db8:90::7")} {
			n++
			t.Run(fmt.Sprintf("%#x from %v", version, src), func(t *testing.T) {
				initial := v1Initial(dcid(8, 1)...)
				if version == quicV2 {
					initial.version, initial.typ = quicV2, 1
				}
				ns := int64(1e9)
				steps := []struct {
					name   string
					q      quicPacket
					charge bool
				}{
					{"the connection's first Initial", initial, true},
					{"a 0-RTT packet alone in 1200 bytes", zeroRTT(version, 50000, clientSCID, 1200, 0), false},
					{"a 0-RTT packet alone in 60 bytes", zeroRTT(version, 50000, clientSCID, 60, 0), false},
					{"a 0-RTT packet whose Length runs a byte past its datagram", zeroRTT(version, 50000, clientSCID, 1200, -1), false},
					{"a 0-RTT packet cut short before its Length's end", zeroRTT(version, 50000, clientSCID, 24, 1), false},
					{"a Handshake packet in a datagram ending 20 bytes after its SCID", tooShort(handshake(version, 50000)), false},
					{"the first Initial retransmitted: the same connection", initial, false},
					{"a 0-RTT packet with a byte behind it", zeroRTT(version, 50000, clientSCID, 1200, 1), false},
					{"an Initial under the DCID after it: a new connection", initial, true},
					{"that one's second", initial, false},
					{"a 0-RTT packet with a Handshake packet behind it", passEnders(version, 50000, clientSCID)["a Handshake packet behind a 0-RTT packet"], false},
					{"a third connection under the DCID", initial, true},
				}
				for _, st := range steps {
					ns += 1e6
					v, charged := chargedBy(t, tb, st.q.frame(src, shape{}), ns)
					if v != xdpPass || charged != st.charge {
						t.Fatalf("%s: verdict %d, charged %v; want pass, charged %v", st.name, v, charged, st.charge)
					}
				}
			})
		}
	}
	if c, want := counts(t, tb), uint64(3*n); c != (Counts{InitialsPassed: want}) {
		t.Fatalf("counts %+v, want %d Initials passed (3 connections in each of %d cases)", c, want, n)
	}
}

// TestAChargeOpensAConnectionOnOneQUICPortOnly: a connection's entry holds
// the server's port, so an Initial under a charged client address, port
// and DCID to another QUIC port of the zone — another socket, where
// quic-go opens another connection — is charged too, and its
// retransmission then passes free. (The entry had no server port: with
// three QUIC ports, one token let one client socket and DCID open a
// handshake on each, at once.)
func TestAChargeOpensAConnectionOnOneQUICPortOnly(t *testing.T) {
	tb := quicTable(t) // QUIC on 443 and 8443
	src := netip.MustParseAddr("198.51.100.9")
	a := v1Initial(dcid(8, 1)...)
	b := a
	b.dport = 8443
	for i, st := range []struct {
		name   string
		q      quicPacket
		charge bool
	}{
		{"an Initial to 443", a, true},
		{"the same Initial to 8443", b, true},
		{"its retransmission to 8443", b, false},
		{"the retransmission to 443", a, false},
	} {
		v, charged := chargedBy(t, tb, st.q.frame(src, shape{}), int64(1e9+i*1e6))
		if v != xdpPass || charged != st.charge {
			t.Fatalf("%s: verdict %d, charged %v; want pass, charged %v", st.name, v, charged, st.charge)
		}
	}
}

// TestAFreePassEndsAfterTheHandshakeWindow: an Initial under a charged
// connection's DCID passes free for 5 seconds after the charge (quic-go's
// handshake idle timeout) if no Handshake packet ended the pass before, and
// is charged after: a client that never sends a Handshake packet from its
// address and port gets no more connections a token than its Initials in
// those 5 seconds.
func TestAFreePassEndsAfterTheHandshakeWindow(t *testing.T) {
	tb := quicZone(t, 100)
	src := netip.MustParseAddr("198.51.100.7")
	f := v1Initial(dcid(8, 1)...).frame(src, shape{})
	const at = int64(3e9)
	for _, st := range []struct {
		ns     int64
		charge bool
	}{
		{at, true},
		{at + 1e9, false},
		{at + 5e9 - 1, false},
		{at + 5e9, true}, // a new connection, and a new pass from here
		{at + 10e9 - 1, false},
		{at + 10e9, true},
	} {
		v, charged := chargedBy(t, tb, f, st.ns)
		if v != xdpPass || charged != st.charge {
			t.Fatalf("an Initial %v after the first charge: verdict %d, charged %v; want pass, charged %v", time.Duration(st.ns-at), v, charged, st.charge)
		}
	}
}

// TestConnectionsAtOnceFromOnePortErrTowardsLimiting: of several
// connections from one address and port under one SCID at once (which no
// quic-go client sends: each of its connections has an SCID of its own,
// TestAnOlderConnectionsHandshakeLeavesTheNewOnesPass), a Handshake packet
// ends the pass of the one whose Initial passed latest — its own, when the
// client opens them one at a time — and the others' passes run on to their
// window: a Handshake packet never ends nothing. Here a retransmission of
// the first connection's Initial makes it the latest again, and the
// Handshake ends its pass, not the second's.
func TestConnectionsAtOnceFromOnePortErrTowardsLimiting(t *testing.T) {
	tb := quicZone(t, 100)
	src := netip.MustParseAddr("198.51.100.7")
	x, y := v1Initial(dcid(8, 1)...).frame(src, shape{}), v1Initial(dcid(8, 50)...).frame(src, shape{})
	hs := handshakeBehind(quicV1, 50000).frame(src, shape{})
	for i, st := range []struct {
		name   string
		frame  []byte
		charge bool
	}{
		{"X's first Initial", x, true},
		{"Y's first Initial", y, true},
		{"X's retransmission", x, false},
		{"a Handshake packet", hs, false},
		{"Y's retransmission", y, false},
		{"an Initial under X", x, true},
		{"a Handshake packet", hs, false},
		{"an Initial under Y, 5 s after its charge", y, true},
	} {
		ns := int64(1e9 + i*1e6)
		if i == 7 {
			ns = 1e9 + 1e6 + 5e9
		}
		v, charged := chargedBy(t, tb, st.frame, ns)
		if v != xdpPass || charged != st.charge {
			t.Fatalf("%s: verdict %d, charged %v; want pass, charged %v", st.name, v, charged, st.charge)
		}
	}
}

// TestAClientReusingItsDCIDPaysForEachConnection: a client that opens
// connection after connection from one address and port under one DCID,
// each with a split ClientHello and a retransmission before its Handshake
// packet, pays one token for each: on a burst of three the fourth is
// dropped, and costs nothing.
func TestAClientReusingItsDCIDPaysForEachConnection(t *testing.T) {
	tb := quicZone(t, 3)
	src := netip.MustParseAddr("198.51.100.7")
	initial := v1Initial(dcid(8, 1)...).frame(src, shape{})
	hs := handshakeBehind(quicV1, 50000).frame(src, shape{})
	ns := int64(1e9)
	var v []uint32
	for range 4 {
		for _, f := range [][]byte{initial, initial, initial, hs} {
			ns += 50e6
			v = append(v, runAt(t, tb, f, ns))
		}
	}
	want := slices.Repeat([]uint32{xdpPass}, 12)
	want = append(want, xdpDrop, xdpDrop, xdpDrop, xdpPass)
	if c := counts(t, tb); !slices.Equal(v, want) || c != (Counts{InitialsPassed: 3, InitialsDropped: 3}) {
		t.Fatalf("four connections under one DCID, on a burst of three: verdicts %v, counts %+v; want %v, 3 Initials passed and 3 dropped", v, c, want)
	}
}

// TestAnOlderConnectionsHandshakeLeavesTheNewOnesPass: a client that dials
// connection after connection over one UDP socket (as quic-go's http3
// client does), each under an SCID of its own, pays one token a
// connection: the previous connection's Handshake packets from the same
// address and port — its close, its answers to the server's
// retransmissions, late when the client reads late — end no pass of the
// new connection, whose retransmitted first Initial passes free; the new
// connection's own Handshake packet ends its pass. Connections open at
// once end their own passes, whichever Initial passed latest. A client
// with a zero-length SCID (quic-go's single-use quic.Dial) ends its pass
// with its Handshake packet as before; a Handshake packet under an SCID
// that none of the port's connections has ends none (quic-go's server
// does not check a Handshake packet's SCID: a client that sends its
// Handshake packets so keeps its pass, to its window or its 16 free
// Initials, as one that sends them from another port does). (A client's
// long-header packet that opened nothing ended the pass of the connection
// latest from its address and port, whatever its SCID: a quic-go client
// reading 150 ms late paid up to 4 tokens a dial, 32 for 10 dials in
// TestDialsOverOneSocketPayOneTokenEach.)
func TestAnOlderConnectionsHandshakeLeavesTheNewOnesPass(t *testing.T) {
	tb := quicZone(t, 100)
	sx, sy, other := []byte{0xa1, 0xa2, 0xa3, 0xa4}, []byte{0xb1, 0xb2, 0xb3, 0xb4}, []byte{0xc1, 0xc2, 0xc3, 0xc4}
	type step struct {
		name   string
		q      quicPacket
		charge bool
	}
	n := 0
	for _, version := range []uint32{quicV1, quicV2} {
		initial := func(scid []byte, seed byte) quicPacket {
			q := v1Initial(dcid(8, seed)...).under(scid)
			q.typ = typeIn(version, 0)
			q.version = version
			return q
		}
		hs := func(scid []byte) quicPacket { return handshakeBehind(version, 50000).under(scid) }
		x, y := initial(sx, 1), initial(sy, 50)
		for _, tc := range []struct {
			name  string
			steps []step
		}{
			{"one after another", []step{
				{"X's first Initial", x, true},
				{"X's Handshake packet", hs(sx), false},
				{"Y's first Initial", y, true},
				{"X's Handshake packet, late", hs(sx), false},
				{"X's Handshake packet alone, late", handshake(version, 50000).under(sx), false},
				{"Y's retransmission: the same connection", y, false},
				{"a Handshake packet under an SCID no connection has", hs(other), false},
				{"Y's retransmission again", y, false},
				{"Y's Handshake packet", hs(sy), false},
				{"an Initial under Y's DCID: a new connection", y, true},
				{"an Initial under X's DCID: a new connection", x, true},
			}},
			{"at once", []step{
				{"X's first Initial", x, true},
				{"Y's first Initial", y, true},
				{"X's Handshake packet", hs(sx), false},
				{"Y's retransmission", y, false},
				{"an Initial under X's DCID: a new connection", x, true},
				{"Y's Handshake packet", hs(sy), false},
				{"an Initial under Y's DCID: a new connection", y, true},
			}},
			{"zero-length SCIDs", []step{
				{"X's first Initial", initial(nil, 1), true},
				{"X's retransmission", initial(nil, 1), false},
				{"X's Handshake packet", hs(nil), false},
				{"an Initial under X's DCID: a new connection", initial(nil, 1), true},
			}},
		} {
			n++
			src := netip.AddrFrom4([4]byte{198, 51, byte(100 + n), 7})
			t.Run(fmt.Sprintf("%#x, %s", version, tc.name), func(t *testing.T) {
				ns := int64(1e9)
				for _, st := range tc.steps {
					ns += 1e6
					v, charged := chargedBy(t, tb, st.q.frame(src, shape{}), ns)
					if v != xdpPass || charged != st.charge {
						t.Fatalf("%s: verdict %d, charged %v; want pass, charged %v", st.name, v, charged, st.charge)
					}
				}
			})
		}
	}
}

// TestADatagramQUICGoCannotReadEndsNoPass: a Handshake packet from a
// charged connection's address, port and SCID ends its free pass from the
// shortest datagram quic-go reads a packet in, 21 bytes after the SCID (a
// Length, and a packet's 20 bytes after it: RFC 9001 §5.4.2; quic-go drops
// a shorter packet undecrypted), and not in a datagram a byte shorter,
// whatever the SCID's length, in version 1 and 2. (A datagram ended the
// pass from 20 bytes after its SCID's start, or 8 after its end: for a
// 4-byte SCID, 5 bytes short of anything quic-go reads.)
func TestADatagramQUICGoCannotReadEndsNoPass(t *testing.T) {
	src := netip.MustParseAddr("198.51.91.7")
	tb := quicZone(t, 100)
	ns := int64(1e9)
	for i, version := range []uint32{quicV1, quicV2} {
		for _, slen := range []int{0, 1, 4, 8, 12, 13, 16, 20} {
			// A connection of its own for each: its own DCID and SCID.
			scid := dcid(slen, byte(0x30+i))
			initial := v1Initial(dcid(8, byte(slen+32*i))...).under(scid)
			if version == quicV2 {
				initial.version, initial.typ = quicV2, 1
			}
			hs := handshake(version, 50000).under(scid)
			for _, st := range []struct {
				name   string
				q      quicPacket
				charge bool
			}{
				{"the connection's first Initial", initial, true},
				{"a Handshake packet ending 20 bytes after its SCID", endingAfterSCID(hs, 20), false},
				{"the first Initial retransmitted", initial, false},
				{"a Handshake packet ending 21 bytes after its SCID", endingAfterSCID(hs, 21), false},
				{"an Initial under the DCID after it: a new connection", initial, true},
			} {
				ns += 1e6
				if v, charged := chargedBy(t, tb, st.q.frame(src, shape{}), ns); v != xdpPass || charged != st.charge {
					t.Fatalf("version %#x, SCID of %d bytes: %s: verdict %d, charged %v; want pass, charged %v", version, slen, st.name, v, charged, st.charge)
				}
			}
		}
	}
}
