//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/floodgate-rl/floodgate/internal/netnstest"
)

// A socketShape is what a client socket puts around its SYN: IPv4 options,
// or IPv6 extension headers (the kernel's sticky options), from a source
// address of its own network.
type socketShape struct {
	name string
	src  netip.Addr
	// opts sets the socket's options before it connects.
	opts func(fd int) error
}

// padOptions is an IPv6 hop-by-hop or destination options header of 8
// bytes holding one PadN option (the kernel fills in the next header).
var padOptions = []byte{0, 0, 1, 4, 0, 0, 0, 0}

var socketShapes = []socketShape{
	{name: "IPv4", src: netip.MustParseAddr("10.99.1.2")},
	{name: "IPv4 options", src: netip.MustParseAddr("10.99.2.2"), opts: func(fd int) error {
		return unix.SetsockoptString(fd, unix.IPPROTO_IP, unix.IP_OPTIONS, string([]byte{1, 1, 1, 0})) // NOP NOP NOP EOL
	}},
	{name: "IPv6", src: netip.MustParseAddr("fd00:99:1::2")},
	{name: "IPv6 hop-by-hop", src: netip.MustParseAddr("fd00:99:2::2"), opts: func(fd int) error {
		return unix.SetsockoptString(fd, unix.IPPROTO_IPV6, unix.IPV6_HOPOPTS, string(padOptions))
	}},
	{name: "IPv6 destination options", src: netip.MustParseAddr("fd00:99:3::2"), opts: func(fd int) error {
		return unix.SetsockoptString(fd, unix.IPPROTO_IPV6, unix.IPV6_DSTOPTS, string(padOptions))
	}},
	{name: "IPv6 hop-by-hop and destination options", src: netip.MustParseAddr("fd00:99:4::2"), opts: func(fd int) error {
		if err := unix.SetsockoptString(fd, unix.IPPROTO_IPV6, unix.IPV6_HOPOPTS, string(padOptions)); err != nil {
			return err
		}
		return unix.SetsockoptString(fd, unix.IPPROTO_IPV6, unix.IPV6_DSTOPTS, string(padOptions))
	}},
}

// TestXDPChargesEveryShapeOnce: a connection whose SYN carries IPv4 options
// or IPv6 extension headers (hop-by-hop, destination options) costs one
// token through the whole path, as a plain one does: the program parses
// the SYN and charges it, and the matcher finds the program's mark and
// charges nothing more. With a burst of 2, each source network gets 2
// connections echoed and the third's SYN dropped. (Before, the program
// passed a SYN behind an IPv6 extension header unparsed and the matcher
// took it for charged: such a client had no connection limit at all.)
func TestXDPChargesEveryShapeOnce(t *testing.T) {
	const burst = 2
	v := netnstest.NewVethPair(t)
	serverV6 := netip.MustParseAddr("fd00:99::1")
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	ip("-n", v.Server, "addr", "add", serverV6.String()+"/64", "dev", v.ServerIf, "nodad")
	ip("-n", v.Client, "addr", "add", "fd00:99::2/64", "dev", v.ClientIf, "nodad")
	ip("-n", v.Server, "-6", "route", "add", "default", "via", "fd00:99::2", "dev", v.ServerIf)
	for _, s := range socketShapes {
		bits := "32"
		if s.src.Is6() {
			bits = "128"
		}
		ip("-n", v.Client, "addr", "add", s.src.String()+"/"+bits, "dev", v.ClientIf, "nodad")
	}
	runOnAnyAddress(t, v, burst)

	for _, s := range socketShapes {
		dst := v.ServerAddr
		if s.src.Is6() {
			dst = serverV6
		}
		var got []string
		for range burst + 1 {
			if err := echoesShaped(v, s, dst); err != nil {
				got = append(got, err.Error())
			} else {
				got = append(got, "echoed")
			}
		}
		for i, g := range got {
			if want := i < burst; (g == "echoed") != want {
				t.Errorf("%s: connections %q; want %d echoed, then none", s.name, got, burst)
				break
			}
		}
	}
	n := uint64(len(socketShapes))
	waitSYNs(t, v, burst*n, n)
	if c := zone(t, v).Connections; c == nil || c.Allowed != burst*n || c.Denied != 0 {
		t.Errorf("the zone counted connections %+v, want %d allowed (charged by their SYNs), none denied by the matcher", c, burst*n)
	}
}

// echoesShaped is echoes from s.src, with s's socket options, to dst, with
// a dial timeout of 500 ms: a SYN the program drops is retransmitted only
// after a second, so each connection sends one SYN.
func echoesShaped(v *netnstest.VethPair, s socketShape, dst netip.Addr) error {
	return echoesVia(v, net.Dialer{Timeout: 500 * time.Millisecond, LocalAddr: &net.TCPAddr{IP: s.src.AsSlice()},
		Control: func(_, _ string, c syscall.RawConn) error {
			if s.opts == nil {
				return nil
			}
			var err error
			if cerr := c.Control(func(fd uintptr) { err = s.opts(int(fd)) }); cerr != nil {
				return cerr
			}
			return err
		}}, dst)
}
