//go:build linux

// Package netnstest builds what the XDP tests run in: two network namespaces
// joined by a veth pair, a raw socket that sends TCP SYNs (and UDP
// datagrams) from any source address, and a packet socket that counts the SYNs that reach the stack.
package netnstest

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
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TCP flags.
const (
	tcpSYN = 0x02
	tcpACK = 0x10
)

// A veth pair between two network namespaces the test creates: the server
// end (where the program is attached and a listener runs) and the client
// end (where spoofed SYNs are sent from). Nothing leaves them; both are
// deleted when the test ends.
type VethPair struct {
	Server, Client       string // namespace names
	ServerIf, ClientIf   string
	ServerAddr, ClientIP netip.Addr
}

// pairs numbers the pairs this process made.
var pairs atomic.Int64

// NewVethPair sets the namespaces up with ip(8), or skips the test where
// that is not permitted (ip says so). Any other failure fails the test: a
// test that cannot build its network must not pass as skipped. Each pair's
// namespaces are named by the process and a sequence number, so that two
// pairs of one process or a namespace left behind by a killed run of the
// same pid do not collide (a stale one is removed first).
func NewVethPair(t *testing.T) *VethPair {
	t.Helper()
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip(8) (iproute2) to create network namespaces")
	}
	id := fmt.Sprintf("fgx%d.%d", os.Getpid()%100000, pairs.Add(1))
	v := &VethPair{Server: id + "s", Client: id + "c", ServerIf: "fgs0", ClientIf: "fgc0",
		ServerAddr: netip.MustParseAddr("10.99.0.1"), ClientIP: netip.MustParseAddr("10.99.0.2")}
	run := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	for _, ns := range []string{v.Server, v.Client} {
		_ = run("netns", "del", ns) // a stale one of a killed run; none is the usual case
	}
	if err := run("netns", "add", v.Server); err != nil {
		if msg := err.Error(); strings.Contains(msg, "Operation not permitted") || strings.Contains(msg, "Permission denied") {
			t.Skipf("creating a network namespace is not permitted here: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { run("netns", "del", v.Server) })
	if err := run("netns", "add", v.Client); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { run("netns", "del", v.Client) })
	for _, args := range [][]string{
		{"link", "add", v.ServerIf, "netns", v.Server, "type", "veth", "peer", "name", v.ClientIf, "netns", v.Client},
		{"-n", v.Server, "addr", "add", v.ServerAddr.String() + "/24", "dev", v.ServerIf},
		{"-n", v.Client, "addr", "add", v.ClientIP.String() + "/24", "dev", v.ClientIf},
		{"-n", v.Server, "link", "set", v.ServerIf, "up"},
		{"-n", v.Client, "link", "set", v.ClientIf, "up"},
		{"-n", v.Server, "link", "set", "lo", "up"},
		// Replies to spoofed sources go back over the pair, where the
		// client namespace drops them. They go through the client's
		// address as a gateway, so the server resolves one neighbour:
		// on-link, every spoofed source would be an ARP entry that
		// never resolves, and a flood would fill the neighbour table
		// (shared by every namespace of the machine, 1,024 entries)
		// until replies to fair sources could not be sent either.
		{"-n", v.Server, "route", "add", "default", "via", v.ClientIP.String(), "dev", v.ServerIf},
	} {
		if err := run(args...); err != nil {
			t.Fatal(err)
		}
	}
	return v
}

// In runs fn on an OS thread switched into namespace ns; the thread is
// discarded afterwards. Sockets fn opens stay in ns.
func In(ns string, fn func() error) error {
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

// SynSender sends TCP SYNs with any source address through a raw socket.
type SynSender struct{ fd int }

func NewSynSender(ns string) (*SynSender, error) {
	s := new(SynSender)
	err := In(ns, func() error {
		var err error
		s.fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW) // IP_HDRINCL
		return err
	})
	return s, err
}

func (s *SynSender) Close() { unix.Close(s.fd) }

// Send sends one SYN from src:sport to dst:dport.
func (s *SynSender) Send(src, dst netip.Addr, sport, dport uint16) error {
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
	tcp[13] = tcpSYN
	binary.BigEndian.PutUint16(tcp[14:], 64240)
	pseudo := uint32(binary.BigEndian.Uint16(s4[:2])) + uint32(binary.BigEndian.Uint16(s4[2:])) +
		uint32(binary.BigEndian.Uint16(d4[:2])) + uint32(binary.BigEndian.Uint16(d4[2:])) + unix.IPPROTO_TCP + 20
	binary.BigEndian.PutUint16(tcp[16:], checksum(tcp, pseudo))
	return unix.Sendto(s.fd, pkt, 0, &unix.SockaddrInet4{Addr: d4})
}

// SendUDP sends one UDP datagram of payload from src:sport to dst:dport,
// without a UDP checksum (IPv4 allows none), through the same raw socket.
func (s *SynSender) SendUDP(src, dst netip.Addr, sport, dport uint16, payload []byte) error {
	pkt := make([]byte, 28+len(payload))
	ip, udp := pkt[:20], pkt[20:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(len(pkt)))
	ip[8] = 64
	ip[9] = unix.IPPROTO_UDP
	s4, d4 := src.As4(), dst.As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	binary.BigEndian.PutUint16(ip[10:], checksum(ip, 0))
	binary.BigEndian.PutUint16(udp[0:], sport)
	binary.BigEndian.PutUint16(udp[2:], dport)
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(payload)))
	copy(udp[8:], payload)
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

// SynCapture counts the SYNs that reach the server's network stack (after
// XDP) per source address, through a packet socket on the interface.
type SynCapture struct{ fd int }

func NewSynCapture(ns, ifname string) (*SynCapture, error) {
	c := new(SynCapture)
	err := In(ns, func() error {
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

// Count reads until the interface has been quiet for 300 ms (or for at
// most limit) and returns the SYNs to dport seen per source.
func (c *SynCapture) Count(dport uint16, limit time.Duration) map[netip.Addr]int {
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
		if binary.BigEndian.Uint16(tcp[2:]) == dport && tcp[13]&(tcpSYN|tcpACK) == tcpSYN {
			seen[netip.AddrFrom4([4]byte(ip[12:16]))]++
		}
	}
	return seen
}

func (c *SynCapture) Close() { unix.Close(c.fd) }
