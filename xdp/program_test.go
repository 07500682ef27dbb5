//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"bytes"
	"encoding/binary"
	"math/big"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/floodgate-rl/floodgate/limiter"
)

// XDP verdicts.
const (
	xdpAborted = 0
	xdpDrop    = 1
	xdpPass    = 2
)

// tcp flags
const (
	flagSYN = 0x02
	flagACK = 0x10
)

// packet is an Ethernet frame holding a TCP segment from src to dport with
// the given flags, in the plain shape: no VLAN tag, no IP options or
// extension headers.
func packet(src netip.Addr, dport uint16, flags byte) []byte {
	return shaped(src, dport, flags, shape{})
}

// A shape is how a frame wraps its TCP segment: what the program must see
// through (VLAN tags, IPv4 options, IPv6 extension headers, a first
// fragment) and what it must leave to the matcher (a later fragment, an
// unknown header, a longer chain than it walks).
type shape struct {
	name  string
	vlans []uint16 // tag protocols, outermost first: 0x8100 or 0x88a8
	// ipv4Opts is the IPv4 options' length in 32-bit words.
	ipv4Opts int
	// ext is the IPv6 extension headers, first first: ipv6HopByHop,
	// ipv6Routing, ipv6Fragment, ipv6DestOpts, or another protocol number
	// (a header of 8 bytes).
	ext []byte
	// fragOffset is a non-zero fragment offset (in 8 bytes) for a later
	// fragment: in the IPv4 header, or in the IPv6 fragment header.
	fragOffset uint16
	// moreFragments marks the packet as a first fragment of several.
	moreFragments bool
}

// IPv6 extension headers' protocol numbers.
const (
	ipv6HopByHop = 0
	ipv6Routing  = 43
	ipv6Fragment = 44
	ipv6ESP      = 50
	ipv6DestOpts = 60
)

// parsedShapes are the shapes whose SYNs the program charges; notParsed,
// those it passes for the matcher to charge.
var (
	parsedShapes = []shape{
		{name: "plain"},
		{name: "ipv4 options", ipv4Opts: 3},
		{name: "ipv4 options, the most", ipv4Opts: 10},
		{name: "ipv4 first fragment", moreFragments: true},
		{name: "802.1Q", vlans: []uint16{0x8100}},
		{name: "802.1ad+802.1Q", vlans: []uint16{0x88a8, 0x8100}},
		{name: "802.1Q+802.1Q", vlans: []uint16{0x8100, 0x8100}},
		{name: "hop-by-hop", ext: []byte{ipv6HopByHop}},
		{name: "destination options", ext: []byte{ipv6DestOpts}},
		{name: "routing", ext: []byte{ipv6Routing}},
		{name: "first fragment", ext: []byte{ipv6Fragment}, moreFragments: true},
		{name: "atomic fragment", ext: []byte{ipv6Fragment}},
		{name: "all four, in a VLAN", vlans: []uint16{0x8100},
			ext: []byte{ipv6HopByHop, ipv6DestOpts, ipv6Routing, ipv6Fragment, ipv6DestOpts}, moreFragments: true},
		{name: "six", ext: []byte{ipv6HopByHop, ipv6DestOpts, ipv6Routing, ipv6Routing, ipv6Fragment, ipv6DestOpts}},
	}
	notParsed = []shape{
		{name: "ipv4 later fragment", fragOffset: 1},
		{name: "ipv6 later fragment", ext: []byte{ipv6Fragment}, fragOffset: 185},
		{name: "ESP", ext: []byte{ipv6ESP}},
		{name: "seven extension headers", ext: []byte{ipv6HopByHop, ipv6DestOpts, ipv6Routing, ipv6Routing, ipv6Routing, ipv6Fragment, ipv6DestOpts}},
		{name: "three VLAN tags", vlans: []uint16{0x88a8, 0x8100, 0x8100}},
	}
)

// v4 reports whether the shape is of an IPv4 packet (it has IPv4 options
// or fragments without IPv6 headers).
func (s shape) v4() bool {
	return s.ipv4Opts > 0 || (len(s.ext) == 0 && (s.fragOffset > 0 || s.moreFragments))
}

