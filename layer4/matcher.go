// Package layer4 is floodgate's connection matcher for the caddy-l4 app,
// layer4.matchers.rate_limit: it limits how many TCP connections a source
// network may open, before a byte is read and, in the caddy.listeners.layer4
// listener wrapper, before the TLS handshake.
//
// The matcher matches a connection whose source network is over its limit, so
// that `route @flood { close }` drops it. It keeps no state of its own: its
// token buckets are a floodgate zone, either a global zone of the rate_limit
// app (shared with HTTP handlers) or an inline limit that the rate_limit app
// creates, keeps across reloads and puts in force when a config goes live.
// This package does not import the root package (which imports it); it
// reaches the app through the Zones interface, which package floodgate's App
// implements. Start reading at Matcher.Match.
package layer4

import (
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

func init() {
	caddy.RegisterModule(new(Matcher))
}

// Default prefix lengths of an inline limit: a connection flood usually comes
// from a network, not one address, and a /48 is what one IPv6 site gets.
const (
	DefaultIPv4Prefix = 24
	DefaultIPv6Prefix = 48
)

// Matcher matches a connection whose source network has opened more
// connections than its limit allows: max_events per window sustained, up to
// burst at once. Use it in its own first route, `route @flood { close }`.
//
// Each connection is charged one token, once, however many times caddy-l4
// evaluates the matcher. IPv4 clients of a dual-stack listener
// (::ffff:a.b.c.d) count as IPv4. A connection without an IP source (a unix
// socket) is never limited and never matches. Match never returns an error, so
// a flood writes no error log line per connection.
//
// Either zone or an inline limit (max_events and window) must be set, not
// both.
type Matcher struct {
	// Zone names a zone of the rate_limit app (the Caddyfile's rate_limit
	// global option). Its buckets are shared with every HTTP handler and
	// matcher that uses it: a connection costs one request. Its ipv4_prefix
	// and ipv6_prefix group sources; its key and request matchers apply to
	// HTTP requests only.
	Zone string `json:"zone,omitempty"`

	// Name identifies an inline limit across config reloads: a reload that
	// keeps the name and the memory keeps what every network has consumed,
	// and puts a changed limit in force on it. Zone names are unique across
	// the config, except that layer4 matchers with the same name and the
	// same settings share one limit. Default: a name made of the settings,
	// so an unnamed limit keeps its state while its settings do not change,
	// and identical unnamed limits count together.
	Name string `json:"name,omitempty"`

	// The inline limit: at most max_events connections in a window (no
	// burst), or max_events per window sustained and up to burst at once
	// (a token bucket), per source network of ipv4_prefix (default 24) or
	// ipv6_prefix (default 48) bits, in a table of memory bytes or sized
	// from sources and false_deny, as for HTTP zones.
	zoneconf.Limit

	zone    Zone
	release func()
	// verdict is the connection variable that caches this matcher's
	// decision, unique per matcher instance.
	verdict string
	logger  *zap.Logger
}

// Zones is what the matcher needs from the rate_limit app. Package floodgate's
// App implements it; the matcher finds it with ctx.App("rate_limit").
type Zones interface {
	// Layer4Zone returns the global zone name, or an error naming it if the
	// config does not define it.
	Layer4Zone(name string) (Zone, error)
	// Layer4Inline returns the buckets of an inline limit, creating them
	// or finding them again after a reload, and has the app put the limit
	// in force when the config goes live. release gives the buckets back
	// when the matcher is cleaned up.
	Layer4Inline(limit Inline) (z Zone, release func(), err error)
}

// Zone is a zone's buckets and how it groups sources into networks.
type Zone struct {
	Name       string
	Buckets    limiter.Table // token buckets, or windows for a zone without burst
	IPv4Prefix int
	IPv6Prefix int
	// Count, if not nil, is told the outcome of every connection the zone
	// decided (over = denied), for the zone's metrics.
	Count func(over bool)
}

// Inline is a matcher's own limit, with its name and prefix lengths filled
// in.
type Inline struct {
	Name string
	zoneconf.Limit
}

// CaddyModule returns the Caddy module information.
func (*Matcher) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "layer4.matchers.rate_limit",
		New: func() caddy.Module { return new(Matcher) },
	}
}

// Provision validates the matcher and gets its zone from the rate_limit app.
// It changes no running state: a config that fails to load leaves every limit
// as it was.
func (m *Matcher) Provision(ctx caddy.Context) error {
	app, err := ctx.App("rate_limit")
	if err != nil {
		return fmt.Errorf("rate_limit: loading the rate_limit app: %v", err)
	}
	zones, ok := app.(Zones)
	if !ok {
		return fmt.Errorf("rate_limit: the rate_limit app (%T) does not serve layer4 zones; build Caddy with github.com/floodgate-rl/floodgate", app)
	}
	return m.provision(zones, ctx.Logger(m))
}

