package integration

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/pberkel/caddy-storage-redis"
)

// A docExample is a fenced code block of README.md or a page of docs/.
type docExample struct {
	where string // page:line
	lang  string // the fence's info string: caddyfile, caddy-d, json, ...
	text  string
}

// docExamples returns every fenced code block of README.md and docs/*.md.
func docExamples(t *testing.T) []docExample {
	t.Helper()
	pages, err := filepath.Glob("../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	var out []docExample
	for _, page := range append([]string{"../README.md"}, pages...) {
		raw, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		var cur *docExample
		var indent string
		for i, line := range strings.Split(string(raw), "\n") {
			trimmed := strings.TrimLeft(line, " ")
			switch {
			case cur == nil && strings.HasPrefix(trimmed, "```"):
				indent = line[:len(line)-len(trimmed)]
				cur = &docExample{where: page[3:] + ":" + strconv.Itoa(i+1), lang: strings.TrimPrefix(trimmed, "```")}
			case cur != nil && trimmed == "```":
				out = append(out, *cur)
				cur = nil
			case cur != nil:
				// A block inside a list item is indented; the
				// Caddyfile inside it is not.
				cur.text += strings.TrimPrefix(line, indent) + "\n"
			}
		}
		if cur != nil {
			t.Errorf("%s: code block never closed", cur.where)
		}
	}
	return out
}

// zoneWords and handlerWords are the first words of the zone and handler
// settings that a caddy-d fragment of docs/directives.md may show; any other
// fragment is a site's directive.
var (
	zoneWords    = []string{"key", "events", "window", "burst", "ipv4_prefix", "ipv6_prefix", "match", "weight", "quota", "action", "memory", "sources", "false_deny", "xdp"}
	handlerWords = []string{"distributed", "storage", "jitter", "log_key", "headers", "disable_metrics", "sweep_interval", "zone"}
)

// syntaxSketch matches the <name> of a syntax block, which is not a config.
var syntaxSketch = regexp.MustCompile(`<[a-z][a-z /|.…-]*>`)

// TestEveryDocsExampleLoads adapts and provisions, as `caddy validate` does,
// every Caddyfile and JSON config shown in README.md and docs/*.md: a whole
// Caddyfile (```caddyfile), a directive fragment (```caddy-d, put in a site),
// and a JSON config (```json with "apps"). Syntax sketches (with <name>
// placeholders), log lines and transcripts are not configs. Examples whose
// behaviour matters are also run against real requests (weights_test.go,
// recipes_test.go, caddytest/layer4, caddytest/cluster).
func TestEveryDocsExampleLoads(t *testing.T) {
	if testing.Short() {
		t.Skip("provisions Caddy configs")
	}
	n := 0
	for _, ex := range docExamples(t) {
		var cfg, adapter string
		switch {
		case syntaxSketch.MatchString(ex.text):
			continue
		case ex.lang == "caddyfile":
			cfg, adapter = ex.text, "caddyfile"
		case ex.lang == "caddy-d":
			adapter = "caddyfile"
			switch first, _, _ := strings.Cut(ex.text, " "); {
			case slices.Contains(zoneWords, first):
				cfg = zoneCaddyfile(ex.text)
			case slices.Contains(handlerWords, first):
				cfg = handlerCaddyfile("zone z {\nevents 5\nwindow 1m\n}\n" + ex.text)
			default:
				cfg = "http://localhost:HTTP_PORT {\n" + ex.text + "}\n"
			}
		case ex.lang == "json" && strings.Contains(ex.text, `"apps"`):
			cfg, adapter = ex.text, "json"
		default:
			continue
		}
		t.Run(ex.where, func(t *testing.T) {
			if strings.Contains(cfg, "storage redis") {
				// Provisioning dials Redis; caddytest/cluster runs
				// these against a real redis-server.
				if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(withPorts(cfg)), nil); err != nil {
					t.Fatalf("%v\n%s", err, cfg)
				}
				return
			}
			if strings.Contains(cfg, "xdp ") || strings.Contains(cfg, `"xdp"`) {
				t.Skip("attaching XDP needs root and the interface: caddytest/xdp runs it in a network namespace")
			}
			if err := validate(t, cfg, adapter); err != nil {
				t.Fatalf("%v\n%s", err, cfg)
			}
		})
		n++
	}
	if n < 40 {
		t.Errorf("only %d examples found in README.md and docs/", n)
	}
	t.Logf("%d examples loaded", n)
}
