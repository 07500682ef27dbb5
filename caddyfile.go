package floodgate

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("rate_limit", parseHandler)
	httpcaddyfile.RegisterDirectiveOrder("rate_limit", httpcaddyfile.Before, "basic_auth")
	httpcaddyfile.RegisterGlobalOption("rate_limit", parseGlobal)
}

// parseHandler sets up the rate_limit directive, a superset of
// mholt/caddy-ratelimit's syntax:
//
//	rate_limit [<matcher>] [<global zone>...] {
//	    zone <name> {
//	        key         <placeholder>...   # several = priority order, first non-empty wins
//	        events      <n>                # at most 10^6 per second of window
//	        window      <duration>         # at most 365d
//	        burst       <n>                # a token bucket, at most 1048576; without: at most events in a window
//	        ipv4_prefix <bits>             # default 32; 0 is no grouping
//	        ipv6_prefix <bits>             # default 64; 0 is no grouping
//	        match {
//	            <matchers>
//	        }
//	        weight <n|placeholder> [{      # weight of a request; rules tried in order,
//	            <matchers>                 # first match wins; default: the handler's, else 1
//	        }]
//	        weight response_header <field> # weight reported by the response, charged after
//	        weight response_bytes          # the response body's size, charged after
//	        quota  <n> <duration>          # also at most n in any rolling duration; repeatable
//	        action deny | log | delay <max> # default deny
//	        memory      <size>             # e.g. 16MiB; or:
//	        sources     <n>                # default 100000
//	        false_deny  <probability>      # default 0.005
//	        xdp <interface> [ports…] [quic <ports…>] [optional] # also drop SYNs and QUIC Initials in XDP (docs/xdp.md)
//	    }
//	    zone <name>                        # a zone from the rate_limit global option
//	    distributed {                      # these inline zones cluster-wide
//	        read_interval  <duration>      # default 5s
//	        write_interval <duration>      # default 5s
//	        purge_age      <duration>      # default max(1m, 2 windows)
//	        bursts         split|free      # default split: a key hit on every instance at once gets about its limit
//	    }
//	    storage <module...>                # default: the config's storage
//	    jitter  <fraction>
//	    log_key
//	    weight <n|placeholder>             # this route's weight in every zone; a zone's rule wins
//	    sweep_interval <duration>          # accepted; no effect
//	    disable_metrics
//	    headers on|off                     # RateLimit headers; default on
//	}
//
// Each setting may appear once in a zone, and once in the directive's block;
// a weight rule after one without a matcher block would never apply and is an
// error too. A zone name defined the same way in several directives (an
// imported snippet) is one zone; defined differently, an error naming both
// places.
func parseHandler(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	var global *App
	if opt, ok := h.Option("rate_limit").(httpcaddyfile.App); ok {
		global = new(App)
		if err := json.Unmarshal(opt.Value, global); err != nil {
			return nil, err
		}
	}
	// h.State lives for the whole Caddyfile (every site), so zones defined
	// in several sites, typically by one imported snippet, can be compared.
	defs, _ := h.State[inlineZonesState].(map[string]inlineDef)
	if defs == nil {
		defs = make(map[string]inlineDef)
		h.State[inlineZonesState] = defs
	}
	rl := new(Handler)
	if err := rl.unmarshalCaddyfile(h.Dispenser, global, defs); err != nil {
		return nil, err
	}
	return rl, nil
}

// inlineZonesState is the key of the inline zones defined so far in the
// Caddyfile's adaptation state.
const inlineZonesState = "floodgate.inline_zones"

// inlineDef is a zone defined inside a rate_limit directive: its JSON and
// where it was written.
type inlineDef struct {
	json  string
	place string
}

// place returns where the dispenser's token was written, with the import
// chain for a token of an imported snippet (the same snippet line is then
// told apart by where it was imported), as Caddy formats it in errors.
func place(d *caddyfile.Dispenser) string {
	return strings.TrimPrefix(d.Err("").Error(), ", at ")
}

