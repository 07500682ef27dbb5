package ops

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// zeroIsHealthy names the series whose only value in a healthy run is 0: a
// panel query over them must return series, but they may all be 0.
var zeroIsHealthy = []string{
	"caddy_rate_limit_cluster_storage_errors_total",     // the storage answered
	"caddy_rate_limit_cluster_instance_conflicts_total", // one process per data directory
	"caddy_rate_limit_held_requests",                    // no action delay zone is holding a request when scraped
}

// unfed names the series this test cannot make, and why: a panel query
// over them must parse (Prometheus answers it), and its emptiness is
// reported, not failed.
var unfed = map[string]string{
	"caddy_rate_limit_xdp_syns_total": "attaching an XDP program needs an interface of a network namespace of its own: this test's Caddy and Prometheus run on the host's loopback (caddytest/xdp feeds these panels in one, TestGrafanaDashboardXDPPanels)",
}

// dashboardConfig is the test's Caddyfile: an HTTP zone that denies, one
// whose action is log (with a lower limit: a zone is charged only for the
// requests every zone grants), a distributed zone over the file system storage
// in dir (reading and writing every 100 ms), and a layer4 server on
// l4Port whose zone closes connections over its burst.
func dashboardConfig(l4Port int, dir string) string {
	l4 := fmt.Sprintf(`layer4 {
		127.0.0.1:%d {
			@flood rate_limit {
				name dash_l4
				events 2
				window 1h
				burst 2
			}
			route @flood {
				close
			}
			route {
				echo
			}
		}
	}`, l4Port)
	return caddyfile(l4, fmt.Sprintf(`	handle /cluster {
		rate_limit {
			zone dash_cluster {
				key {client_ip}
				events 2
				window 1h
			}
			distributed {
				read_interval 100ms
				write_interval 100ms
			}
			storage file_system %s
		}
		respond "cluster"
	}
	handle {
		rate_limit {
			zone dash_api {
				key {client_ip}
				events 3
				window 1h
			}
			zone dash_log {
				key {client_ip}
				events 1
				window 1h
				action log
			}
		}
		respond "ok"
	}`, dir))
}