// shaped is packet in shape s: an IPv4 packet if src is IPv4, an IPv6 one
// otherwise (an IPv4-mapped src too). An IPv4 shape needs an IPv4 src, an
// IPv6 shape an IPv6 one; a shape of neither kind takes src's family.
func shaped(src netip.Addr, dport uint16, flags byte, s shape) []byte {
	tcp := make([]byte, 20)
	binary.BigEndian.PutUint16(tcp[0:], 40000)
	binary.BigEndian.PutUint16(tcp[2:], dport)
	tcp[12] = 5 << 4
	tcp[13] = flags
	return framed(src, 6, tcp, s)
}

// framed is an Ethernet frame in shape s holding the transport segment l4
// of protocol proto (6 TCP, 17 UDP) from src.
func framed(src netip.Addr, proto byte, l4 []byte, s shape) []byte {
	var b bytes.Buffer
	b.Write(make([]byte, 12)) // MACs
	for _, tpid := range s.vlans {
		b.Write(binary.BigEndian.AppendUint16(nil, tpid))
		b.Write([]byte{0x00, 0x64}) // the tag: VLAN 100
	}
	if src.Is4() {
		b.Write([]byte{0x08, 0x00})
		ip := make([]byte, 20+4*s.ipv4Opts)
		ip[0] = 0x40 | byte(5+s.ipv4Opts)
		binary.BigEndian.PutUint16(ip[2:], uint16(len(ip)+len(l4)))
		frag := s.fragOffset
		if s.moreFragments {
			frag |= 0x2000
		}
		binary.BigEndian.PutUint16(ip[6:], frag)
		ip[8] = 64
		ip[9] = proto
		s4 := src.As4()
		copy(ip[12:], s4[:])
		copy(ip[16:], []byte{10, 0, 0, 1})
		for i := 20; i < len(ip); i++ {
			ip[i] = 1 // NOP
		}
		b.Write(ip)
	} else {
		b.Write([]byte{0x86, 0xdd})
		var ext []byte
		for i, h := range s.ext {
			next := proto
			if i+1 < len(s.ext) {
				next = s.ext[i+1]
			}
			switch h {
			case ipv6Routing: // type 0 (deprecated, and so unusual), no segment left, one address
				ext = append(ext, next, 2, 0, 0, 0, 0, 0, 0)
				ext = append(ext, make([]byte, 16)...)
			case ipv6Fragment:
				off := s.fragOffset << 3
				if s.moreFragments {
					off |= 1
				}
				ext = append(ext, next, 0, byte(off>>8), byte(off), 0, 0, 0x12, 0x34)
			default: // options: one PadN of 4 bytes, so 8 bytes in all; or ESP's SPI and sequence
				ext = append(ext, next, 0, 1, 4, 0, 0, 0, 0)
			}
		}
		ip := make([]byte, 40)
		ip[0] = 0x60
		binary.BigEndian.PutUint16(ip[4:], uint16(len(ext)+len(l4)))
		ip[6] = proto
		if len(s.ext) > 0 {
			ip[6] = s.ext[0]
		}
		ip[7] = 64
		s16 := src.As16()
		copy(ip[8:], s16[:])
		ip[39] = 1
		b.Write(ip)
		b.Write(ext)
	}
	b.Write(l4)
	return b.Bytes()
}

// flowOf is the connection a SYN of shaped(src, 443, …) opens, as its
// accepted socket shows it: from src:40000 to 10.0.0.1:443 or [::1]:443.
func flowOf(src netip.Addr) (local, remote netip.AddrPort) {
	dst := netip.MustParseAddr("::1")
	if src.Is4() {
		dst = netip.MustParseAddr("10.0.0.1")
	}
	return netip.AddrPortFrom(dst, 443), netip.AddrPortFrom(src, 40000)
}

