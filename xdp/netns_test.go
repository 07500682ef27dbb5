//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/floodgate-rl/floodgate/limiter"
)

// A veth pair between two network namespaces the test creates: the server
// end (where the program is attached and a listener runs) and the client
// end (where spoofed SYNs are sent from). Nothing leaves them; both are
// deleted when the test ends.
type vethPair struct {
	server, client       string // namespace names
	serverIf, clientIf   string
	serverAddr, clientIP netip.Addr
}

// newVethPair sets the namespaces up with ip(8), or skips the test where
// that is not permitted.
func newVethPair(t *testing.T) *vethPair {
	t.Helper()
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip(8) (iproute2) to create network namespaces")
	}
	id := fmt.Sprintf("fgx%d", os.Getpid()%100000)
	v := &vethPair{server: id + "s", client: id + "c", serverIf: "fgs0", clientIf: "fgc0",
		serverAddr: netip.MustParseAddr("10.99.0.1"), clientIP: netip.MustParseAddr("10.99.0.2")}
	run := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	if err := run("netns", "add", v.server); err != nil {
		t.Skipf("creating a network namespace is not permitted here: %v", err)
	}
	t.Cleanup(func() { run("netns", "del", v.server) })
	if err := run("netns", "add", v.client); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { run("netns", "del", v.client) })
	for _, args := range [][]string{
		{"link", "add", v.serverIf, "netns", v.server, "type", "veth", "peer", "name", v.clientIf, "netns", v.client},
		{"-n", v.server, "addr", "add", v.serverAddr.String() + "/24", "dev", v.serverIf},
		{"-n", v.client, "addr", "add", v.clientIP.String() + "/24", "dev", v.clientIf},
		{"-n", v.server, "link", "set", v.serverIf, "up"},
		{"-n", v.client, "link", "set", v.clientIf, "up"},
		{"-n", v.server, "link", "set", "lo", "up"},
		// Replies to spoofed sources go back over the pair, where the
		// client namespace drops them.
		{"-n", v.server, "route", "add", "default", "dev", v.serverIf},
	} {
		if err := run(args...); err != nil {
			t.Fatal(err)
		}
	}
	return v
}

// in runs fn on an OS thread switched into namespace ns; the thread is
// discarded afterwards. Sockets fn opens stay in ns.
func in(ns string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		fd, err := unix.Open("/var/run/netns/"+ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- err
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", ns, err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// synSender sends TCP SYNs with any source address through a raw socket.
type synSender struct{ fd int }

func newSynSender(ns string) (*synSender, error) {
	s := new(synSender)
	err := in(ns, func() error {
		var err error
		s.fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW) // IP_HDRINCL
		return err
	})
	return s, err
}

func (s *synSender) close() { unix.Close(s.fd) }

// send sends one SYN from src:sport to dst:dport.
func (s *synSender) send(src, dst netip.Addr, sport, dport uint16) error {
	pkt := make([]byte, 40)
	ip, tcp := pkt[:20], pkt[20:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], 40)
	ip[8] = 64
	ip[9] = unix.IPPROTO_TCP
	s4, d4 := src.As4(), dst.As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	binary.BigEndian.PutUint16(ip[10:], checksum(ip, 0))
	binary.BigEndian.PutUint16(tcp[0:], sport)
	binary.BigEndian.PutUint16(tcp[2:], dport)
	binary.BigEndian.PutUint32(tcp[4:], uint32(sport)*2654435761)
	tcp[12] = 5 << 4
	tcp[13] = flagSYN
	binary.BigEndian.PutUint16(tcp[14:], 64240)
	pseudo := uint32(binary.BigEndian.Uint16(s4[:2])) + uint32(binary.BigEndian.Uint16(s4[2:])) +
		uint32(binary.BigEndian.Uint16(d4[:2])) + uint32(binary.BigEndian.Uint16(d4[2:])) + unix.IPPROTO_TCP + 20
	binary.BigEndian.PutUint16(tcp[16:], checksum(tcp, pseudo))
	return unix.Sendto(s.fd, pkt, 0, &unix.SockaddrInet4{Addr: d4})
}

// checksum is the Internet checksum of b plus sum.
func checksum(b []byte, sum uint32) uint16 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

// synCapture counts the SYNs that reach the server's network stack (after
// XDP) per source address, through a packet socket on the interface.
type synCapture struct{ fd int }

