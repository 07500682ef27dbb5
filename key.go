package floodgate

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/textproto"
	"strings"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/cespare/xxhash/v2"

	"github.com/floodgate-rl/floodgate/internal/siphash"
	"github.com/floodgate-rl/floodgate/limiter"
)

// How a zone reads a key from a request. A key is parsed once, when the zone
// is provisioned, into the cheapest way of reading it: the client address
// without the replacer, a header field without copying it, a template
// hashed piece by piece without building the expanded text. Every way hashes
// the same bytes that Caddy's replacer would expand the key to (cut at
// maxKeyHashed), so the choice never changes a key's bucket.

// keyKind says how a key is read from a request.
type keyKind uint8

const (
	// keyTemplate is expanded part by part: literal text and placeholders.
	keyTemplate keyKind = iota
	// keyPlaceholder is a template that is exactly one placeholder.
	keyPlaceholder
	// keyHeader is exactly one request header field
	// (`{http.request.header.<field>}`), read from the request directly.
	keyHeader
	// keyClientIP is the client IP Caddy computed (honouring
	// trusted_proxies), read from the request's vars.
	keyClientIP
	// keyRemoteIP is the address of the connection's peer.
	keyRemoteIP
)

// A keySpec is one key of a zone, parsed.
type keySpec struct {
	kind keyKind
	// salt is the key's public salt: its placeholder's hash, the same in
	// every process. Its values are hashed under it and a secret
	// (zone.seal, zone.salted), so that a value only ever meets values of
	// the same key: a header that holds "203.0.113.7" must not draw on the
	// counters of the client 203.0.113.7. It is derived from the key's
	// placeholder, not its place in the key list, so a key keeps its
	// counters when the list is reordered. The source address
	// (keyClientIP, keyRemoteIP) has salt 0: its hash is the one layer4
	// matchers and the XDP program compute for a connection's source,
	// which share the zone's table.
	salt uint64
	// text is the key as its placeholders are written in JSON (Caddyfile
	// shorthands expanded, a header field canonical): how sources of a
	// salted key that are networks are named (zone.source).
	text string
	// name is the header field (keyHeader, canonical) or the placeholder
	// (keyPlaceholder).
	name string
	// parts is a keyTemplate's literal text and placeholders, in order.
	parts []templatePart
}

// A templatePart is a run of literal text or one placeholder of a template.
type templatePart struct {
	text        string // the literal, or the placeholder's name
	placeholder bool
}

// maxKeyHashed is how many bytes of a key identify it: a longer key is
// hashed (and counted) by its first maxKeyHashed bytes, so that a huge header
// costs a bounded amount of work per zone. 8 KiB is the longest header line
// nginx accepts by default (large_client_header_buffers).
const maxKeyHashed = 8 << 10

// maxShownKey is the longest key, in bytes, that log_key shows in logs,
// events and the {http.rate_limit.key} placeholder; a longer key is cut there
// and marked with "…".
const maxShownKey = 256

// maxIPText is the length of the longest IP address text worth parsing
// (a full IPv6 address with an embedded IPv4 part and a zone). A longer key
// is hashed as text even if it parses, since an IPv6 zone may be of any
// length: a key is an address only up to here.
const maxIPText = 64

const headerPlaceholder = "http.request.header."

func parseKeySpec(s string) keySpec {
	switch s {
	case "{http.vars.client_ip}", "{client_ip}":
		return keySpec{kind: keyClientIP, text: "{client_ip}"}
	case "{http.request.remote.host}", "{remote_host}":
		return keySpec{kind: keyRemoteIP, text: "{http.request.remote.host}"}
	}
	parts := compileTemplate(s)
	if len(parts) == 1 && parts[0].placeholder {
		name := parts[0].text
		if field, ok := strings.CutPrefix(name, headerPlaceholder); ok {
			// What Caddy's replacer does for this placeholder: the
			// field's values joined with commas.
			text := "{" + headerPlaceholder + textproto.CanonicalMIMEHeaderKey(field) + "}"
			return keySpec{kind: keyHeader, name: textproto.CanonicalMIMEHeaderKey(field), salt: keySalt(text), text: text}
		}
		return keySpec{kind: keyPlaceholder, name: name, salt: keySalt(s), text: s}
	}
	return keySpec{kind: keyTemplate, parts: parts, salt: keySalt(s), text: s}
}

