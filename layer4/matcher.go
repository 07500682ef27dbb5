// Package layer4 is floodgate's connection matcher for the caddy-l4 app,
// layer4.matchers.rate_limit: it limits how many TCP connections a source
// network may open, and how many it may hold open at once (max_concurrent),
// before a byte is read and, in the caddy.listeners.layer4 listener wrapper,
// before the TLS handshake.
//
// The matcher matches a connection whose source network is over its limit, so
// that `route @flood { close }` drops it. It keeps no state of its own: its
// token buckets are a floodgate zone, either a global zone of the rate_limit
// app (shared with HTTP handlers) or an inline limit that the rate_limit app
// creates, keeps across reloads and puts in force when a config goes live.
// This package does not import the root package (which imports it); it
// reaches the app through the Zones interface, which package floodgate's App
// implements. Start reading at Matcher.Match.
//
// A connection is charged at most once per zone: the zone's verdict is kept
// in the connection's variables (see Charged), and every matcher of the zone,
// in any route or matcher set, takes it from there. A stage that charges a
// connection earlier records its verdict with Charged, and the matchers then
// charge nothing more; so does Match for a connection whose SYN the zone's
// XDP program charged (Zone.SYNCharged). A connection that a zone with
// max_concurrent admits holds a place until its socket closes; places.go
// says how the place is given back, since caddy-l4 tells a matcher nothing
// of the close.
package layer4

import (
	"fmt"
	"net"
	"net/netip"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
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
// burst at once, and, with max_concurrent, no more than max_concurrent open
// at once. Use it in its own first route, `route @flood { close }`.
//
// Each connection is charged one token per zone, once, however many times
// caddy-l4 evaluates the matcher and however many matchers of the zone the
// routes hold. IPv4 clients of a dual-stack listener (::ffff:a.b.c.d) count
// as IPv4. A connection without an IP source (a unix socket) is never
// limited and never matches. Match returns no error other than asking for
// the rest of a PROXY protocol header (see Match), so a flood writes no error
// log line per connection.
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
	// watch gives back the places of the connections the matcher admits
	// when they close: the process's (see closeWatch).
	watch *closeWatch
	// verdict is the connection variable that holds the zone's decision
	// (verdictVar).
	verdict string
	logger  *zap.Logger
	// warnedProxy is set once the matcher has warned that it met an unread
	// PROXY protocol header, warnedUnwatchable once it has met a
	// connection whose close it cannot see (pointers: Matcher is a config
	// value, copied).
	warnedProxy, warnedUnwatchable *atomic.Bool
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

// Zone is a zone's buckets, how it groups sources into networks and what it
// does with a connection over its limit.
type Zone struct {
	Name       string
	Buckets    limiter.Table // token buckets, or windows for a zone without burst
	IPv4Prefix int
	IPv6Prefix int
	// DryRun is set for a zone with action log: a connection over the
	// limit is not matched (so nothing closes it) and charges nothing, but
	// is counted and logged as logged.
	DryRun bool
	// Count, if not nil, is told the outcome of every connection the zone
	// decided, for the zone's metrics.
	Count func(Outcome)
	// Note, if not nil, is told of every connection over the limit, by the
	// hash of its source network, and says whether to log it at INFO and
	// how many of the network's were not since its last INFO line: the
	// zone's denial log, shared with its HTTP denials, so that a flood
	// writes a line per network and interval, not one per connection.
	// Without it, such connections are logged at DEBUG.
	Note func(source uint64, now time.Time) (info bool, suppressed int64)
	// Denied, if not nil, is told of every connection from ip the zone
	// matched to be closed (not a dry run's), for the zone's top sources.
	Denied func(ip netip.Addr, now time.Time)
	// SYNCharged, if not nil, reports whether the zone's XDP program
	// charged a connection between these addresses on its SYN (the program
	// marked it), and forgets the mark: Match asks once per connection.
	// Match then counts it as allowed (its SYN passed) and charges nothing
	// more, so that it costs one token, not two; a connection the program
	// did not mark (its SYN came in a shape the program does not parse,
	// or elsewhere) Match charges. It runs once per connection, flood
	// included: one system call.
	SYNCharged func(local, remote netip.AddrPort) bool
	// Places, if not nil, is the zone's table of places (max_concurrent):
	// a connection it admits holds a place of its source network until it
	// closes (see closeWatch); a connection it has no place for is over
	// the limit, and one whose close the matcher cannot see is refused.
	Places *limiter.Concurrency
	// PlaceDenied, if not nil, is told of every connection matched for
	// want of a place (not a dry run's), for the zone's metrics.
	PlaceDenied func()
}

// Outcome is what a zone did with a connection.
type Outcome uint8

const (
	Allowed Outcome = iota // under the limit: charged, not matched
	Denied                 // over the limit: matched, to be closed
	Logged                 // over the limit of a dry-run zone: not matched
)

func (o Outcome) String() string {
	return [...]string{"allowed", "denied", "logged"}[o]
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
	if err := m.provision(zones, ctx.Logger(m)); err != nil {
		return err
	}
	m.warnProxyOrder(ctx)
	return nil
}

func (m *Matcher) provision(zones Zones, logger *zap.Logger) error {
	m.logger, m.watch = logger, watch
	m.warnedProxy, m.warnedUnwatchable = new(atomic.Bool), new(atomic.Bool)
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
	m.verdict = verdictVar(m.zone.Name)
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
		in.Name = DerivedName(in.Rate(), in.MaxConcurrent, v4, v6) + sizingSuffix(m.Limit)
	}
	return in
}