// unmarshalCaddyfile reads the rate_limit directive. global, if not nil,
// holds the zones of the rate_limit global option, to reject references to
// zones it does not define. defs holds the zones defined in the directives
// read before this one: a zone defined again the same way is the same zone,
// shared; defined differently, it is an error naming both places.
func (h *Handler) unmarshalCaddyfile(d *caddyfile.Dispenser, global *App, defs map[string]inlineDef) error {
	d.Next() // directive name
	useGlobal := func(name string) error {
		if global == nil || global.Zones[name] == nil {
			return d.Errf("zone %q is not defined in the rate_limit global option", name)
		}
		if slices.Contains(h.Zones, name) {
			return d.Errf("zone %q is listed twice", name)
		}
		h.Zones = append(h.Zones, name)
		return nil
	}
	for d.NextArg() {
		if err := useGlobal(d.Val()); err != nil {
			return err
		}
	}
	seen := make(zoneconf.Fields)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() != "zone" {
			if err := seen.Once(d, ""); err != nil {
				return err
			}
		}
		switch d.Val() {
		case "zone":
			if !d.NextArg() {
				return d.Err("zone needs a name: zone <name> { … } defines one, zone <name> uses a global one")
			}
			name := d.Val()
			if d.NextArg() {
				return d.Errf("zone %q: unexpected %q after the name (one name per zone; settings go in its block)", name, d.Val())
			}
			if err := validZoneName(name); err != nil {
				return d.Err(err.Error())
			}
			at := place(d)
			nesting := d.Nesting()
			if !d.NextBlock(nesting) {
				if err := useGlobal(name); err != nil {
					return err
				}
				continue
			}
			zc, err := parseZoneBody(d, name, nesting)
			if err != nil {
				return err
			}
			if err := h.addInline(name, zc, at, global, defs); err != nil {
				return err
			}
		case "distributed":
			dist, err := parseDistributed(d)
			if err != nil {
				return err
			}
			h.Distributed = dist
		case "storage":
			raw, err := parseStorage(d)
			if err != nil {
				return err
			}
			h.StorageRaw = raw
		case "jitter":
			v, err := zoneconf.OneArg(d)
			if err != nil {
				return err
			}
			j, err := strconv.ParseFloat(v, 64)
			if err != nil || j < 0 || math.IsNaN(j) {
				return d.Errf("jitter %q: must be a fraction of the wait from 0 to 1, e.g. 0.2", v)
			}
			if why := jitterProblem(j); why != "" {
				return d.Errf("jitter %q: %s", v, why)
			}
			h.Jitter = j
		case "log_key":
			if d.NextArg() {
				return d.ArgErr()
			}
			h.LogKey = true
		case "weight":
			if err := h.unmarshalWeight(d); err != nil {
				return err
			}
		case "sweep_interval":
			if err := parseDuration(d, &h.SweepInterval); err != nil {
				return err
			}
		case "disable_metrics":
			if d.NextArg() {
				return d.ArgErr()
			}
			h.DisableMetrics = true
		case "headers":
			v, err := zoneconf.OneArg(d)
			if err != nil {
				return err
			}
			switch v {
			case "on":
				h.DisableHeaders = false
			case "off":
				h.DisableHeaders = true
			default:
				return d.Errf("headers %q: must be on or off", v)
			}
		default:
			word := d.Val()
			if zonal := slices.Contains(zoneFields, word) || zoneconf.Nearest(word, zoneFields) != ""; zonal && zoneconf.Nearest(word, handlerFields) == "" {
				return d.Errf("%q is a zone's setting: it goes inside a zone block, rate_limit { zone <name> { key {client_ip}; events <n>; window <duration> } }", word)
			}
			return zoneconf.Unknown(d, "", "rate_limit subdirective", word, handlerFields)
		}
	}
	if err := h.Validate(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// addInline records the zone name defined at place in this directive. A
// definition the same as the global option's, or as another directive's, is
// that zone: the zone is shared as if defined once. A different definition of
// a name fails, naming both places.
func (h *Handler) addInline(name string, zc *Zone, at string, global *App, defs map[string]inlineDef) error {
	js := string(caddyconfig.JSON(zc, nil))
	useOnce := fmt.Sprintf("a zone name is one limit: to share it, define it once in the rate_limit global option (rate_limit { zone %s { … } }) and use it by name (rate_limit %s); for two limits, give each definition its own name (in a snippet imported with different values, put an argument in the name: zone %s_{args[0]})", name, name, name)
	if g := global.zoneConfig(name); g != nil {
		if string(caddyconfig.JSON(g, nil)) != js {
			return fmt.Errorf("zone %q at %s is defined differently in the rate_limit global option; %s", name, at, useOnce)
		}
		if slices.Contains(h.Zones, name) {
			return fmt.Errorf("zone %q at %s is listed twice", name, at)
		}
		h.Zones = append(h.Zones, name)
		return nil
	}
	if h.RateLimits[name] != nil {
		return fmt.Errorf("zone %q at %s is defined twice in one rate_limit directive", name, at)
	}
	if prev, ok := defs[name]; ok && prev.json != js {
		return fmt.Errorf("zone %q is defined differently at %s and at %s; %s", name, prev.place, at, useOnce)
	} else if !ok {
		defs[name] = inlineDef{json: js, place: at}
	}
	if h.RateLimits == nil {
		h.RateLimits = make(map[string]*Zone)
	}
	h.RateLimits[name] = zc
	return nil
}

// parseGlobal sets up the rate_limit global option, which defines zones that
// any rate_limit directive can use by name:
//
//	{
//	    rate_limit {
//	        zone <name> {
//	            <zone subdirectives, as in the directive>
//	        }
//	        distributed { ... }   # as in the directive: these zones cluster-wide
//	        storage <module...>   # default: the config's storage
//	    }
//	}
//
// The option may appear more than once; its zones are merged.
func parseGlobal(d *caddyfile.Dispenser, existing any) (any, error) {
	app := new(App)
	if prev, ok := existing.(httpcaddyfile.App); ok {
		if err := json.Unmarshal(prev.Value, app); err != nil {
			return nil, err
		}
	}
	d.Next() // option name
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "zone":
		case "distributed":
			dist, err := parseDistributed(d)
			if err != nil {
				return nil, err
			}
			app.Distributed = dist
			continue
		case "storage":
			raw, err := parseStorage(d)
			if err != nil {
				return nil, err
			}
			app.StorageRaw = raw
			continue
		default:
			return nil, zoneconf.Unknown(d, "", "rate_limit global option", d.Val(), []string{"zone", "distributed", "storage"})
		}
		if !d.NextArg() {
			return nil, d.Err("zone needs a name: zone <name> { … }")
		}
		name := d.Val()
		if d.NextArg() {
			return nil, d.Errf("zone %q: unexpected %q after the name (one name per zone; settings go in its block)", name, d.Val())
		}
		if err := validZoneName(name); err != nil {
			return nil, d.Err(err.Error())
		}
		at := place(d)
		zc, err := parseZone(d, name)
		if err != nil {
			return nil, err
		}
		if prev := app.Zones[name]; prev != nil {
			if string(caddyconfig.JSON(prev, nil)) != string(caddyconfig.JSON(zc, nil)) {
				return nil, fmt.Errorf("zone %q at %s is already defined differently in the rate_limit global option", name, at)
			}
			continue
		}
		if app.Zones == nil {
			app.Zones = make(map[string]*Zone)
		}
		app.Zones[name] = zc
	}
	return httpcaddyfile.App{Name: "rate_limit", Value: caddyconfig.JSON(app, nil)}, nil
}

