package floodgate

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"

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
//	        events      <n>
//	        window      <duration>
//	        burst       <n>                # default: events
//	        ipv4_prefix <bits>             # default 32
//	        ipv6_prefix <bits>             # default 64
//	        match {
//	            <matchers>
//	        }
//	        weight <n|placeholder> [{      # cost of a request; rules tried in order,
//	            <matchers>                 # first match wins; default: the handler's, else 1
//	        }]
//	        weight response_header <field> # cost reported by the response, charged after
//	        weight response_bytes          # the response body's size, charged after
//	        quota  <n> <duration>          # also at most n in any rolling duration; repeatable
//	        action deny | log | delay <max> # default deny
//	        memory      <size>             # e.g. 16MiB; or:
//	        sources     <n>                # default 100000
//	        false_deny  <probability>      # default 0.005
//	    }
//	    zone <name>                        # a zone from the rate_limit global option
//	    distributed {                      # parsed and validated; not implemented yet
//	        read_interval  <duration>
//	        write_interval <duration>
//	        purge_age      <duration>
//	    }
//	    storage <module...>                # parsed; not used yet
//	    jitter  <fraction>
//	    log_key
//	    weight <n|placeholder>             # this route's cost in every zone; a zone's rule wins
//	    sweep_interval <duration>          # accepted; no effect
//	    disable_metrics
//	    headers on|off                     # RateLimit headers; default on
//	}
func parseHandler(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	var global *App
	if opt, ok := h.Option("rate_limit").(httpcaddyfile.App); ok {
		global = new(App)
		if err := json.Unmarshal(opt.Value, global); err != nil {
			return nil, err
		}
	}
	rl := new(Handler)
	if err := rl.unmarshalCaddyfile(h.Dispenser, global); err != nil {
		return nil, err
	}
	return rl, nil
}

