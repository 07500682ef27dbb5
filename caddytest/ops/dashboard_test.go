package ops

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// dashboardFile is the Grafana dashboard shipped in contrib/grafana.
const dashboardFile = "../../contrib/grafana/floodgate.json"

// A grafanaPanel is what the test reads of a dashboard panel: its title,
// its queries, and the panels of a row.
type grafanaPanel struct {
	Title   string `json:"title"`
	Type    string `json:"type"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"`
}

type grafanaDashboard struct {
	Panels     []grafanaPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name     string          `json:"name"`
			Type     string          `json:"type"`
			AllValue string          `json:"allValue"`
			Query    json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// A panelQuery is one query of the dashboard, with Grafana's variables
// replaced by what Grafana would send Prometheus.
type panelQuery struct {
	where string // panel title and refId
	expr  string // as in the dashboard
	query string // as sent
}

// Grafana's built-in variables as the test fills them in: a rate over 15
// scrapes at the test's 1 s interval (Grafana's $__rate_interval is at
// least 4 scrapes), and a range longer than the test.
var grafanaBuiltins = []struct{ name, value string }{
	{"$__rate_interval", "15s"},
	{"$__interval", "1s"},
	{"$__range", "5m"},
}

// dashboardQueries reads the dashboard and returns every panel's queries
// (a row's too), and the label_values queries of its template variables.
func dashboardQueries(t *testing.T) (queries []panelQuery, variables map[string]string) {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	// A variable that lists values (zone) is given its "All" value, a
	// regexp that matches them all, as Grafana sends it.
	subst := map[string]string{}
	variables = map[string]string{}
	for _, v := range d.Templating.List {
		if v.Type == "datasource" {
			continue
		}
		value := v.AllValue
		if value == "" {
			value = ".*"
		}
		subst[v.Name] = value
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			if err := json.Unmarshal(v.Query, &q.Query); err != nil {
				t.Fatalf("variable %s: query %s: %v", v.Name, v.Query, err)
			}
		}
		variables[v.Name] = q.Query
	}
	var walk func(ps []grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if len(p.Targets) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			for _, tg := range p.Targets {
				q := tg.Expr
				for _, b := range grafanaBuiltins {
					q = strings.ReplaceAll(q, b.name, b.value)
				}
				for name, value := range subst {
					q = strings.NewReplacer("${"+name+"}", value, "$"+name, value, "[["+name+"]]", value).Replace(q)
				}
				if strings.Contains(q, "$") {
					t.Errorf("panel %q query %s: a variable the test does not know is left in %s", p.Title, tg.RefID, q)
				}
				queries = append(queries, panelQuery{where: fmt.Sprintf("panel %q query %s", p.Title, tg.RefID), expr: tg.Expr, query: q})
			}
		}
	}
	walk(d.Panels)
	return queries, variables
}

// A prometheusServer is a Prometheus the test started, scraping the test
// Caddy's admin endpoint.
type prometheusServer struct {
	url   string
	start time.Time
}

// startPrometheus starts Prometheus on a free port, with its data in a
// temporary directory, scraping the admin endpoint's /metrics every second,
// and waits (at most 30 s) until it is ready. It is killed when the test
// ends.
func startPrometheus(t *testing.T, bin string) *prometheusServer {
	t.Helper()
	dir := t.TempDir()
	port := testcaddy.MustFreePorts(1)[0]
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: caddy
    static_configs:
      - targets: ['127.0.0.1:%d']
`, adminPort)
	cfgFile := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config.file="+cfgFile, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		fmt.Sprintf("--web.listen-address=127.0.0.1:%d", port))
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		log.Close()
	})
	p := &prometheusServer{url: fmt.Sprintf("http://127.0.0.1:%d", port), start: time.Now()}
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case err := <-exited:
			out, _ := os.ReadFile(log.Name())
			t.Fatalf("prometheus exited: %v\n%s", err, out)
		default:
		}
		if resp, err := http.Get(p.url + "/-/ready"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(log.Name())
			t.Fatalf("prometheus not ready after 30 s:\n%s", out)
		}
		time.Sleep(100 * time.Millisecond) // waiting for a process to start, not a rate
	}
}

// api GETs path?params from Prometheus's HTTP API and returns its data, or
// the error Prometheus gave (a query that does not parse is one).
func (p *prometheusServer) api(path string, params url.Values) (json.RawMessage, error) {
	resp, err := http.Get(p.url + path + "?" + params.Encode())
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	var r struct {
		Status string          `json:"status"`
		Data   json.RawMessage `json:"data"`
		Error  string          `json:"error"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, fmt.Errorf("%s: %d %s", path, resp.StatusCode, body)
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("%s", r.Error)
	}
	return r.Data, nil
}

// A promSeries is one series of a range query's answer.
type promSeries struct {
	Metric map[string]string `json:"metric"`
	Values [][2]any          `json:"values"`
}

