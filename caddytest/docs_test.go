package caddytest

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/pberkel/caddy-storage-redis"
)

// A docExample is a fenced code block of README.md or a page of docs/.
type docExample struct {
	where string // page:line
	lang  string // the fence's info string: caddyfile, caddy-d, json, ...
	text  string
}

// docPages returns the manual's pages: README.md, then docs/*.md.
func docPages(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob("../docs/*.md")
	if err != nil || len(pages) == 0 {
		t.Fatalf("no pages in docs/: %v", err)
	}
	return append([]string{"../README.md"}, pages...)
}

// isFence reports whether a line opens or closes a fenced code block (also
// one indented in a list item).
func isFence(line string) bool { return strings.HasPrefix(strings.TrimLeft(line, " "), "```") }

// docExamples returns every fenced code block of the manual's pages.
func docExamples(t *testing.T) []docExample {
	t.Helper()
	var out []docExample
	for _, page := range docPages(t) {
		raw, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		var cur *docExample
		var indent string
		for i, line := range strings.Split(string(raw), "\n") {
			trimmed := strings.TrimLeft(line, " ")
			switch {
			case cur == nil && isFence(line):
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

// mdLink matches an inline Markdown link's target: [text](target).
var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// mdPage is a Markdown page's text outside code, and its headings' anchors.
type mdPage struct {
	prose   []string // its lines, those of fenced code blocks empty, inline code removed
	anchors map[string]bool
}

func readMarkdown(t *testing.T, path string) mdPage {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	p := mdPage{anchors: map[string]bool{}}
	seen := map[string]int{}
	fenced := false
	inlineCode := regexp.MustCompile("`[^`]*`")
	for _, line := range strings.Split(string(raw), "\n") {
		if isFence(line) {
			fenced = !fenced
		}
		if fenced || isFence(line) {
			p.prose = append(p.prose, "") // keeps line numbers
			continue
		}
		if title, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " "); ok && strings.HasPrefix(line, "#") {
			a := anchor(title)
			if n := seen[a]; n > 0 {
				p.anchors[a+"-"+strconv.Itoa(n)] = true
			} else {
				p.anchors[a] = true
			}
			seen[a]++
		}
		p.prose = append(p.prose, inlineCode.ReplaceAllString(line, ""))
	}
	return p
}

// anchor is the id GitHub gives a heading: lower case, punctuation other
// than - and _ dropped, spaces as -.
func anchor(title string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(title) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// TestDocsLinksResolve checks every relative link of README.md and
// docs/*.md: the file or directory it names exists, and a #anchor names a
// heading of the page it points to.
func TestDocsLinksResolve(t *testing.T) {
	pages := docPages(t)
	parsed := map[string]mdPage{}
	get := func(path string) mdPage {
		if p, ok := parsed[path]; ok {
			return p
		}
		parsed[path] = readMarkdown(t, path)
		return parsed[path]
	}
	links := 0
	for _, page := range pages {
		for i, line := range get(page).prose {
			for _, m := range mdLink.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				links++
				path, frag, _ := strings.Cut(target, "#")
				file := page
				if path != "" {
					file = filepath.Join(filepath.Dir(page), path)
					if _, err := os.Stat(file); err != nil {
						t.Errorf("%s:%d: link %s: %v", page[3:], i+1, target, err)
						continue
					}
				}
				if frag != "" && strings.HasSuffix(file, ".md") && !get(file).anchors[frag] {
					t.Errorf("%s:%d: link %s: %s has no heading #%s", page[3:], i+1, target, file[3:], frag)
				}
			}
		}
	}
	if links < 50 {
		t.Errorf("only %d relative links found", links)
	}
}

// TestEveryDocsCaddyfileIsFormatted checks that every Caddyfile shown in
// README.md and docs/*.md is as `caddy fmt` writes it (caddyfile.Format, the
// function `caddy fmt` and Caddy's start-up check both call): a reader who
// copies one gets no "Caddyfile input is not formatted" warning at every
// start. A ```caddy-d fragment (a directive, or a zone's or handler's
// settings, without its site) is checked alone and as it reads pasted into
// a block, one tab in, which is how Caddy formats it there. Syntax sketches
// (with <name> placeholders) are not configs: their comments are aligned in
// columns for reading, which caddy fmt would undo.
func TestEveryDocsCaddyfileIsFormatted(t *testing.T) {
	n := 0
	for _, ex := range docExamples(t) {
		if ex.lang != "caddyfile" && ex.lang != "caddy-d" || syntaxSketch.MatchString(ex.text) {
			continue
		}
		n++
		unformatted := func(what, text string) {
			if got := string(caddyfile.Format([]byte(text))); got != text {
				t.Errorf("%s: %s is not as caddy fmt writes it; caddy fmt gives:\n%s\ninstead of:\n%s", ex.where, what, got, text)
			}
		}
		unformatted("the "+ex.lang+" block", ex.text)
		if ex.lang == "caddy-d" {
			var in strings.Builder
			in.WriteString("example.com {\n")
			for _, line := range strings.SplitAfter(ex.text, "\n") {
				if strings.TrimSpace(line) != "" {
					in.WriteString("\t")
				}
				in.WriteString(line)
			}
			in.WriteString("}\n")
			unformatted("the fragment, in a site block,", in.String())
		}
	}
	if n < 40 {
		t.Errorf("only %d Caddyfile examples found in README.md and docs/", n)
	}
}
