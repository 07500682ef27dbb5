package floodgate

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// chargeOf is what a request whose first key expanded to key would be
// charged: the shared bucket of the empty key, an address's network, or the
// key's hash, salted as the first key's values are.
func (z *zone) chargeOf(key string) charge {
	if key == "" {
		return charge{hash: limiter.Hash(nil), key: -1}
	}
	return z.textCharge(key, 0)
}

// sourceCharge is what the admin API's key names in z: a source as `top`
// and the denial log print it (z.source: a masked network such as
// 127.0.9.0/24, a key's placeholder and a network, `key:` and a key's hash,
// `none` for the bucket of requests without a key), or a key as a request
// would carry it. A key's value may name its key (`{header.X-User}=alice`,
// either form of the placeholder); a bare value is the source address's if
// it is an address and the zone has an address key (or a layer4 matcher
// charges it), else the first key's. A network of another size than the
// zone's prefixes, or text that is not an address in a zone keyed by
// address only, is an error rather than a key that no request has:
// resetting it would report success and change nothing.
func (z *zone) sourceCharge(key string) (charge, error) {
	if key == "none" || key == "" {
		return z.chargeOf(""), nil
	}
	layer4 := z.counts.layer4.Load()
	if len(z.keys) == 0 && !layer4 {
		return charge{}, fmt.Errorf("zone %q has no key: every request it applies to shares one bucket, the source none", z.name)
	}
	if hex, ok := strings.CutPrefix(key, "key:"); ok && len(hex) == 16 {
		if h, err := strconv.ParseUint(hex, 16, 64); err == nil {
			return charge{hash: h}, nil
		}
	}
	i, value, named := z.namedKey(key)
	if p, err := netip.ParsePrefix(value); err == nil {
		if !named {
			i = z.addressKey()
		}
		return z.prefixCharge(p, i)
	}
	if !named {
		if a := parseIP(value); a.IsValid() {
			return z.network(a, z.addressKey()), nil
		}
	}
	c := z.textCharge(value, i)
	if !c.addr.IsValid() && z.saltOf(i) == 0 && z.keyedByAddress() {
		return charge{}, fmt.Errorf("key %q is not an IP address or network: zone %q is keyed by the client's address, so its sources are networks such as 192.0.2.0/%d",
			key, z.name, z.v4)
	}
	return c, nil
}

// namedKey splits an admin API key of the form `<placeholder>=<value>` whose
// placeholder is one of z's keys, written in any form a config may write it
// (a Caddyfile shorthand, a header field in any case), into that key's
// number and the value. Any other text is a value of the first key.
func (z *zone) namedKey(key string) (i int, value string, named bool) {
	// A placeholder as written is never longer than the zone's longest key
	// as configured or expanded (a shorthand is shorter): only '=' up to
	// there can end one, which bounds the work for any key.
	longest := 0
	for j := range z.keys {
		longest = max(longest, len(z.keys[j].text), len(z.keyName(charge{key: j})))
	}
	for p := strings.IndexByte(key, '='); p > 0 && p <= longest; p = nextByte(key, '=', p) {
		name := parseKeySpec(expandShorthands(key[:p])).text
		for j := range z.keys {
			if z.keys[j].text == name {
				return j, key[p+1:], true
			}
		}
	}
	return 0, key, false
}

// nextByte returns the index of the first c in s after index i, or -1.
func nextByte(s string, c byte, i int) int {
	if j := strings.IndexByte(s[i+1:], c); j >= 0 {
		return i + 1 + j
	}
	return -1
}

// addressKey returns the number of the zone's first key that is the
// client's or the peer's address: the key a bare address names. In a zone
// without one, a bare address names the connections a layer4 matcher
// charges (-1, unsalted) if one does, else a value of the first key.
func (z *zone) addressKey() int {
	for i, k := range z.keys {
		if k.kind == keyClientIP || k.kind == keyRemoteIP {
			return i
		}
	}
	if len(z.keys) == 0 || z.counts.layer4.Load() {
		return -1
	}
	return 0
}