// TestProgramChargesEverySYNItParses: a SYN in each shape the program
// parses takes one token (a burst of one: the first passes, the second is
// dropped), as the plain one does, and the connection it opens is marked
// as charged, once (Table.Charged); a packet in a shape it does not parse
// passes, charges nothing and marks nothing, so the matcher charges it.
func TestProgramChargesEverySYNItParses(t *testing.T) {
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	if err := tb.enable(Ports{TCP: []uint16{443}}); err != nil {
		t.Fatal(err)
	}
	// Each shape's SYNs come from a network of their own (/24, /48).
	srcOf := func(i int, s shape) netip.Addr {
		if s.v4() {
			return netip.AddrFrom4([4]byte{192, 0, byte(i), 7})
		}
		return netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, byte(i), 15: 7})
	}
	counts := func() Counts {
		t.Helper()
		c, err := tb.Counts()
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	for i, s := range parsedShapes {
		t.Run(s.name, func(t *testing.T) {
			src := srcOf(i, s)
			before := counts()
			local, remote := flowOf(src)
			for i, want := range []uint32{xdpPass, xdpDrop} {
				if v := runAt(t, tb, shaped(src, 443, flagSYN, s), 1e9); v != want {
					t.Fatalf("SYN %d: verdict %d, want %d", i+1, v, want)
				}
				if got := []bool{tb.Charged(local, remote), tb.Charged(local, remote)}; got[0] != (want == xdpPass) || got[1] {
					t.Fatalf("after SYN %d (verdict %d), Charged(%v, %v) twice: %v", i+1, want, local, remote, got)
				}
			}
			// Not a SYN, or another port, in the same shape: passed, free.
			for _, p := range [][]byte{shaped(src, 443, flagACK, s), shaped(src, 80, flagSYN, s)} {
				if v := runAt(t, tb, p, 1e9); v != xdpPass {
					t.Fatalf("verdict %d for %x, want pass", v, p)
				}
			}
			if c := counts(); c != (Counts{Passed: before.Passed + 1, Dropped: before.Dropped + 1}) {
				t.Fatalf("counts %+v after %+v: want one more passed, one more dropped", c, before)
			}
		})
	}
	for i, s := range notParsed {
		t.Run(s.name, func(t *testing.T) {
			src := srcOf(100+i, s)
			before, table := counts(), slices.Clone(words(tb.mem))
			local, remote := flowOf(src)
			for range 3 {
				if v := runAt(t, tb, shaped(src, 443, flagSYN, s), 1e9); v != xdpPass {
					t.Fatalf("verdict %d, want pass", v)
				}
				if tb.Charged(local, remote) {
					t.Fatal("a SYN the program did not parse is marked charged: the matcher would not charge its connection")
				}
			}
			if c := counts(); c != before || !slices.Equal(words(tb.mem), table) {
				t.Fatalf("a packet the program does not parse was counted (%+v after %+v) or charged the table", c, before)
			}
		})
	}
}

