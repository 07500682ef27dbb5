package floodgate

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

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
		if strings.HasPrefix(strings.TrimLeft(line, " "), "```") {
			fenced = !fenced
		}
		if fenced || strings.HasPrefix(strings.TrimLeft(line, " "), "```") {
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
	pages, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	pages = append([]string{"README.md"}, pages...)
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
						t.Errorf("%s:%d: link %s: %v", page, i+1, target, err)
						continue
					}
				}
				if frag != "" && strings.HasSuffix(file, ".md") && !get(file).anchors[frag] {
					t.Errorf("%s:%d: link %s: %s has no heading #%s", page, i+1, target, file, frag)
				}
			}
		}
	}
	if links < 50 {
		t.Errorf("only %d relative links found", links)
	}
}