// prefixCharge is the charge of network p, a source of the zone's key
// number i, or an error if p is not of the size the zone groups addresses
// by.
func (z *zone) prefixCharge(p netip.Prefix, i int) (charge, error) {
	a := p.Addr().Unmap()
	bits := z.v6
	if a.Is4() {
		bits = z.v4
	}
	if p.Addr().Is4In6() && p.Bits() >= 96 {
		// ::ffff:192.0.2.0/120 is the IPv4 network 192.0.2.0/24.
		p = netip.PrefixFrom(a, p.Bits()-96)
	}
	if p.Bits() != bits {
		return charge{}, fmt.Errorf("%s is not a source of zone %q: its sources are /%d networks for IPv4 and /%d for IPv6 (ipv4_prefix, ipv6_prefix); give an address or a /%d network",
			p, z.name, z.v4, z.v6, bits)
	}
	return z.network(a, i), nil
}

// keyedByAddress reports whether every key of z is the client's or the
// peer's address (or z has no key and a layer4 matcher charges it by the
// connection's address), so that a key which is not an address names no
// source.
func (z *zone) keyedByAddress() bool {
	for _, k := range z.keys {
		if k.kind != keyClientIP && k.kind != keyRemoteIP {
			return false
		}
	}
	return len(z.keys) > 0 || z.counts.layer4.Load()
}

// adminAPI serves the zones of the running config on Caddy's admin
// endpoint, under /rate_limit/.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.rate_limit",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the API's routes. Methods are checked by the handlers, so
// that a wrong one gets a JSON error like every other.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/rate_limit/zones", Handler: caddy.AdminHandlerFunc(handleZones)},
		{Pattern: "/rate_limit/zones/{zone}", Handler: caddy.AdminHandlerFunc(handleZone)},
		{Pattern: "/rate_limit/zones/{zone}/top", Handler: caddy.AdminHandlerFunc(handleTop)},
		{Pattern: "/rate_limit/zones/{zone}/keys/{key...}", Handler: caddy.AdminHandlerFunc(handleKey)},
	}
}

// ZoneInfo is a zone as GET /rate_limit/zones reports it.
type ZoneInfo struct {
	Name string `json:"name"`
	// Key holds the zone's key and fallback keys, in order; empty for a
	// zone without a key.
	Key        []string     `json:"key"`
	IPv4Prefix int          `json:"ipv4_prefix"`
	IPv6Prefix int          `json:"ipv6_prefix"`
	Policies   []PolicyInfo `json:"policies"`
	// Requests and Weight count the zone's requests since a config first
	// had it, surviving reloads.
	Requests Outcomes `json:"requests"`
	Weight   Outcomes `json:"weight"`
	// Connections counts layer4 connections, for zones a layer4 matcher
	// uses.
	Connections *Connections `json:"connections,omitempty"`
	Held        int64        `json:"held"`
	Memory      MemoryInfo   `json:"memory"`
	// Occupancy is the share of the table's counters in use (not full).
	Occupancy float64 `json:"occupancy"`
	// FalseDeny is the estimated probability that a key never seen before
	// is denied now.
	FalseDeny float64 `json:"false_deny"`
	// Cluster is the sync state of a distributed zone.
	Cluster *ClusterInfo `json:"cluster,omitempty"`
	// XDP is the zone's XDP program, if it has one.
	XDP *XDPInfo `json:"xdp,omitempty"`
	// Concurrent is the zone's max_concurrent, if it has one.
	Concurrent *ConcurrentInfo `json:"concurrent,omitempty"`
}

// ConcurrentInfo is a zone's max_concurrent on this instance: the places a
// key may hold, the places in use now (requests in flight, of every key),
// the requests denied for want of one, and the size of its table.
type ConcurrentInfo struct {
	MaxConcurrent int64  `json:"max_concurrent"`
	InFlight      int64  `json:"in_flight"`
	Denied        uint64 `json:"denied"`
	// Waiting is how many requests wait for a place (action delay).
	Waiting int        `json:"waiting"`
	Memory  MemoryInfo `json:"memory"`
}