// DerivedName is the name of an unnamed inline limit: its settings (a rate
// l, if it has one, and max_concurrent, if set), short enough to type in
// `caddy rate-limit top`, with what is not the default only:
// "layer4_3_per_1h", "layer4_100_per_1m_burst_20_v4_16",
// "layer4_concurrent_10".
func DerivedName(l limiter.Limit, concurrent int64, v4, v6 int) string {
	var b strings.Builder
	b.WriteString("layer4")
	if l.Events > 0 {
		fmt.Fprintf(&b, "_%d_per_%s", l.Events, shortDuration(l.Window))
	}
	if l.Burst > 0 {
		fmt.Fprintf(&b, "_burst_%d", l.Burst)
	}
	if concurrent > 0 {
		fmt.Fprintf(&b, "_concurrent_%d", concurrent)
	}
	if v4 != DefaultIPv4Prefix {
		fmt.Fprintf(&b, "_v4_%d", v4)
	}
	if v6 != DefaultIPv6Prefix {
		fmt.Fprintf(&b, "_v6_%d", v6)
	}
	return b.String()
}

// sizingSuffix names l's table sizing where it is set, for a derived name:
// two unnamed limits that differ only in size are two zones, each with its
// own name, not one name defined twice.
func sizingSuffix(l zoneconf.Limit) string {
	var b strings.Builder
	if l.Memory != 0 {
		fmt.Fprintf(&b, "_memory_%d", l.Memory)
	}
	if l.Sources != 0 {
		fmt.Fprintf(&b, "_sources_%d", l.Sources)
	}
	if l.FalseDeny != 0 {
		fmt.Fprintf(&b, "_false_deny_%s", strconv.FormatFloat(l.FalseDeny, 'g', -1, 64))
	}
	return b.String()
}

// shortDuration writes d without its zero units: 1h, 90s, 1h30m, 1.5s.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
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
// charging it one connection the first time the zone is asked about cx.
//
// caddy-l4 may run a matcher several times for one connection (routes are
// evaluated again after every read of more bytes, and matchers of a set run
// in map order), and a zone may have matchers in several routes and sets, so
// the zone's verdict is kept in the connection's variables, which PROXY
// protocol's wrapping of the connection keeps too. Match reads nothing from
// the connection.
//
// A source is charged once it is final. If the bytes that other matchers
// have read so far begin a PROXY protocol header, a proxy_protocol handler
// of an earlier route has yet to read it and replace the proxy's address
// with the client's: while they are only the first bytes of its signature,
// Match asks for more (ErrConsumedAllPrefetchedBytes) and charges nothing,
// so that the earlier route can match. A whole header still unread here has
// no earlier route to read it: the proxy is charged, as configured, and the
// matcher warns once.
func (m *Matcher) Match(cx *layer4.Connection) (bool, error) {
	if over, ok := cx.GetVar(m.verdict).(bool); ok {
		return over, nil
	}
	ip, ok := SourceIP(cx.RemoteAddr())
	if !ok {
		Charged(cx, m.zone.Name, false)
		return false, nil
	}
	switch proxyHeader(cx.MatchingBytes()) {
	case proxyHeaderBegun:
		return false, layer4.ErrConsumedAllPrefetchedBytes
	case proxyHeaderUnread:
		if !m.warnedProxy.Swap(true) {
			m.logger.Warn("a connection begins with a PROXY protocol header that no route before this matcher has read: the matcher limits the proxy, not the client; put the proxy_protocol route first (see docs/layer4.md#behind-proxy-protocol)",
				zap.String("zone", m.zone.Name), zap.Stringer("remote", cx.RemoteAddr()))
		}
	}
	synPaid := m.zone.SYNCharged != nil && synCharged(cx, m.zone.SYNCharged)
	over := m.decide(cx, ip, synPaid, time.Now()) // one clock reading per connection
	Charged(cx, m.zone.Name, over)
	return over, nil
}

