// Weights: what a request costs in a zone, in the zone's terms. The pure
// core (a weight as configured, read from a placeholder or a response
// header, and refused when it could pass for free) is package weight; this
// file holds what needs Caddy and the zone's tables: the zone's weight rules
// with their request matchers (WeightRule), the handler's weight, their
// Caddyfile forms, and the weights a response reports after the fact,
// charged by weightWriter as it is written.

package floodgate

import (
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// WeightRule is one rule of a zone's weights: the requests its matchers
// select cost weight tokens.
type WeightRule struct {
	// Weight is a whole number of at least 1 (JSON number), or a string
	// holding a placeholder, e.g. "{http.request.header.X-Cost}", expanded
	// for each request. A fixed weight above the zone's burst (or a quota)
	// fails at load. A request whose placeholder weight is empty, not a
	// whole number of at least 1, or above the most the zone can grant is
	// answered 400 Bad Request and charged nothing.
	Weight weight.Value `json:"weight"`

	// Matchers that select the requests this rule prices; the sets are
	// ORed. Default: every request.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`
}

// weightRule is a provisioned WeightRule.
type weightRule struct {
	weight   weight.Value
	matchers caddyhttp.MatcherSets
}

// validateWeights checks the weight settings; the limits must be valid.
func (zc *Zone) validateWeights(where string) error {
	for i, rule := range zc.Weights {
		if rule == nil || rule.Weight.IsZero() {
			return fmt.Errorf("%sweights[%d]: a weight is required", where, i)
		}
		if i > 0 && len(zc.Weights[i-1].MatcherSetsRaw) == 0 {
			return fmt.Errorf("%sweights[%d] never applies: weights[%d] has no matchers, so it prices every request (rules are tried in order)", where, i, i-1)
		}
		if err := rule.Weight.CheckFixed(zc.grantable(), "the zone"); err != nil {
			return fmt.Errorf("%s%v", where, err)
		}
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
	for i, rule := range zc.Weights {
		cr := weightRule{weight: rule.Weight}
		if rule.MatcherSetsRaw != nil {
			ms, err := ctx.LoadModule(rule, "MatcherSetsRaw")
			if err != nil {
				return fmt.Errorf("zone %q: weights[%d]: loading matchers: %v", z.name, i, err)
			}
			if err := cr.matchers.FromInterface(ms); err != nil {
				return fmt.Errorf("zone %q: weights[%d]: %v", z.name, i, err)
			}
		} else {
			z.pricesAll = true
		}
		z.weights = append(z.weights, cr)
	}
	return nil
}

// checkHandlerWeight reports an error if w, the weight of a handler that
// charges z, is a number z could never grant. A zone with a rule for every
// request never uses the handler's weight.
func (z *zone) checkHandlerWeight(w weight.Value) error {
	if z.pricesAll {
		return nil
	}
	if err := w.CheckFixed(z.grantable, fmt.Sprintf("zone %q", z.name)); err != nil {
		return err
	}
	return nil
}

// weightOf is what r costs in z: the first of z's rules that matches, else
// the handler's weight hw, else 1. An error is a HandlerError: 400 for a
// weight that must not pass (see weight.Value.Resolve), 500 for a matcher
// that failed.
func (z *zone) weightOf(r *http.Request, repl *caddy.Replacer, hw weight.Value) (int64, error) {
	v := hw
	for _, rule := range z.weights {
		if len(rule.matchers) > 0 {
			ok, err := rule.matchers.AnyMatchWithError(r)
			if err != nil {
				return 0, caddyhttp.Error(http.StatusInternalServerError, err)
			}
			if !ok {
				continue
			}
		}
		v = rule.weight
		break
	}
	if v.IsZero() {
		return 1, nil
	}
	n, err := v.Resolve(func(s string) string { return repl.ReplaceAll(s, "") }, z.grantable)
	if err != nil {
		return 0, caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("zone %q: %v", z.name, err))
	}
	return n, nil
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
	rule := &WeightRule{Weight: v}
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
// wild report cannot lock a key out for longer than a full refill.
func (c afterCharge) settle(from, to int64, now time.Time) {
	before, after := max(from-c.paid, 0), max(to-c.paid, 0)
	if after <= before {
		return
	}
	c.z.buckets.Charge(c.hash, after-before, now)
	for _, s := range c.z.quotas {
		q := s.Quota()
		s.Add(c.hash, min(after, q)-min(before, q), now)
	}
}

// weightWriter watches a response for the weights zones charge after it, and
// charges each when it is known, at the time read from clock: the value of
// a header when the header is written (weight response_header), and the
// body's bytes as they are written (weight response_bytes), each before
// the client can have them, so that its next request is decided on a key
// that has paid for this one. Only requests that meet such a zone get one.
type weightWriter struct {
	caddyhttp.ResponseWriterWrapper
	clock   func() time.Time
	pending []afterCharge
	inline  [2]afterCharge
	wrote   bool
	// countBytes: a pending zone charges the body's bytes; bytes is how
	// many have been charged.
	countBytes bool
	bytes      int64
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
			ww = &weightWriter{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, clock: h.now}
			ww.pending = ww.inline[:0]
		}
		ww.pending = append(ww.pending, afterCharge{z: v.z, hash: v.c.hash, paid: v.weight})
		ww.countBytes = ww.countBytes || v.z.afterBytes
	}
	if ww == nil {
		return next.ServeHTTP(w, r)
	}
	return next.ServeHTTP(ww, r)
}

// WriteHeader charges the zones that read a response header, once, at the
// final (non-1xx) status. A missing or bad value charges nothing more than
// the request-time weight already paid.
func (ww *weightWriter) WriteHeader(code int) {
	if code >= 200 && !ww.wrote {
		ww.wrote = true
		for _, c := range ww.pending {
			if c.z.afterHeader != "" {
				if n, ok := weight.Count(ww.Header().Get(c.z.afterHeader)); ok {
					c.settle(0, n, ww.clock())
				}
			}
		}
	}
	ww.ResponseWriterWrapper.WriteHeader(code)
}

// Write charges p's bytes before it passes them on. Bytes the connection
// then fails to take (a client gone) are charged all the same.
func (ww *weightWriter) Write(p []byte) (int, error) {
	if !ww.wrote {
		ww.WriteHeader(http.StatusOK)
	}
	ww.chargeBytes(int64(len(p)))
	return ww.ResponseWriterWrapper.Write(p)
}

// chargeBytes charges n more body bytes to the zones that count them.
func (ww *weightWriter) chargeBytes(n int64) {
	if !ww.countBytes || n <= 0 {
		return
	}
	from := ww.bytes
	ww.bytes += n
	now := ww.clock()
	for _, c := range ww.pending {
		if c.z.afterBytes {
			c.settle(from, ww.bytes, now)
		}
	}
}

// ReadFrom keeps the underlying writer's sendfile path (a file server's
// body) when no zone counts the body's bytes. When one does, the bytes go
// through Write, to be charged before they are sent: the price of counting
// them is the copy that sendfile saves.
func (ww *weightWriter) ReadFrom(r io.Reader) (int64, error) {
	if !ww.wrote {
		ww.WriteHeader(http.StatusOK)
	}
	if ww.countBytes {
		return io.Copy(writerOnly{ww}, r)
	}
	return ww.ResponseWriterWrapper.ReadFrom(r)
}

// writerOnly hides every method of a writer but Write, so that io.Copy
// uses Write.
type writerOnly struct{ io.Writer }

var _ http.ResponseWriter = (*weightWriter)(nil)