// keySalt is the salt of the key whose (shorthand-expanded) text is s: its
// hash, never 0, which is the source address's.
func keySalt(s string) uint64 {
	return max(limiter.HashString("floodgate key "+s), 1)
}

// seal sets the secret the zone hashes its keys' values with (but the
// source address's): a random secret of the zone's table, or for a
// distributed zone the cluster's (see hashSecret), so that the counters a
// value lands on cannot be computed from the public code and a guess of
// the table's size. A distributed zone may be sealed again while it
// serves, when it learns the cluster's secret (zone.adopt): the secret is
// read atomically.
func (z *zone) seal(secret uint64) { z.secret.Store(secret) }

// salted returns the hash h of one of the key's values as a zone never
// sealed (in tests) hashes it: h itself for the source address.
func (k *keySpec) salted(h uint64) uint64 {
	if k.salt == 0 {
		return h
	}
	return siphash.Sum64(0, k.salt, h)
}

// compileTemplate splits a key template into literal text and placeholders
// with Caddy's own parser (escaped braces, unclosed braces and all): it
// expands the template once with a replacer that marks where each
// placeholder was.
func compileTemplate(tmpl string) []templatePart {
	// The mark is text the template does not hold, and no prefix of it is
	// also its suffix, so that in the expansion it is found only where a
	// placeholder was, whatever literal text stands beside it.
	mark := "\x00"
	for n := 1; strings.Contains(tmpl, mark); n++ {
		mark = "\x00" + strings.Repeat("\x01", n)
	}
	var names []string
	repl := caddy.NewEmptyReplacer()
	repl.Map(func(name string) (any, bool) {
		names = append(names, name)
		return mark, true
	})
	lits := strings.Split(repl.ReplaceAll(tmpl, ""), mark)
	var parts []templatePart
	for i, lit := range lits {
		if lit != "" {
			parts = append(parts, templatePart{text: lit})
		}
		if i < len(names) {
			parts = append(parts, templatePart{text: names[i], placeholder: true})
		}
	}
	return parts
}

// A request is what the zones of a handler read from one HTTP request. The
// client and peer addresses are found and parsed at most once, however many
// zones use them.
type request struct {
	r      *http.Request
	repl   *caddy.Replacer
	client peer
	remote peer
}

// A peer is an address of a request: its text and, if it is an IP address,
// the address.
type peer struct {
	known bool
	text  string
	addr  netip.Addr
}

// clientIP returns the client IP that Caddy computed for the request
// (honouring trusted_proxies), or the peer's address outside a Caddy server.
func (q *request) clientIP() *peer {
	if !q.client.known {
		if ip, ok := caddyhttp.GetVar(q.r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
			q.client = newPeer(ip)
		} else {
			q.client = *q.remoteIP()
		}
	}
	return &q.client
}

// remoteIP returns the host part of the request's RemoteAddr.
func (q *request) remoteIP() *peer {
	if !q.remote.known {
		host, _, err := net.SplitHostPort(q.r.RemoteAddr)
		if err != nil {
			host = q.r.RemoteAddr
		}
		q.remote = newPeer(host)
	}
	return &q.remote
}

func newPeer(text string) peer {
	return peer{known: true, text: text, addr: parseIP(text)}
}

// parseIP returns the address s holds, without its zone, or the zero Addr.
// It only calls netip.ParseAddr on text that can be an address, because a
// failed parse allocates its error.
func parseIP(s string) netip.Addr {
	if !ipLike(s) {
		return netip.Addr{}
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Addr{}
	}
	return a.WithZone("")
}

// ipLike reports whether s can be the text of an IP address: short enough,
// with a dot or a colon, and only hex digits, dots and colons before an
// optional zone (`%eth0`).
func ipLike[T string | []byte](s T) bool {
	if len(s) > maxIPText {
		return false
	}
	sep := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '%':
			return sep && i > 0
		case c == '.' || c == ':':
			sep = true
		case !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'):
			return false
		}
	}
	return sep
}