// runAt runs the program on frame at ns on the table's clock and returns
// its verdict.
func runAt(t *testing.T, tb *Table, frame []byte, ns int64) uint32 {
	t.Helper()
	if err := tb.objs.Probes.Update(uint32(0), &synlimitProbe{Ns: uint64(ns)}, ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
	ret, err := tb.objs.SynlimitAt.Run(&ebpf.RunOptions{Data: frame})
	if err != nil {
		t.Fatal(err)
	}
	return ret
}

// probe runs the probe program on key at ns.
func probe(t *testing.T, tb *Table, key []byte, ns uint64) synlimitProbe {
	t.Helper()
	in := synlimitProbe{Len: uint8(len(key)), Ns: ns}
	copy(in.Key[:], key)
	if err := tb.objs.Probes.Update(uint32(0), &in, ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
	if ret, err := tb.objs.Probe.Run(&ebpf.RunOptions{Data: make([]byte, 14)}); err != nil || ret != xdpPass {
		t.Fatalf("probe: %d, %v", ret, err)
	}
	var out synlimitProbe
	if err := tb.objs.Probes.Lookup(uint32(0), &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func randomAddr(r *rand.Rand) netip.Addr {
	switch r.IntN(3) {
	case 0:
		var a [4]byte
		binary.BigEndian.PutUint32(a[:], r.Uint32())
		return netip.AddrFrom4(a)
	case 1: // IPv4-mapped IPv6: counts as IPv4
		var a [4]byte
		binary.BigEndian.PutUint32(a[:], r.Uint32())
		return netip.AddrFrom16(netip.AddrFrom4(a).As16())
	}
	var a [16]byte
	binary.BigEndian.PutUint64(a[:], r.Uint64())
	binary.BigEndian.PutUint64(a[8:], r.Uint64())
	a[0] = 0x20
	return netip.AddrFrom16(a)
}

func TestProgramHashesKeysAsLimiter(t *testing.T) {
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 10, Window: time.Second}))
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 2000 {
		a := randomAddr(r)
		k := limiter.NetworkKey(a, r.IntN(33), r.IntN(129))
		got := probe(t, tb, k.Bytes(), 0).Hash
		if want := limiter.Hash(k.Bytes()); got != want {
			t.Fatalf("key %d %x: program hash %#x, limiter.Hash %#x", i, k.Bytes(), got, want)
		}
	}
}

// TestProgramTicksAsLimiter checks the program's ticks, made of 32-bit
// products, against ⌊ns·PE/W⌋ in exact big integers, over limits from one a
// day to a million a second and times up to about three centuries.
func TestProgramTicksAsLimiter(t *testing.T) {
	limits := []limiter.Limit{
		{Events: 1, Window: 24 * time.Hour},
		{Events: 3, Window: 7 * time.Second},
		{Events: 10, Window: time.Second, Burst: 50},
		{Events: 1_000_000, Window: time.Second},
		{Events: 999_999, Window: time.Second, Burst: 1 << 20},
		{Events: 1000, Window: time.Minute, Burst: 1 << 20},
	}
	r := rand.New(rand.NewPCG(3, 4))
	for _, l := range limits {
		tb := newTestTable(t, testConfig(l))
		g := tb.Buckets.Geometry()
		times := []uint64{0, 1, g.W - 1, g.W, g.W + 1, 1 << 62, 1<<63 - 1}
		for range 500 {
			times = append(times, r.Uint64N(1<<63), r.Uint64N(1<<40), r.Uint64N(g.W*4))
		}
		for _, ns := range times {
			want := new(big.Int).Mul(new(big.Int).SetUint64(ns), new(big.Int).SetUint64(g.PE))
			want.Quo(want, new(big.Int).SetUint64(g.W))
			if got := probe(t, tb, []byte{4, 0, 0, 0, 0}, ns).Tick; got != want.Uint64() {
				t.Fatalf("%v: ticks(%d) = %d, want %d", l, ns, got, want)
			}
		}
		tb.Close()
	}
}

// words returns the table's memory as words.
func words(mem []byte) []uint64 {
	return unsafe.Slice((*uint64)(unsafe.Pointer(&mem[0])), len(mem)/8)
}

// alignedLines returns n zeroed lines of Go memory, 64-byte aligned.
func alignedLines(n int) []byte {
	raw := make([]byte, 64*n+64)
	off := (64 - int(uintptr(unsafe.Pointer(&raw[0]))&63)) & 63
	return raw[off : off+64*n]
}

// TestProgramChargesAsLimiter runs a flood of SYNs from a few hundred
// networks through the program and the same requests through a
// limiter.Buckets on Go memory, at the same times, and requires the same
// verdict for every SYN and the same value in every word of the two tables
// after each. Requests alternate between the program and the shared
// table's own Go side, so each side also decides on the other's charges.
// Each SYN comes in one of the shapes the program parses, picked at
// random for its family (VLAN tags, IPv4 options, IPv6 extension headers),
// and half the program's attempts are QUIC packets instead (v1 or v2, in
// the same shapes but fragments): Initials, charged as SYNs are unless the
// Go copy of the program's free passes (quicPasses) lets them pass free,
// under a few DCIDs and ports of each source so that connections repeat,
// to either QUIC port, and a client's other long-header packets (Handshake,
// 0-RTT with something behind it, an Initial that opens no connection, or
// one in a short datagram), which end the pass of the connection latest
// from their address, port and SCID and charge nothing, and 0-RTT packets
// alone in their datagrams, which end none; each under one of a few SCIDs
// (none among them), Initials too.
func TestProgramChargesAsLimiter(t *testing.T) {
	for _, tc := range []struct {
		l limiter.Limit
		k int
	}{
		{limiter.Limit{Events: 5, Window: time.Second, Burst: 8}, 3},
		{limiter.Limit{Events: 1_000_000, Window: time.Second, Burst: 3}, 2},
		{limiter.Limit{Events: 2, Window: time.Minute}, 8},
		{limiter.Limit{Events: 100, Window: time.Second, Burst: 1}, 1},
	} {
		cfg := testConfig(tc.l)
		cfg.Buckets.Bytes = 64 * 16 // few lines: keys share them
		cfg.Buckets.K = tc.k
		tb := newTestTable(t, cfg)
		if err := tb.enable(Ports{TCP: []uint16{443}, QUIC: []uint16{443, 8443}}); err != nil {
			t.Fatal(err)
		}
		refMem := alignedLines(16)
		ref, err := limiter.NewBucketsOver(cfg.Buckets, refMem, tb.Buckets.Base())
		if err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(5, uint64(tc.k)))
		var sources []netip.Addr
		for range 300 {
			sources = append(sources, randomAddr(r))
		}
		step := tc.l.Window / time.Duration(tc.l.Events) / 7
		ns := int64(0)
		granted, denied, free := 0, 0, 0
		passes := newQUICPasses()
		// The SCIDs of a source's packets: a few, none among them, so that
		// a packet that opens nothing ends a pass under its SCID or none.
		scids := [][]byte{nil, clientSCID, dcid(8, 70)}
		for i := range 6000 {
			ns += r.Int64N(int64(step) + 1)
			src := sources[r.IntN(len(sources))]
			if r.IntN(4) == 0 {
				src = sources[0] // one source floods
			}
			key := limiter.NetworkKey(src, cfg.IPv4Prefix, cfg.IPv6Prefix)
			var got bool
			if i%3 == 2 {
				got = tb.Buckets.Allow(key.Bytes(), 1, tb.Buckets.Base().Add(time.Duration(ns))).Allowed
			} else {
				frame := shaped(src, 443, flagSYN, randomShape(r, src, false))
				version, sport := uint32(quicV1), uint16(50000+r.IntN(2))
				if r.IntN(2) == 0 {
					version = quicV2
				}
				var id quicID
				var scid string
				switch r.IntN(4) {
				case 0: // a SYN
				case 1: // a long-header packet that opens nothing: passed, nothing charged
					scid := scids[r.IntN(len(scids))]
					q, ends := endsPass(r, version, sport, scid), true
					if r.IntN(3) == 0 { // a 0-RTT packet alone in its datagram, which ends no pass
						q, ends = zeroRTT(version, sport, scid, 60+r.IntN(1141), 0), false
						q.dport = uint16(443 + 8000*r.IntN(2))
					}
					if v := runAt(t, tb, q.frame(src, randomShape(r, src, true)), ns); v != xdpPass {
						t.Fatalf("%v k=%d: long-header packet %d from %v that opens nothing: verdict %d, want pass", tc.l, tc.k, i, src, v)
					}
					if ends {
						passes.endPass(src, sport, scid)
					}
					continue
				default: // an Initial under one of a few DCIDs
					q := v1Initial(binary.BigEndian.AppendUint64(nil, uint64(r.IntN(3)))...)
					q.sport, q.dport, q.scid = sport, uint16(443+8000*r.IntN(2)), scids[r.IntN(len(scids))]
					if version == quicV2 {
						q.version, q.typ = quicV2, 1
					}
					id, scid = quicID{src.As16(), sport, q.dport, string(q.dcid)}, string(q.scid)
					frame = q.frame(src, randomShape(r, src, true))
				}
				v := runAt(t, tb, frame, ns)
				if v != xdpPass && v != xdpDrop {
					t.Fatalf("verdict %d", v)
				}
				got = v == xdpPass
				if id.dcid != "" && passes.initial(id, scid, ns) {
					if !got {
						t.Fatalf("%v k=%d: Initial %d from %v at %dns, within its connection's pass: dropped", tc.l, tc.k, i, src, ns)
					}
					free++
					if w, rw := words(tb.mem), words(refMem); !slicesEqual(w, rw) {
						t.Fatalf("%v k=%d: Initial %d, within its connection's pass, charged the table", tc.l, tc.k, i)
					}
					continue
				}
				if id.dcid != "" && got {
					passes.charged(id, scid, ns)
				}
			}
			want := ref.Allow(key.Bytes(), 1, tb.Buckets.Base().Add(time.Duration(ns))).Allowed
			if got != want {
				t.Fatalf("%v k=%d: request %d from %v at %dns: granted %v, limiter %v", tc.l, tc.k, i, src, ns, got, want)
			}
			if got {
				granted++
			} else {
				denied++
			}
			if w, rw := words(tb.mem), words(refMem); !slicesEqual(w, rw) {
				t.Fatalf("%v k=%d: after request %d the tables differ:\nxdp   %x\ngo    %x", tc.l, tc.k, i, w, rw)
			}
		}
		c, err := tb.Counts()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%v k=%d: %d granted, %d denied, %d Initials passed free, %d passes ended by a client's other long-header packet; program %+v", tc.l, tc.k, granted, denied, free, passes.ended, c)
		if granted == 0 || denied == 0 || free == 0 || passes.ended == 0 {
			t.Fatalf("the trace should grant, deny, pass Initials free and end passes: %d granted, %d denied, %d free, %d ended", granted, denied, free, passes.ended)
		}
		tb.Close()
	}
}