// ClusterInfo is a distributed zone's sync through storage: its failures
// by operation since the process started, and the entries it skipped
// (storage entries under the zone that are not its snapshots).
type ClusterInfo struct {
	ReadErrors    uint64 `json:"read_errors"`
	WriteErrors   uint64 `json:"write_errors"`
	RestoreErrors uint64 `json:"restore_errors"`
	Skipped       uint64 `json:"skipped"`
	// Instances is how many instances, this one included, were live at
	// the last read (0 before the first): a key's share of what the
	// cluster has left for it is split among them (Bursts split).
	Instances int `json:"instances"`
	// LastRead and LastWrite are the last successful read (this
	// instance's view of the others) and write (theirs of it).
	LastRead      *time.Time `json:"last_read,omitempty"`
	LastWrite     *time.Time `json:"last_write,omitempty"`
	ReadInterval  string     `json:"read_interval"`
	WriteInterval string     `json:"write_interval"`
	Bursts        string     `json:"bursts"`
}

// PolicyInfo is one of a zone's limits.
type PolicyInfo struct {
	// Kind is "window" (at most events in a window: a zone without
	// burst), "bucket" (a token bucket) or "quota" (at most events in any
	// window, beside the rate).
	Kind   string `json:"kind"`
	Events int64  `json:"events"`
	Window string `json:"window"`
	Burst  int64  `json:"burst,omitempty"`
}

// Outcomes counts requests by what a zone did with them.
type Outcomes struct {
	Allowed uint64 `json:"allowed"`
	Denied  uint64 `json:"denied"`
	Logged  uint64 `json:"logged"`
	Delayed uint64 `json:"delayed"`
}

// Connections counts connections by what a layer4 matcher did with them.
type Connections struct {
	Allowed uint64 `json:"allowed"`
	Denied  uint64 `json:"denied"`
	Logged  uint64 `json:"logged"`
}

// MemoryInfo is what a zone holds: Bytes in all, by part in Parts
// (memory.go names them; docs/sizing.md gives their formulas); Lines and K
// describe its table.
type MemoryInfo struct {
	Bytes int            `json:"bytes"`
	Parts map[string]int `json:"parts"`
	Lines int            `json:"lines"`
	K     int            `json:"k"`
}

func (z *zone) info(now time.Time) ZoneInfo {
	c := z.counts
	s := c.tableStats(z.buckets, now)
	zi := ZoneInfo{
		Name:       z.name,
		Key:        append([]string{}, z.keyNames...),
		IPv4Prefix: z.v4,
		IPv6Prefix: z.v6,
		Policies:   z.policiesInfo(),
		Held:       c.held.Load(),
		Memory:     MemoryInfo{Parts: z.memory(), Lines: s.Lines, K: s.K},
		Occupancy:  s.Busy,
		FalseDeny:  s.FalseDeny,
	}
	zi.Memory.Bytes = memoryTotal(zi.Memory.Parts)
	outcomes := func(v func(outcome) uint64) Outcomes {
		return Outcomes{Allowed: v(outcomeAllowed), Denied: v(outcomeDenied), Logged: v(outcomeLogged), Delayed: v(outcomeDelayed)}
	}
	zi.Requests = outcomes(func(o outcome) uint64 { return c.requests[o].Load() })
	zi.Weight = outcomes(c.weight)
	if c.layer4.Load() {
		zi.Connections = &Connections{Allowed: c.connections[outcomeAllowed].Load(), Denied: c.connections[outcomeDenied].Load(),
			Logged: c.connections[outcomeLogged].Load()}
	}
	zi.XDP = z.table.xdp.info()
	if z.conc != nil {
		zi.Concurrent = &ConcurrentInfo{MaxConcurrent: z.conc.Max(), InFlight: z.conc.InUse(), Denied: c.concDenied.Load(), Waiting: z.queue.len(),
			Memory: MemoryInfo{Bytes: z.conc.Bytes(), Lines: z.conc.Lines(), K: z.conc.K()}}
	}
	if z.dist != nil {
		zi.Cluster = z.dist.info()
	}
	return zi
}

