package weight

import (
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Rule is one weight rule as configured: the requests its matchers select
// cost Weight.
type Rule struct {
	// Weight is a whole number of at least 1 (JSON number), or a string
	// holding a placeholder, e.g. "{http.request.header.X-Cost}", expanded
	// for each request. A fixed weight above the zone's burst (or a quota)
	// fails at load. A request whose placeholder weight is empty, not a
	// whole number of at least 1, or above the most the zone can grant is
	// answered 400 Bad Request and charged nothing.
	Weight Value `json:"weight"`

	// Matchers that select the requests this rule prices; the sets are
	// ORed. Default: every request.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`
}

// Validate reports the first rule of rules that cannot work: one without a
// weight, one after a rule that prices every request (rules are tried in
// order, so it would never apply), or a fixed weight above limit, the most
// the zone can grant. Errors name the rule by its index (weights[i]); the
// caller says whose rules they are.
func Validate(rules []*Rule, limit int64) error {
	for i, rule := range rules {
		if rule == nil || rule.Weight.IsZero() {
			return fmt.Errorf("weights[%d]: a weight is required", i)
		}
		if i > 0 && len(rules[i-1].MatcherSetsRaw) == 0 {
			return fmt.Errorf("weights[%d] never applies: weights[%d] has no matchers, so it prices every request (rules are tried in order)", i, i-1)
		}
		if err := rule.Weight.CheckFixed(limit, "the zone"); err != nil {
			return err
		}
	}
	return nil
}

// Rules are weight rules provisioned: their matchers loaded, ready to price
// requests. The zero Rules price every request at the handler's weight.
type Rules struct {
	// who is whose rules they are, e.g. `zone "api"`, as errors name it.
	who   string
	rules []rule
	// all is set if a rule matches every request, so the handler's
	// weight is never used.
	all bool
}

// rule is a provisioned Rule.
type rule struct {
	weight   Value
	matchers caddyhttp.MatcherSets
}

// Provision loads cfg's matchers in ctx. who says whose rules they are
// (e.g. `zone "api"`), for the errors of Provision, CheckHandler and Of.
func Provision(ctx caddy.Context, cfg []*Rule, who string) (Rules, error) {
	rs := Rules{who: who}
	for i, c := range cfg {
		r := rule{weight: c.Weight}
		if c.MatcherSetsRaw != nil {
			ms, err := ctx.LoadModule(c, "MatcherSetsRaw")
			if err != nil {
				return Rules{}, fmt.Errorf("%s: weights[%d]: loading matchers: %v", who, i, err)
			}
			if err := r.matchers.FromInterface(ms); err != nil {
				return Rules{}, fmt.Errorf("%s: weights[%d]: %v", who, i, err)
			}
		} else {
			rs.all = true
		}
		rs.rules = append(rs.rules, r)
	}
	return rs, nil
}

// CheckHandler reports an error if hw, the weight of a handler whose
// requests these rules price, is a number above limit, the most the zone
// can grant. Rules with one for every request never use the handler's
// weight.
func (rs Rules) CheckHandler(hw Value, limit int64) error {
	if rs.all {
		return nil
	}
	return hw.CheckFixed(limit, rs.who)
}

// Of is what r costs: the weight of the first rule that matches, else the
// handler's weight hw, else 1, with placeholders expanded by repl and
// refused above limit, the most the zone can grant. An error is a
// caddyhttp.HandlerError: 400 for a weight that must not pass (see
// Value.Resolve), 500 for a matcher that failed.
func (rs Rules) Of(r *http.Request, repl *caddy.Replacer, hw Value, limit int64) (int64, error) {
	v := hw
	for _, rule := range rs.rules {
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
	n, err := v.Resolve(func(s string) string { return repl.ReplaceAll(s, "") }, limit)
	if err != nil {
		return 0, caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("%s: %v", rs.who, err))
	}
	return n, nil
}