// unmarshalCaddyfile reads the rate_limit directive. global, if not nil,
// holds the zones of the rate_limit global option, to reject references to
// zones it does not define.
func (rl *Handler) unmarshalCaddyfile(d *caddyfile.Dispenser, global *App) error {
	d.Next() // directive name
	useGlobal := func(name string) error {
		if global == nil || global.Zones[name] == nil {
			return d.Errf("zone %q is not defined in the rate_limit global option", name)
		}
		for _, n := range rl.Zones {
			if n == name {
				return d.Errf("zone %q is listed twice", name)
			}
		}
		rl.Zones = append(rl.Zones, name)
		return nil
	}
	for d.NextArg() {
		if err := useGlobal(d.Val()); err != nil {
			return err
		}
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "zone":
			if !d.NextArg() {
				return d.ArgErr()
			}
			name := d.Val()
			if d.NextArg() {
				return d.ArgErr()
			}
			if nesting := d.Nesting(); d.NextBlock(nesting) {
				zc, err := parseZoneBody(d, name, nesting)
				if err != nil {
					return err
				}
				if rl.RateLimits[name] != nil || (global != nil && global.Zones[name] != nil) {
					return d.Errf("duplicate zone name %q", name)
				}
				if rl.RateLimits == nil {
					rl.RateLimits = make(map[string]*Zone)
				}
				rl.RateLimits[name] = zc
			} else if err := useGlobal(name); err != nil {
				return err
			}
		case "distributed":
			if d.NextArg() {
				return d.ArgErr()
			}
			rl.Distributed = new(Distributed)
			for nesting := d.Nesting(); d.NextBlock(nesting); {
				var dst *caddy.Duration
				switch d.Val() {
				case "read_interval":
					dst = &rl.Distributed.ReadInterval
				case "write_interval":
					dst = &rl.Distributed.WriteInterval
				case "purge_age":
					dst = &rl.Distributed.PurgeAge
				default:
					return d.Errf("distributed: unrecognized subdirective %q", d.Val())
				}
				if err := parseDuration(d, dst); err != nil {
					return err
				}
			}
		case "storage":
			if !d.NextArg() {
				return d.ArgErr()
			}
			modID := "caddy.storage." + d.Val()
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return err
			}
			storage, ok := unm.(caddy.StorageConverter)
			if !ok {
				return d.Errf("storage: module %s is not a caddy.StorageConverter", modID)
			}
			rl.StorageRaw = caddyconfig.JSONModuleObject(storage, "module", storage.(caddy.Module).CaddyModule().ID.Name(), nil)
		case "jitter":
			v, err := zoneconf.OneArg(d)
			if err != nil {
				return err
			}
			j, err := strconv.ParseFloat(v, 64)
			if err != nil || j < 0 || math.IsNaN(j) || math.IsInf(j, 0) {
				return d.Errf("jitter %q: must be a number of at least 0 (a fraction of the wait, e.g. 0.2)", v)
			}
			rl.Jitter = j
		case "log_key":
			if d.NextArg() {
				return d.ArgErr()
			}
			rl.LogKey = true
		case "weight":
			if err := rl.unmarshalWeight(d); err != nil {
				return err
			}
		case "sweep_interval":
			if err := parseDuration(d, &rl.SweepInterval); err != nil {
				return err
			}
		case "disable_metrics":
			if d.NextArg() {
				return d.ArgErr()
			}
			rl.DisableMetrics = true
		case "headers":
			v, err := zoneconf.OneArg(d)
			if err != nil {
				return err
			}
			switch v {
			case "on":
				rl.DisableHeaders = false
			case "off":
				rl.DisableHeaders = true
			default:
				return d.Errf("headers %q: must be on or off", v)
			}
		default:
			return d.Errf("unrecognized rate_limit subdirective %q", d.Val())
		}
	}
	if err := rl.Validate(); err != nil {
		return d.Err(err.Error())
	}
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
		if d.Val() != "zone" {
			return nil, d.Errf("unrecognized rate_limit global option %q", d.Val())
		}
		if !d.NextArg() {
			return nil, d.ArgErr()
		}
		name := d.Val()
		if d.NextArg() {
			return nil, d.ArgErr()
		}
		zc, err := parseZone(d, name)
		if err != nil {
			return nil, err
		}
		if app.Zones[name] != nil {
			return nil, d.Errf("duplicate zone name %q", name)
		}
		if app.Zones == nil {
			app.Zones = make(map[string]*Zone)
		}
		app.Zones[name] = zc
	}
	return httpcaddyfile.App{Name: "rate_limit", Value: caddyconfig.JSON(app, nil)}, nil
}

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
	windowSet := false
	for more := true; more; more = d.NextBlock(nesting) {
		switch field := d.Val(); field {
		case "key":
			// Caddy expands placeholder shorthands ({client_ip},
			// {header.X}) in site blocks but not in global options.
			keys := caddyfile.Segment(d.RemainingArgsAsTokens())
			if len(keys) == 0 {
				return nil, d.ArgErr()
			}
			httpcaddyfile.NewShorthandReplacer().ApplyToSegment(&keys)
			for _, k := range keys {
				if zc.Key == "" && len(zc.FallbackKeys) == 0 {
					zc.Key = k.Text
				} else {
					zc.FallbackKeys = append(zc.FallbackKeys, k.Text)
				}
			}
		case "match":
			ms, err := caddyhttp.ParseCaddyfileNestedMatcherSet(d)
			if err != nil {
				return nil, d.Errf("zone %q: match: %v", name, err)
			}
			zc.MatcherSetsRaw = append(zc.MatcherSetsRaw, ms)
		case "weight":
			if err := zc.unmarshalWeight(d, fmt.Sprintf("zone %q: ", name)); err != nil {
				return nil, err
			}
		case "quota":
			if err := zc.unmarshalQuota(d, fmt.Sprintf("zone %q: ", name)); err != nil {
				return nil, err
			}
		case "action":
			if err := zc.unmarshalAction(d, fmt.Sprintf("zone %q: ", name)); err != nil {
				return nil, err
			}
		default:
			ok, err := zc.UnmarshalOption(d, fmt.Sprintf("zone %q: ", name))
			if err != nil {
				return nil, err
			}
			if !ok {
				return nil, d.Errf("zone %q: unrecognized subdirective %q", name, field)
			}
			if field == "window" {
				windowSet = true
			}
		}
	}
	if zc.MaxEvents == 0 {
		return nil, d.Errf("zone %q: events is required", name)
	}
	if !windowSet {
		return nil, d.Errf("zone %q: window is required", name)
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