func newSynCapture(ns, ifname string) (*synCapture, error) {
	c := new(synCapture)
	err := in(ns, func() error {
		ifc, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		c.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons(unix.ETH_P_IP)))
		if err != nil {
			return err
		}
		// Room for every SYN of the flood that passes, read after it.
		if err := unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 32<<20); err != nil {
			return err
		}
		if err := unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 300_000}); err != nil {
			return err
		}
		return unix.Bind(c.fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_IP), Ifindex: ifc.Index})
	})
	return c, err
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// count reads until the interface has been quiet for 300 ms (or for at
// most limit) and returns the SYNs to dport seen per source.
func (c *synCapture) count(dport uint16, limit time.Duration) map[netip.Addr]int {
	seen := map[netip.Addr]int{}
	buf := make([]byte, 2048)
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		n, _, err := unix.Recvfrom(c.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			break
		}
		if err != nil || n < 40 {
			continue
		}
		ip := buf[:n]
		ihl := int(ip[0]&15) * 4
		if ip[9] != unix.IPPROTO_TCP || n < ihl+20 {
			continue
		}
		tcp := ip[ihl:]
		if binary.BigEndian.Uint16(tcp[2:]) == dport && tcp[13]&(flagSYN|flagACK) == flagSYN {
			seen[netip.AddrFrom4([4]byte(ip[12:16]))]++
		}
	}
	return seen
}

func (c *synCapture) close() { unix.Close(c.fd) }

// TestSpoofedFloodDroppedAtXDP floods the server end of a veth pair with
// spoofed SYNs from 200 /24 networks, 40 each, faster than their limit
// refills, while a fair client connects. Each network must get exactly its
// burst through XDP (plus at most the one token that refills during the
// flood), the Go side must see the program's charges on the shared table
// and allow, at the same time, what a table fed the same SYNs in Go allows,
// and the fair client must connect.
func TestSpoofedFloodDroppedAtXDP(t *testing.T) {
	v := newVethPair(t)
	limit := limiter.Limit{Events: 5, Window: time.Minute} // a token every 12 s
	tb := newTestTable(t, testConfig(limit))
	const port = 8443
	var att *Attachment
	if err := in(v.server, func() error {
		var err error
		att, err = tb.Attach(v.serverIf, []uint16{port})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer att.Close()
	t.Logf("attached to %s in %s mode", att.Interface, att.Mode)

	var ln net.Listener
	if err := in(v.server, func() error {
		var err error
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(v.serverAddr, port).String())
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
	capture, err := newSynCapture(v.server, v.serverIf)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.close()
	sender, err := newSynSender(v.client)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.close()

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
			if err := sender.send(src, v.serverAddr, uint16(10000+i), port); err != nil {
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
	if err := in(v.client, func() error {
		c, err := net.DialTimeout("tcp4", netip.AddrPortFrom(v.serverAddr, port).String(), 5*time.Second)
		if err != nil {
			return fmt.Errorf("fair client: %w", err)
		}
		return c.Close()
	}); err != nil {
		t.Fatal(err)
	}

	seen := capture.count(port, 10*time.Second)
	perNet := map[netip.Addr]int{}
	for src, n := range seen {
		if src == v.clientIP {
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

// TestReloadReplacesTheProgramOnTheInterface: a second table attached to an
// interface (a reload's) takes over its one link, closing it gives the
// interface back to the first, and closing the first detaches the program.
func TestReloadReplacesTheProgramOnTheInterface(t *testing.T) {
	v := newVethPair(t)
	const port = 8443
	old := newTestTable(t, testConfig(limiter.Limit{Events: 1, Window: time.Hour}))
	next := newTestTable(t, testConfig(limiter.Limit{Events: 1000, Window: time.Hour}))
	attach := func(tb *Table) *Attachment {
		var a *Attachment
		if err := in(v.server, func() error {
			var err error
			a, err = tb.Attach(v.serverIf, []uint16{port})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return a
	}
	sender, err := newSynSender(v.client)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.close()
	// flood sends n SYNs from network 172.20.<net>.0/24 and waits until
	// the program running on the interface has counted them.
	flood := func(net byte, n int) {
		t.Helper()
		for i := range n {
			if err := sender.send(netip.AddrFrom4([4]byte{172, 20, net, byte(1 + i)}), v.serverAddr, uint16(20000+i), port); err != nil {
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
	out, err := exec.Command("ip", "-n", v.server, "link", "show", "dev", v.serverIf).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if strings.Contains(string(out), "xdp") {
		t.Fatalf("the program is still attached after the last attachment closed:\n%s", out)
	}
}
