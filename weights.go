// Weights in a zone's terms. What a weight is, the rules that price a
// request by its matchers, and the writer that reports what a response
// declares are package weight; this file holds what needs the zone: the
// checks against the most it can grant, its Caddyfile forms (beside the
// zone's other settings, as caddyfile.go's parsers are), and the settling
// of a response's weight into the zone's tables (afterCharge, weightWriter).

package floodgate

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
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
	var after []string
	if zc.WeightResponseHeader != "" {
		after = append(after, "response_header")
	}
	if zc.WeightResponseBytes {
		after = append(after, "response_bytes")
	}
	if zc.WeightResponseStatus != nil {
		after = append(after, "response_status")
		if _, err := weight.ParseStatuses(zc.WeightResponseStatus); err != nil {
			return fmt.Errorf("%sweight response_status: %v", where, err)
		}
	}
	if zc.WeightResponseTime {
		after = append(after, "response_time")
		if len(zc.Weights) > 0 {
			return fmt.Errorf("%sweight response_time: a zone that charges the response's time has no other weight rule (its unit is the millisecond)", where)
		}
	}
	if len(after) > 1 {
		return fmt.Errorf("%sweight %s and weight %s: a zone charges one cost its response reports, not both (define a zone for each)", where, after[0], after[1])
	}
	return nil
}

// provisionWeights loads the zone's weight rules into z.
func (z *zone) provisionWeights(ctx caddy.Context, zc *Zone) error {
	z.grantable = zc.grantable()
	z.afterHeader = zc.WeightResponseHeader
	z.afterBytes = zc.WeightResponseBytes
	z.afterTime = zc.WeightResponseTime
	if zc.WeightResponseStatus != nil {
		st, err := weight.ParseStatuses(zc.WeightResponseStatus)
		if err != nil {
			return fmt.Errorf("zone %q: weight response_status: %v", z.name, err)
		}
		z.afterStatus = &st
	}
	rules, err := weight.Provision(ctx, zc.Weights, fmt.Sprintf("zone %q", z.name))
	if err != nil {
		return err
	}
	z.weights = rules
	return nil
}

// checkHandlerWeight reports an error if w, the weight of a handler that
// charges z, is a number z could never grant. A zone with a rule for every
// request never uses the handler's weight. A zone that charges the response's
// time ignores the handler's weight.
func (z *zone) checkHandlerWeight(w weight.Value) error {
	if z.afterTime {
		return nil
	}
	return z.weights.CheckHandler(w, z.grantable)
}

// weightOf is what r costs in z: see weight.Rules.Of. In a zone that
// charges the response's time, what r needs to be admitted: 1 ms.
func (z *zone) weightOf(r *http.Request, repl *caddy.Replacer, hw weight.Value) (int64, error) {
	if z.afterTime {
		return 1, nil
	}
	return z.weights.Of(r, repl, hw, z.grantable)
}

// deferred reports whether z charges a request nothing at admission, only
// once its response says what it costs (weight response_status and
// response_time): it admits a request if the key has room for its weight.
func (z *zone) deferred() bool { return z.afterStatus != nil || z.afterTime }

// reportsWeight reports whether the response tells z what the request
// costs, through a weightWriter.
func (z *zone) reportsWeight() bool {
	return z.afterHeader != "" || z.afterBytes || z.afterStatus != nil
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
//	weight response_status <code|class>...
//	weight response_time
//
// seen holds the zone's settings so far: the response_ forms may be
// written once, and a rule after one without matchers (which prices
// every request) would never apply.
func (zc *Zone) unmarshalWeight(d *caddyfile.Dispenser, where string, seen zoneconf.Fields) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	switch d.Val() {
	case "response_header", "response_bytes", "response_status", "response_time":
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
	case "response_bytes", "response_time":
		form := d.Val()
		if rest := d.RemainingArgs(); len(rest) > 0 {
			return d.Errf("%sweight %s takes no value, not %q", where, form, strings.Join(rest, " "))
		}
		if form == "response_bytes" {
			zc.WeightResponseBytes = true
		} else {
			zc.WeightResponseTime = true
		}
		return nil
	case "response_status":
		codes := d.RemainingArgs()
		if _, err := weight.ParseStatuses(codes); err != nil {
			return d.Errf("%sweight response_status: %v", where, err)
		}
		zc.WeightResponseStatus = codes
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
func (h *Handler) unmarshalWeight(d *caddyfile.Dispenser) error {
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
	h.Weight = v
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
// response_header, response_bytes, response_status) as weight.ResponseWriter
// reports them: pending[i] settles what the response reports for its i-th
// Watch. Only requests that meet such a zone get one.
type weightWriter struct {
	weight.ResponseWriter
	pending []afterCharge
	inline  [2]afterCharge
}

// serveCharged passes the request on; for zones whose weight the response
// reports, through a weightWriter that charges it, and for zones that
// charge its time, metered by h.meter while it runs. A zone that charged
// nothing at admission (zone.deferred) owes all of it, unless action delay
// held the request, which reserved its weight (paid, then).
func (h *Handler) serveCharged(w http.ResponseWriter, r *http.Request, verdicts []verdict, next caddyhttp.Handler) error {
	var ww *weightWriter
	var runs [2]*timedRun
	timed := runs[:0]
	for i := range verdicts {
		v := &verdicts[i]
		if v.logged || !v.z.reportsWeight() && !v.z.afterTime {
			continue
		}
		c := afterCharge{z: v.z, hash: v.c.hash, paid: v.weight}
		if v.z.deferred() && !v.delayed {
			c.paid = 0
		}
		if v.z.afterTime {
			timed = append(timed, h.meter.start(c, h.now()))
			continue
		}
		if ww == nil {
			ww = &weightWriter{}
			ww.Init(w, ww, h.now)
			ww.pending = ww.inline[:0]
		}
		ww.pending = append(ww.pending, c)
		ww.Watch(weight.Watch{Header: v.z.afterHeader, Bytes: v.z.afterBytes, Status: v.z.afterStatus, Cost: v.weight})
	}
	// A later handler may panic: Caddy's abort does, and reverse_proxy
	// when a streamed response breaks or its client leaves (both with
	// http.ErrAbortHandler, which net/http recovers). The runs end and the
	// response is settled all the same, else the meter would charge the
	// key for ever.
	defer func() {
		for _, run := range timed {
			h.meter.end(run, h.now())
		}
	}()
	if ww == nil {
		return next.ServeHTTP(w, r)
	}
	settled := false
	defer func() {
		if !settled {
			ww.Done(errAborted)
		}
	}()
	err := next.ServeHTTP(ww, r)
	settled = true
	ww.Done(err)
	return err
}

// errAborted is the error a response that a handler's panic cut short is
// settled with: one without a status, so response_status reads it as the
// 500 Caddy logs for an error without one.
var errAborted = errors.New("the handler panicked")

// Reported settles the zone of the i-th pending charge.
func (ww *weightWriter) Reported(i int, from, to int64, now time.Time) {
	ww.pending[i].settle(from, to, now)
}
