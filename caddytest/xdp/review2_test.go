//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/internal/netnstest"
)

// A review found (response_status with xdp, high), now fixed: a zone with weight
// response_status and xdp loads, and its XDP program charges every TCP SYN
// to the zone's table, though the zone counts only failed logins: three
// successful logins (3 connections) spend a budget of 3 failures, and the
// 4th client connection's SYN is dropped at the driver. The layer4 matcher
// refuses such a zone ("a connection has no response"); xdp, which charges
// connections in the same way, does not. The config should fail to load,
// naming the zone, as for layer4.
func TestXDPNeverChargesAResponseStatusZonesConnections(t *testing.T) {
	v := netnstest.NewVethPair(t)
	cfg := fmt.Sprintf(`{
	admin %s
	persist_config off
	auto_https off
	rate_limit {
		zone failed_logins {
			key {client_ip}
			events 3
			window 1h
			burst 3
			weight response_status 401
			xdp %s %d
		}
	}
}
http://%s:%d {
	rate_limit {
		zone failed_logins
	}
	respond "welcome" 200
}
`, adminAddr, v.ServerIf, port, v.ServerAddr, port)
	err := load(v, cfg)
	if err != nil {
		if strings.Contains(err.Error(), "not permitted") {
			t.Skipf("BPF is not permitted here: %v", err)
		}
		if strings.Contains(err.Error(), "failed_logins") {
			return // refused at load, naming the zone: what this asks
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	var outcomes []string
	for i := range 6 {
		code, err := loginFrom(v, 500*time.Millisecond)
		if err != nil || code != http.StatusOK {
			outcomes = append(outcomes, fmt.Sprintf("%d: %d %v", i+1, code, err))
		}
	}
	if len(outcomes) > 0 {
		t.Errorf("successful logins (200, never charged) under a zone of 3 failed logins with xdp: failed %q", outcomes)
	}
}

// loginFrom sends one GET on a new connection from the client namespace,
// with a dial timeout of d (a dropped SYN is retransmitted after a second).
func loginFrom(v *netnstest.VethPair, d time.Duration) (int, error) {
	code := 0
	err := netnstest.In(v.Client, func() error {
		c, err := net.DialTimeout("tcp", netip.AddrPortFrom(v.ServerAddr, port).String(), d)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "GET /login HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", v.ServerAddr)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		resp.Body.Close()
		code = resp.StatusCode
		return nil
	})
	return code, err
}