// policiesInfo describes the zone's rate, then each of its quotas.
func (z *zone) policiesInfo() []PolicyInfo {
	var out []PolicyInfo
	if _, none := z.buckets.(noRate); !none {
		out = append(out, z.policyInfo())
	}
	for i, q := range z.quotas {
		out = append(out, PolicyInfo{Kind: "quota", Events: q.Quota(), Window: time.Duration(z.conf.Quotas[i].Window).String()})
	}
	return out
}

// policyInfo describes the zone's rate.
func (z *zone) policyInfo() PolicyInfo {
	if z.tkey.window {
		return PolicyInfo{Kind: "window", Events: z.limit.Events, Window: z.limit.Window.String()}
	}
	return PolicyInfo{Kind: "bucket", Events: z.limit.Events, Window: z.limit.Window.String(), Burst: z.limit.Burst}
}

// KeyInfo is what a key would get from a zone now.
type KeyInfo struct {
	Zone string `json:"zone"`
	// Source is what the key is charged under: its network for an IP
	// address, else the key's short hash (as /top shows it without
	// log_key).
	Source string `json:"source"`
	// Allowed reports whether a request with the key would pass now.
	Allowed  bool        `json:"allowed"`
	Policies []KeyPolicy `json:"policies"`
	// ClusterReset is set in the answer to a DELETE of a distributed
	// zone's key: when the other instances let the key through.
	ClusterReset string `json:"cluster_reset,omitempty"`
}

// KeyPolicy is a key's state in one of a zone's limits, as the RateLimit
// header would give it; times are whole seconds, rounded up. Policy is
// "bucket" (this instance's token bucket), "window" (its window, in a zone
// without burst), "cluster" (a distributed zone's estimate across
// instances) or "quota" (one of the zone's rolling quotas).
type KeyPolicy struct {
	Policy     string `json:"policy"`
	Limit      int64  `json:"limit"`
	Remaining  int64  `json:"remaining"`
	RetryAfter int64  `json:"retry_after"`
	Reset      int64  `json:"reset"`
	// Window is a quota's rolling window.
	Window string `json:"window,omitempty"`
	// Cluster is the key's standing in the cluster, for the cluster
	// policy and each quota of a distributed zone.
	Cluster *KeyCluster `json:"cluster,omitempty"`
	// InFlight is the key's requests in flight, for the policy
	// "concurrent" (max_concurrent; Limit is its n): what the table
	// counts, which collisions can only make more.
	InFlight *int64 `json:"in_flight,omitempty"`
}

// TopInfo is a zone's most denied sources.
type TopInfo struct {
	Zone string `json:"zone"`
	// Since is the start of the period the counts cover: the last one
	// to two minutes.
	Since   time.Time   `json:"since"`
	Sources []TopSource `json:"sources"`
}

// TopSource is one source and how many of its requests the zone denied:
// between Denied-Error and Denied.
type TopSource struct {
	Source string `json:"source"`
	Denied uint64 `json:"denied"`
	Error  uint64 `json:"error"`
}

func handleZones(w http.ResponseWriter, r *http.Request) error {
	if err := onlyMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	now := time.Now()
	out := []ZoneInfo{}
	for _, z := range liveZones() {
		out = append(out, z.info(now))
	}
	return writeJSON(w, out)
}

func handleZone(w http.ResponseWriter, r *http.Request) error {
	if err := onlyMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	z, err := liveZone(r)
	if err != nil {
		return err
	}
	return writeJSON(w, z.info(time.Now()))
}

// defaultTop and the sketch's capacity bound how many sources /top lists.
const defaultTop = 10

func handleTop(w http.ResponseWriter, r *http.Request) error {
	if err := onlyMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	z, err := liveZone(r)
	if err != nil {
		return err
	}
	n := defaultTop
	if q := r.URL.Query().Get("n"); q != "" {
		n, err = strconv.Atoi(q)
		if err != nil || n < 1 || n > topCapacity {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("n %q: must be a whole number from 1 to %d", q, topCapacity)}
		}
	}
	entries, since := z.counts.top.Top(time.Now(), n)
	out := TopInfo{Zone: z.name, Since: since, Sources: []TopSource{}}
	for _, e := range entries {
		out.Sources = append(out.Sources, TopSource{Source: z.show(&e.Label), Denied: e.Count, Error: e.Err})
	}
	return writeJSON(w, out)
}

