package floodgate

import (
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/weight"
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

// costRule is a provisioned WeightRule.
type costRule struct {
	weight   weight.Value
	matchers caddyhttp.MatcherSets
}

// grantable is the largest weight the zone can ever grant: its effective
// burst, or a smaller quota.
func (zc *Zone) grantable() int64 {
	g := zc.Rate().EffectiveBurst()
	for _, q := range zc.Quotas {
		g = min(g, q.MaxEvents)
	}
	return g
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

// provisionCosts loads the zone's weight rules into z.
func (z *zone) provisionCosts(ctx caddy.Context, zc *Zone) error {
	z.grantable = zc.grantable()
	z.afterHeader = zc.WeightResponseHeader
	z.afterBytes = zc.WeightResponseBytes
	for i, rule := range zc.Weights {
		cr := costRule{weight: rule.Weight}
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
		z.costs = append(z.costs, cr)
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
	for _, rule := range z.costs {
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
