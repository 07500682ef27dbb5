//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/internal/netnstest"
)

// TestFigures measures, in one run, the same spoofed SYN flood (100,000 /24
// networks, 4 SYNs each, a limit of 2 per network per hour) against the Go
// layer4 matcher alone (spoofed from two raw sockets), the matcher behind iptables hashlimit with the same
// limit, and the matcher's zone with xdp; and 100 fair sources, each of its
// own /24, connecting during the flood. It prints a table (the figures of
// docs/xdp.md) and asserts only that XDP let no network through beyond its
// burst. Set FLOODGATE_XDP_FIGURES=1 to
// run it: it takes a minute and its CPU figures mean something only on a
// quiet machine.
func TestFigures(t *testing.T) {
	if os.Getenv("FLOODGATE_XDP_FIGURES") == "" {
		t.Skip("set FLOODGATE_XDP_FIGURES=1 to measure")
	}
	const networks, perNet, fair, senders = 100_000, 4, 100, 2
	v := netnstest.NewVethPair(t)
	for i := range fair {
		ip := fmt.Sprintf("10.100.%d.2/32", i)
		if out, err := exec.Command("ip", "-n", v.Client, "addr", "add", ip, "dev", v.ClientIf).CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
	}
	if out, err := exec.Command("ip", "-n", v.Client, "route", "add", "default", "dev", v.ClientIf).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	fmt.Printf("%-9s %9s %8s %22s %11s %10s %9s %8s %7s\n", "setup", "SYNs", "SYN/s", "dropped", "SYN-ACKs", "handshakes", "softirq", "system", "fair")
	for _, setup := range []string{"go", "iptables", "xdp"} {
		xdpLine := ""
		if setup == "xdp" {
			xdpLine = fmt.Sprintf("xdp %s %d", v.ServerIf, port)
		}
		if err := load(v, strings.Replace(config(v, 2, xdpLine), "name "+zoneName, "name "+zoneName+"-"+setup, 1)); err != nil {
			t.Fatal(err)
		}
		ipt := func(args ...string) string {
			out, err := exec.Command("ip", append([]string{"netns", "exec", v.Server, "iptables"}, args...)...).CombinedOutput()
			if err != nil {
				t.Fatalf("iptables %v: %v: %s", args, err, out)
			}
			return string(out)
		}
		if setup == "iptables" {
			ipt("-A", "INPUT", "-p", "tcp", "--syn", "--dport", strconv.Itoa(port), "-m", "hashlimit",
				"--hashlimit-name", "fg", "--hashlimit-mode", "srcip", "--hashlimit-srcmask", "24",
				"--hashlimit-upto", "2/hour", "--hashlimit-burst", "2", "--hashlimit-htable-size", "131072",
				"--hashlimit-htable-max", "262144", "-j", "ACCEPT")
			ipt("-A", "INPUT", "-p", "tcp", "--syn", "--dport", strconv.Itoa(port), "-j", "DROP")
		}
		outSegs := func() int64 { return netstat(t, v.Server, "Tcp:", "OutSegs") }
		segs0 := outSegs()
		cpu0 := procStat(t)

		done := make(chan int)
		go func() { // fair sources, during the flood
			time.Sleep(200 * time.Millisecond)
			ok := 0
			for i := range fair {
				src := netip.MustParseAddr(fmt.Sprintf("10.100.%d.2", i))
				if netnstest.In(v.Client, func() error {
					d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)), Timeout: 5 * time.Second}
					c, err := d.Dial("tcp", netip.AddrPortFrom(v.ServerAddr, port).String())
					if err != nil {
						return err
					}
					return c.Close()
				}) == nil {
					ok++
				}
			}
			done <- ok
		}()
		start := time.Now()
		sendErr := make(chan error, senders)
		for g := range senders { // each sends every senders-th network
			go func() {
				s, err := netnstest.NewSynSender(v.Client)
				if err != nil {
					sendErr <- err
					return
				}
				defer s.Close()
				for i := range perNet {
					for n := g; n < networks; n += senders {
						src := netip.AddrFrom4([4]byte{byte(20 + n>>16), byte(n >> 8), byte(n), byte(1 + i)})
						if err := s.Send(src, v.ServerAddr, uint16(30000+i), port); err != nil {
							sendErr <- err
							return
						}
					}
				}
				sendErr <- nil
			}()
		}
		for range senders {
			if err := <-sendErr; err != nil {
				t.Fatal(err)
			}
		}
		sendTime := time.Since(start)
		served := <-done
		time.Sleep(500 * time.Millisecond) // let the last SYNs be processed
		cpu1 := procStat(t)
		segs := outSegs() - segs0
		z := zoneNamed(t, v, zoneName+"-"+setup)
		dropped := "-"
		switch setup {
		case "xdp":
			dropped = fmt.Sprintf("%d (passed %d)", z.XDP.Dropped, z.XDP.Passed)
		case "iptables":
			for _, l := range strings.Split(ipt("-nvx", "-L", "INPUT"), "\n") {
				if f := strings.Fields(l); len(f) > 2 && f[2] == "DROP" {
					dropped = f[0]
				}
			}
			ipt("-F", "INPUT")
		}
		handshakes := uint64(0)
		if z.Connections != nil {
			handshakes = z.Connections.Allowed + z.Connections.Denied
		}
		sent := networks * perNet
		fmt.Printf("%-9s %9d %8.0f %22s %11d %10d %8.2fs %7.2fs %4d/%d\n", setup, sent, float64(sent)/sendTime.Seconds(), dropped, segs,
			handshakes, cpu1[6]-cpu0[6], cpu1[2]-cpu0[2], served, fair)
		// What the program let through never exceeds each network's
		// burst (the fair sources' own networks included).
		if setup == "xdp" && z.XDP.Passed > uint64(networks*2+fair*2) {
			t.Errorf("xdp passed %d SYNs, more than %d networks × a burst of 2", z.XDP.Passed, networks+fair)
		}
	}
}

// netstat reads a counter of /proc/net/snmp in namespace ns.
func netstat(t *testing.T, ns, table, name string) int64 {
	out, err := exec.Command("ip", "netns", "exec", ns, "cat", "/proc/net/snmp").Output()
	if err != nil {
		t.Fatal(err)
	}
	var head []string
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || f[0] != table {
			continue
		}
		if head == nil {
			head = f
			continue
		}
		for i, h := range head {
			if h == name {
				n, _ := strconv.ParseInt(f[i], 10, 64)
				return n
			}
		}
	}
	t.Fatalf("no %s %s", table, name)
	return 0
}

// procStat returns the machine's CPU seconds by kind (the cpu line of
// /proc/stat: user nice system idle iowait irq softirq …).
func procStat(t *testing.T) []float64 {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(strings.SplitN(string(b), "\n", 2)[0])[1:]
	out := make([]float64, len(f))
	for i, s := range f {
		n, _ := strconv.ParseFloat(s, 64)
		out[i] = n / 100 // USER_HZ
	}
	return out
}