// decide charges the network of ip one connection (its rate, unless its
// SYN paid it already, and a place if the zone has max_concurrent) and
// returns whether the connection is to be matched: over the limit, in a
// zone that enforces it. A connection over any of the zone's limits takes
// nothing from the others: a place is taken first and given back at once
// if the rate refuses the connection.
//
// A connection whose close the matcher cannot see (see place) is matched
// too, in a zone with max_concurrent, but its network is not over a limit:
// it is counted as denied and not logged as a denial, nor noted among the
// zone's top sources or its place denials (place warns once instead).
func (m *Matcher) decide(cx *layer4.Connection, ip netip.Addr, synPaid bool, now time.Time) bool {
	z := &m.zone
	key := limiter.NetworkKey(ip, z.IPv4Prefix, z.IPv6Prefix)
	o := Allowed
	held, placed := m.place(cx, key)
	ex := excessNone
	switch {
	case placed == placeFull:
		ex = excessPlaces
	case placed == placeUnseen:
	case !synPaid && !z.Buckets.Allow(key.Bytes(), 1, now).Allowed:
		ex = excessRate
		if held != nil {
			held.place.Release()
		}
	}
	if ex != excessNone || placed == placeUnseen {
		o = Denied
		if z.DryRun {
			o = Logged
		} else if ex != excessNone {
			if z.Denied != nil {
				z.Denied(ip, now)
			}
			if ex == excessPlaces && z.PlaceDenied != nil {
				z.PlaceDenied()
			}
		}
		if ex != excessNone {
			z.log(m.logger, ip, key, o, ex, now)
		}
	} else if held != nil {
		m.watch.hold(held)
	}
	if z.Count != nil {
		z.Count(o)
	}
	return o == Denied
}

// A placing is what place did for a connection.
type placing uint8

const (
	placeTaken  placing = iota // a place taken, or none needed
	placeFull                  // the network holds max_concurrent connections
	placeUnseen                // the connection's close cannot be seen: refused
)

// An excess is which of a zone's limits a connection is over: its log
// line's limit field.
type excess uint8

const (
	excessNone   excess = iota
	excessRate          // the rate: limit "rate"
	excessPlaces        // max_concurrent: limit "max_concurrent"
)

// place takes a place for a connection from the network key in a zone with
// max_concurrent. It takes none, and reports placeFull, if the network
// holds max_concurrent connections, or placeUnseen if the matcher cannot
// see when the connection closes (see watchable) or it has closed already,
// so that a place it took would never be given back. In a zone without
// max_concurrent it takes nothing and reports placeTaken. A connection
// refused a place costs no allocation.
func (m *Matcher) place(cx *layer4.Connection, key limiter.NetKey) (*heldPlace, placing) {
	z := &m.zone
	if z.Places == nil {
		return nil, placeTaken
	}
	h := limiter.Hash(key.Bytes())
	if !z.Places.PeekHash(h).Allowed {
		return nil, placeFull
	}
	sc, ok := socket(cx.Conn).(syscall.Conn)
	if !ok {
		if !m.warnedUnwatchable.Swap(true) {
			m.logger.Warn("a connection whose close the matcher cannot see (a UDP flow, or a connection wrapped in a type it does not know): a zone with max_concurrent counts TCP connections only, and refuses this one rather than hold a place it could never give back",
				zap.String("zone", z.Name), zap.Stringer("remote", cx.RemoteAddr()), zap.String("type", fmt.Sprintf("%T", socket(cx.Conn))))
		}
		return nil, placeUnseen
	}
	held := new(heldPlace)
	if !z.Places.AdmitHash(h, &held.place).Allowed {
		return nil, placeFull
	}
	rc, err := sc.SyscallConn()
	if err == nil {
		held.socket = rc
	}
	if err != nil || held.closed() {
		// Closed already: no sweep would see it close.
		held.place.Release()
		return nil, placeUnseen
	}
	return held, placeTaken
}