// queryRange evaluates q as a Grafana panel does, once a second from when
// Prometheus started until now.
func (p *prometheusServer) queryRange(q string) ([]promSeries, error) {
	data, err := p.api("/api/v1/query_range", url.Values{
		"query": {q},
		"start": {strconv.FormatInt(p.start.Unix(), 10)},
		"end":   {strconv.FormatInt(time.Now().Unix()+1, 10)},
		"step":  {"1"},
	})
	if err != nil {
		return nil, err
	}
	var m struct {
		Result []promSeries `json:"result"`
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, err
	}
	return m.Result, nil
}

// hasNonZero reports whether a sample of the series is a number other than
// 0.
func hasNonZero(series []promSeries) bool {
	for _, s := range series {
		for _, v := range s.Values {
			str, _ := v[1].(string)
			if f, err := strconv.ParseFloat(str, 64); err == nil && f != 0 && !math.IsNaN(f) {
				return true
			}
		}
	}
	return false
}

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
	"caddy_rate_limit_xdp_syns_total": "attaching an XDP program needs root and an interface of a network namespace of its own (caddytest/xdp checks the series on /metrics there); this test's Caddy and Prometheus run on the host's loopback",
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

// promQLMetric matches the metric names a query reads.
var promQLMetric = regexp.MustCompile(`caddy_rate_limit_[a-z_]+`)

// TestGrafanaDashboardQueriesReturnData runs the dashboard in
// contrib/grafana against a real Prometheus scraping this Caddy while it
// allows and denies HTTP requests, logs requests over a limit, closes
// layer4 connections and syncs a distributed zone: every panel's query
// (read from the dashboard, so a panel added later is checked too) must
// parse and return series, with a value other than 0 unless 0 is the
// healthy value of what it reads. Panels over series the test cannot make
// (XDP) are named, and their queries still must parse. It skips, saying
// so, where Prometheus is not installed.
func TestGrafanaDashboardQueriesReturnData(t *testing.T) {
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Skip("prometheus is not installed (apt-get install prometheus): contrib/grafana's dashboard is not checked")
	}
	queries, variables := dashboardQueries(t)
	if len(queries) < 10 {
		t.Fatalf("only %d queries found in %s", len(queries), dashboardFile)
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

	prom := startPrometheus(t, bin)
	zones := []string{"dash_api", "dash_cluster", "dash_l4", "dash_log"}
	// Counters must be scraped before the load and after it, for rate()
	// to see it.
	waitFor(t, prom, "the first scrape of the zones", func() error {
		data, err := prom.api("/api/v1/query", url.Values{"query": {`count(caddy_rate_limit_config{zone=~"dash_.*"})`}})
		if err != nil {
			return err
		}
		if !strings.Contains(string(data), fmt.Sprintf(`"%d"`, len(zones))) {
			return fmt.Errorf("%s", data)
		}
		return nil
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

	// Every panel's query, until each returns what it should or 60 s
	// have passed (scrapes every second, cluster syncs every 100 ms).
	type verdict struct {
		series int
		err    error
	}
	var got map[string]verdict
	waitFor(t, prom, "every panel's data", func() error {
		got = map[string]verdict{}
		var missing []string
		for _, q := range queries {
			series, err := prom.queryRange(q.query)
			got[q.where] = verdict{len(series), err}
			metrics := promQLMetric.FindAllString(q.expr, -1)
			switch {
			case err != nil:
				missing = append(missing, fmt.Sprintf("%s: %v", q.where, err))
			case isUnfed(metrics):
			case len(series) == 0:
				missing = append(missing, q.where+": no series")
			case !hasNonZero(series) && !allZeroHealthy(metrics):
				missing = append(missing, q.where+": only zeros")
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("%s", strings.Join(missing, "\n"))
		}
		return nil
	})
	for _, q := range queries {
		v := got[q.where]
		if metrics := promQLMetric.FindAllString(q.expr, -1); isUnfed(metrics) && v.err == nil {
			for _, m := range metrics {
				if why, ok := unfed[m]; ok {
					t.Logf("%s: not fed (%d series), its query parses; %s: %s", q.where, v.series, m, why)
				}
			}
			continue
		}
		t.Logf("%s: %d series", q.where, v.series)
	}

	// The zone variable lists the zones.
	for name, q := range variables {
		m := regexp.MustCompile(`^label_values\((\w+), *(\w+)\)$`).FindStringSubmatch(q)
		if m == nil {
			t.Errorf("variable %s: query %q is not label_values(metric, label), which the test knows", name, q)
			continue
		}
		data, err := prom.api("/api/v1/label/"+m[2]+"/values", url.Values{"match[]": {m[1]}})
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

// isUnfed reports whether a query reads a series the test cannot make.
func isUnfed(metrics []string) bool {
	for _, m := range metrics {
		if _, ok := unfed[m]; ok {
			return true
		}
	}
	return false
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

// waitFor calls check every 250 ms until it returns nil, for at most 60 s,
// then fails the test with its last error.
func waitFor(t *testing.T, prom *prometheusServer, what string, check func() error) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting 60 s for %s from Prometheus at %s:\n%v", what, prom.url, err)
		}
		time.Sleep(250 * time.Millisecond) // waiting for scrapes, not a rate
	}
}