// l4Echoes reports whether a connection from src to the layer4 server gets
// its bytes back; false means the zone closed it.
func l4Echoes(t *testing.T, src string, l4Port int) bool {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", l4Port))
	if err != nil {
		t.Fatalf("dial from %s: %v", src, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return false
	}
	buf := make([]byte, 4)
	_, err = io.ReadFull(c, buf)
	return err == nil && string(buf) == "ping"
}

// TestGrafanaDashboardQueriesReturnData runs the dashboard in
// contrib/grafana against a real Prometheus scraping this Caddy while it
// allows and denies HTTP requests, logs requests over a limit, closes
// layer4 connections and syncs a distributed zone: every panel's query
// (read from the dashboard, so a panel added later is checked too) must
// parse and return series, with a value other than 0 unless 0 is the
// healthy value of what it reads. Panels over series this test cannot make
// (XDP) are named, and their queries still must parse; caddytest/xdp
// feeds them. It skips, saying so, where Prometheus is not installed.
func TestGrafanaDashboardQueriesReturnData(t *testing.T) {
	if _, err := exec.LookPath("prometheus"); err != nil {
		t.Skip("prometheus is not installed (apt-get install prometheus): contrib/grafana's dashboard is not checked")
	}
	queries, variables := testcaddy.DashboardQueries(t)
	if len(queries) < 10 {
		t.Fatalf("only %d queries found in %s", len(queries), testcaddy.DashboardFile)
	}

	// A file under the distributed zone's prefix that is not a snapshot:
	// the zone skips it at every read, which feeds the skipped series.
	dir := t.TempDir()
	junk := filepath.Join(dir, "rate_limit", "dash_cluster", "not-a-snapshot")
	if err := os.MkdirAll(filepath.Dir(junk), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(junk, []byte("not a snapshot"), 0o644); err != nil {
		t.Fatal(err)
	}
	l4Port := testcaddy.MustFreePorts(1)[0]
	mustLoad(t, dashboardConfig(l4Port, dir))
	// Before the directory goes: the distributed zone writes there until
	// a config without it is loaded.
	t.Cleanup(func() { mustLoad(t, caddyfile("", `respond "ok"`)) })

	prom := testcaddy.StartPrometheus(t, fmt.Sprintf("127.0.0.1:%d", adminPort), testcaddy.ClientDialling(new(net.Dialer).DialContext))
	zones := []string{"dash_api", "dash_cluster", "dash_l4", "dash_log"}
	// Counters must be scraped before the load and after it, for rate()
	// to see it.
	prom.WaitFor(t, "the first scrape of the zones", func() error {
		n, err := prom.Count(`caddy_rate_limit_config{zone=~"dash_.*"}`)
		if err == nil && n != len(zones) {
			err = fmt.Errorf("%d of the %d zones scraped", n, len(zones))
		}
		return err
	})

	// The load: allowed and denied requests, requests over an action log
	// zone's limit, the distributed zone's limit, layer4 connections
	// closed over the burst.
	if got, want := codes(t, "127.0.61.1", 8), "200 200 200 429 429 429 429 429"; got != want {
		t.Fatalf("dash_api: %s, want %s", got, want)
	}
	if got, want := codes(t, "127.0.62.1", 2), "200 200"; got != want {
		t.Fatalf("dash_api from another client: %s, want %s", got, want)
	}
	clusterCodes := testcaddy.Codes(t, from("127.0.63.1"), 4, http.MethodGet, fmt.Sprintf("http://localhost:%d/cluster", httpPort))
	if want := "200 200 429 429"; clusterCodes != want {
		t.Fatalf("dash_cluster: %s, want %s", clusterCodes, want)
	}
	var l4 []bool
	for range 5 {
		l4 = append(l4, l4Echoes(t, "127.0.64.1", l4Port))
	}
	if want := []bool{true, true, false, false, false}; !slices.Equal(l4, want) {
		t.Fatalf("dash_l4 echoed %v, want %v", l4, want)
	}

	// Every panel's query this test feeds, until each returns what it
	// should or 60 s have passed (scrapes every second, cluster syncs
	// every 100 ms); the others must parse.
	var fed []testcaddy.PanelQuery
	for _, q := range queries {
		if why := unfedBecause(q.Metrics); why != "" {
			series, err := prom.QueryRange(q.Query)
			if err != nil {
				t.Errorf("%s: %v", q.Where, err)
				continue
			}
			t.Logf("%s: not fed (%d series), its query parses: %s", q.Where, len(series), why)
			continue
		}
		fed = append(fed, q)
	}
	got := prom.WaitForPanels(t, fed, func(q testcaddy.PanelQuery) bool { return allZeroHealthy(q.Metrics) })
	for _, q := range fed {
		t.Logf("%s: %d series", q.Where, got[q.Where])
	}

	// The zone variable lists the zones.
	for name, q := range variables {
		m := regexp.MustCompile(`^label_values\((\w+), *(\w+)\)$`).FindStringSubmatch(q)
		if m == nil {
			t.Errorf("variable %s: query %q is not label_values(metric, label), which the test knows", name, q)
			continue
		}
		data, err := prom.API("/api/v1/label/"+m[2]+"/values", url.Values{"match[]": {m[1]}})
		if err != nil {
			t.Fatalf("variable %s: %v", name, err)
		}
		var values []string
		if err := json.Unmarshal(data, &values); err != nil {
			t.Fatal(err)
		}
		for _, z := range zones {
			if !slices.Contains(values, z) {
				t.Errorf("variable %s lists %q, without zone %s", name, values, z)
			}
		}
	}
}

// unfedBecause says why this test cannot feed a query over the series
// metrics, or "" if it can.
func unfedBecause(metrics []string) string {
	for _, m := range metrics {
		if why, ok := unfed[m]; ok {
			return m + ": " + why
		}
	}
	return ""
}

// allZeroHealthy reports whether every series a query reads is 0 when all
// is well.
func allZeroHealthy(metrics []string) bool {
	for _, m := range metrics {
		if !slices.Contains(zeroIsHealthy, m) {
			return false
		}
	}
	return len(metrics) > 0
}
