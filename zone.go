package floodgate

import (
	"fmt"
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
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

	// The rate, burst, source-network grouping and table size:
	// max_events, window, burst, ipv4_prefix (default 32: one bucket per
	// address), ipv6_prefix (default 64: the smallest network a client
	// usually gets), memory, sources and false_deny.
	zoneconf.Limit

	// Weights set what a request costs in this zone, in tokens. The rules
	// are tried in order; the first whose matchers match (a rule without
	// matchers always does) gives the weight. Default: the handler's
	// weight, else 1. See WeightRule.
	Weights []*WeightRule `json:"weights,omitempty"`

	// WeightResponseHeader names a response header whose value (a whole
	// number) the request costs, charged when the response is written on
	// top of what was charged at arrival. See "Weights" in the README.
	WeightResponseHeader string `json:"weight_response_header,omitempty"`

	// WeightResponseBytes charges the size of the response body, counted
	// as it is written and charged when the handler returns; the zone's
	// unit is then the byte (RateLimit-Policy says qu="content-bytes").
	WeightResponseBytes bool `json:"weight_response_bytes,omitempty"`

	// Quotas are rolling limits beside the rate: at most max_events in
	// any window of that length. A request is charged to the rate and
	// every quota only if all of them allow it. At most 4 per zone.
	Quotas []Quota `json:"quotas,omitempty"`

	// Action is what happens to a request this zone would deny: "deny"
	// (default, a 429), "log" (a dry run: it passes, charging nothing, but
	// is logged, counted and given the headers and placeholders of a
	// denial) or "delay" (held until its tokens return, up to max_delay).
	Action string `json:"action,omitempty"`

	// MaxDelay is the longest a request is held with action "delay";
	// required with it, positive. A request that would wait longer is
	// denied at once.
	MaxDelay caddy.Duration `json:"max_delay,omitempty"`
}

const (
	defaultIPv4Prefix = 32
	defaultIPv6Prefix = 64
)

// Validate reports the first setting of z that cannot work, naming the zone,
// the field and the value.
func (z *Zone) Validate(name string) error {
	if err := validZoneName(name); err != nil {
		return err
	}
	where := fmt.Sprintf("zone %q: ", name)
	if err := z.Limit.Validate(where); err != nil {
		return err
	}
	if err := z.validateQuotas(where); err != nil {
		return err
	}
	if err := z.validateWeights(where); err != nil {
		return err
	}
	return z.validateAction(where)
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
	// name is the key as configured, for the key_name placeholder.
	name string
}

func parseKeySpec(s string) keySpec {
	switch s {
	case "{http.vars.client_ip}", "{client_ip}":
		return keySpec{kind: keyClientIP, name: s}
	case "{http.request.remote.host}", "{remote_host}":
		return keySpec{kind: keyRemoteIP, name: s}
	}
	return keySpec{kind: keyTemplate, template: s, name: s}
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
	// allowed, denied, logged and delayed count the zone's requests.
	allowed, denied, logged, delayed counter

	// costs are the zone's weight rules; pricesAll is set if one of them
	// matches every request. grantable is the largest weight the zone can
	// ever grant.
	costs     []costRule
	pricesAll bool
	grantable int64
	// afterHeader or afterBytes: the cost reported by the response.
	afterHeader string
	afterBytes  bool
	// unit is the RateLimit-Policy parameter naming the zone's unit, if
	// not requests.
	unit string

	// quotas are the zone's rolling quotas, skeys their pool keys,
	// quotaNames their names in the RateLimit headers and quotaPolicies
	// their RateLimit-Policy items.
	quotas        []*limiter.Sketch
	skeys         []sketchKey
	quotaNames    []string
	quotaPolicies []string

	action   action
	maxDelay time.Duration
	// held counts the requests the zone holds now (action delay).
	held atomic.Int64
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
		limit:     zc.Rate(),
	}
	z.v4, z.v6 = zc.Prefixes(defaultIPv4Prefix, defaultIPv6Prefix)
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
	if err := z.provisionCosts(ctx, zc); err != nil {
		return nil, err
	}
	if z.afterBytes {
		z.unit = `;qu="content-bytes"`
	}
	z.action, z.maxDelay = parseAction(zc.Action), time.Duration(zc.MaxDelay)
	burst := z.limit.Burst
	if burst == 0 {
		burst = z.limit.Events
	}
	z.burstValue = burst
	z.policy = policyItem(name, burst, z.limit.Window) + z.unit
	z.allowed = requests.WithLabelValues(name, "allowed")
	z.denied = requests.WithLabelValues(name, "denied")
	z.logged = requests.WithLabelValues(name, "logged")
	z.delayed = requests.WithLabelValues(name, "delayed")
	if err := z.provisionQuotas(zc); err != nil {
		z.releaseQuotas()
		return nil, err
	}
	z.tkey = tableKey{zone: name, lines: zc.Lines(), k: limiter.DefaultK}
	t, err := acquireTable(z.tkey, zc.Buckets())
	if err != nil {
		z.releaseQuotas()
		return nil, fmt.Errorf("zone %q: %v", name, err)
	}
	z.table, z.buckets = t, t.buckets
	return z, nil
}

// release gives back the zone's references to its table and sketches.
func (z *zone) release() {
	releaseTable(z.tkey)
	z.releaseQuotas()
}

// key returns the hash of the request's key for this zone, the key as text
// (for logs with log_key), and which configured key gave it ("" if none
// did).
//
// The first key that is not empty wins. An IP address (from the client IP
// fast path or from a template that expands to one) is masked to the zone's
// prefixes; anything else is hashed as bytes. With every key empty the result
// is the hash of the empty key, one bucket shared by all such requests.
func (z *zone) key(r *http.Request, repl *caddy.Replacer) (uint64, string, string) {
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
		return z.hash(s), s, k.name
	}
	return limiter.Hash(nil), "", ""
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
