package layer4

import (
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// UnmarshalCaddyfile sets up the matcher from Caddyfile tokens, inside a
// layer4 server or listener wrapper. Syntax:
//
//	@flood rate_limit {
//	    zone <name>             # a zone of the rate_limit global option; or:
//	    name        <name>      # default: made of the settings below
//	    events      <n>         # required, unless max_concurrent is set alone
//	    window      <duration>  # required, unless max_concurrent is set alone
//	    burst       <n>         # a token bucket; without: at most events in a window
//	    max_concurrent <n>      # at most n connections open at once
//	    ipv4_prefix <bits>      # default 24
//	    ipv6_prefix <bits>      # default 48
//	    memory      <size>      # e.g. 16MiB; or:
//	    sources     <n>         # default 100000
//	    false_deny  <p>         # default 0.005
//	    xdp <interface> [ports…] [quic <ports…>] [optional]  # also drop SYNs and QUIC Initials in XDP (docs/xdp.md)
//	}
//	route @flood {
//	    close
//	}
//
// `rate_limit zone <name>` on one line is short for the block with zone;
// zone and name may each be given once.
func (m *Matcher) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the matcher's name
	seen := make(zoneconf.Fields)
	// set reads the zone or name the dispenser is on, once per matcher:
	// `rate_limit zone a { zone b }` is an error, not zone b.
	set := func(field string, dst *string) error {
		if err := seen.Once(d, "rate_limit: "); err != nil {
			return err
		}
		v, err := zoneconf.Arg(d, "rate_limit: ")
		if err != nil {
			return err
		}
		*dst = v
		return nil
	}
	if d.NextArg() {
		if d.Val() != "zone" {
			return d.Errf("rate_limit: unexpected argument %q; options go in a block", d.Val())
		}
		if err := set("zone", &m.Zone); err != nil {
			return err
		}
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch field := d.Val(); field {
		case "zone":
			if err := set(field, &m.Zone); err != nil {
				return err
			}
		case "name":
			if err := set(field, &m.Name); err != nil {
				return err
			}
		default:
			ok, err := m.UnmarshalOption(d, "rate_limit: ", seen)
			if err != nil {
				return err
			}
			if !ok {
				return zoneconf.Unknown(d, "rate_limit: ", "option", field, append([]string{"zone", "name"}, zoneconf.Options...))
			}
		}
	}
	if m.Zone == "" && m.MaxConcurrent == 0 {
		if err := seen.Require(d, "rate_limit: ", "events", "window"); err != nil {
			return err
		}
	}
	if err := m.validate(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

var _ caddyfile.Unmarshaler = (*Matcher)(nil)
