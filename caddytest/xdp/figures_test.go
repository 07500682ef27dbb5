//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"golang.org/x/sys/unix"

	"github.com/floodgate-rl/floodgate"
	"github.com/floodgate-rl/floodgate/internal/netnstest"
)

// TestFigures measures, in one run, the same spoofed SYN flood (100,000 /24
// networks, 4 SYNs each, from two raw sockets, against a limit of 2 per
// network per hour with false_deny 0.001) against the Go layer4 matcher
// alone, the matcher behind iptables hashlimit with the same limit, and the
// matcher's zone with xdp; 100 fair sources, each of its own /24,
// connecting during the flood; and, after the Go setup's flood, real
// connections from a drained network against the matcher (its drop rate
// per core: matcherDrops). It prints a table (the figures of docs/xdp.md)
// with the kernel's counters that explain fair sources' losses, and
// asserts only that XDP let no network through beyond its burst. Set
// FLOODGATE_XDP_FIGURES=1 to run it: it takes a minute, and its CPU figures
// mean something only on a quiet machine.
func TestFigures(t *testing.T) {
	if os.Getenv("FLOODGATE_XDP_FIGURES") == "" {
		t.Skip("set FLOODGATE_XDP_FIGURES=1 to measure")
	}
	const networks, perNet, fair, senders = 100_000, 4, 100, 2
	const drained = fair // the network matcherDrops connects from
	v := netnstest.NewVethPair(t)
	for i := range drained + 1 { // the fair networks, and matcherDrops' (10.100.100.2)
		ip := fmt.Sprintf("10.100.%d.2/32", i)
		if out, err := exec.Command("ip", "-n", v.Client, "addr", "add", ip, "dev", v.ClientIf).CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
	}
	if out, err := exec.Command("ip", "-n", v.Client, "route", "add", "default", "dev", v.ClientIf).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	fmt.Printf("%-9s %9s %8s %22s %11s %10s %9s %8s %9s %7s\n", "setup", "SYNs", "SYN/s", "dropped", "SYN-ACKs", "handshakes", "softirq", "system", "process", "fair")
	for _, setup := range []string{"go", "iptables", "xdp"} {
		xdpLine := ""
		if setup == "xdp" {
			xdpLine = fmt.Sprintf("xdp %s %d", v.ServerIf, port)
		}
		// The zone is sized for the flood it meets (sources 100000, the
		// default) with a false-deny probability of 0.1%: at the
		// default 0.5%, 3 of these 100 fair networks share every
		// counter with flooding ones (0.6% of 10,000 networks, in Go
		// alone), and XDP then drops their SYNs as the table says.
		cfg := strings.Replace(config(v, 2, xdpLine), "name "+zoneName, "name "+zoneName+"-"+setup+"\n\t\t\t\tfalse_deny 0.001", 1)
		if err := load(v, cfg); err != nil {
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

		nst0 := nstat(t, v)
		rus0 := rusage(t)
		// Fair sources dial one every 12 ms from 200 ms into the flood,
		// each on its own, so that they meet it throughout (all of them
		// start within 1.4 s; the flood lasts 2 s at 200,000 SYNs per
		// second, more than the senders reach here, and the table
		// prints how many started before it ended); a dial gives up
		// after 5 s, three SYNs (at 0, 1 and 3 s).
		floodEnd := make(chan struct{})
		done := make(chan int)
		failed := make([]error, fair)
		during := make([]bool, fair)
		go func() {
			res := make(chan int, fair)
			time.Sleep(170 * time.Millisecond)
			for i := range fair {
				time.Sleep(12 * time.Millisecond)
				select {
				case <-floodEnd:
				default:
					during[i] = true
				}
				go func() {
					src := netip.MustParseAddr(fmt.Sprintf("10.100.%d.2", i))
					failed[i] = netnstest.In(v.Client, func() error {
						d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)), Timeout: 5 * time.Second}
						c, err := d.Dial("tcp", netip.AddrPortFrom(v.ServerAddr, port).String())
						if err != nil {
							return err
						}
						return c.Close()
					})
					res <- i
				}()
			}
			ok := 0
			for range fair {
				if failed[<-res] == nil {
					ok++
				}
			}
			done <- ok
		}()
		sendTime := spoofFlood(t, v, senders, perNet, networks, func(s *netnstest.SynSender, src netip.Addr, i, _ int) error {
			return s.Send(src, v.ServerAddr, uint16(30000+i), port)
		})
		close(floodEnd)
		served := <-done
		time.Sleep(500 * time.Millisecond) // let the last SYNs be processed
		cpu1 := procStat(t)
		segs := outSegs() - segs0
		z := zoneNamed(t, v, zoneName+"-"+setup)
		rus1 := rusage(t)
		nst1 := nstat(t, v)
		diff := func(k string) int64 { return nst1[k] - nst0[k] }
		var notes []string
		met := 0
		for i := range fair {
			if during[i] {
				met++
			}
			if failed[i] != nil {
				notes = append(notes, fmt.Sprintf("fair %d: %v", i, failed[i]))
			}
		}
		dropped := "-"
		switch setup {
		case "xdp":
			dropped = fmt.Sprintf("%d (passed %d)", z.XDP.Dropped, z.XDP.Passed)
			// Fair networks that paid for a second SYN (their own
			// retransmission) or share a counter with a flooding one.
			second := 0
			for i := range fair {
				var ki floodgate.KeyInfo
				if err := json.Unmarshal([]byte(admin(t, v, fmt.Sprintf("/rate_limit/zones/%s-%s/keys/10.100.%d.2", zoneName, setup, i))), &ki); err != nil {
					t.Fatal(err)
				}
				if ki.Policies[0].Remaining == 0 {
					second++
				}
			}
			notes = append(notes, fmt.Sprintf("fair networks with no token left after their one connection: %d", second))
		case "iptables":
			for _, l := range strings.Split(ipt("-nvx", "-L", "INPUT"), "\n") {
				if f := strings.Fields(l); len(f) > 2 && f[2] == "DROP" {
					dropped = f[0]
				}
			}
			ipt("-F", "INPUT")
		}
		notes = append(notes, fmt.Sprintf("fair dials started during the flood: %d/%d; SYNs lost in the veth pair before the server: %d; SYN cookies sent: %d; listen drops: %d; fair clients' SYN retransmissions: %d; neighbour-table overflows: %d",
			met, fair, diff(v.ClientIf+" TX: dropped"), diff(v.Server+" TcpExtSyncookiesSent"), diff(v.Server+" TcpExtListenDrops"),
			diff(v.Client+" TcpExtTCPSynRetrans"), diff("arp table_fulls")))
		handshakes := uint64(0)
		if z.Connections != nil {
			handshakes = z.Connections.Allowed + z.Connections.Denied
		}
		sent := networks * perNet
		fmt.Printf("%-9s %9d %8.0f %22s %11d %10d %8.2fs %7.2fs %8.2fs %4d/%d\n", setup, sent, float64(sent)/sendTime.Seconds(), dropped, segs,
			handshakes, cpu1[6]-cpu0[6], cpu1[2]-cpu0[2], rus1-rus0, served, fair)
		for _, n := range notes {
			fmt.Printf("  %s\n", n)
		}
		if setup == "go" {
			matcherDrops(t, v)
		}
		// What the program let through never exceeds each network's
		// burst (the fair sources' own networks included).
		if setup == "xdp" && z.XDP.Passed > uint64(networks*2+fair*2) {
			t.Errorf("xdp passed %d SYNs, more than %d networks × a burst of 2", z.XDP.Passed, networks+fair)
		}
	}
}

