package floodgate

import (
	"fmt"
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Zone is a named rate limit: which requests it applies to, what identifies a
// client, how many requests a client may make, and how much memory its state
// may use.
//
// A zone is a token bucket per key: `max_events` per `window` sustained, and
// up to `burst` at once. A key starts with a full bucket. Requests that match
// no key (every key placeholder empty) share the bucket of the empty key.
type Zone struct {
	// Matchers that select the requests this zone applies to. Each set is
	// ANDed inside, the sets are ORed. Default: every request.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`

	// Key identifies a client, usually with placeholders, e.g.
	// `{http.vars.client_ip}` (the client IP honouring `trusted_proxies`) or
	// `{http.request.header.X-API-Key}`. A key that expands to an IP address
	// is grouped by network with ipv4_prefix and ipv6_prefix; any other
	// value is hashed, whatever its length, and never stored. Default: empty,
	// which makes the zone one bucket shared by all requests.
	Key string `json:"key,omitempty"`

	// FallbackKeys are tried in order when Key expands to the empty string;
	// the first non-empty one is used. If all are empty the request uses the
	// bucket of the empty key, shared by every request without a key.
	FallbackKeys []string `json:"fallback_keys,omitempty"`

	// MaxEvents is how many requests a key may make per window, sustained.
	// Required, at least 1.
	MaxEvents int64 `json:"max_events,omitempty"`

	// Window is the period over which max_events are allowed. Required,
	// positive.
	Window caddy.Duration `json:"window,omitempty"`

	// Burst is how many requests a key may make at once, after being idle.
	// Default: max_events.
	Burst int64 `json:"burst,omitempty"`

	// IPv4Prefix groups IPv4 keys by network: keys in the same /ipv4_prefix
	// share a bucket. 0 to 32; default 32 (one bucket per address).
	IPv4Prefix *int `json:"ipv4_prefix,omitempty"`

	// IPv6Prefix groups IPv6 keys by network. 0 to 128; default 64 (one
	// bucket per /64, the smallest network a client usually gets).
	IPv6Prefix *int `json:"ipv6_prefix,omitempty"`

	// Memory is the size of the zone's table in bytes, fixed whatever the
	// number of clients. Default: sized from sources and false_deny. Do not
	// set both.
	Memory int64 `json:"memory,omitempty"`

	// Sources is the number of clients expected to be over the limit at the
	// same time. Used to size the table when memory is not set. Default:
	// 100000.
	Sources int `json:"sources,omitempty"`

	// FalseDeny is the largest acceptable probability that a client under
	// its limit is denied while sources others flood. Used to size the table
	// when memory is not set. Above 0, below 1. Default: 0.005.
	FalseDeny float64 `json:"false_deny,omitempty"`
}

const (
	defaultIPv4Prefix = 32
	defaultIPv6Prefix = 64
)

// limit returns the zone's token-bucket rate.
func (z *Zone) limit() limiter.Limit {
	return limiter.Limit{Events: z.MaxEvents, Window: time.Duration(z.Window), Burst: z.Burst}
}

// Validate reports the first setting of z that cannot work, naming the zone,
// the field and the value.
func (z *Zone) Validate(name string) error {
	if err := validZoneName(name); err != nil {
		return err
	}
	bad := func(field string, value any, why string) error {
		return fmt.Errorf("zone %q: %s %v: %s", name, field, value, why)
	}
	if z.MaxEvents < 1 {
		return bad("max_events", z.MaxEvents, "must be at least 1")
	}
	if z.Window <= 0 {
		return bad("window", time.Duration(z.Window), "must be positive")
	}
	if z.Burst < 0 {
		return bad("burst", z.Burst, "must not be negative")
	}
	if err := z.limit().Validate(); err != nil {
		return fmt.Errorf("zone %q: %v", name, err)
	}
	if p := z.IPv4Prefix; p != nil && (*p < 0 || *p > 32) {
		return bad("ipv4_prefix", *p, "must be between 0 and 32")
	}
	if p := z.IPv6Prefix; p != nil && (*p < 0 || *p > 128) {
		return bad("ipv6_prefix", *p, "must be between 0 and 128")
	}
	if z.Memory != 0 && (z.Sources != 0 || z.FalseDeny != 0) {
		return bad("memory", z.Memory, "set either memory or sources and false_deny, not both")
	}
	if z.Memory != 0 && (z.Memory < 64 || z.Memory > limiter.MaxBytes) {
		return bad("memory", z.Memory, fmt.Sprintf("must be between 64 bytes and %d bytes", int64(limiter.MaxBytes)))
	}
	if z.Sources < 0 {
		return bad("sources", z.Sources, "must be positive")
	}
	if z.FalseDeny != 0 && !(z.FalseDeny > 0 && z.FalseDeny < 1) {
		return bad("false_deny", z.FalseDeny, "must be above 0 and below 1")
	}
	if z.Memory == 0 {
		if lines := z.lines(); lines > limiter.MaxBytes/64 {
			return bad("sources", z.Sources, fmt.Sprintf("with false_deny %g needs more than the maximum table size of %d bytes", z.falseDeny(), int64(limiter.MaxBytes)))
		}
	}
	return nil
}

// validZoneName accepts names that can be written in a header's quoted
// string without escaping: printable ASCII other than `"` and `\`.
func validZoneName(name string) error {
	if name == "" {
		return fmt.Errorf("zone name must not be empty")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < 0x21 || c > 0x7e || c == '"' || c == '\\' {
			return fmt.Errorf("zone name %q: only printable ASCII without spaces, quotes or backslashes is allowed", name)
		}
	}
	return nil
}

func (z *Zone) sources() int {
	if z.Sources == 0 {
		return limiter.DefaultSources
	}
	return z.Sources
}

func (z *Zone) falseDeny() float64 {
	if z.FalseDeny == 0 {
		return limiter.DefaultFalseDeny
	}
	return z.FalseDeny
}

// lines is the number of 64-byte lines of the zone's table.
func (z *Zone) lines() int {
	if z.Memory != 0 {
		return int(z.Memory / 64)
	}
	return limiter.LinesFor(z.sources(), z.falseDeny(), limiter.DefaultK)
}

func prefixOr(p *int, def int) int {
	if p == nil {
		return def
	}
	return *p
}

// keyKind says how a key is read from a request.
type keyKind uint8

const (
	// keyTemplate is expanded by the replacer.
	keyTemplate keyKind = iota
	// keyClientIP is the client IP Caddy computed (honouring
	// trusted_proxies), read from the request's vars.
	keyClientIP
	// keyRemoteIP is the address of the connection's peer.
	keyRemoteIP
)

type keySpec struct {
	kind     keyKind
	template string
}

func parseKeySpec(s string) keySpec {
	switch s {
	case "{http.vars.client_ip}", "{client_ip}":
		return keySpec{kind: keyClientIP}
	case "{http.request.remote.host}", "{remote_host}":
		return keySpec{kind: keyRemoteIP}
	}
	return keySpec{kind: keyTemplate, template: s}
}

// zone is a Zone provisioned for one config: its matchers, its parsed keys and
// the table it shares with every other config that holds the same zone.
type zone struct {
	name string
	// nameValue is name as an interface value, boxed once rather than on
	// every request that sets the zone placeholder.
	nameValue any
	// burstValue is the burst in force, boxed once likewise.
	burstValue any
	limit      limiter.Limit
	keys       []keySpec
	v4, v6     int
	matchers   caddyhttp.MatcherSets
	tkey       tableKey
	table      *table
	buckets    *limiter.Buckets // table.buckets
	// policy is the zone's RateLimit-Policy item: `"name";q=<burst>;w=<s>`.
	policy string
	// allowed and denied count the zone's requests.
	allowed, denied counter
}

// provisionZone validates zc and acquires its table. The caller must
// release the zone (z.release) if it returns no error.
func provisionZone(ctx caddy.Context, name string, zc *Zone) (*zone, error) {
	if err := zc.Validate(name); err != nil {
		return nil, err
	}
	z := &zone{
		name:      name,
		nameValue: name,
		limit:     zc.limit(),
		v4:        prefixOr(zc.IPv4Prefix, defaultIPv4Prefix),
		v6:        prefixOr(zc.IPv6Prefix, defaultIPv6Prefix),
	}
	for _, k := range append([]string{zc.Key}, zc.FallbackKeys...) {
		if k != "" {
			z.keys = append(z.keys, parseKeySpec(k))
		}
	}
	if zc.MatcherSetsRaw != nil {
		ms, err := ctx.LoadModule(zc, "MatcherSetsRaw")
		if err != nil {
			return nil, fmt.Errorf("zone %q: loading matchers: %v", name, err)
		}
		if err := z.matchers.FromInterface(ms); err != nil {
			return nil, fmt.Errorf("zone %q: %v", name, err)
		}
	}
	burst := z.limit.Burst
	if burst == 0 {
		burst = z.limit.Events
	}
	z.burstValue = burst
	z.policy = policyItem(name, burst, z.limit.Window)
	z.allowed = requests.WithLabelValues(name, "allowed")
	z.denied = requests.WithLabelValues(name, "denied")
	z.tkey = tableKey{zone: name, lines: zc.lines(), k: limiter.DefaultK}
	t, err := acquireTable(z.tkey, limiter.BucketsConfig{
		Limit:     z.limit,
		Bytes:     int(zc.Memory),
		Sources:   zc.Sources,
		FalseDeny: zc.FalseDeny,
	})
	if err != nil {
		return nil, fmt.Errorf("zone %q: %v", name, err)
	}
	z.table, z.buckets = t, t.buckets
	return z, nil
}

// release gives back the zone's reference to its table.
func (z *zone) release() { releaseTable(z.tkey) }

// key returns the hash of the request's key for this zone, and the key as
// text (for logs with log_key).
//
// The first key that is not empty wins. An IP address (from the client IP
// fast path or from a template that expands to one) is masked to the zone's
// prefixes; anything else is hashed as bytes. With every key empty the result
// is the hash of the empty key, one bucket shared by all such requests.
func (z *zone) key(r *http.Request, repl *caddy.Replacer) (uint64, string) {
	for _, k := range z.keys {
		var s string
		switch k.kind {
		case keyClientIP:
			s = clientIP(r)
		case keyRemoteIP:
			s = remoteIP(r)
		default:
			s = repl.ReplaceAll(k.template, "")
		}
		if s == "" {
			continue
		}
		return z.hash(s), s
	}
	return limiter.Hash(nil), ""
}

// hash hashes a non-empty key, grouping IP addresses by network.
func (z *zone) hash(s string) uint64 {
	if len(s) <= maxIPText {
		if a, err := netip.ParseAddr(s); err == nil {
			nk := limiter.NetworkKey(a.WithZone(""), z.v4, z.v6)
			return limiter.Hash(nk.Bytes())
		}
	}
	return limiter.HashString(s)
}

// maxIPText is the length of the longest IP address text worth parsing
// (a full IPv6 address with an embedded IPv4 part and a zone).
const maxIPText = 64

// clientIP returns the client IP that Caddy computed for r (honouring
// trusted_proxies), or the peer's address outside a Caddy server.
func clientIP(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return ip
	}
	return remoteIP(r)
}

// remoteIP returns the host part of r.RemoteAddr.
func remoteIP(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// policyItem formats a RateLimit-Policy list item
// (draft-ietf-httpapi-ratelimit-headers-10): the quota is the burst, the
// window is in whole seconds, rounded up.
func policyItem(name string, burst int64, window time.Duration) string {
	return `"` + name + `";q=` + strconv.FormatInt(burst, 10) + ";w=" + strconv.FormatInt(ceilSeconds(window), 10)
}

// ceilSeconds rounds d up to whole seconds; a duration that never ends counts
// as the largest number of seconds.
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	if d > limiter.Never-time.Second {
		return math.MaxInt64 / int64(time.Second)
	}
	return int64((d + time.Second - 1) / time.Second)
}