// quicID is a QUIC connection as the program's map initials knows it:
// the client's address (IPv4 as ::ffff:a.b.c.d) and port, the server's
// port, and the DCID.
type quicID struct {
	src   [16]byte
	sport uint16
	dport uint16
	dcid  string
}

// quicPasses is the program's free passes (synlimit.c, initials and
// latest) in Go, for the tests that run both: which Initials of a
// connection charged already pass free. Its maps do not evict: the tests
// charge far fewer connections than the program's maps hold.
type quicPasses struct {
	at     map[quicID]int64 // when the connection was charged
	free   map[quicID]int   // the Initials passed free since
	latest map[quicClient]quicID
	ended  int // passes a Handshake packet ended
}

// quicClient is a key of the program's map latest: a client's address,
// port and SCID.
type quicClient struct {
	src   [16]byte
	sport uint16
	scid  string
}

func newQUICPasses() *quicPasses {
	return &quicPasses{at: map[quicID]int64{}, free: map[quicID]int{}, latest: map[quicClient]quicID{}}
}

func clientOf(id quicID, scid string) quicClient {
	return quicClient{src: id.src, sport: id.sport, scid: scid}
}

// initial reports whether an Initial of id under SCID scid passes free at
// ns.
func (p *quicPasses) initial(id quicID, scid string, ns int64) bool {
	at, ok := p.at[id]
	if !ok || ns-at >= 5e9 || p.free[id] >= 16 {
		return false
	}
	p.free[id]++
	p.latest[clientOf(id, scid)] = id
	return true
}

