package layer4

import (
	"math"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/dustin/go-humanize"
)

// UnmarshalCaddyfile sets up the matcher from Caddyfile tokens, inside a
// layer4 server or listener wrapper. Syntax:
//
//	@flood rate_limit {
//	    zone <name>             # a zone of the rate_limit global option; or:
//	    name        <name>      # default: made of the settings below
//	    events      <n>         # required
//	    window      <duration>  # required
//	    burst       <n>         # default: events
//	    ipv4_prefix <bits>      # default 24
//	    ipv6_prefix <bits>      # default 48
//	    memory      <size>      # e.g. 16MiB; or:
//	    sources     <n>         # default 100000
//	    false_deny  <p>         # default 0.005
//	}
//	route @flood {
//	    close
//	}
//
// `rate_limit zone <name>` on one line is short for the block with zone.
func (m *Matcher) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the matcher's name
	if d.NextArg() {
		if d.Val() != "zone" {
			return d.Errf("rate_limit: unexpected argument %q; options go in a block", d.Val())
		}
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		m.Zone = v
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		field := d.Val()
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		bad := func(why string) error { return d.Errf("rate_limit: %s %q: %s", field, v, why) }
		switch field {
		case "zone":
			m.Zone = v
		case "name":
			m.Name = v
		case "events", "burst":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 1 {
				return bad("must be a whole number of at least 1")
			}
			if field == "events" {
				m.MaxEvents = n
			} else {
				m.Burst = n
			}
		case "window":
			dur, err := caddy.ParseDuration(v)
			if err != nil || dur <= 0 {
				return bad("must be a positive duration such as 1m")
			}
			m.Window = caddy.Duration(dur)
		case "ipv4_prefix", "ipv6_prefix":
			bits, err := strconv.Atoi(v)
			if err != nil {
				return bad("must be a number of bits")
			}
			if field == "ipv4_prefix" {
				m.IPv4Prefix = &bits
			} else {
				m.IPv6Prefix = &bits
			}
		case "memory":
			size, err := humanize.ParseBytes(v)
			if err != nil || size > math.MaxInt64 {
				return bad("must be a size such as 16MiB")
			}
			m.Memory = int64(size)
		case "sources":
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return bad("must be a whole number of at least 1")
			}
			m.Sources = n
		case "false_deny":
			p, err := strconv.ParseFloat(v, 64)
			if err != nil || !(p > 0 && p < 1) {
				return bad("must be a probability above 0 and below 1")
			}
			m.FalseDeny = p
		default:
			return d.Errf("rate_limit: unrecognized option %q", field)
		}
	}
	if err := m.validate(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// oneArg returns the single argument of the current option.
func oneArg(d *caddyfile.Dispenser) (string, error) {
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	v := d.Val()
	if d.NextArg() {
		return "", d.ArgErr()
	}
	return v, nil
}

var _ caddyfile.Unmarshaler = (*Matcher)(nil)
