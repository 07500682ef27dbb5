package floodgate

import (
	"fmt"
	"math"
	"math/big"
	"math/bits"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// Zone is a named rate limit: which requests it applies to, what identifies a
// client, how many requests a client may make, and how much memory its state
// may use.
//
// Without `burst`, a zone means what it means in caddy-ratelimit: at most
// `max_events` in any span of `window`, and Retry-After until a request would
// pass (limiter.Windows). With `burst`, it is a token bucket per key:
// `max_events` per `window` sustained, and up to `burst` at once, a key
// starting with a full bucket (limiter.Buckets; the meaning of nginx and
// Envoy). Requests that match no key (every key placeholder empty) share the
// state of the empty key.
type Zone struct {
	// Matchers that select the requests this zone applies to. Each set is
	// ANDed inside, the sets are ORed. Default: every request.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`

	// Key identifies a client, usually with placeholders, e.g.
	// `{http.vars.client_ip}` (the client IP honouring `trusted_proxies`) or
	// `{http.request.header.X-API-Key}`. A key that expands to an IP address
	// is grouped by network with ipv4_prefix and ipv6_prefix; any other
	// value is hashed and never stored. A key longer than 8 KiB is
	// identified by its first 8 KiB. The Caddyfile's shorthands
	// ({client_ip}, {header.X}, …) work here too. Default: empty, which
	// makes the zone one bucket shared by all requests; in a zone that a
	// layer4 matcher also uses, the client IP.
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
	// weight, else 1. See weight.Rule.
	Weights []*weight.Rule `json:"weights,omitempty"`

	// WeightResponseHeader names a response header whose value (a whole
	// number) the request costs, charged when the response is written on
	// top of what was charged at arrival. See "Costs reported by the
	// response" in docs/keys-weights-quotas-actions.md.
	WeightResponseHeader string `json:"weight_response_header,omitempty"`

	// WeightResponseBytes charges the size of the response body, each
	// write's bytes before they are sent; the zone's unit is then the
	// byte (RateLimit-Policy says qu="content-bytes").
	WeightResponseBytes bool `json:"weight_response_bytes,omitempty"`

	// WeightResponseStatus charges the request's weight (1, or what the
	// weight rules or the handler's weight say) only when its final
	// status is one of these codes ("401") or classes ("4xx"): a handler's
	// written status, or the status of the error it returned (basic_auth's
	// 401, reverse_proxy's 502). A request is admitted only if its key
	// has room for its weight, charging nothing until the status is known.
	WeightResponseStatus []string `json:"weight_response_status,omitempty"`

	// WeightResponseTime charges the time from the request passing the
	// zone until its response is complete, in milliseconds, as that time
	// passes; the zone's unit is then the millisecond (RateLimit-Policy
	// says qu="ms"). A request is admitted if its key has 1 ms left.
	WeightResponseTime bool `json:"weight_response_time,omitempty"`

	// Quotas are rolling limits beside the rate: at most max_events in
	// any window of that length. A request is charged to the rate and
	// every quota only if all of them allow it. At most 2 per zone.
	Quotas []Quota `json:"quotas,omitempty"`

	// Action is what happens to a request this zone would deny: "deny"
	// (default, a 429), "log" (a dry run: it passes, charging nothing, but
	// is logged, counted and given the placeholders of a denial; it adds
	// no header, so clients see what they would without the zone) or
	// "delay" (held until its tokens return, up to max_delay).
	// For the connections of a layer4 matcher, "log" is a dry run too (the
	// connection is not closed); a delay zone cannot serve a layer4
	// matcher and fails the config.
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
func (zc *Zone) Validate(name string) error {
	if err := validZoneName(name); err != nil {
		return err
	}
	where := fmt.Sprintf("zone %q: ", name)
	if err := zc.Limit.Validate(where); err != nil {
		return err
	}
	if err := zc.validateQuotas(where); err != nil {
		return err
	}
	if err := zc.validateWeights(where); err != nil {
		return err
	}
	if zc.XDP != nil && (len(zc.WeightResponseStatus) > 0 || zc.WeightResponseTime) {
		// As a layer4 matcher (Layer4Zone), the program charges each SYN
		// a token: a unit a zone counting failed responses or milliseconds
		// does not count in, and successful logins would spend its budget.
		return fmt.Errorf("%sxdp charges each connection, but the zone charges only what an HTTP response says it cost (weight response_status or response_time): give xdp a zone of its own", where)
	}
	return zc.validateAction(where)
}

// grantable is the largest weight the zone can ever grant: its effective
// burst, or a smaller quota.
func (zc *Zone) grantable() int64 {
	g := zc.Rate().EffectiveBurst()
	if !zc.HasRate() {
		g = limiter.MaxBurst // weights only count in its quotas
	}
	for _, q := range zc.Quotas {
		g = min(g, q.MaxEvents)
	}
	return g
}

// validZoneName accepts names that can be written in a header's quoted
// string without escaping: printable ASCII other than quotes and `\`. Single
// quotes and backquotes are refused too: the Caddyfile does not take `'` as
// quotes, so `zone 'api'` would otherwise name the zone 'api', quotes
// included, and `rate_limit api` would not find it.
func validZoneName(name string) error {
	if name == "" {
		return fmt.Errorf("zone name must not be empty")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < 0x21 || c > 0x7e || c == '"' || c == '\\' || c == '\'' || c == '`' {
			return fmt.Errorf("zone name %q: only printable ASCII without spaces, quotes or backslashes is allowed (a name needs no quotes)", name)
		}
	}
	return nil
}

// zone is a Zone provisioned for one config: its matchers, its parsed keys and
// the table it shares with every other config that holds the same zone. Its
// fields are grouped by the file that owns them: that file's code sets them
// (at provisioning) and reads them on the request path.
type zone struct {
	// The zone itself (this file): its name, its rate and the errors and
	// values a request it answers gets.

	name string
	// nameValue is name as an interface value, boxed once rather than on
	// every request that sets the zone placeholder.
	nameValue any
	// burstValue is the burst in force, boxed once likewise.
	burstValue any
	limit      limiter.Limit
	// window is the window of a window zone (0 for a token bucket); rateW
	// the longest wait of its rate it tells a client (see told).
	window   time.Duration
	rateW    time.Duration
	matchers caddyhttp.MatcherSets
	// policy is the zone's RateLimit-Policy items (see policyItem): its
	// rate's, then one for each quota.
	policy string
	// exceeded is the error of every request the zone denies: a
	// caddyhttp.HandlerError made once, because Caddy only reads it (see
	// denialError).
	exceeded error
	// conf is the zone's configuration, as the admin API shows it.
	conf *Zone

	// Its table (tables.go): shared by every config that holds a zone of
	// this name and shape, found by tkey.

	tkey    tableKey
	table   *table
	buckets limiter.Table // table.buckets: token buckets, or windows without burst
	// counts are what the zone has done, shared by every config that has
	// a zone of this name (metrics.go: zoneCounts).
	counts *zoneCounts

	// Its keys (key.go): what identifies a client.

	keys []keySpec
	// secret is what the keys' values are hashed under (seal, salted).
	secret atomic.Uint64
	v4, v6 int
	// keyNames are the zone's keys as configured, for the key_name
	// placeholder and the log; keyNameValues the same, boxed once.
	keyNames      []string
	keyNameValues []any

	// Its denial logs (denylog.go).

	// denials decides which denials are logged at INFO; made at the
	// zone's first denial.
	denials atomic.Pointer[denialLog]
	// refusals decides likewise which requests refused for their weight
	// are logged at INFO (Handler.logRefusedWeight).
	refusals atomic.Pointer[denialLog]

	// Its weights (weights.go).

	// weights are the zone's weight rules; grantable is the largest
	// weight the zone can ever grant.
	weights   weight.Rules
	grantable int64
	// afterHeader, afterBytes, afterStatus (nil if none) or afterTime:
	// the weight reported by the response.
	afterHeader string
	afterBytes  bool
	afterStatus *weight.Statuses
	afterTime   bool
	// unit is the RateLimit-Policy parameter naming the zone's unit, if
	// not requests.
	unit string

	// Its quotas (quota.go).

	// quotas are the zone's rolling quotas (their RateLimit-Policy items
	// follow the rate's in policy), skeys their pool keys and quotaNames
	// their names in the RateLimit headers.
	quotas     []quotaPolicy
	skeys      []sketchKey
	quotaNames []string
	// quotaW are the quotas' windows, the longest waits they tell a
	// client (quotaTold).
	quotaW []time.Duration

	// Its action (action.go).

	action   action
	maxDelay time.Duration

	// Its places in flight (concurrency.go, concqueue.go).

	// conc is the zone's table of places in flight (max_concurrent), nil
	// without one; ckey its pool key, maxConcurrent the limit this config
	// puts in force (App.Start) and concPolicy its RateLimit-Policy item.
	conc          *limiter.Concurrency
	ckey          concKey
	maxConcurrent int64
	concPolicy    string
	concSecret    uint64
	// queue holds the requests waiting for a place, with action delay.
	queue *concQueue

	// Its cluster (cluster.go).

	// dist is set when the zone is distributed.
	dist *distributedZone
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
		conf:      zc,
	}
	z.v4, z.v6 = zc.Prefixes(defaultIPv4Prefix, defaultIPv6Prefix)
	for _, k := range append([]string{zc.Key}, zc.FallbackKeys...) {
		if k != "" {
			z.keys = append(z.keys, parseKeySpec(expandShorthands(k)))
			z.keyNames = append(z.keyNames, k)
			z.keyNameValues = append(z.keyNameValues, k)
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
	if err := z.provisionWeights(ctx, zc); err != nil {
		return nil, err
	}
	switch {
	case z.afterBytes:
		z.unit = `;qu="content-bytes"`
	case z.afterTime:
		z.unit = `;qu="ms"`
	}
	z.action, z.maxDelay = parseAction(zc.Action), time.Duration(zc.MaxDelay)
	if z.action.holds() && !zc.Windowed() {
		z.limit.Debt = delayDebt(z.limit, z.maxDelay)
	}
	z.burstValue = z.limit.EffectiveBurst()
	if zc.Windowed() && zc.HasRate() {
		z.window = z.limit.Window
	}
	z.rateW = itemW(z.limit, zc.Windowed())
	if zc.HasRate() {
		z.policy = policyItem(name, z.limit) + z.unit
	}
	z.exceeded = denialError(name)
	if err := z.provisionQuotas(zc); err != nil {
		z.releaseQuotas()
		return nil, err
	}
	if err := z.provisionConcurrency(zc); err != nil {
		z.releaseQuotas()
		return nil, err
	}
	if z.conc != nil {
		z.policy = strings.TrimPrefix(z.policy+", "+z.concPolicy, ", ")
	}
	if !zc.HasRate() {
		// max_concurrent alone: no rate table, a rate that grants
		// everything in its place.
		z.burstValue = zc.MaxConcurrent
		z.table, z.buckets = &table{buckets: noRate{}}, noRate{}
		z.seal(z.concSecret)
		z.counts = acquireCounts(name)
		return z, nil
	}
	x := z.xdpSpec(zc)
	z.tkey = tableKey{zone: name, lines: zc.Lines(), k: limiter.DefaultK, window: zc.Windowed(), xdp: x.key()}
	// A new table is made at the zone's limit, Debt included, so that
	// Start finds it in force and converts nothing.
	cfg := zc.Buckets()
	cfg.Limit = z.limit
	t, err := acquireTable(z.tkey, func() (limiter.Table, *xdpTable, error) {
		if x != nil {
			return newXDPBuckets(name, cfg, x.XDP, x.v4, x.v6)
		}
		if zc.Windowed() {
			tb, err := limiter.NewWindows(cfg)
			return tb, nil, err
		}
		tb, err := limiter.NewBuckets(cfg)
		return tb, nil, err
	})
	if err != nil {
		z.releaseQuotas()
		z.releaseConcurrency()
		return nil, fmt.Errorf("zone %q: %v", name, err)
	}
	z.table, z.buckets = t, t.buckets
	z.seal(t.secret) // distribute seals a zone that becomes distributed with the cluster's
	z.counts = acquireCounts(name)
	return z, nil
}

// release gives back the zone's references to its table, sketches, counts
// and cluster state.
func (z *zone) release() {
	if z.tkey.zone != "" {
		releaseTable(z.tkey)
	}
	z.releaseConcurrency()
	z.releaseQuotas()
	releaseCounts(z.name)
	if z.dist != nil {
		z.dist.release()
	}
}

// policyItem formats a zone's RateLimit-Policy list item
// (draft-ietf-httpapi-ratelimit-headers-10): `"name";q=<quota>;w=<seconds>`.
//
// The draft's policy is a quota per time window. A zone without burst is one:
// q is max_events and w the window's seconds, rounded up (a window under a
// second says w=1 and q its events per second), and RateLimit's t counts down
// until the key's grants no longer count, at most w (see told). A token
// bucket has no fixed window, so q and w say what a client can rely on: q is
// the burst (what a full bucket allows at once, and the most r can say) and w
// the seconds an emptied bucket takes to be full again, burst × window /
// events, rounded up. q/w is then the sustained rate or just under it,
// whatever the burst. A bucket that refills in under a second says w=1 and q
// the events of one second, rounded down: the rate, since no whole second
// describes the burst.
func policyItem(name string, l limiter.Limit) string {
	q, w := policyQuota(l)
	return `"` + name + `";q=` + strconv.FormatInt(q, 10) + ";w=" + strconv.FormatInt(w, 10)
}

// policyQuota returns the q and w of policyItem for l, in exact integer
// arithmetic: a year's window times a large burst overflows 64 bits.
func policyQuota(l limiter.Limit) (q, w int64) {
	burst := l.EffectiveBurst()
	// w = ⌈window × burst / (events × 1 s)⌉
	num := new(big.Int).Mul(big.NewInt(int64(l.Window)), big.NewInt(burst))
	den := new(big.Int).Mul(big.NewInt(l.Events), big.NewInt(int64(time.Second)))
	secs, rem := new(big.Int).QuoRem(num, den, new(big.Int))
	if rem.Sign() > 0 {
		secs.Add(secs, big.NewInt(1))
	}
	if secs.Cmp(big.NewInt(1)) > 0 || rem.Sign() == 0 {
		return burst, secs.Int64()
	}
	// The bucket refills in under a second: q = ⌊events × 1 s / window⌋,
	// at most 10^6 by validation.
	perSecond := new(big.Int).Quo(den, big.NewInt(int64(l.Window)))
	return perSecond.Int64(), 1
}

// delayDebt is the debt a bucket zone that holds requests up to maxDelay
// needs (limiter.Limit.Debt): the tokens that return within maxDelay, so that
// every request whose tokens are free by then can reserve them, however many
// arrive at once; at least the default (a burst), at most limiter.MaxBurst. A
// key that could owe only a burst would refuse, with burst 1, a second
// request arriving at once although a token is free long before max_delay
// (docs/design.md, "The root package").
func delayDebt(l limiter.Limit, maxDelay time.Duration) int64 {
	// ⌈maxDelay × events / window⌉, in 128 bits: an hour's delay times a
	// million events overflows 64.
	hi, lo := bits.Mul64(uint64(maxDelay), uint64(l.Events))
	if hi >= uint64(l.Window) {
		return limiter.MaxBurst
	}
	q, r := bits.Div64(hi, lo, uint64(l.Window))
	if r != 0 {
		q++
	}
	return max(l.EffectiveBurst(), int64(min(q, limiter.MaxBurst)))
}

// reset is the wait RateLimit's t says for the zone's decision d: when the
// key is whole again (d.Reset), but for a request a window zone denies,
// when a request of its weight would pass (d.RetryAfter): a window has no
// refill to count down to, only grants that stop counting one by one.
func (z *zone) reset(d limiter.Decision) time.Duration {
	if z.window > 0 && !d.Allowed && d.RetryAfter != limiter.Never {
		return d.RetryAfter
	}
	return d.Reset
}

// takeAll asks every policy of z (its rate, then its quotas) for v's weight
// in txn, and sets v's decisions. A zone that charges once the response is
// known (zone.deferred) only checks that every policy has room for the
// weight.
func (z *zone) takeAll(txn *limiter.Txn, v *verdict, now time.Time) {
	v.rate = z.take(txn, v.c.hash, v.weight, now)
	for i, s := range z.quotas {
		v.q[i] = z.ask(txn, s, v.c.hash, v.weight, now)
	}
	v.combine()
}

// peekAll replaces v's decisions by what z's policies hold now, charging
// nothing: all of them, or only those that granted (and were refunded
// since, because another policy denied the request).
func (z *zone) peekAll(v *verdict, all bool, now time.Time) {
	if z.conc != nil && (all || v.conc.Allowed) {
		v.conc = z.peekConc(v.c.hash)
	}
	if all || v.rate.Allowed {
		v.rate = z.peek(v.c.hash, v.weight, now)
	}
	for i, s := range z.quotas {
		if all || v.q[i].Allowed {
			v.q[i] = s.PeekHash(v.c.hash, v.weight, now)
		}
	}
	v.combine()
}

// take charges the key with hash h in the zone's token bucket and, if the
// zone is distributed, in its cluster estimate, as part of txn: the request
// passes when both allow it. The decision is the bucket's, with the
// cluster's denial, wait and remaining count where they are stricter. A
// zone that charges once the response is known (zone.deferred) charges
// nothing here: it checks the key has room for the weight.
func (z *zone) take(txn *limiter.Txn, h uint64, weight int64, now time.Time) limiter.Decision {
	d := z.ask(txn, z.buckets, h, weight, now)
	if z.dist == nil {
		return d
	}
	return stricter(d, z.ask(txn, z.dist.cluster, h, weight, now))
}

// ask takes weight from p in txn, or, in a zone that charges once the
// response is known, checks p has room for it (limiter.Txn.Check).
func (z *zone) ask(txn *limiter.Txn, p limiter.Policy, h uint64, weight int64, now time.Time) limiter.Decision {
	if z.deferred() {
		return txn.Check(p, h, weight, now)
	}
	return txn.Take(p, h, weight, now)
}

// peek answers what take would, charging nothing.
func (z *zone) peek(h uint64, weight int64, now time.Time) limiter.Decision {
	d := z.buckets.PeekHash(h, weight, now)
	if z.dist == nil {
		return d
	}
	return stricter(d, z.dist.cluster.PeekHash(h, weight, now))
}

// stricter combines the bucket's decision d with the cluster's c. The limit
// stays the bucket's (the burst the headers advertise).
func stricter(d, c limiter.Decision) limiter.Decision {
	d.Allowed = d.Allowed && c.Allowed
	d.Remaining = min(d.Remaining, c.Remaining)
	d.RetryAfter = max(d.RetryAfter, c.RetryAfter)
	d.Reset = max(d.Reset, c.Reset)
	return d
}

// quotas are the decisions of the quotas of v's zone.
func (v *verdict) quotas() []limiter.Decision { return v.q[:len(v.z.quotas)] }

// combine sets v.d, the zone's answer, from its policies' (the rate's, the
// quotas', max_concurrent's): allowed if all allow, the fewest left, the
// longest wait of those that deny, the latest reset.
func (v *verdict) combine() {
	v.d = v.rate
	for _, q := range v.quotas() {
		combineInto(&v.d, q)
	}
	if v.z.conc != nil {
		combineInto(&v.d, v.conc) // a place has no reset
	}
}

// combineInto combines another policy's decision p into d, as combine
// does.
func combineInto(d *limiter.Decision, p limiter.Decision) {
	if !p.Allowed {
		if d.Allowed {
			d.Allowed, d.RetryAfter = false, p.RetryAfter
		} else {
			d.RetryAfter = max(d.RetryAfter, p.RetryAfter)
		}
	}
	if p.Remaining < d.Remaining {
		d.Remaining, d.Limit = p.Remaining, p.Limit
	}
	d.Reset = max(d.Reset, p.Reset)
}

// reserve charges a held request's cost ahead of time and says how long
// the request must wait: a token bucket charges it as a debt that the wait
// repays. A window zone charges it now, as a place in the window that
// every later request counts (so none takes the room the held request
// waits for), and hold gives the place back when the request goes, for
// the take that counts it from then: a window counts when requests went.
// A window's counters hold at most 2·events, and a place is reserved only
// within that (limiter.Windows.Reserve): beyond it the request is denied,
// not held, since a reservation that dropped the window's oldest grants
// would, once given back (its client gone), have let the key past its
// limit.
func (z *zone) reserve(h uint64, weight int64, now time.Time) (limiter.Decision, limiter.Reservation) {
	if w, ok := z.buckets.(*limiter.Windows); ok {
		d := w.PeekHash(h, weight, now)
		if d.Allowed = d.RetryAfter != limiter.Never; !d.Allowed {
			return d, limiter.Reservation{}
		}
		reserved, res := w.Reserve(h, weight, now)
		d.Allowed = reserved.Allowed
		return d, res
	}
	return z.buckets.Charge(h, weight, now)
}

// windowTable is the zone's table if it is a window zone's, else nil.
func (z *zone) windowTable() limiter.Policy {
	if z.window > 0 {
		return z.buckets
	}
	return nil
}

// told is the wait of d as the zone tells it to a client of its rate
// (Retry-After, RateLimit's t, the admin API's key view): d, but at most
// rateW, the rate's RateLimit item's w. The draft's t is the item's
// effective window, and a client told a longer wait than the window would
// wait longer than it must; d is longer than w only where the limiter
// knows a time more finely than w or counts a debt: a window zone knows a
// grant's time to a tick (Window/2²⁰ or finer, see limiter.Windows), so
// the exact wait of a request in the same tick as the grant that filled
// its window is the window and part of a tick; a cluster's sliding
// estimate (stricter) can wait up to two windows; a reported cost leaves a
// debt. Told w, such a client is early, and is told again.
func (z *zone) told(d time.Duration) time.Duration { return min(d, z.rateW) }

// quotaTold is told for the zone's quota j: at most the quota's window.
func (z *zone) quotaTold(j int, d time.Duration) time.Duration { return min(d, z.quotaW[j]) }

// itemW is the w of policyItem for l, as a duration: a window zone's
// window, a bucket's refill time rounded up to the second.
func itemW(l limiter.Limit, windowed bool) time.Duration {
	if windowed {
		return l.Window
	}
	_, w := policyQuota(l)
	if w > int64(limiter.Never/time.Second) {
		return limiter.Never
	}
	return time.Duration(w) * time.Second
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

// keyName is the key of z that gave charge c, as configured, or "" if every
// key was empty.
func (z *zone) keyName(c charge) string {
	if c.key < 0 || c.key >= len(z.keyNames) {
		return ""
	}
	return z.keyNames[c.key]
}

// keyNameValue is keyName as a placeholder value, without boxing it again.
func (z *zone) keyNameValue(c charge) any {
	if c.key < 0 || c.key >= len(z.keyNameValues) {
		return ""
	}
	return z.keyNameValues[c.key]
}

// definition is zc as JSON, to tell whether two definitions of a zone name
// are the same zone. It must be taken before provisioning, which clears the
// raw matchers.
func (zc *Zone) definition() string {
	return string(caddyconfig.JSON(zc, nil))
}
