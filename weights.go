// Weights in a zone's terms. What a weight is, the rules that price a
// request by its matchers, and the writer that reports what a response
// declares are package weight; this file holds what needs the zone: the
// checks against the most it can grant, its Caddyfile forms (beside the
// zone's other settings, as caddyfile.go's parsers are), and the settling
// of a response's weight into the zone's tables (afterCharge, weightWriter).

package floodgate

import (
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// validateWeights checks the weight settings; the limits must be valid.
func (zc *Zone) validateWeights(where string) error {
	if err := weight.Validate(zc.Weights, zc.grantable()); err != nil {
		return fmt.Errorf("%s%v", where, err)
	}
	if zc.WeightResponseHeader != "" && zc.WeightResponseBytes {
		return fmt.Errorf("%sweight response_header %q: a zone charges either a response header or the response bytes, not both", where, zc.WeightResponseHeader)
	}
	return nil
}

// provisionWeights loads the zone's weight rules into z.
func (z *zone) provisionWeights(ctx caddy.Context, zc *Zone) error {
	z.grantable = zc.grantable()
	z.afterHeader = zc.WeightResponseHeader
	z.afterBytes = zc.WeightResponseBytes
	rules, err := weight.Provision(ctx, zc.Weights, fmt.Sprintf("zone %q", z.name))
	if err != nil {
		return err
	}
	z.weights = rules
	return nil
}

// checkHandlerWeight reports an error if w, the weight of a handler that
// charges z, is a number z could never grant. A zone with a rule for every
// request never uses the handler's weight.
func (z *zone) checkHandlerWeight(w weight.Value) error {
	return z.weights.CheckHandler(w, z.grantable)
}

// weightOf is what r costs in z: see weight.Rules.Of.
func (z *zone) weightOf(r *http.Request, repl *caddy.Replacer, hw weight.Value) (int64, error) {
	return z.weights.Of(r, repl, hw, z.grantable)
}

// parseWeightValue reads the weight argument the dispenser is on: a whole
// number, or a placeholder, whose shorthands ({header.X-Cost}) are expanded
// as Caddy does in site blocks (it does not in global options).
func parseWeightValue(d *caddyfile.Dispenser, where string) (weight.Value, error) {
	seg := caddyfile.Segment{d.Token()}
	httpcaddyfile.NewShorthandReplacer().ApplyToSegment(&seg)
	v, err := weight.Parse(seg[0].Text)
	if err != nil {
		return weight.Value{}, d.Errf("%s%v", where, err)
	}
	return v, nil
}

// unmarshalWeight reads a zone's weight subdirective:
//
//	weight <n|placeholder> [{ <matchers> }]
//	weight response_header <field>
//	weight response_bytes
//
// seen holds the zone's settings so far: response_header and response_bytes
// may be written once, and a rule after one without matchers (which prices
// every request) would never apply.
func (zc *Zone) unmarshalWeight(d *caddyfile.Dispenser, where string, seen zoneconf.Fields) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	switch d.Val() {
	case "response_header", "response_bytes":
		if err := seen.OnceAs(d, where, "weight "+d.Val()); err != nil {
			return err
		}
	default:
		if first, ok := seen[everyRequest]; ok {
			return d.Errf("%sweight %s never applies: the weight rule at %s has no matcher block, so it prices every request (rules are tried in order; give that one a block or keep one)", where, d.Val(), first)
		}
	}
	switch d.Val() {
	case "response_header":
		field, err := zoneconf.OneArg(d)
		if err != nil {
			return err
		}
		zc.WeightResponseHeader = field
		return nil
	case "response_bytes":
		if d.NextArg() {
			return d.ArgErr()
		}
		zc.WeightResponseBytes = true
		return nil
	}
	v, err := parseWeightValue(d, where)
	if err != nil {
		return err
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	rule := &weight.Rule{Weight: v}
	ms, err := caddyhttp.ParseCaddyfileNestedMatcherSet(d)
	if err != nil {
		return d.Errf("%sweight %s: %v", where, v, err)
	}
	if len(ms) > 0 {
		rule.MatcherSetsRaw = caddyhttp.RawMatcherSets{ms}
	} else {
		seen[everyRequest] = place(d)
	}
	zc.Weights = append(zc.Weights, rule)
	return nil
}

// everyRequest is where, in a zone's zoneconf.Fields, the zone's weight rule
// without matchers is recorded.
const everyRequest = "weight <n> without a matcher block"

// unmarshalWeight reads the handler's `weight <n|placeholder>`.
func (rl *Handler) unmarshalWeight(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	v, err := parseWeightValue(d, "")
	if err != nil {
		return err
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	rl.Weight = v
	return nil
}

// afterCharge is a charge a response still owes a zone: the request paid its
// request-time weight at arrival; the response may report more.
type afterCharge struct {
	z    *zone
	hash uint64
	paid int64
}

// settle charges the zone for a response whose reported weight has grown from
// `from` to `to`, at now, the time it grew: whatever of that growth is
// beyond what the request paid. Not at the request's arrival: a response
// may take longer than the key takes to refill, and a charge dated then
// would be refilled away before it was made (or, on a counter that has moved
// past that time, read as a debt that far ahead), and a quota would count it
// in a window that may already weigh nothing. The key may go into debt: at
// most one burst below empty in the rate (see limiter.Buckets.Charge), and
// one quota in each quota however many times a response is settled, so a
// wild report cannot lock a key out for longer than a full refill. In a
// distributed zone the cost is counted in the cluster too, in the rate's
// estimate (at most its events, as a quota) and in the quotas, which are
// the cluster's there: the other instances deny the key as they would had
// it been granted that much.
func (c afterCharge) settle(from, to int64, now time.Time) {
	before, after := max(from-c.paid, 0), max(to-c.paid, 0)
	if after <= before {
		return
	}
	c.z.buckets.Charge(c.hash, after-before, now)
	if d := c.z.dist; d != nil {
		addCapped(d.cluster, c.hash, before, after, now)
	}
	for _, s := range c.z.quotas {
		addCapped(s, c.hash, before, after, now)
	}
}

// addCapped adds to s what a reported cost growing from before to after
// adds of it up to s's quota: a key owes at most one quota, however many
// times a response is settled.
func addCapped(s quotaPolicy, h uint64, before, after int64, now time.Time) {
	q := s.Quota()
	s.Add(h, min(after, q)-min(before, q), now)
}

// weightWriter charges the weights zones read from a response (weight
// response_header, weight response_bytes) as weight.ResponseWriter reports
// them: pending[i] settles what the response reports for its i-th Watch.
// Only requests that meet such a zone get one.
type weightWriter struct {
	weight.ResponseWriter
	pending []afterCharge
	inline  [2]afterCharge
}

// serveCharged passes the request on; for zones whose weight the response
// reports, through a weightWriter that charges it.
func (h *Handler) serveCharged(w http.ResponseWriter, r *http.Request, verdicts []verdict, next caddyhttp.Handler) error {
	var ww *weightWriter
	for i := range verdicts {
		v := &verdicts[i]
		if v.z.afterHeader == "" && !v.z.afterBytes || v.logged {
			continue
		}
		if ww == nil {
			ww = &weightWriter{}
			ww.Init(w, ww, h.now)
			ww.pending = ww.inline[:0]
		}
		ww.pending = append(ww.pending, afterCharge{z: v.z, hash: v.c.hash, paid: v.weight})
		ww.Watch(weight.Watch{Header: v.z.afterHeader, Bytes: v.z.afterBytes})
	}
	if ww == nil {
		return next.ServeHTTP(w, r)
	}
	return next.ServeHTTP(ww, r)
}

// Reported settles the zone of the i-th pending charge.
func (ww *weightWriter) Reported(i int, from, to int64, now time.Time) {
	ww.pending[i].settle(from, to, now)
}