func (m *Matcher) provision(zones Zones, logger *zap.Logger) error {
	m.logger = logger
	m.verdict = fmt.Sprintf("floodgate.rate_limit.%p", m)
	if err := m.validate(); err != nil {
		return err
	}
	var err error
	if m.Zone != "" {
		m.zone, err = zones.Layer4Zone(m.Zone)
	} else {
		m.zone, m.release, err = zones.Layer4Inline(m.inline())
	}
	if err != nil {
		return fmt.Errorf("rate_limit: %v", err)
	}
	return nil
}

// validate reports the first setting that cannot work, naming the field and
// its value. Table sizing is checked by the app, which knows its bounds.
func (m *Matcher) validate() error {
	bad := func(field string, value any, why string) error {
		return fmt.Errorf("rate_limit: %s %v: %s", field, value, why)
	}
	if m.Zone != "" {
		if !m.Limit.IsZero() || m.Name != "" {
			return bad("zone", m.Zone, "uses the global zone's settings; do not set name, max_events, window, burst, prefixes or sizing with it")
		}
		return nil
	}
	return m.Limit.Validate("rate_limit: ")
}

// inline returns the matcher's own limit with its defaults.
func (m *Matcher) inline() Inline {
	in := Inline{Name: m.Name, Limit: m.Limit}
	v4, v6 := m.Prefixes(DefaultIPv4Prefix, DefaultIPv6Prefix)
	in.IPv4Prefix, in.IPv6Prefix = &v4, &v6
	if in.Name == "" {
		in.Name = DerivedName(in.Rate(), v4, v6)
	}
	return in
}

// DerivedName is the name of an unnamed inline limit: its settings, e.g.
// "layer4:3/1h0m0s,burst=3,v4=24,v6=48".
func DerivedName(l limiter.Limit, v4, v6 int) string {
	burst := l.Burst
	if burst == 0 {
		burst = l.Events
	}
	return fmt.Sprintf("layer4:%d/%s,burst=%d,v4=%d,v6=%d", l.Events, l.Window, burst, v4, v6)
}

// Cleanup gives back the inline limit's buckets. They outlive this config if
// the next one holds the same limit.
func (m *Matcher) Cleanup() error {
	if m.release != nil {
		m.release()
		m.release = nil
	}
	return nil
}

// Match reports whether the connection's source network is over its limit,
// charging it one connection the first time it is asked about cx.
//
// caddy-l4 may run a matcher several times for one connection (routes are
// evaluated again after every read of more bytes, and matchers of a set run
// in map order), so the verdict is kept in the connection's variables. Match
// reads nothing from the connection.
func (m *Matcher) Match(cx *layer4.Connection) (bool, error) {
	if over, ok := cx.GetVar(m.verdict).(bool); ok {
		return over, nil
	}
	over := false
	if ip, ok := SourceIP(cx.RemoteAddr()); ok {
		key := limiter.NetworkKey(ip, m.zone.IPv4Prefix, m.zone.IPv6Prefix)
		over = !m.zone.Buckets.Allow(key.Bytes(), 1, time.Now()).Allowed // one clock reading per connection
		if m.zone.Count != nil {
			m.zone.Count(over)
		}
		if over {
			if ce := m.logger.Check(zap.DebugLevel, "connection rate exceeded"); ce != nil {
				ce.Write(zap.String("zone", m.zone.Name),
					zap.Stringer("source_network", key.Prefix(m.zone.IPv4Prefix, m.zone.IPv6Prefix)))
			}
		}
	}
	cx.SetVar(m.verdict, over)
	return over, nil
}

// SourceIP returns the IP address of a connection's remote address, IPv4
// clients of a dual-stack listener unmapped to IPv4, and false for an address
// that has none (a unix socket).
func SourceIP(a net.Addr) (netip.Addr, bool) {
	var ip netip.Addr
	switch a := a.(type) {
	case *net.TCPAddr:
		ip, _ = netip.AddrFromSlice(a.IP)
	case *net.UDPAddr:
		ip, _ = netip.AddrFromSlice(a.IP)
	case nil:
	default:
		// Other wrappers (PROXY protocol, tests) may have their own types;
		// their text is host:port.
		if ap, err := netip.ParseAddrPort(a.String()); err == nil {
			ip = ap.Addr()
		}
	}
	if !ip.IsValid() {
		return netip.Addr{}, false
	}
	return ip.Unmap().WithZone(""), true
}

// Interface guards
var (
	_ caddy.Module       = (*Matcher)(nil)
	_ caddy.Provisioner  = (*Matcher)(nil)
	_ caddy.CleanerUpper = (*Matcher)(nil)
	_ layer4.ConnMatcher = (*Matcher)(nil)
)