// charged notes that an Initial of id under SCID scid was charged, and
// granted, at ns.
func (p *quicPasses) charged(id quicID, scid string, ns int64) {
	p.at[id], p.free[id] = ns, 0
	p.latest[clientOf(id, scid)] = id
}

// endPass notes a client's long-header packet that opens no connection
// (endsPass) from src and sport under SCID scid.
func (p *quicPasses) endPass(src netip.Addr, sport uint16, scid []byte) {
	if id, ok := p.latest[quicClient{src: src.As16(), sport: sport, scid: string(scid)}]; ok {
		if _, live := p.at[id]; live {
			p.ended++
		}
		delete(p.at, id)
	}
}

// randomShape picks one of parsedShapes that a packet from src can take:
// for a QUIC Initial, no fragment (TestProgramDropsFragmentedQUIC).
func randomShape(r *rand.Rand, src netip.Addr, quic bool) shape {
	var fit []shape
	for _, s := range parsedShapes {
		if quic && s.moreFragments {
			continue
		}
		if s.v4() == src.Is4() || !s.v4() && len(s.ext) == 0 {
			fit = append(fit, s)
		}
	}
	return fit[r.IntN(len(fit))]
}

func slicesEqual(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestProgramPassesOtherPackets: only a SYN to a limited port is charged.
func TestProgramPassesOtherPackets(t *testing.T) {
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	if err := tb.enable(Ports{TCP: []uint16{443, 8443}}); err != nil {
		t.Fatal(err)
	}
	src := netip.MustParseAddr("192.0.2.7")
	for _, p := range [][]byte{
		packet(src, 80, flagSYN),             // another port
		packet(src, 443, flagSYN|flagACK),    // a SYN-ACK
		packet(src, 443, flagACK),            // a segment of a connection
		packet(src, 443, flagSYN)[:14+20+10], // truncated
		make([]byte, 14),                     // not IP
	} {
		for range 3 {
			if v := runAt(t, tb, p, 0); v != xdpPass {
				t.Fatalf("verdict %d for %x, want pass", v, p)
			}
		}
	}
	for _, w := range words(tb.mem) {
		if w != 0 {
			t.Fatal("a packet that is not a limited SYN charged the table")
		}
	}
	for i, want := range []uint32{xdpPass, xdpDrop} { // a burst of one
		if v := runAt(t, tb, packet(src, 8443, flagSYN), 0); v != want {
			t.Fatalf("SYN %d: verdict %d, want %d", i, v, want)
		}
	}
	// Another address of the same /24 is the same network.
	if v := runAt(t, tb, packet(netip.MustParseAddr("192.0.2.200"), 443, flagSYN), 0); v != xdpDrop {
		t.Fatalf("same /24: verdict %d, want drop", v)
	}
}

// TestBothSidesTogetherGrantExactlyTheBurst: the program (on the kernel's
// clock, run by BPF_PROG_TEST_RUN) and Go goroutines (Buckets.Allow) take
// tokens of one key at the same time, both charging the same words by
// compare-and-swap, three times more attempts than the burst: together they
// grant exactly the burst, never a token more, never one lost. No token
// returns during the test (20,000 tokens per thousand hours). The threads
// running the program are sent signals throughout, as the Go runtime does
// to preempt a thread (see runOnce).
func TestBothSidesTogetherGrantExactlyTheBurst(t *testing.T) {
	const burst, perSide = 20_000, 60_000
	cfg := testConfig(limiter.Limit{Events: burst, Window: 1000 * time.Hour})
	cfg.Buckets.Bytes = 64
	tb := newTestTable(t, cfg)
	if err := tb.enable(Ports{TCP: []uint16{443}}); err != nil {
		t.Fatal(err)
	}
	src := netip.MustParseAddr("203.0.113.9")
	key := limiter.NetworkKey(src, 24, 48)
	// One thread's SYNs are plain, the other's in QinQ with IPv4 options.
	syns := [][]byte{packet(src, 443, flagSYN), shaped(src, 443, flagSYN, shape{vlans: []uint16{0x88a8, 0x8100}, ipv4Opts: 3})}
	var goGranted atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	tids := make(chan int, 2)
	for _, syn := range syns {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			tids <- unix.Gettid()
			if err := runOnce(tb.objs.Synlimit, syn, perSide/2); err != nil {
				errs <- err
			}
		})
	}
	stop := interrupt([]int{<-tids, <-tids})
	defer stop()
	// Go joins once the program is under way, so that the two overlap.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		if c, err := tb.Counts(); err != nil || c.Passed > 0 {
			break
		}
	}
	for range 2 {
		wg.Go(func() {
			for range perSide / 2 {
				if tb.Buckets.Allow(key.Bytes(), 1, time.Now()).Allowed {
					goGranted.Add(1)
				}
			}
		})
	}
	wg.Wait()
	signals := stop()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	c, err := tb.Counts()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("program %+v, Go granted %d, %d signals to the program's threads", c, goGranted.Load(), signals)
	if signals == 0 {
		t.Fatal("no signal reached the program's threads while they ran")
	}
	if c.Passed+c.Dropped != perSide {
		t.Fatalf("the program decided %d SYNs, want %d", c.Passed+c.Dropped, perSide)
	}
	if total := int64(c.Passed) + goGranted.Load(); total != burst {
		t.Fatalf("together the two sides granted %d, want exactly the burst of %d (program %d, Go %d)",
			total, burst, c.Passed, goGranted.Load())
	}
}

