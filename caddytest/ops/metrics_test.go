package ops

import (
	"fmt"
	"regexp"
	"strings"
	"testing"
)

// series returns the lines of /metrics about zone (its samples, without
// HELP and TYPE).
func series(body, zone string) []string {
	var out []string
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, "caddy_rate_limit_") && strings.Contains(line, `zone="`+zone+`"`) {
			out = append(out, line)
		}
	}
	return out
}

func wantLines(t *testing.T, body string, lines ...string) {
	t.Helper()
	for _, l := range lines {
		if !strings.Contains(body, "\n"+l+"\n") {
			t.Errorf("/metrics lacks %q", l)
		}
	}
}

func TestMetricsSurviveReloadsAndNeverShowAKey(t *testing.T) {
	const secret = "sk_live_51HsEcReTkEy0000000000"
	zones := func(events int, extra string) string {
		return caddyfile("", fmt.Sprintf(`	rate_limit {
		zone metrics_kept {
			key {http.request.header.X-Api-Key}
			events %d
			window 1h
			memory 64KiB
		}
		%s
	}
	respond "ok"`, events, extra))
	}
	mustLoad(t, zones(2, `zone metrics_gone {
			events 100
			window 1h
		}`))
	if got := codes(t, "127.0.20.1", 3, "X-Api-Key: "+secret); got != "200 200 429" {
		t.Fatalf("requests: %s", got)
	}
	before := metrics(t)
	wantLines(t, before,
		`caddy_rate_limit_requests_total{outcome="allowed",zone="metrics_kept"} 2`,
		`caddy_rate_limit_requests_total{outcome="denied",zone="metrics_kept"} 1`,
		`caddy_rate_limit_requests_total{outcome="logged",zone="metrics_kept"} 0`,
		`caddy_rate_limit_requests_total{outcome="delayed",zone="metrics_kept"} 0`,
		`caddy_rate_limit_weight_total{outcome="allowed",zone="metrics_kept"} 2`,
		`caddy_rate_limit_weight_total{outcome="denied",zone="metrics_kept"} 1`,
		`caddy_rate_limit_held_requests{zone="metrics_kept"} 0`,
		`caddy_rate_limit_memory_bytes{part="table",zone="metrics_kept"} 65536`,
		`caddy_rate_limit_requests_total{outcome="allowed",zone="metrics_gone"} 2`,
	)
	for _, re := range []string{
		`\ncaddy_rate_limit_occupancy_ratio\{zone="metrics_kept"\} 0\.000[0-9e.-]+\n`,
		`\ncaddy_rate_limit_false_deny_ratio\{zone="metrics_kept"\} [0-9e.-]+\n`,
	} {
		if !regexp.MustCompile(re).MatchString(before) {
			t.Errorf("/metrics lacks %s", re)
		}
	}
	// A reload that changes the zone's limit and drops metrics_gone.
	mustLoad(t, zones(3, ""))
	if got := codes(t, "127.0.20.1", 2, "X-Api-Key: "+secret); got != "200 429" {
		t.Fatalf("after the reload: %s", got)
	}
	after := metrics(t)
	wantLines(t, after,
		`caddy_rate_limit_requests_total{outcome="allowed",zone="metrics_kept"} 3`,
		`caddy_rate_limit_requests_total{outcome="denied",zone="metrics_kept"} 2`,
	)
	if s := series(after, "metrics_gone"); len(s) != 0 {
		t.Errorf("series of a zone the reload removed: %q", s)
	}
	for _, body := range []string{before, after} {
		if strings.Contains(body, secret) || strings.Contains(body, "sk_live") {
			t.Fatal("/metrics shows the key")
		}
	}
	// Every label of floodgate's series is zone or outcome, but for
	// caddy_rate_limit_config (caddy-ratelimit's series), whose labels are
	// the zone's settings, and caddy_rate_limit_memory_bytes's part (a
	// name from a fixed list).
	labels := regexp.MustCompile(`[{,]([a-z_]+)=`)
	settings := map[string]bool{"max_events": true, "window": true, "ipv4_prefix": true, "ipv6_prefix": true}
	for _, line := range series(after, "metrics_kept") {
		for _, m := range labels.FindAllStringSubmatch(line, -1) {
			if m[1] != "zone" && m[1] != "outcome" && !(strings.HasPrefix(line, "caddy_rate_limit_config{") && settings[m[1]]) &&
				!(strings.HasPrefix(line, "caddy_rate_limit_memory_bytes{") && m[1] == "part") {
				t.Errorf("label %q in %s", m[1], line)
			}
		}
	}
}

func TestDisableMetricsStopsAHandlersCounting(t *testing.T) {
	mustLoad(t, caddyfile(`rate_limit {
		zone metrics_off {
			events 1
			window 1h
		}
	}`, `	rate_limit /counted* metrics_off
	rate_limit /quiet* metrics_off {
		disable_metrics
	}
	respond "ok"`))
	get := func(path string) {
		c := from("127.0.21.1")
		resp, err := c.Get(fmt.Sprintf("http://localhost:%d%s", httpPort, path))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	get("/quiet")
	get("/quiet")
	get("/counted")
	wantLines(t, metrics(t),
		`caddy_rate_limit_requests_total{outcome="allowed",zone="metrics_off"} 0`,
		`caddy_rate_limit_requests_total{outcome="denied",zone="metrics_off"} 1`,
	)
}

// TestWeightMetricCountsEachRequestsWeight checks that weight_total adds
// each request's weight, not one per request, and that its HELP says so.
func TestWeightMetricCountsEachRequestsWeight(t *testing.T) {
	mustLoad(t, caddyfile("", `	rate_limit {
		zone metrics_weight {
			key {client_ip}
			events 10
			window 1h
			weight 3
		}
	}
	respond "ok"`))
	if got := codes(t, "127.0.21.1", 4); got != "200 200 200 429" {
		t.Fatalf("requests of weight 3 on 10 an hour: %s", got)
	}
	body := metrics(t)
	wantLines(t, body,
		`# HELP caddy_rate_limit_weight_total Weight of the HTTP requests checked by a rate_limit zone, by zone and outcome: each request's weight when it arrived (1 unless a weight rule says otherwise), without the costs responses report later.`,
		`caddy_rate_limit_requests_total{outcome="allowed",zone="metrics_weight"} 3`,
		`caddy_rate_limit_weight_total{outcome="allowed",zone="metrics_weight"} 9`,
		`caddy_rate_limit_weight_total{outcome="denied",zone="metrics_weight"} 3`,
	)
}
