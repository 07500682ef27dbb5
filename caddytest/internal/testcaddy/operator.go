package testcaddy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

// RateLimit runs `caddy rate-limit args...` as Caddy's command line would,
// against the admin endpoint on localhost:adminPort unless args name
// another address or a config, and returns what it printed.
func RateLimit(t testing.TB, adminPort int, args ...string) (string, error) {
	t.Helper()
	cmd, ok := caddycmd.Commands()["rate-limit"]
	if !ok {
		t.Fatal("no rate-limit command registered")
	}
	c := &cobra.Command{Use: cmd.Name}
	cmd.CobraFunc(c)
	var out bytes.Buffer
	c.SetOut(&out)
	c.SetErr(&out)
	if a := strings.Join(args, " "); !strings.Contains(a, "--address") && !strings.Contains(a, "--config") {
		args = append(args, "--address", fmt.Sprintf("localhost:%d", adminPort))
	}
	c.SetArgs(args)
	err := c.Execute()
	return out.String(), err
}

// Metrics returns the /metrics page of the admin endpoint on
// localhost:adminPort, asked on a connection of its own (none outlives a
// config load); it fails the test unless the page is served.
func Metrics(t testing.TB, adminPort int) string {
	t.Helper()
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	code, body, _ := Do(t, c, Request(t, http.MethodGet, fmt.Sprintf("http://localhost:%d/metrics", adminPort)))
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d %s", code, body)
	}
	return body
}

// MetricSum returns the sum of the values of the series of metrics, a page
// that Metrics returned, named series: a metric's name, for all its series,
// or one series with its labels as /metrics writes them.
func MetricSum(metrics, series string) float64 {
	var sum float64
	for line := range strings.Lines(metrics) {
		line = strings.TrimSuffix(line, "\n")
		if strings.HasPrefix(line, series+"{") || strings.HasPrefix(line, series+" ") {
			var v float64
			fmt.Sscanf(line[strings.LastIndexByte(line, ' ')+1:], "%g", &v)
			sum += v
		}
	}
	return sum
}

// JSONLog returns a global log option that writes the log name (the
// default log if name is "") to file as JSON, with one more setting such as
// "level INFO" or "include http.handlers.rate_limit"; LogEntries reads it.
func JSONLog(name, file, setting string) string {
	return fmt.Sprintf("log %s {\n\toutput file %s\n\tformat json\n\t%s\n}", name, file, setting)
}

// LogEntries reads a JSON log file that Caddy wrote and returns the entries
// whose message starts with msg, each as its fields' values joined with
// spaces in the order fields names them (e.g. "level", "zone").
func LogEntries(t testing.TB, file, msg string, fields ...string) []string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		var e map[string]any
		if json.Unmarshal([]byte(line), &e) != nil {
			continue
		}
		if m, _ := e["msg"].(string); !strings.HasPrefix(m, msg) {
			continue
		}
		var vals []string
		for _, f := range fields {
			vals = append(vals, fmt.Sprint(e[f]))
		}
		out = append(out, strings.Join(vals, " "))
	}
	return out
}
