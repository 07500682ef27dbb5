//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

// Package xdp tests a layer4 zone's xdp setting in a real Caddy, in process,
// inside a network namespace the test creates (internal/netnstest): the
// layer4 server, the admin endpoint and the XDP program live on the server
// end of a veth pair, spoofed SYNs and a fair client come from the other
// end. Caddy is loaded from a goroutine locked to a thread in that
// namespace, so the sockets it opens while loading are there. Ports are
// fixed because the namespace is the test's own: nothing else listens in it.
// Where BPF or namespaces are not permitted, the tests skip.
package xdp

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/floodgate-rl/floodgate"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
	"github.com/floodgate-rl/floodgate/internal/netnstest"
)

const (
	port = 8443
	// adminAddr is in the server end's network namespace, which each test
	// makes for itself: no other process, nor a second copy of the suite,
	// listens there.
	adminAddr = "127.0.0.1:2500"
	zoneName  = "syn"
)

func TestMain(m *testing.M) {
	ports := testcaddy.MustFreePorts(2)
	h3Port = uint16(ports[1])
	os.Exit(testcaddy.Main(m, "xdp", ports[0]))
}

func config(v *netnstest.VethPair, events int, xdp string) string {
	return fmt.Sprintf(`{
	admin %s
	persist_config off
	layer4 {
		%s:%d {
			@flood rate_limit {
				name %s
				events %[5]d
				window 1h
				burst %[5]d
				%[6]s
			}
			route @flood {
				close
			}
			route {
				echo
			}
		}
	}
}
`, adminAddr, v.ServerAddr, port, zoneName, events, xdp)
}

// load runs a Caddyfile in this process from the server namespace. It is
// not testcaddy.Load: a config posted to the admin endpoint is loaded on one
// of net/http's goroutines, in this process's namespace, so its listeners
// and the XDP attach would land outside the veth pair; caddy.Load runs on
// the thread netnstest.In holds in the server namespace.
func load(v *netnstest.VethPair, caddyfile string) error {
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		return fmt.Errorf("adapt: %v", err)
	}
	return netnstest.In(v.Server, func() error { return caddy.Load(cfg, true) })
}

// admin GETs path from the admin endpoint in the server namespace. The
// request is written by hand on a connection dialled from that namespace:
// net/http dials from goroutines of its own, in this process's namespace.
// Right after a reload the replaced admin server may still hold the port
// and reset the connection, so a failed connection is tried again, at most
// ten times (testcaddy.Do fails the test at the first error, and dials from
// net/http's goroutines).
func admin(t *testing.T, v *netnstest.VethPair, path string) string {
	t.Helper()
	return adminDo(t, v, http.MethodGet, path)
}