// A charge is what a zone charged for a request: the hash of its key, which
// of the zone's keys it was, and the key's address if it is one.
type charge struct {
	hash uint64
	key  int        // index in zone.keys; -1 if every key was empty
	addr netip.Addr // valid if the key is an IP address
}

// key returns what the zone charges for the request: the first of its keys
// that is not empty. An IP address (from the client IP fast path or any key
// that expands to one) is masked to the zone's prefixes; anything else is
// hashed as bytes, up to maxKeyHashed of them. With every key empty the
// result is the hash of the empty key, one bucket shared by all such
// requests.
func (z *zone) key(q *request) charge {
	for i := range z.keys {
		k := &z.keys[i]
		var s string
		switch k.kind {
		case keyClientIP, keyRemoteIP:
			p := q.remoteIP()
			if k.kind == keyClientIP {
				p = q.clientIP()
			}
			if p.addr.IsValid() {
				return z.network(p.addr, i)
			}
			s = p.text
		case keyHeader:
			vals := q.r.Header[k.name]
			if len(vals) > 1 {
				// Joined with commas, as Caddy does. That is an address
				// only when the commas fall in an IPv6 zone ("fe80::1%a"
				// and ""), but then it is one, as the replacer's text is.
				var h keyHasher
				h.init()
				for j, v := range vals {
					if j > 0 {
						h.write(",")
					}
					h.write(v)
				}
				return z.hashedCharge(&h, i)
			}
			if len(vals) == 1 {
				s = vals[0]
			}
		case keyPlaceholder:
			v, _ := q.repl.Get(k.name)
			s = caddy.ToString(v)
		default:
			if c, ok := z.templateKey(q, k, i); ok {
				return c
			}
			continue
		}
		if s == "" {
			continue
		}
		return z.textCharge(s, i)
	}
	return charge{hash: limiter.Hash(nil), key: -1}
}

// keysReadRequestOnly reports whether reading z's keys reads nothing but
// the request's header fields and addresses: no placeholder, which might
// read the body or have another effect.
func (z *zone) keysReadRequestOnly() bool {
	for i := range z.keys {
		switch z.keys[i].kind {
		case keyHeader, keyClientIP, keyRemoteIP:
		default:
			return false
		}
	}
	return true
}

// textCharge is what a key that expanded to s, the zone's key number i,
// charges: the network of an address, else the hash of s (cut at
// maxKeyHashed bytes). The admin API uses it for a key given as text.
func (z *zone) textCharge(s string, i int) charge {
	if a := parseIP(s); a.IsValid() {
		return z.network(a, i)
	}
	return charge{hash: z.salted(i, limiter.HashString(s[:min(len(s), maxKeyHashed)])), key: i}
}

// templateKey hashes the expansion of a template piece by piece, without
// building it; ok is false if it expands to nothing.
func (z *zone) templateKey(q *request, k *keySpec, i int) (c charge, ok bool) {
	var h keyHasher
	h.init()
	for _, p := range k.parts {
		if !p.placeholder {
			h.write(p.text)
			continue
		}
		v, _ := q.repl.Get(p.text)
		h.write(caddy.ToString(v))
	}
	if h.n == 0 {
		return charge{}, false
	}
	return z.hashedCharge(&h, i), true
}

// hashedCharge is what a key written into h, the zone's key number i,
// charges: the network of an address, else the hash.
func (z *zone) hashedCharge(h *keyHasher, i int) charge {
	if h.n <= maxIPText && ipLike(h.head[:h.n]) {
		// Possibly an address: worth one conversion.
		if a := parseIP(string(h.head[:h.n])); a.IsValid() {
			return z.network(a, i)
		}
	}
	return charge{hash: z.salted(i, h.sum()), key: i}
}

// network charges the network of a, the value of the zone's key number i.
func (z *zone) network(a netip.Addr, i int) charge {
	nk := limiter.NetworkKey(a, z.v4, z.v6)
	return charge{hash: z.salted(i, limiter.Hash(nk.Bytes())), key: i, addr: a}
}

