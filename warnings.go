package floodgate

import (
	"cmp"
	"fmt"
	"net/http"
	"net/textproto"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Checks of configurations that load but do not limit the way an operator
// most likely means. Each is logged once at load, at WARN, naming the zone
// (App.warn); docs/troubleshooting.md#warnings-at-load lists them. They are warnings,
// not errors, because each has a legitimate use: a constant key is
// caddy-ratelimit's way to write one bucket for all (`key static`), a
// per-connection key limits requests per connection, another handler may set
// a placeholder this check does not know, and a tiny table suits a zone that
// few keys use.

// warnings returns what in zc will not limit as its operator most likely
// means, one sentence each, without the zone's name. set holds the
// placeholders that handlers of the config set (a map's destinations), which
// a key may use although Caddy's server does not know them.
// incumbent says that the config looks written for caddy-ratelimit (a
// handler has its sweep_interval), whose meaning of some settings differs.
func (zc *Zone) warnings(set map[string]bool, incumbent bool) []string {
	var out []string
	for _, k := range append([]string{zc.Key}, zc.FallbackKeys...) {
		if k != "" {
			out = append(out, keyWarnings(expandShorthands(k), set)...)
		}
	}
	for _, r := range zc.Weights {
		if r.Weight.IsTemplate() && len(r.MatcherSetsRaw) == 0 {
			out = append(out, placeholderWeightWarning("its weight rule", r.Weight.String()))
		}
	}
	if w := zc.burstWarning(incumbent); w != "" {
		out = append(out, w)
	}
	if w := zc.memoryWarning(); w != "" {
		out = append(out, w)
	}
	if w := zc.sizeWarning(); w != "" {
		out = append(out, w)
	}
	return out
}

// keyWarnings returns what is wrong with one key template, its shorthands
// expanded; set is as for Zone.warnings.
func keyWarnings(key string, set map[string]bool) []string {
	names := placeholders(key)
	if len(names) == 0 {
		if w := constantKeyWarning(key); w != "" {
			return []string{w}
		}
		return nil
	}
	var out []string
	for _, name := range names {
		switch {
		case name == "http.request.remote" || name == "http.request.remote.port":
			out = append(out, fmt.Sprintf("key %q contains {%s}, the client's port: every new connection is a new key with a full bucket, so a client that reconnects is never limited; use {client_ip} (or {remote_host})", key, name))
		case !knownPlaceholder(name) && !set[name]:
			out = append(out, fmt.Sprintf("key %q contains {%s}, which is not a placeholder of Caddy's HTTP server: unless a handler before rate_limit sets it, it expands to nothing and every request without it shares one bucket", key, name))
		}
	}
	return out
}

// placeholderWeightWarning says that a weight read from every request
// (who: "its weight rule", "the rate_limit block's weight") answers 400 to a
// request without it, and how to charge such a request 1 instead.
func placeholderWeightWarning(who, tmpl string) string {
	return fmt.Sprintf("%s %s prices every request, so a request without it (or with anything but a whole number of at least 1) is answered 400; to charge such a request 1 instead, give the weight a matcher block for the requests that carry it (weight %s { header <Field> * }, with the header it reads), or answer the 400 with handle_errors 400",
		who, tmpl, tmpl)
}

// burstWarning says when burst makes a zone stricter at once than its
// events and window read alone, in a config that looks written for
// caddy-ratelimit (incumbent): there a zone without burst is at most events
// in any window, and caddy-ratelimit has no burst (its JSON ignores the
// field), so a config moved from it with burst 100 beside events 1000
// window 5m allows 100 at once, not 1000. Elsewhere burst below events is
// a token bucket meant as one (docs/limits.md recommends it to smooth
// bursts), and the zone's INFO line says what it does.
func (zc *Zone) burstWarning(incumbent bool) string {
	if zc.Burst == 0 || zc.Burst >= zc.MaxEvents || !incumbent {
		return ""
	}
	w := time.Duration(zc.Window)
	return fmt.Sprintf("burst %d makes events %d window %s a token bucket: %d at once, then one every %v; caddy-ratelimit has no burst and allows %d in any %s: if this zone comes from it, remove burst to keep that meaning",
		zc.Burst, zc.MaxEvents, w, zc.Burst, (w / time.Duration(zc.MaxEvents)).Round(time.Millisecond), zc.MaxEvents, spanWords(w))
}

// nginxVariable is nginx's syntax for a variable ($http_x_api_key), which
// Caddy does not expand.
var nginxVariable = regexp.MustCompile(`\$([a-z_][a-z0-9_]*)`)

// constantKeyWarning says why a key without placeholders looks like a
// placeholder mistyped (no braces, a brace without its pair, nginx's
// $variable), so that it is the same text for every request and every client
// shares one bucket; or "" for a constant that looks meant, such as
// caddy-ratelimit's `key static`.
func constantKeyWarning(key string) string {
	const shared = "so it is that text for every request and every client shares one bucket"
	if p := expandShorthands("{" + key + "}"); knownPlaceholder(p[1 : len(p)-1]) {
		return fmt.Sprintf("key %q has no braces, %s; write the placeholder {%s}", key, shared, key)
	}
	if strings.ContainsAny(key, "{}") && !strings.Contains(key, `\{`) && !strings.Contains(key, `\}`) {
		fix := "a placeholder in a pair of braces, e.g. {header.X-API-Key}"
		if strings.Count(key, "{") == 1 && strings.HasPrefix(key, "{") && !strings.Contains(key, "}") {
			fix = "the placeholder " + key + "}"
		}
		return fmt.Sprintf("key %q has a brace without its pair, so it is no placeholder: it is that text for every request and every client shares one bucket; write %s", key, fix)
	}
	if m := nginxVariable.FindStringSubmatch(key); m != nil {
		return fmt.Sprintf("key %q is nginx's variable syntax, which Caddy does not expand, %s; write the placeholder %s", key, shared, nginxPlaceholder(m[1]))
	}
	return ""
}

// nginxPlaceholder is the Caddy placeholder for nginx's variable name, or
// examples of placeholders if there is none.
func nginxPlaceholder(name string) string {
	switch {
	case name == "remote_addr" || name == "binary_remote_addr":
		return "{client_ip}"
	case strings.HasPrefix(name, "http_") && len(name) > len("http_"):
		return "{header." + textproto.CanonicalMIMEHeaderKey(strings.ReplaceAll(name[len("http_"):], "_", "-")) + "}"
	case strings.HasPrefix(name, "arg_") && len(name) > len("arg_"):
		return "{query." + name[len("arg_"):] + "}"
	case strings.HasPrefix(name, "cookie_") && len(name) > len("cookie_"):
		return "{cookie." + name[len("cookie_"):] + "}"
	}
	return "such as {client_ip} or {header.X-API-Key}"
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
	lines := zc.Lines()
	if zc.EstimateFalseDeny(minSources) <= limiter.DefaultFalseDeny {
		return ""
	}
	n := 1
	for zc.EstimateFalseDeny(n) <= limiter.DefaultFalseDeny {
		n++
	}
	return fmt.Sprintf("memory %s is a table of %d lines: from %d keys over their limit at once, other keys are denied more than %g%% of the time; raise memory or size the table with sources and false_deny",
		humanize.IBytes(uint64(zc.Memory)), lines, n, limiter.DefaultFalseDeny*100)
}

// minSources is the fewest flooding keys a keyed zone's table should bear at
// the default false-deny probability before a warning says it is too small.
const minSources = 100

// Sizes above which a configuration's tables are worth a word at load. The
// default zone (sources 100,000, false_deny 0.005) is 10.6 MiB; tables are
// allocated at load and a flood touches every line, so what the
// configuration asks for is memory an attack makes resident.
const (
	// bigZone: 256 MiB per zone, 24 default zones' worth, bears about 2.4
	// million flooding sources at the default false_deny: a larger table
	// is more likely a typo in sources or memory (an extra zero) than a
	// sizing decision.
	bigZone = 256 << 20
	// bigTotal: 1 GiB across a config's zones, the memory of a small
	// server, reached for example by a hundred default zones, each of which
	// looks small on its own.
	bigTotal = 1 << 30
)

// tableBytes is the size of zc's table.
func (zc *Zone) tableBytes() int64 { return int64(zc.Lines()) * 64 }

// sizeWarning says when zc's table is larger than bigZone, naming its size
// and what it was sized from.
func (zc *Zone) sizeWarning() string {
	n := zc.tableBytes()
	if n <= bigZone {
		return ""
	}
	return fmt.Sprintf("its table is %s (from %s), allocated at load, more than the %s beyond which a zone is most likely sized by mistake; lower sources or memory, or raise false_deny",
		humanize.IBytes(uint64(n)), zc.Sizing(), humanize.IBytes(bigZone))
}

// unusedZonesWarning says which global zones (by name) no handler or layer4
// matcher uses, and how to use them: the rate_limit global option only
// defines zones, it applies none of them to any site. "" if all are used.
func unusedZonesWarning(global map[string]*zone, used map[string]bool) string {
	var names []string
	for name := range global {
		if !used[name] {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return ""
	}
	slices.Sort(names)
	quoted := make([]string, len(names))
	for i, n := range names {
		quoted[i] = fmt.Sprintf("%q", n)
	}
	return fmt.Sprintf("the rate_limit global option defines %s, which no site, route or layer4 matcher uses, so nothing is limited by it: the global option only defines zones; to apply one, write rate_limit %s in each site (or route) it limits",
		plural(len(names), "zone "+quoted[0], "zones "+strings.Join(quoted, ", ")), strings.Join(names, " "))
}

// plural returns one if n is 1, else many.
func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// totalSizeWarning says when the tables of zones add up to more than
// bigTotal, naming the total and the largest zones; "" otherwise.
func totalSizeWarning(zones []*zone) string {
	var total int64
	for _, z := range zones {
		total += z.conf.tableBytes()
	}
	if total <= bigTotal {
		return ""
	}
	zones = slices.Clone(zones)
	slices.SortStableFunc(zones, func(a, b *zone) int { return cmp.Compare(b.conf.tableBytes(), a.conf.tableBytes()) })
	var largest []string
	for _, z := range zones[:min(len(zones), 3)] {
		largest = append(largest, fmt.Sprintf("%s %s", z.name, humanize.IBytes(uint64(z.conf.tableBytes()))))
	}
	return fmt.Sprintf("the tables of this config's %d rate_limit zones add up to %s, allocated at load, more than %s (largest: %s); size zones with sources and false_deny or memory, or share one zone between sites",
		len(zones), humanize.IBytes(uint64(total)), humanize.IBytes(bigTotal), strings.Join(largest, ", "))
}
