//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
	"github.com/floodgate-rl/floodgate/internal/netnstest"
)

// TestGrafanaDashboardXDPPanels runs the queries of contrib/grafana's
// dashboard over the XDP series against a real Prometheus while a zone's
// program drops a spoofed SYN flood: each must return series, not all 0.
// caddytest/ops runs the other panels (its Caddy is on the host's
// loopback, where no program can be attached). Prometheus runs in the
// server's namespace (ip netns exec), scraping the admin endpoint there,
// and the test reaches it with connections dialled from that namespace.
// It skips, saying so, where Prometheus is not installed, or where
// namespaces or BPF are not permitted.
func TestGrafanaDashboardXDPPanels(t *testing.T) {
	if _, err := exec.LookPath("prometheus"); err != nil {
		t.Skip("prometheus is not installed (apt-get install prometheus): contrib/grafana's XDP panels are not checked")
	}
	queries, _ := testcaddy.DashboardQueries(t)
	var xdpQueries []testcaddy.PanelQuery
	for _, q := range queries {
		if slices.Contains(q.Metrics, "caddy_rate_limit_xdp_syns_total") {
			xdpQueries = append(xdpQueries, q)
		}
	}
	if len(xdpQueries) == 0 {
		t.Fatalf("%s has no panel over caddy_rate_limit_xdp_syns_total", testcaddy.DashboardFile)
	}

	v := netnstest.NewVethPair(t)
	if err := load(v, config(v, 3, fmt.Sprintf("xdp %s %d", v.ServerIf, port))); err != nil {
		if strings.Contains(err.Error(), "not permitted") {
			t.Skipf("BPF is not permitted here: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	client := testcaddy.ClientDialling(func(ctx context.Context, network, addr string) (net.Conn, error) {
		var c net.Conn
		err := netnstest.In(v.Server, func() error {
			var err error
			c, err = new(net.Dialer).DialContext(ctx, network, addr)
			return err
		})
		return c, err
	})
	prom := testcaddy.StartPrometheus(t, adminAddr, client, "ip", "netns", "exec", v.Server)
	// Counters must be scraped before the flood and after it, for rate()
	// to see it.
	prom.WaitFor(t, "the first scrape of the zone", func() error {
		n, err := prom.Count(fmt.Sprintf(`caddy_rate_limit_xdp_syns_total{zone=%q}`, zoneName))
		if err == nil && n != 2 {
			err = fmt.Errorf("%d series of the zone's SYNs, want passed and dropped", n)
		}
		return err
	})

	flood(t, v, 0, 30, 8)
	waitSYNs(t, v, 30*3, 30*5) // each network's burst passes, the rest is dropped

	got := prom.WaitForPanels(t, xdpQueries, func(testcaddy.PanelQuery) bool { return false })
	for _, q := range xdpQueries {
		t.Logf("%s: %d series", q.Where, got[q.Where])
	}
}