// runOnce runs prog on frame n times, one BPF_PROG_TEST_RUN of one repeat
// each. A run of several repeats counts none of them if a signal interrupts
// it (EINTR after the repeats made so far), and cilium/ebpf then starts it
// over from the first: the repeats made before the signal are run again.
// The Go runtime signals a thread to preempt it (SIGURG), so a loaded
// machine once saw the program decide 60,001 SYNs of 60,000. A run of one
// repeat is run once: the kernel checks for a signal only after the first
// repeat, and cilium/ebpf takes EINTR then for the run it was.
func runOnce(prog *ebpf.Program, frame []byte, n int) error {
	for range n {
		if _, err := prog.Run(&ebpf.RunOptions{Data: frame, Repeat: 1}); err != nil {
			return err
		}
	}
	return nil
}

// interrupt sends SIGURG (the Go runtime's preemption signal, harmless to
// the goroutine) to the given threads of this process every millisecond until
// stop is called; stop returns how many were sent. The test ends with the
// threads, which must outlive stop.
func interrupt(tids []int) (stop func() int) {
	done := make(chan struct{})
	sent := make(chan int, 1)
	go func() {
		n := 0
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
			select {
			case <-done:
				sent <- n
				return
			case <-tick.C:
			}
			for _, tid := range tids {
				if unix.Tgkill(unix.Getpid(), tid, unix.SIGURG) == nil {
					n++
				}
			}
		}
		<-done
		sent <- n
	}()
	var once sync.Once
	var n int
	return func() int {
		once.Do(func() { close(done); n = <-sent })
		return n
	}
}