// spoofFlood sends perNet packets from each of networks /24 networks (the
// n-th network's i-th source is 20+n>>16 . n>>8 . n . 1+i, from port
// 30000+i) through senders raw sockets in the client namespace at once,
// each sending every senders-th network, and returns how long it took.
func spoofFlood(t *testing.T, v *netnstest.VethPair, senders, perNet, networks int, send func(s *netnstest.SynSender, src netip.Addr, i, n int) error) time.Duration {
	t.Helper()
	start := time.Now()
	sendErr := make(chan error, senders)
	for g := range senders {
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
					if err := send(s, src, i, n); err != nil {
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
	return time.Since(start)
}

// nstat reads the kernel's drop counters: of both namespaces' network
// stacks and of the veth ends.
func nstat(t *testing.T, v *netnstest.VethPair) map[string]int64 {
	m := map[string]int64{}
	for _, ns := range []string{v.Server, v.Client} {
		out, err := exec.Command("ip", "netns", "exec", ns, "nstat", "-a", "-z", "-s").Output()
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(out), "\n") {
			f := strings.Fields(l)
			if len(f) >= 2 && (strings.Contains(f[0], "Drop") || strings.Contains(f[0], "Overflow") || strings.Contains(f[0], "Syncookies") || strings.Contains(f[0], "Retrans") || f[0] == "TcpPassiveOpens") {
				n, _ := strconv.ParseInt(f[1], 10, 64)
				m[ns+" "+f[0]] = n
			}
		}
	}
	if out, err := exec.Command("ip", "netns", "exec", v.Server, "cat", "/proc/net/stat/arp_cache").Output(); err == nil {
		ls := strings.Split(strings.TrimSpace(string(out)), "\n")
		head := strings.Fields(ls[0])
		for _, l := range ls[1:] {
			for j, f := range strings.Fields(l) {
				n, _ := strconv.ParseInt(f, 16, 64)
				if h := head[j]; h == "res_failed" || h == "unresolved_discards" || h == "table_fulls" || h == "forced_gc_runs" {
					m["arp "+h] += n
				}
			}
		}
	}
	b, _ := os.ReadFile("/proc/net/softnet_stat")
	for i, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(l)
		n, _ := strconv.ParseInt(f[1], 16, 64)
		m[fmt.Sprintf("softnet cpu%d dropped", i)] = n
	}
	for _, e := range []struct{ ns, ifc string }{{v.Server, v.ServerIf}, {v.Client, v.ClientIf}} {
		out, _ := exec.Command("ip", "netns", "exec", e.ns, "ethtool", "-S", e.ifc).Output()
		for _, l := range strings.Split(string(out), "\n") {
			f := strings.Fields(strings.ReplaceAll(l, ":", " "))
			if len(f) == 2 && (strings.Contains(f[0], "drop") || strings.Contains(f[0], "xdp")) {
				n, _ := strconv.ParseInt(f[1], 10, 64)
				m[e.ifc+" "+f[0]] = n
			}
		}
		out, _ = exec.Command("ip", "-n", e.ns, "-s", "link", "show", e.ifc).Output()
		ls := strings.Split(string(out), "\n")
		for j, l := range ls {
			if strings.Contains(l, "RX:") || strings.Contains(l, "TX:") {
				f := strings.Fields(ls[j+1])
				n, _ := strconv.ParseInt(f[3], 10, 64)
				m[e.ifc+" "+strings.TrimSpace(strings.Fields(l)[0])+" dropped"] = n
			}
		}
	}
	return m
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

// rusage is this process's CPU time (user and system) in seconds: Caddy,
// and the test's own senders and dialers.
func rusage(t *testing.T) float64 {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

// matcherDrops measures what the Go layer4 matcher does per core with a
// flood it can see: real connections (it never sees spoofed ones) from one
// network it has drained, each accepted and closed by the matcher. The
// dialers run in this process too, so the CPU counted (this process's, and
// the machine's softirq time, where the veth pair's packets are handled)
// includes the clients' side of every handshake: it overstates the
// matcher's cost, by at most the clients' share.
func matcherDrops(t *testing.T, v *netnstest.VethPair) {
	const conns, workers = 20_000, 8
	src := netip.MustParseAddr("10.100.100.2")
	dial := func() (denied bool, err error) {
		err = netnstest.In(v.Client, func() error {
			d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)), Timeout: 5 * time.Second}
			c, err := d.Dial("tcp", netip.AddrPortFrom(v.ServerAddr, port).String())
			if err != nil {
				return err
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Write([]byte("x")); err != nil {
				denied = true
				return nil
			}
			_, err = c.Read(make([]byte, 1))
			denied = err != nil
			return nil
		})
		return denied, err
	}
	for range 3 { // the burst of 2, and one denied
		if _, err := dial(); err != nil {
			t.Fatal(err)
		}
	}
	cpu0, rus0, start := procStat(t), rusage(t), time.Now()
	var mu sync.Mutex
	denied, failed := 0, 0
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := netnstest.In(v.Client, func() error {
				for range conns / workers {
					d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)), Timeout: 5 * time.Second}
					c, err := d.Dial("tcp", netip.AddrPortFrom(v.ServerAddr, port).String())
					ok := err == nil
					if ok {
						c.SetDeadline(time.Now().Add(5 * time.Second))
						_, rerr := c.Read(make([]byte, 1))
						ok = rerr != nil // closed by the matcher, nothing echoed
						c.Close()
					}
					mu.Lock()
					if ok {
						denied++
					} else {
						failed++
					}
					mu.Unlock()
				}
				return nil
			})
			if err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	cpu1, rus1 := procStat(t), rusage(t)
	cpu := rus1 - rus0 + cpu1[6] - cpu0[6]
	fmt.Printf("  go matcher, %d real connections from one drained network (%d workers): %d closed by the matcher, %d failed, in %.2fs: %.0f/s; CPU %.2fs (process %.2fs + softirq %.2fs): %.0f per CPU-second\n",
		conns, workers, denied, failed, wall.Seconds(), float64(denied)/wall.Seconds(), cpu, rus1-rus0, cpu1[6]-cpu0[6], float64(denied)/cpu)
}