// handleKey answers GET (what the key would get now, charging nothing) and
// DELETE (make the key's buckets full again and, in a distributed zone,
// reset it across the cluster; then answer as GET) for
// /rate_limit/zones/{zone}/keys/{key}. The key is a source as /top names it,
// or a key masked and hashed as a request's would be (sourceCharge); one
// that names no source of the zone is a 400.
func handleKey(w http.ResponseWriter, r *http.Request) error {
	if err := onlyMethods(w, r, http.MethodGet, http.MethodDelete); err != nil {
		return err
	}
	z, err := liveZone(r)
	if err != nil {
		return err
	}
	c, err := z.sourceCharge(r.PathValue("key"))
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	now := time.Now()
	var clusterReset string
	if r.Method == http.MethodDelete {
		z.buckets.Fill(c.hash)
		for _, q := range z.quotas {
			q.Reset(c.hash, now)
		}
		if d := z.dist; d != nil {
			// This instance passes the key at once; the others once they
			// have read the reset (storage.Cluster.Reset).
			d.cluster.Reset(c.hash, now)
			clusterReset = d.clusterResetText(now)
		}
	}
	d := z.buckets.PeekHash(c.hash, 1, now)
	d.RetryAfter, d.Reset = z.told(d.RetryAfter), z.told(d.Reset)
	var policies []KeyPolicy
	if _, none := z.buckets.(noRate); !none {
		policies = append(policies, keyPolicy(z.policyInfo().Kind, d))
	}
	// Each policy's waits as the headers tell them (zone.told, quotaTold).
	if z.dist != nil {
		d := z.dist.cluster.PeekHash(c.hash, 1, now)
		d.RetryAfter, d.Reset = z.told(d.RetryAfter), z.told(d.Reset)
		p := keyPolicy("cluster", d)
		p.Cluster = keyCluster(z.dist.cluster, c.hash, now)
		policies = append(policies, p)
	}
	for i, q := range z.quotas {
		d := q.PeekHash(c.hash, 1, now)
		d.RetryAfter, d.Reset = z.quotaTold(i, d.RetryAfter), z.quotaTold(i, d.Reset)
		p := keyPolicy("quota", d)
		p.Window = time.Duration(z.conf.Quotas[i].Window).String()
		if cl, ok := q.(*storage.Cluster); ok {
			p.Cluster = keyCluster(cl, c.hash, now)
		}
		policies = append(policies, p)
	}
	if z.conc != nil {
		p := keyPolicy("concurrent", z.peekConc(c.hash))
		inFlight := z.conc.InFlight(c.hash)
		p.InFlight = &inFlight
		policies = append(policies, p)
	}
	allowed := true
	for _, p := range policies {
		allowed = allowed && p.RetryAfter == 0
	}
	return writeJSON(w, KeyInfo{Zone: z.name, Source: z.source(c), Allowed: allowed, Policies: policies, ClusterReset: clusterReset})
}

func keyPolicy(name string, d limiter.Decision) KeyPolicy {
	return KeyPolicy{
		Policy:     name,
		Limit:      d.Limit,
		Remaining:  max(d.Remaining, 0),
		RetryAfter: ceilSeconds(d.RetryAfter),
		Reset:      ceilSeconds(d.Reset),
	}
}

// liveZone returns the running zone named in r's path, or a 404.
func liveZone(r *http.Request) (*zone, error) {
	name := r.PathValue("zone")
	for _, z := range liveZones() {
		if z.name == name {
			return z, nil
		}
	}
	return nil, caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("unknown zone %q", name)}
}

// onlyMethods answers 405 to a request whose method is not one of methods.
func onlyMethods(w http.ResponseWriter, r *http.Request, methods ...string) error {
	if slices.Contains(methods, r.Method) {
		return nil
	}
	allow := methods[0]
	for _, m := range methods[1:] {
		allow += ", " + m
	}
	w.Header().Set("Allow", allow)
	return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed; use %s", r.Method, allow)}
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// Interface guards
var _ caddy.AdminRouter = (*adminAPI)(nil)