// TestSetLimitKeepsWhatKeysUsed: a new limit keeps what each key used, on
// both sides, as limiter's SetLimit does on a plain table: a network the
// program drained under "events 3" has 2 SYNs under "events 5", a key Go
// charged twice has 3 requests; the new program decides on the converted
// counters, the SYN counts go on, and so do the marks of the SYNs charged.
func TestSetLimitKeepsWhatKeysUsed(t *testing.T) {
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 3, Window: time.Hour}))
	if err := tb.enable(Ports{TCP: []uint16{443}}); err != nil {
		t.Fatal(err)
	}
	src := netip.MustParseAddr("198.51.100.7")
	syn := packet(src, 443, flagSYN)
	other := limiter.NetworkKey(netip.MustParseAddr("192.0.2.1"), 24, 48)
	at := func(s int) time.Time { return tb.Buckets.Base().Add(time.Duration(s) * time.Second) }
	verdicts := func(ns int64, n int) []uint32 {
		var vs []uint32
		for range n {
			vs = append(vs, runAt(t, tb, syn, ns))
		}
		return vs
	}
	if got := verdicts(1e9, 4); !slices.Equal(got, []uint32{xdpPass, xdpPass, xdpPass, xdpDrop}) {
		t.Fatalf("under events 3: verdicts %v", got)
	}
	for range 2 {
		if !tb.Buckets.Allow(other.Bytes(), 1, at(1)).Allowed {
			t.Fatal("Go denied a key with tokens")
		}
	}
	if err := tb.SetLimit(limiter.Limit{Events: 5, Window: time.Hour}, at(1)); err != nil {
		t.Fatal(err)
	}
	// The new program marks in the old one's map: a connection whose SYN
	// the old program charged is found after the change.
	if !tb.Charged(flowOf(src)) {
		t.Fatal("a SYN charged before the limit changed is not found charged after it")
	}
	if got := verdicts(1e9+1, 3); !slices.Equal(got, []uint32{xdpPass, xdpPass, xdpDrop}) {
		t.Fatalf("under events 5, after using 3: verdicts %v, want 2 passed", got)
	}
	granted := 0
	for range 4 {
		if tb.Buckets.Allow(other.Bytes(), 1, at(1)).Allowed {
			granted++
		}
	}
	if granted != 3 {
		t.Fatalf("under events 5, after using 2: Go granted %d, want 3", granted)
	}
	if c, err := tb.Counts(); err != nil || c.Passed != 5 || c.Dropped != 2 {
		t.Fatalf("counts %+v, %v: want 5 passed, 2 dropped across the change", c, err)
	}
}

// TestProgramNeitherGrantsFromNorWritesAFrozenWord: while SetLimit
// converts the table, a word it has read holds the frozen marker; the
// program drops a SYN that meets one and leaves the word as it is (a grant
// there would be lost from the conversion; a write would unfreeze it).
func TestProgramNeitherGrantsFromNorWritesAFrozenWord(t *testing.T) {
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 3, Window: time.Hour}))
	if err := tb.enable(Ports{TCP: []uint16{443}}); err != nil {
		t.Fatal(err)
	}
	for i := range tb.mem {
		tb.mem[i] = 0xff
	}
	if v := runAt(t, tb, packet(netip.MustParseAddr("198.51.100.7"), 443, flagSYN), 1e9); v != xdpDrop {
		t.Fatalf("verdict %d on frozen words, want drop", v)
	}
	for i, b := range tb.mem {
		if b != 0xff {
			t.Fatalf("byte %d of the table is %#x after the program met frozen words", i, b)
		}
	}
}