// salted returns h, the hash of a value of the zone's key number i, as
// that key's values are hashed: h for the source address; else SipHash of
// h under the zone's secret and the key's salt, a pseudorandom function of
// h, so that a value only ever meets values of the same key, and neither
// the counters a value lands on nor the hash the tools show (zone.source)
// say anything of the secret to whoever knows the value.
func (z *zone) salted(i int, h uint64) uint64 {
	if s := z.saltOf(i); s != 0 {
		return siphash.Sum64(z.secret.Load(), s, h)
	}
	return h
}

// saltOf returns the salt of the zone's key number i: 0 for the source
// address, whose hash is its network's. A number that is not one of the
// zone's keys (a layer4 zone's connections, which have none) is the
// source address's.
func (z *zone) saltOf(i int) uint64 {
	if i < 0 || i >= len(z.keys) {
		return 0
	}
	return z.keys[i].salt
}

// A keyHasher hashes a key written in pieces to what limiter.HashString
// gives for the whole (cut at maxKeyHashed bytes), and keeps the first
// bytes to recognise an IP address.
type keyHasher struct {
	d    xxhash.Digest
	n    int // bytes hashed
	head [maxIPText]byte
}

func (kh *keyHasher) init() { kh.d.Reset() }

func (kh *keyHasher) write(s string) {
	s = s[:min(len(s), maxKeyHashed-kh.n)]
	if kh.n < len(kh.head) {
		copy(kh.head[kh.n:], s)
	}
	_, _ = kh.d.WriteString(s)
	kh.n += len(s)
}

func (kh *keyHasher) sum() uint64 { return kh.d.Sum64() }

// source names what a charge drew on, for logs, events, /top and the admin
// API's keys: the masked network of the source address (`203.0.113.0/24`);
// the network of an address that another key held, after that key's
// placeholder (`{http.request.header.X-Api-Key}=203.0.113.0/24`), since it
// draws on other counters than the client at that address; `key:` and the
// key's salted hash in hex (the same hash for the same key, but not the
// key); or `none` for the bucket shared by requests without a key.
func (z *zone) source(c charge) string {
	switch {
	case c.addr.IsValid():
		nk := limiter.NetworkKey(c.addr, z.v4, z.v6)
		p := nk.Prefix(z.v4, z.v6).String()
		if z.saltOf(c.key) != 0 {
			return z.keys[c.key].text + "=" + p
		}
		return p
	case c.key < 0:
		return "none"
	}
	return fmt.Sprintf("key:%016x", c.hash)
}

// keyText returns the key a charge was made for as text, for log_key: at
// most maxShownKey bytes of it, cut at a character boundary and marked with
// "…" if it was longer.
func (z *zone) keyText(q *request, c charge) string {
	if c.key < 0 {
		return ""
	}
	k := &z.keys[c.key]
	switch k.kind {
	case keyClientIP:
		return shownKey(q.clientIP().text)
	case keyRemoteIP:
		return shownKey(q.remoteIP().text)
	case keyHeader:
		vals := q.r.Header[k.name]
		if len(vals) == 1 {
			return shownKey(vals[0])
		}
		var b strings.Builder
		for j, v := range vals {
			if b.Len() > maxShownKey {
				break
			}
			if j > 0 {
				b.WriteByte(',')
			}
			b.WriteString(v[:min(len(v), maxShownKey+1)])
		}
		return shownKey(b.String())
	case keyPlaceholder:
		v, _ := q.repl.Get(k.name)
		return shownKey(caddy.ToString(v))
	}
	var b strings.Builder
	for _, p := range k.parts {
		if b.Len() > maxShownKey {
			break
		}
		s := p.text
		if p.placeholder {
			v, _ := q.repl.Get(p.text)
			s = caddy.ToString(v)
		}
		b.WriteString(s[:min(len(s), maxShownKey+1)])
	}
	return shownKey(b.String())
}

// shownKey cuts s to at most maxShownKey bytes at a character boundary,
// marked with "…".
func shownKey(s string) string {
	if len(s) <= maxShownKey {
		return s
	}
	const ellipsis = "…"
	cut := maxShownKey - len(ellipsis)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + ellipsis
}