// TestFiguresQUIC measures one spoofed QUIC Initial flood (2,000 /24
// networks, 40 Initials each, every one a new connection's, from two raw
// sockets, against a limit of 2 connections per network per hour) against
// Caddy's HTTP/3 without the program (quic-go's own server-wide limiter
// alone) and with `xdp … quic`; 20 fair sources, each of its own /24,
// making 5 HTTP/3 requests over one connection during the flood. It
// prints the Initials sent and dropped, the CPU the machine spent (softirq,
// system) and this process's (Caddy, and the test's senders and clients),
// and the fair requests served (the figures of docs/xdp.md), and asserts
// only that XDP let no network through beyond its burst. Set
// FLOODGATE_XDP_FIGURES=1 to run it.
func TestFiguresQUIC(t *testing.T) {
	if os.Getenv("FLOODGATE_XDP_FIGURES") == "" {
		t.Skip("set FLOODGATE_XDP_FIGURES=1 to measure")
	}
	const networks, perNet, fair, perConn, senders = 2_000, 40, 20, 5, 2
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
	storage := t.TempDir()
	fmt.Printf("%-5s %9s %9s %22s %9s %8s %9s %7s\n", "setup", "Initials", "sent/s", "dropped", "softirq", "system", "process", "fair")
	for _, setup := range []string{"go", "xdp"} {
		cfg := h3Config(v, 2, storage)
		if setup == "go" {
			cfg = strings.Replace(cfg, fmt.Sprintf("xdp %s %d quic %d", v.ServerIf, port, h3Port), "", 1)
		}
		cfg = strings.Replace(cfg, "name "+zoneName, "name "+zoneName+"-quic-"+setup, 1)
		if err := load(v, cfg); err != nil {
			t.Fatal(err)
		}
		if err := httpsOverTCP(v, 10*time.Second); err != nil {
			t.Fatalf("no HTTPS answer before the flood: %v", err)
		}
		cpu0, rus0 := procStat(t), rusage(t)
		results := make(chan int, fair)
		var errs sync.Map
		go func() {
			time.Sleep(100 * time.Millisecond)
			for i := range fair {
				time.Sleep(20 * time.Millisecond)
				go func() {
					n, _, err := h3Get(v, netip.MustParseAddr(fmt.Sprintf("10.100.%d.2", i)), perConn, 5*time.Second)
					if err != nil {
						errs.Store(i, err)
					}
					results <- n
				}()
			}
		}()
		sendTime := spoofFlood(t, v, senders, perNet, networks, func(s *netnstest.SynSender, src netip.Addr, i, n int) error {
			return s.SendUDP(src, v.ServerAddr, uint16(30000+i), h3Port, quicInitial(uint64(n*perNet+i)))
		})
		served := 0
		for range fair {
			served += <-results
		}
		time.Sleep(500 * time.Millisecond) // let the last Initials be processed
		cpu1, rus1 := procStat(t), rusage(t)
		z := zoneNamed(t, v, zoneName+"-quic-"+setup)
		dropped := "-"
		if setup == "xdp" {
			dropped = fmt.Sprintf("%d (passed %d)", z.XDP.InitialsDropped, z.XDP.InitialsPassed)
			if z.XDP.InitialsPassed > uint64(networks*2+fair) {
				t.Errorf("xdp passed %d Initials, more than %d networks × a burst of 2 and %d fair connections", z.XDP.InitialsPassed, networks, fair)
			}
		}
		sent := networks * perNet
		fmt.Printf("%-5s %9d %9.0f %22s %8.2fs %7.2fs %8.2fs %4d/%d\n", setup, sent, float64(sent)/sendTime.Seconds(), dropped,
			cpu1[6]-cpu0[6], cpu1[2]-cpu0[2], rus1-rus0, served, fair*perConn)
		errs.Range(func(k, v any) bool { fmt.Printf("  fair %v: %v\n", k, v); return true })
	}
}
