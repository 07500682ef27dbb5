package floodgate

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Checks of configurations that load but do not limit the way an operator
// most likely means. Each is logged once at load, at WARN, naming the zone
// (App.warn); the README's "Warnings at load" lists them. They are warnings,
// not errors, because each has a legitimate use: a constant key is
// caddy-ratelimit's way to write one bucket for all (`key static`), a
// per-connection key limits requests per connection, another handler may set
// a placeholder this check does not know, and a tiny table suits a zone that
// few keys use.

// warnings returns what in zc will not limit as its operator most likely
// means, one sentence each, without the zone's name.
func (zc *Zone) warnings() []string {
	var out []string
	for _, k := range append([]string{zc.Key}, zc.FallbackKeys...) {
		if k != "" {
			out = append(out, keyWarnings(expandShorthands(k))...)
		}
	}
	if w := zc.memoryWarning(); w != "" {
		out = append(out, w)
	}
	return out
}

// keyWarnings returns what is wrong with one key template, its shorthands
// expanded.
func keyWarnings(key string) []string {
	names := placeholders(key)
	if len(names) == 0 {
		if p := expandShorthands("{" + key + "}"); knownPlaceholder(p[1 : len(p)-1]) {
			return []string{fmt.Sprintf("key %q has no braces, so it is that text for every request and every client shares one bucket; write the placeholder {%s}", key, key)}
		}
		return nil
	}
	var out []string
	for _, name := range names {
		switch {
		case name == "http.request.remote" || name == "http.request.remote.port":
			out = append(out, fmt.Sprintf("key %q contains {%s}, the client's port: every new connection is a new key with a full bucket, so a client that reconnects is never limited; use {client_ip} (or {remote_host})", key, name))
		case !knownPlaceholder(name):
			out = append(out, fmt.Sprintf("key %q contains {%s}, which is not a placeholder of Caddy's HTTP server: unless a handler before rate_limit sets it, it expands to nothing and every request without it shares one bucket", key, name))
		}
	}
	return out
}

// placeholders returns the names of the placeholders in a key template,
// as Caddy's replacer finds them.
func placeholders(key string) []string {
	var names []string
	for _, p := range compileTemplate(key) {
		if p.placeholder {
			names = append(names, p.text)
		}
	}
	return names
}

// runtimeNamespaces are placeholders that matchers and handlers set while a
// request is served, so a request built at load time cannot show them.
var runtimeNamespaces = []string{
	"http.vars.", "http.regexp.", "http.matchers.", "http.auth.", "http.reverse_proxy.",
	"http.error.", "http.intercept.", "http.request.tls.", "http.rate_limit.",
}

// knownPlaceholder reports whether Caddy's HTTP server knows the placeholder
// name: a namespace set while serving, or one that Caddy's replacer resolves
// for a request.
func knownPlaceholder(name string) bool {
	for _, ns := range runtimeNamespaces {
		if strings.HasPrefix(name, ns) {
			return true
		}
	}
	r, err := http.NewRequest(http.MethodGet, "http://localhost/", nil)
	if err != nil {
		return false
	}
	r.RemoteAddr = "192.0.2.1:1234"
	repl := caddy.NewReplacer()
	caddyhttp.PrepareRequest(r, repl, nil, &caddyhttp.Server{})
	_, ok := repl.Get(name)
	return ok
}

// expandShorthands replaces the Caddyfile's placeholder shorthands in a key
// ({client_ip}, {header.X}, …) with Caddy's placeholders, as the Caddyfile
// adapter does. The Caddyfile has done it already; in JSON it makes
// `u-{client_ip}` mean the client IP, not "u-" for everyone.
func expandShorthands(key string) string {
	seg := caddyfile.Segment{{Text: key}}
	httpcaddyfile.NewShorthandReplacer().ApplyToSegment(&seg)
	return seg[0].Text
}

// memoryWarning says when a keyed zone's table is so small that a handful of
// keys over their limit deny everyone else: it names how many flooding keys
// push the false-deny probability past the default target.
func (zc *Zone) memoryWarning() string {
	if zc.Memory == 0 || zc.Key == "" {
		return ""
	}
	lines := int(zc.Memory / 64)
	if lines >= limiter.LinesFor(minSources, limiter.DefaultFalseDeny, limiter.DefaultK) {
		return ""
	}
	n := 1
	for limiter.EstimateFalseDeny(n, lines, limiter.DefaultK) <= limiter.DefaultFalseDeny {
		n++
	}
	return fmt.Sprintf("memory %s is a table of %d lines: from %d keys over their limit at once, other keys are denied more than %g%% of the time; raise memory or size the table with sources and false_deny",
		humanize.IBytes(uint64(zc.Memory)), lines, n, limiter.DefaultFalseDeny*100)
}

// minSources is the fewest flooding keys a keyed zone's table should bear at
// the default false-deny probability before a warning says it is too small.
const minSources = 100
