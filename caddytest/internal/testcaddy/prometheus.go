package testcaddy

import (
	"context"
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
	"strconv"
	"strings"
	"testing"
	"time"
)

// DashboardFile is the Grafana dashboard shipped in contrib/grafana, from a
// package two levels below the repository's root (caddytest/ops,
// caddytest/xdp).
const DashboardFile = "../../contrib/grafana/floodgate.json"

// A grafanaPanel is what the tests read of a dashboard panel: its title,
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

// A PanelQuery is one query of the dashboard, with Grafana's variables
// replaced by what Grafana would send Prometheus.
type PanelQuery struct {
	Where   string   // panel title and refId
	Expr    string   // as in the dashboard
	Query   string   // as sent
	Metrics []string // the floodgate series it reads
}

// Grafana's built-in variables as the tests fill them in: a rate over 15
// scrapes at the tests' 1 s interval (Grafana's $__rate_interval is at
// least 4 scrapes), and a range longer than a test.
var grafanaBuiltins = []struct{ name, value string }{
	{"$__rate_interval", "15s"},
	{"$__interval", "1s"},
	{"$__range", "5m"},
}

// promQLMetric matches the floodgate metric names a query reads.
var promQLMetric = regexp.MustCompile(`caddy_rate_limit_[a-z_]+`)

// DashboardQueries reads the dashboard and returns every panel's queries
// (a row's too), and the queries of its template variables by name.
func DashboardQueries(t testing.TB) (queries []PanelQuery, variables map[string]string) {
	t.Helper()
	raw, err := os.ReadFile(DashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", DashboardFile, err)
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
				queries = append(queries, PanelQuery{Where: fmt.Sprintf("panel %q query %s", p.Title, tg.RefID),
					Expr: tg.Expr, Query: q, Metrics: promQLMetric.FindAllString(tg.Expr, -1)})
			}
		}
	}
	walk(d.Panels)
	return queries, variables
}

// A Prometheus is a prometheus process a test started, scraping one
// target.
type Prometheus struct {
	URL    string
	Start  time.Time
	client *http.Client
}

// StartPrometheus starts prometheus on a free port of 127.0.0.1, with its
// data in a temporary directory, scraping target's /metrics every second,
// and waits (at most 30 s) until it is ready; it is killed when the test
// ends. The command is run after prefix (e.g. ip netns exec <ns>), and the
// test talks to it with client, whose dialler must reach where it runs.
func StartPrometheus(t testing.TB, target string, client *http.Client, prefix ...string) *Prometheus {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	port := MustFreePorts(1)[0]
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: caddy
    static_configs:
      - targets: ['%s']
`, target)
	cfgFile := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	args := append(prefix[:len(prefix):len(prefix)], bin, "--config.file="+cfgFile, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		fmt.Sprintf("--web.listen-address=127.0.0.1:%d", port))
	cmd := exec.Command(args[0], args[1:]...)
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
	p := &Prometheus{URL: fmt.Sprintf("http://127.0.0.1:%d", port), Start: time.Now(), client: client}
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case err := <-exited:
			out, _ := os.ReadFile(log.Name())
			t.Fatalf("prometheus exited: %v\n%s", err, out)
		default:
		}
		if resp, err := client.Get(p.URL + "/-/ready"); err == nil {
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

// ClientDialling returns an HTTP client that opens each connection with
// dial (a new one per request).
func ClientDialling(dial func(ctx context.Context, network, addr string) (net.Conn, error)) *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: dial, DisableKeepAlives: true}}
}

// API GETs path?params from Prometheus's HTTP API and returns its data, or
// the error Prometheus gave (a query that does not parse is one).
func (p *Prometheus) API(path string, params url.Values) (json.RawMessage, error) {
	resp, err := p.client.Get(p.URL + path + "?" + params.Encode())
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

// A PromSeries is one series of a range query's answer.
type PromSeries struct {
	Metric map[string]string `json:"metric"`
	Values [][2]any          `json:"values"`
}

// QueryRange evaluates q as a Grafana panel does, once a second from when
// Prometheus started until now.
func (p *Prometheus) QueryRange(q string) ([]PromSeries, error) {
	data, err := p.API("/api/v1/query_range", url.Values{
		"query": {q},
		"start": {strconv.FormatInt(p.Start.Unix(), 10)},
		"end":   {strconv.FormatInt(time.Now().Unix()+1, 10)},
		"step":  {"1"},
	})
	if err != nil {
		return nil, err
	}
	var m struct {
		Result []PromSeries `json:"result"`
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, err
	}
	return m.Result, nil
}

// Count returns the number of series an instant query q returns now.
func (p *Prometheus) Count(q string) (int, error) {
	data, err := p.API("/api/v1/query", url.Values{"query": {q}})
	if err != nil {
		return 0, err
	}
	var m struct {
		Result []json.RawMessage `json:"result"`
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return 0, err
	}
	return len(m.Result), nil
}

// HasNonZero reports whether a sample of the series is a number other than
// 0.
func HasNonZero(series []PromSeries) bool {
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

// WaitFor calls check every 250 ms until it returns nil, for at most 60 s,
// then fails the test with its last error.
func (p *Prometheus) WaitFor(t testing.TB, what string, check func() error) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting 60 s for %s from Prometheus at %s:\n%v", what, p.URL, err)
		}
		time.Sleep(250 * time.Millisecond) // waiting for scrapes, not a rate
	}
}

// WaitForPanels runs each query until every one parses and returns series,
// with a value other than 0 unless zeroOK says 0 is what it should show,
// for at most 60 s (WaitFor), and returns how many series each returned.
func (p *Prometheus) WaitForPanels(t testing.TB, queries []PanelQuery, zeroOK func(PanelQuery) bool) map[string]int {
	t.Helper()
	got := map[string]int{}
	p.WaitFor(t, "every panel's data", func() error {
		var missing []string
		for _, q := range queries {
			series, err := p.QueryRange(q.Query)
			got[q.Where] = len(series)
			switch {
			case err != nil:
				missing = append(missing, fmt.Sprintf("%s: %v", q.Where, err))
			case len(series) == 0:
				missing = append(missing, q.Where+": no series")
			case !HasNonZero(series) && !zeroOK(q):
				missing = append(missing, q.Where+": only zeros")
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("%s", strings.Join(missing, "\n"))
		}
		return nil
	})
	return got
}
