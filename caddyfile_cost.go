package floodgate

import (
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

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

// unmarshalQuota reads `quota <n> <duration>`.
func (zc *Zone) unmarshalQuota(d *caddyfile.Dispenser, where string) error {
	args := d.RemainingArgs()
	if len(args) != 2 {
		return d.Errf("%squota %v: needs a count and a duration, e.g. quota 10000 24h", where, args)
	}
	n, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || n < 1 {
		return d.Errf("%squota %q: the count must be a whole number of at least 1", where, args[0])
	}
	dur, err := caddy.ParseDuration(args[1])
	if err != nil || dur <= 0 {
		return d.Errf("%squota %s %q: the window must be a positive duration", where, args[0], args[1])
	}
	zc.Quotas = append(zc.Quotas, Quota{MaxEvents: n, Window: caddy.Duration(dur)})
	return nil
}

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