// adminDo sends method to path on the admin API, tried up to 10 times.
func adminDo(t *testing.T, v *netnstest.VethPair, method, path string) string {
	t.Helper()
	var err error
	for range 10 {
		var body string
		if body, err = adminOnce(v, method, path); err == nil {
			return body
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal(err)
	return ""
}

func adminOnce(v *netnstest.VethPair, method, path string) (string, error) {
	var body string
	err := netnstest.In(v.Server, func() error {
		c, err := net.DialTimeout("tcp", adminAddr, 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", method, path, adminAddr)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, b)
		}
		body = string(b)
		return err
	})
	return body, err
}

// zone returns the zone as GET /rate_limit/zones reports it.
func zone(t *testing.T, v *netnstest.VethPair) floodgate.ZoneInfo {
	t.Helper()
	return zoneNamed(t, v, zoneName)
}

func zoneNamed(t *testing.T, v *netnstest.VethPair, name string) floodgate.ZoneInfo {
	t.Helper()
	var zs []floodgate.ZoneInfo
	if err := json.Unmarshal([]byte(admin(t, v, "/rate_limit/zones")), &zs); err != nil {
		t.Fatal(err)
	}
	for _, z := range zs {
		if z.Name == name {
			return z
		}
	}
	t.Fatalf("no zone %q in %+v", name, zs)
	return floodgate.ZoneInfo{}
}

// waitSYNs polls the zone until its program has counted passed and
// dropped SYNs, for at most five seconds (SYNs cross the pair
// asynchronously).
func waitSYNs(t *testing.T, v *netnstest.VethPair, passed, dropped uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		x := zone(t, v).XDP
		if x == nil {
			t.Fatal("the zone reports no XDP side")
		}
		if x.Passed == passed && x.Dropped == dropped {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("XDP counted %d passed, %d dropped; want %d, %d", x.Passed, x.Dropped, passed, dropped)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// flood sends perNet spoofed SYNs from each of networks /24s 172.(16+first).x.0.
func flood(t *testing.T, v *netnstest.VethPair, first byte, networks, perNet int) {
	t.Helper()
	s, err := netnstest.NewSynSender(v.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range perNet {
		for n := range networks {
			src := netip.AddrFrom4([4]byte{172, 16 + first, byte(n), byte(1 + i)})
			if err := s.Send(src, v.ServerAddr, uint16(30000+i), port); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// echoes reports whether a client in the client namespace connects and gets
// its bytes echoed.
func echoes(v *netnstest.VethPair) error {
	return echoesWithin(v, 5*time.Second)
}

func attached(t *testing.T, v *netnstest.VethPair) bool {
	t.Helper()
	out, err := exec.Command("ip", "-n", v.Server, "link", "show", "dev", v.ServerIf).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return strings.Contains(string(out), "prog/xdp")
}

// TestXDPZoneInCaddy: one line in a layer4 zone drops a spoofed SYN flood at
// XDP, per source network, while a fair client connects; the admin API and
// /metrics count it; a reload that keeps the setting keeps the table, one
// that changes the limit keeps what each network used; stopping Caddy
// detaches it.
func TestXDPZoneInCaddy(t *testing.T) {
	v := netnstest.NewVethPair(t)
	xdpLine := fmt.Sprintf("xdp %s %d", v.ServerIf, port)
	if err := load(v, config(v, 3, xdpLine)); err != nil {
		if strings.Contains(err.Error(), "not permitted") {
			t.Skipf("BPF is not permitted here: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if !attached(t, v) {
		t.Fatal("loading the config attached no XDP program")
	}
	x := zone(t, v).XDP
	t.Logf("attached to %s in %s mode", x.Interface, x.Mode)

	flood(t, v, 0, 30, 8)
	if err := echoes(v); err != nil {
		t.Fatalf("the fair client was not served during the flood: %v", err)
	}
	waitSYNs(t, v, 30*3+1, 30*5) // each network's burst, and the fair client's SYN

	metrics := admin(t, v, "/metrics")
	for _, want := range []string{
		fmt.Sprintf(`caddy_rate_limit_xdp_syns_total{outcome="dropped",zone="%s"} 150`, zoneName),
		fmt.Sprintf(`caddy_rate_limit_xdp_syns_total{outcome="passed",zone="%s"} 91`, zoneName),
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// The same config again: the same table, the same program.
	if err := load(v, config(v, 3, xdpLine+" ")); err != nil {
		t.Fatal(err)
	}
	waitSYNs(t, v, 91, 150)

	// A new limit keeps what each network used, as in a plain zone: the
	// networks that used 3 of "events 3" have 2 SYNs under "events 5",
	// and the SYN counts go on.
	if err := load(v, config(v, 5, xdpLine)); err != nil {
		t.Fatal(err)
	}
	waitSYNs(t, v, 91, 150)
	flood(t, v, 0, 10, 8)
	waitSYNs(t, v, 91+10*2, 150+10*6)

	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
	if attached(t, v) {
		t.Fatal("the program is still attached after Caddy stopped")
	}
}

// TestXDPZoneErrors: a missing interface fails the config with an error
// that names it; with optional the config loads and limits in Go only.
func TestXDPZoneErrors(t *testing.T) {
	v := netnstest.NewVethPair(t)
	err := load(v, config(v, 3, "xdp nosuch0"))
	if err == nil {
		t.Fatal("a config with xdp on a missing interface loaded")
	}
	if !strings.Contains(err.Error(), `interface "nosuch0"`) {
		t.Fatalf("error %q does not name the interface", err)
	}
	if err := load(v, config(v, 3, "xdp nosuch0 optional")); err != nil {
		t.Fatalf("optional xdp: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if x := zone(t, v).XDP; x != nil {
		t.Fatalf("optional xdp on a missing interface reports an XDP side: %+v", x)
	}
	if err := echoes(v); err != nil {
		t.Fatal(err)
	}
}

// TestXDPChargesAConnectionOnce: a connection whose SYN the zone's program
// charged is not charged again by the zone's layer4 matcher, so a fair
// source gets exactly its burst of connections through the whole path
// (XDP, then the matcher), not half of it; the rest have their SYNs
// dropped. The matcher counts the connections it let through as allowed.
func TestXDPChargesAConnectionOnce(t *testing.T) {
	const burst = 4
	v := netnstest.NewVethPair(t)
	if err := load(v, config(v, burst, fmt.Sprintf("xdp %s %d", v.ServerIf, port))); err != nil {
		if strings.Contains(err.Error(), "not permitted") {
			t.Skipf("BPF is not permitted here: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })

	var outcomes []string
	echoed := 0
	for range burst + 2 {
		// A SYN the program drops is retransmitted after a second: a
		// shorter timeout sends each connection one SYN.
		err := echoesWithin(v, 500*time.Millisecond)
		if err == nil {
			echoed++
			outcomes = append(outcomes, "echoed")
		} else {
			outcomes = append(outcomes, err.Error())
		}
	}
	if echoed != burst {
		t.Errorf("%d of %d connections were echoed, want the burst, %d: %q", echoed, burst+2, burst, outcomes)
	}
	for i, o := range outcomes[:burst] {
		if o != "echoed" {
			t.Errorf("connection %d: %s, want echoed", i+1, o)
		}
	}
	c := zone(t, v).Connections
	if c == nil || c.Allowed != burst || c.Denied != 0 {
		t.Errorf("the zone counted connections %+v, want %d allowed, none denied", c, burst)
	}
	waitSYNs(t, v, burst, 2)
}

// echoesWithin is echoes with a dial timeout of d.
func echoesWithin(v *netnstest.VethPair, d time.Duration) error {
	return echoesTo(v, v.ServerAddr, d)
}

// echoesTo is echoes to the server's address addr, with a dial timeout of d.
func echoesTo(v *netnstest.VethPair, addr netip.Addr, d time.Duration) error {
	return echoesVia(v, net.Dialer{Timeout: d}, addr)
}

// echoesVia is echoes to the server's address addr, dialled with d.
func echoesVia(v *netnstest.VethPair, d net.Dialer, addr netip.Addr) error {
	return netnstest.In(v.Client, func() error {
		c, err := d.Dial("tcp", netip.AddrPortFrom(addr, port).String())
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			return err
		}
		buf := make([]byte, 4)
		_, err = io.ReadFull(c, buf)
		return err
	})
}

// runOnAnyAddress runs config with xdp on the server's interface, the
// layer4 server listening on every address, until the test ends.
func runOnAnyAddress(t *testing.T, v *netnstest.VethPair, burst int) {
	t.Helper()
	anyAddr := strings.Replace(config(v, burst, fmt.Sprintf("xdp %s %d", v.ServerIf, port)),
		fmt.Sprintf("%s:%d {", v.ServerAddr, port), fmt.Sprintf(":%d {", port), 1)
	if err := load(v, anyAddr); err != nil {
		if strings.Contains(err.Error(), "not permitted") {
			t.Skipf("BPF is not permitted here: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
}

// TestXDPChargesAConnectionToANewAddressOnce: the matcher knows a
// connection the program charged by the program's mark of its SYN, not by
// the interface's addresses, so a connection to an address the interface
// gained after the config loaded costs one token, as any other: a burst of
// 4 is 4 connections, the fifth's SYN dropped. (Telling them by address,
// the matcher took the new address for another interface's and charged
// such a connection twice, until a reload.)
func TestXDPChargesAConnectionToANewAddressOnce(t *testing.T) {
	const burst = 4
	v := netnstest.NewVethPair(t)
	runOnAnyAddress(t, v, burst)
	added := netip.MustParseAddr("10.99.0.3")
	if out, err := exec.Command("ip", "-n", v.Server, "addr", "add", added.String()+"/24", "dev", v.ServerIf).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	var got []string
	for range burst + 1 {
		if err := echoesTo(v, added, 500*time.Millisecond); err != nil {
			got = append(got, err.Error())
		} else {
			got = append(got, "echoed")
		}
	}
	for i, g := range got {
		if want := i < burst; (g == "echoed") != want {
			t.Fatalf("connections to the added address: %q; want %d echoed, then none", got, burst)
		}
	}
	waitSYNs(t, v, burst, 1)
}

// attachOther attaches another program (one that passes every packet) to
// the interface ifname of the server namespace, as another tool would, until
// the test ends; it returns the link and the program's ID. It skips the
// test where BPF is not permitted.
func attachOther(t *testing.T, v *netnstest.VethPair, ifname string, flags link.XDPAttachFlags) (link.Link, ebpf.ProgramID) {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2 /* XDP_PASS */), asm.Return()}})
	if err != nil {
		t.Skipf("BPF is not permitted here: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	var l link.Link
	if err := netnstest.In(v.Server, func() error {
		ifc, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		l, err = link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifc.Index, Flags: flags})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	info, err := prog.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return l, id
}

// TestValidateAttachesNothing: validating a config with xdp (what `caddy
// validate` does: provision every module, start none) loads the program but
// never touches the interface. The interface here runs another program, as
// it would while the Caddy being validated for runs: attaching would fail
// the validation, and would replace or detach that program.
func TestValidateAttachesNothing(t *testing.T) {
	v := netnstest.NewVethPair(t)
	other, wantID := attachOther(t, v, v.ServerIf, 0)

	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(config(v, 3, fmt.Sprintf("xdp %s %d", v.ServerIf, port))), nil)
	if err != nil {
		t.Fatal(err)
	}
	var c caddy.Config
	if err := json.Unmarshal(cfg, &c); err != nil {
		t.Fatal(err)
	}
	if err := netnstest.In(v.Server, func() error { return caddy.Validate(&c) }); err != nil {
		t.Fatalf("validating the config: %v", err)
	}
	info, err := other.Info()
	if err != nil {
		t.Fatal(err)
	}
	if info.Program != wantID {
		t.Fatalf("after validating, the interface runs program %d, not the one attached before (%d)", info.Program, wantID)
	}

	// Running the config is what attaches: it fails on the busy
	// interface, and with optional it runs with the zone in Go only,
	// charging every connection at accept.
	if err := load(v, config(v, 3, fmt.Sprintf("xdp %s %d", v.ServerIf, port))); err == nil || !strings.Contains(err.Error(), "attaching to "+v.ServerIf) {
		t.Fatalf("loading the config on an interface running another program: %v, want an error attaching to %s", err, v.ServerIf)
	}
	if err := load(v, config(v, 3, fmt.Sprintf("xdp %s %d optional", v.ServerIf, port))); err != nil {
		t.Fatalf("optional xdp on a busy interface: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := echoes(v); err != nil {
		t.Fatal(err)
	}
	if x := zone(t, v).XDP; x != nil {
		t.Fatalf("optional xdp on a busy interface: the zone reports an XDP side %+v", x)
	}
	var k floodgate.KeyInfo
	if err := json.Unmarshal([]byte(admin(t, v, "/rate_limit/zones/"+zoneName+"/keys/"+v.ClientIP.String())), &k); err != nil {
		t.Fatal(err)
	}
	if r := k.Policies[0].Remaining; r != 2 {
		t.Fatalf("after one connection the client's network has %d of 3 connections left, want 2: the matcher took it for one the program charged", r)
	}
}

// TestFailedReloadPutsTheOldProgramBack: a reload that changes the limit
// (the counters converted into a new map, whose program replaces the old
// one, when the config starts) and then fails to start leaves the old
// limit in force on the interface: the networks it had drained stay
// drained, and the SYN counts go on. The reload fails in the rate_limit
// app's own Start, after converting (zones start in name order, and the
// second one's interface runs another program), so the limit must be put
// back.
func TestFailedReloadPutsTheOldProgramBack(t *testing.T) {
	v := netnstest.NewVethPair(t)
	if out, err := exec.Command("sh", "-c", fmt.Sprintf("ip -n %[1]s link add fgd0 type veth peer name fgd1 && ip -n %[1]s link set fgd0 up && ip -n %[1]s link set fgd1 up", v.Server)).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	attachOther(t, v, "fgd0", link.XDPGenericMode)

	cfg := func(events int, busy string) string {
		return fmt.Sprintf(`{
	admin %s
	persist_config off
	rate_limit {
		zone %s {
			events %[3]d
			window 1h
			burst %[3]d
			ipv4_prefix 24
			xdp %s %d
		}
		%s
	}
	layer4 {
		%s:%d {
			@flood rate_limit {
				zone %[2]s
			}
			route @flood {
				close
			}
			route {
				echo
			}
		}
	}
}
`, adminAddr, zoneName, events, v.ServerIf, port, busy, v.ServerAddr, port)
	}
	if err := load(v, cfg(3, "")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	flood(t, v, 0, 10, 5)
	waitSYNs(t, v, 10*3, 10*2)

	err := load(v, cfg(5, "zone tbusy {\n\t\t\tevents 1\n\t\t\twindow 1h\n\t\t\tburst 1\n\t\t\txdp fgd0\n\t\t}"))
	if err == nil || !strings.Contains(err.Error(), "attaching to fgd0") {
		t.Fatalf("the reload: %v, want an error attaching to fgd0", err)
	}
	if !attached(t, v) {
		t.Fatal("no program is attached after the failed reload")
	}
	waitSYNs(t, v, 10*3, 10*2)
	flood(t, v, 0, 10, 2)
	waitSYNs(t, v, 10*3, 10*4) // still drained: the old table decides
	if err := echoes(v); err != nil {
		t.Fatal(err)
	}
}
