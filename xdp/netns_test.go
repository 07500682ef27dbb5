//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/floodgate-rl/floodgate/internal/netnstest"
	"github.com/floodgate-rl/floodgate/limiter"
)

// TestSpoofedFloodDroppedAtXDP floods the server end of a veth pair with
// spoofed SYNs from 200 /24 networks, 40 each, faster than their limit
// refills, while a fair client connects. Each network must get exactly its
// burst through XDP (plus at most the one token that refills during the
// flood), the Go side must see the program's charges on the shared table
// and allow, at the same time, what a table fed the same SYNs in Go allows,
// and the fair client must connect.
func TestSpoofedFloodDroppedAtXDP(t *testing.T) {
	v := netnstest.NewVethPair(t)
	limit := limiter.Limit{Events: 5, Window: time.Minute} // a token every 12 s
	tb := newTestTable(t, testConfig(limit))
	const port = 8443
	var att *Attachment
	if err := netnstest.In(v.Server, func() error {
		var err error
		att, err = tb.Attach(v.ServerIf, Ports{TCP: []uint16{port}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer att.Close()
	t.Logf("attached to %s in %s mode", att.Interface, att.Mode)

	var ln net.Listener
	if err := netnstest.In(v.Server, func() error {
		var err error
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(v.ServerAddr, port).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	capture, err := netnstest.NewSynCapture(v.Server, v.ServerIf)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Close()
	sender, err := netnstest.NewSynSender(v.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.Close()

	const networks, perNetwork = 200, 40
	goRef, err := limiter.NewBucketsOver(testConfig(limit).Buckets, alignedLines(tb.Buckets.Lines()), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	goGranted := map[netip.Addr]int{}
	start := time.Now()
	for i := range perNetwork {
		for n := range networks {
			// A different host of the network each time.
			src := netip.AddrFrom4([4]byte{172, 16 + byte(n>>8), byte(n), byte(1 + i)})
			if err := sender.Send(src, v.ServerAddr, uint16(10000+i), port); err != nil {
				t.Fatal(err)
			}
			key := limiter.NetworkKey(src, 24, 48)
			if goRef.Allow(key.Bytes(), 1, time.Now()).Allowed {
				goGranted[netip.AddrFrom4([4]byte{172, 16 + byte(n>>8), byte(n), 0})]++
			}
		}
	}
	flood := time.Since(start)

	// A fair client, from a network of its own, connects during the flood.
	if err := netnstest.In(v.Client, func() error {
		c, err := net.DialTimeout("tcp4", netip.AddrPortFrom(v.ServerAddr, port).String(), 5*time.Second)
		if err != nil {
			return fmt.Errorf("fair client: %w", err)
		}
		return c.Close()
	}); err != nil {
		t.Fatal(err)
	}

	seen := capture.Count(port, 10*time.Second)
	perNet := map[netip.Addr]int{}
	for src, n := range seen {
		if src == v.ClientIP {
			continue
		}
		b := src.As4()
		perNet[netip.AddrFrom4([4]byte{b[0], b[1], b[2], 0})] += n
	}
	maxExtra := int(flood/(limit.Window/time.Duration(limit.Events))) + 1 // tokens that may refill during the flood
	burst := int(limit.Events)
	for n := range networks {
		net := netip.AddrFrom4([4]byte{172, 16 + byte(n>>8), byte(n), 0})
		got, want := perNet[net], goGranted[net]
		if got < burst || got > burst+maxExtra {
			t.Errorf("network %v: %d SYNs passed XDP, want the burst of %d (+%d refilled at most)", net, got, burst, maxExtra)
		}
		if d := got - want; d < -1 || d > 1 {
			t.Errorf("network %v: XDP passed %d, the Go side granted %d of the same SYNs: more than a token apart", net, got, want)
		}
		// The Go side of the shared table sees what the program charged.
		key := limiter.NetworkKey(net, 24, 48)
		if d := tb.Buckets.PeekHash(limiter.Hash(key.Bytes()), 1, time.Now()); d.Allowed {
			t.Errorf("network %v: the Go side of the table would grant after the flood drained it", net)
		}
	}
	c, err := tb.Counts()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d SYNs from %d networks in %v: program %+v; %d reached the stack", networks*perNetwork, networks, flood, c, len(seen))
	if int(c.Passed+c.Dropped) < networks*perNetwork {
		t.Errorf("the program saw %d SYNs of the %d sent", c.Passed+c.Dropped, networks*perNetwork)
	}
}

// TestReloadReplacesTheProgramOnTheInterface: a second table of the same
// zone attached to an interface (a reload's) takes over its one link,
// another zone's is refused, closing it gives the
// interface back to the first, and closing the first detaches the program.
func TestReloadReplacesTheProgramOnTheInterface(t *testing.T) {
	v := netnstest.NewVethPair(t)
	const port = 8443
	zoneConfig := func(zone string, l limiter.Limit) Config {
		cfg := testConfig(l)
		cfg.Zone = zone
		return cfg
	}
	old := newTestTable(t, zoneConfig("syn", limiter.Limit{Events: 1, Window: time.Hour}))
	next := newTestTable(t, zoneConfig("syn", limiter.Limit{Events: 1000, Window: time.Hour}))
	other := newTestTable(t, zoneConfig("other", limiter.Limit{Events: 1000, Window: time.Hour}))
	attach := func(tb *Table) *Attachment {
		var a *Attachment
		if err := netnstest.In(v.Server, func() error {
			var err error
			a, err = tb.Attach(v.ServerIf, Ports{TCP: []uint16{port}})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return a
	}
	sender, err := netnstest.NewSynSender(v.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.Close()
	// flood sends n SYNs from network 172.20.<net>.0/24 and waits until
	// the program running on the interface has counted them.
	flood := func(net byte, n int) {
		t.Helper()
		for i := range n {
			if err := sender.Send(netip.AddrFrom4([4]byte{172, 20, net, byte(1 + i)}), v.ServerAddr, uint16(20000+i), port); err != nil {
				t.Fatal(err)
			}
		}
	}
	counts := func(tb *Table) Counts {
		t.Helper()
		c, err := tb.Counts()
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	// waitFor polls the table's counters until they reach want, for at
	// most five seconds: the SYNs cross the veth pair asynchronously.
	waitFor := func(tb *Table, want Counts) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for counts(tb) != want && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if got := counts(tb); got != want {
			t.Fatalf("counts %+v, want %+v", got, want)
		}
	}

	aOld := attach(old)
	flood(1, 3)
	waitFor(old, Counts{Passed: 1, Dropped: 2})

	if err := netnstest.In(v.Server, func() error {
		_, err := other.Attach(v.ServerIf, Ports{TCP: []uint16{port}})
		return err
	}); err == nil || !strings.Contains(err.Error(), `already limits SYNs for zone "syn"`) {
		t.Fatalf("another zone's table attached over zone syn's: %v", err)
	}
	aNext := attach(next) // the reload's table takes over
	flood(2, 3)
	waitFor(next, Counts{Passed: 3})
	if c := counts(old); c != (Counts{Passed: 1, Dropped: 2}) {
		t.Fatalf("the replaced program still counted SYNs: %+v", c)
	}

	if err := aNext.Close(); err != nil { // the reload failed: back to the old table
		t.Fatal(err)
	}
	flood(1, 2)
	waitFor(old, Counts{Passed: 1, Dropped: 4})

	if err := aOld.Close(); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ip", "-n", v.Server, "link", "show", "dev", v.ServerIf).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if strings.Contains(string(out), "xdp") {
		t.Fatalf("the program is still attached after the last attachment closed:\n%s", out)
	}
}

// When the kernel refuses the new program after a limit change, the
// conversion cannot be undone and the old program would drop every SYN on
// its all-frozen map: SetLimit detaches it instead, says so, and leaves
// the limit in force on the table for Go.
func TestAFailedProgramSwapDetachesRatherThanDropEverySYN(t *testing.T) {
	v := netnstest.NewVethPair(t)
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	if err := netnstest.In(v.Server, func() error {
		_, err := tb.Attach(v.ServerIf, Ports{TCP: []uint16{8443}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	xdpOn := func() bool {
		t.Helper()
		out, err := exec.Command("ip", "-n", v.Server, "link", "show", "dev", v.ServerIf).CombinedOutput()
		if err != nil {
			t.Fatalf("ip link show: %v: %s", err, out)
		}
		return strings.Contains(string(out), "xdp")
	}
	if !xdpOn() {
		t.Fatal("no XDP program on the interface after Attach")
	}
	refused := fmt.Errorf("refused by the test")
	defer func(f func(link.Link, *ebpf.Program) error) { updateLink = f }(updateLink)
	updateLink = func(link.Link, *ebpf.Program) error { return refused }
	raised := limiter.Limit{Events: 5, Window: time.Hour}
	err := tb.SetLimit(raised, tb.Buckets.Base().Add(time.Second))
	var notReplaced *ProgramNotReplacedError
	if !errors.As(err, &notReplaced) || !errors.Is(err, refused) {
		t.Fatalf("SetLimit with the swap refused: %v, want a ProgramNotReplacedError wrapping the refusal", err)
	}
	if xdpOn() {
		t.Fatal("the old program is still attached, on a map whose every word is frozen: every SYN would be dropped")
	}
	if got := tb.Buckets.Limit(); got != raised {
		t.Fatalf("the table's limit after the failed swap: %v, want %v in force for Go", got, raised)
	}
}

// TestShapedSYNsChargedOnTheInterface: SYNs in VLAN-tagged frames (one tag,
// and 802.1ad outside 802.1Q) and behind IPv6 extension headers, written
// onto the client's end of the veth pair as they are (a packet socket), are
// parsed and charged by the program attached to the server's end, one token
// each: with a burst of one, each shape's first SYN passes and is marked
// for the matcher, once, and its second is dropped. (This machine's kernel
// has no VLAN interfaces, so no connection can follow them; the matcher's
// side of a marked connection is TestXDPChargesEveryShapeOnce's.)
func TestShapedSYNsChargedOnTheInterface(t *testing.T) {
	v := netnstest.NewVethPair(t)
	tb := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	var att *Attachment
	if err := netnstest.In(v.Server, func() error {
		var err error
		att, err = tb.Attach(v.ServerIf, Ports{TCP: []uint16{443}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer att.Close()
	var fd int
	if err := netnstest.In(v.Client, func() error {
		ifc, err := net.InterfaceByName(v.ClientIf)
		if err != nil {
			return err
		}
		if fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: ifc.Index})
	}); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	shapes := []shape{
		{name: "802.1Q", vlans: []uint16{0x8100}},
		{name: "802.1ad+802.1Q", vlans: []uint16{0x88a8, 0x8100}},
		{name: "802.1Q, hop-by-hop and destination options", vlans: []uint16{0x8100}, ext: []byte{ipv6HopByHop, ipv6DestOpts}},
	}
	for i, s := range shapes {
		src := netip.AddrFrom4([4]byte{172, 30, byte(i), 7})
		if len(s.ext) > 0 {
			src = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, byte(i), 15: 7})
		}
		before, err := tb.Counts()
		if err != nil {
			t.Fatal(err)
		}
		frame := shaped(src, 443, flagSYN, s)
		for range 2 {
			if _, err := unix.Write(fd, frame); err != nil {
				t.Fatal(err)
			}
		}
		want := Counts{Passed: before.Passed + 1, Dropped: before.Dropped + 1}
		var c Counts
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if c, err = tb.Counts(); err != nil || c == want {
				break
			}
		}
		if c != want {
			t.Errorf("%s: the program counted %+v after %+v, want one SYN passed and one dropped", s.name, c, before)
		}
		local, remote := flowOf(src)
		if got := []bool{tb.Charged(local, remote), tb.Charged(local, remote)}; !got[0] || got[1] {
			t.Errorf("%s: Charged twice: %v, want the first SYN's mark found once", s.name, got)
		}
	}
}