// log logs a connection from ip over the zone's limit (outcome o, Denied or
// Logged; the limit it is over, ex), as the HTTP handler logs a denial: at INFO for the first of its
// network's in each interval of the zone's denial log (Note), with the
// number not logged at INFO since; at DEBUG otherwise. A dry run's message
// differs, so that filters of denials (fail2ban, CrowdSec) never ban for it.
func (z *Zone) log(logger *zap.Logger, ip netip.Addr, key limiter.NetKey, o Outcome, ex excess, now time.Time) {
	if !logger.Core().Enabled(zap.InfoLevel) {
		return
	}
	level, info, suppressed := zap.DebugLevel, false, int64(0)
	if z.Note != nil {
		if info, suppressed = z.Note(limiter.Hash(key.Bytes()), now); info {
			level = zap.InfoLevel
		}
	}
	msg := "connection rate exceeded"
	if o == Logged {
		msg = "connection rate would be exceeded"
	}
	if ce := logger.Check(level, msg); ce != nil {
		fields := []zap.Field{zap.String("zone", z.Name), zap.String("client_ip", ip.String()),
			zap.Stringer("source", key.Prefix(z.IPv4Prefix, z.IPv6Prefix)), zap.Stringer("outcome", o),
			zap.String("limit", [...]string{excessRate: "rate", excessPlaces: "max_concurrent"}[ex])}
		if info {
			fields = append(fields, zap.Int64("suppressed", suppressed))
		}
		ce.Write(fields...)
	}
}

// synCharged reports whether charged says the connection's SYN was charged.
// The SYN's addresses are those of the accepted socket, under any PROXY
// protocol wrapping: a connection whose source a PROXY header replaced is
// charged to the client, whose network the SYN (the proxy's) never paid
// for, so it is not covered.
func synCharged(cx *layer4.Connection, charged func(local, remote netip.AddrPort) bool) bool {
	raw := socket(cx.Conn)
	if raw.RemoteAddr().String() != cx.RemoteAddr().String() {
		return false
	}
	local, ok1 := addrPort(raw.LocalAddr())
	remote, ok2 := addrPort(raw.RemoteAddr())
	return ok1 && ok2 && charged(local, remote)
}

// socket unwraps c to the accepted socket: through caddy-l4's Connection,
// PROXY protocol's Conn (Raw), TLS (NetConn) and any wrapper that embeds
// the net.Conn it wraps (Caddy's http_redirect listener wrapper, placed
// before layer4 as Caddy's docs show it), a bounded number of layers.
func socket(c net.Conn) net.Conn {
	for range 8 {
		switch w := c.(type) {
		case *net.TCPConn:
			return c // the common case, without embeddedConn's reflection
		case *layer4.Connection:
			c = w.Conn
		case interface{ Raw() net.Conn }:
			c = w.Raw()
		case interface{ NetConn() net.Conn }:
			c = w.NetConn()
		default:
			inner := embeddedConn(c)
			if inner == nil {
				return c
			}
			c = inner
		}
	}
	return c
}

// embeddedConn is the net.Conn that c, a struct or a pointer to one,
// embeds (its exported field Conn of type net.Conn), or nil. Closing such a
// wrapper closes what it embeds, whose close the watch then sees.
func embeddedConn(c net.Conn) net.Conn {
	v := reflect.ValueOf(c)
	if v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return nil
		}
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct {
		return nil
	}
	f, ok := v.Type().FieldByName("Conn")
	if !ok || !f.Anonymous || len(f.Index) != 1 || f.Type != reflect.TypeFor[net.Conn]() {
		return nil
	}
	inner, _ := v.Field(f.Index[0]).Interface().(net.Conn)
	return inner
}

// addrPort is a TCP address's IP (unmapped, without zone) and port.
func addrPort(a net.Addr) (netip.AddrPort, bool) {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return netip.AddrPort{}, false
	}
	ip, ok := netip.AddrFromSlice(ta.IP)
	if !ok {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(ip.Unmap().WithZone(""), uint16(ta.Port)), true
}

// Charged records that cx has been charged to the zone named zone, and
// whether it is to be matched (over). Every rate_limit matcher of that zone
// then answers over for cx without charging it again. Match records its own
// decisions so, and a connection the zone's XDP program charged on its SYN
// as allowed; an earlier stage that charged the connection itself records
// its verdict here before routing begins.
func Charged(cx *layer4.Connection, zone string, over bool) {
	cx.SetVar(verdictVar(zone), over)
}

// verdictVar is the connection variable that holds zone's verdict. Zone
// names are unique in a config, and all routes of a connection are of one
// config.
func verdictVar(zone string) string {
	return "floodgate.rate_limit." + zone
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