// The subdirectives of a rate_limit block and of a zone's block, for the
// errors that suggest one.
var (
	handlerFields = []string{"zone", "distributed", "storage", "jitter", "log_key", "weight", "sweep_interval", "disable_metrics", "headers"}
	zoneFields    = append([]string{"key", "match", "weight", "quota", "action"}, zoneconf.Options...)
)

// parseZone reads a zone's block; the dispenser is on the zone's name.
func parseZone(d *caddyfile.Dispenser, name string) (*Zone, error) {
	nesting := d.Nesting()
	if !d.NextBlock(nesting) {
		return nil, d.Errf("zone %q: a zone needs a block with at least events and window", name)
	}
	return parseZoneBody(d, name, nesting)
}

// parseZoneBody reads a zone's block from its first subdirective, the
// dispenser being on it; nesting is the level outside the block.
func parseZoneBody(d *caddyfile.Dispenser, name string, nesting int) (*Zone, error) {
	zc := new(Zone)
	where := fmt.Sprintf("zone %q: ", name)
	seen := make(zoneconf.Fields)
	for more := true; more; more = d.NextBlock(nesting) {
		switch field := d.Val(); field {
		case "key":
			if err := seen.Once(d, where); err != nil {
				return nil, fmt.Errorf("%w (several keys, in priority order, go on one line)", err)
			}
			// Caddy expands placeholder shorthands ({client_ip},
			// {header.X}) in site blocks but not in global options.
			keys := caddyfile.Segment(d.RemainingArgsAsTokens())
			if len(keys) == 0 {
				return nil, d.Errf("%skey needs at least one placeholder, e.g. key {client_ip}", where)
			}
			httpcaddyfile.NewShorthandReplacer().ApplyToSegment(&keys)
			zc.Key = keys[0].Text
			for _, k := range keys[1:] {
				zc.FallbackKeys = append(zc.FallbackKeys, k.Text)
			}
		case "match":
			ms, err := caddyhttp.ParseCaddyfileNestedMatcherSet(d)
			if err != nil {
				return nil, d.Errf("%smatch: %v", where, err)
			}
			zc.MatcherSetsRaw = append(zc.MatcherSetsRaw, ms)
		case "weight":
			if err := zc.unmarshalWeight(d, where, seen); err != nil {
				return nil, err
			}
		case "quota":
			if err := zc.unmarshalQuota(d, where); err != nil {
				return nil, err
			}
		case "action":
			if err := seen.Once(d, where); err != nil {
				return nil, err
			}
			if err := zc.unmarshalAction(d, where); err != nil {
				return nil, err
			}
		default:
			ok, err := zc.UnmarshalOption(d, where, seen)
			if err != nil {
				return nil, err
			}
			if !ok {
				return nil, zoneconf.Unknown(d, where, "subdirective", field, zoneFields)
			}
		}
	}
	// A zone limits a rate, requests in flight, or both: max_concurrent
	// alone needs no events and window (as the incumbent's PR #98 writes
	// it), one beside them needs both.
	if _, conc := seen["max_concurrent"]; !conc || seen["events"] != "" || seen["window"] != "" {
		if err := seen.Require(d, where, "events", "window"); err != nil {
			return nil, err
		}
	}
	if err := zc.Validate(name); err != nil {
		return nil, d.Err(err.Error())
	}
	return zc, nil
}

// parseDuration reads the single, non-negative duration argument of the
// current subdirective into dst.
func parseDuration(d *caddyfile.Dispenser, dst *caddy.Duration) error {
	field := d.Val()
	v, err := zoneconf.OneArg(d)
	if err != nil {
		return err
	}
	dur, err := caddy.ParseDuration(v)
	if err != nil {
		return d.Errf("%s %q: not a duration: %v", field, v, err)
	}
	if dur < 0 {
		return d.Errf("%s %q: must not be negative", field, v)
	}
	*dst = caddy.Duration(dur)
	return nil
}
