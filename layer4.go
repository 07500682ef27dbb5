package floodgate

import (
	"fmt"
	"net/netip"
	"time"

	"go.uber.org/zap"

	// The whole caddy-l4 app (servers, listener wrapper, handlers such as
	// close, proxy and echo), so that building Caddy with floodgate alone
	// gives the layer4 matcher something to run in.
	_ "github.com/mholt/caddy-l4"

	"github.com/floodgate-rl/floodgate/layer4"
)

// Layer4Zone returns the global zone name for a layer4 matcher. A zone that
// charges an HTTP response's status or time is refused (a connection has
// neither), and so is a zone with action delay: a connection cannot be held until its tokens
// return without keeping a socket and a goroutine for every connection of a
// flood, and closing it instead would enforce a zone whose action says
// otherwise.
func (a *App) Layer4Zone(name string) (layer4.Zone, error) {
	z, err := a.zone(name)
	if err != nil {
		return layer4.Zone{}, err
	}
	if z.action.holds() {
		return layer4.Zone{}, fmt.Errorf("zone %q has action delay, which holds HTTP requests; a layer4 matcher cannot hold a connection: use a zone with action deny or log", name)
	}
	if z.deferred() {
		return layer4.Zone{}, fmt.Errorf("zone %q charges only what an HTTP response says it cost (weight response_status or response_time); a connection has no response, so a layer4 matcher would charge each one a unit the zone does not count in: use a zone of its own", name)
	}
	a.sharedWithLayer4(z)
	return z.layer4(), nil
}

// Layer4Inline sets up a layer4 matcher's own limit as an inline zone of this
// config: its table is found again after a reload if its name and size stay
// the same, and its limit is put in force by Start, when the config goes
// live. Matchers with the same name and settings share the zone, as do
// identical inline definitions anywhere in the config; any other zone of
// that name is an error. The zone has no key: no HTTP handler can use it.
func (a *App) Layer4Inline(in layer4.Inline) (layer4.Zone, func(), error) {
	z, owned, err := a.inlineZone(a.ctx, in.Name, &Zone{Limit: in.Limit})
	if err != nil {
		return layer4.Zone{}, nil, err
	}
	release := func() {}
	if owned {
		release = z.release
	}
	return z.layer4(), release, nil
}

// sharedWithLayer4 gives a zone without a key that a layer4 matcher uses the
// client IP as its HTTP key. The matcher charges each connection to its
// source network; without a key every HTTP request would share one bucket,
// so a network's first request could be denied for what other networks did.
// Keyed by the client IP, grouped by the zone's prefixes, a request and a
// connection of one network draw on the same bucket, as operators sharing a
// zone between the two mean; the admin API and the key_name placeholder
// name the key {client_ip}. The zone is this config's, not yet serving, so
// changing its keys races with nothing.
func (a *App) sharedWithLayer4(z *zone) {
	if len(z.keys) > 0 {
		return
	}
	z.keys = []keySpec{parseKeySpec("{client_ip}")}
	z.keyNames, z.keyNameValues = []string{"{client_ip}"}, []any{"{client_ip}"}
	a.logger.Info(fmt.Sprintf("zone %q has no key and a layer4 matcher uses it: HTTP requests are keyed by {client_ip}, grouped like connections by ipv4_prefix %d and ipv6_prefix %d", z.name, z.v4, z.v6),
		zap.String("zone", z.name))
}

func (z *zone) layer4() layer4.Zone {
	z.counts.layer4.Store(true)
	return layer4.Zone{Name: z.name, Buckets: z.buckets, IPv4Prefix: z.v4, IPv6Prefix: z.v6,
		DryRun: !z.action.enforces(), Count: z.counts.countConnection, Note: logOf(&z.denials).note,
		Denied: z.connectionDenied, SYNCharged: z.table.xdp.synCharged(),
		Places: z.conc, PlaceDenied: z.placeDenied}
}

// placeDenied counts a connection a layer4 matcher denied for want of a
// place (max_concurrent), as a request denied so is counted.
func (z *zone) placeDenied() { z.counts.concDenied.Add(1) }

// connectionDenied notes in the zone's top sketch that a layer4 matcher
// denied a connection from ip: its source network, under the hash an HTTP
// request from it is charged by, so that /top counts both together.
func (z *zone) connectionDenied(ip netip.Addr, now time.Time) {
	c := z.network(ip, -1) // a connection's source is charged unsalted, as the source address
	z.counts.top.Record(now, c.hash, 1, topSource(c, ""))
}

// connectionOutcomes maps what a layer4 matcher did with a connection to the
// zone's outcomes.
var connectionOutcomes = [...]outcome{
	layer4.Allowed: outcomeAllowed,
	layer4.Denied:  outcomeDenied,
	layer4.Logged:  outcomeLogged,
}

// countConnection records one connection a layer4 matcher decided.
func (c *zoneCounts) countConnection(o layer4.Outcome) {
	c.connections[connectionOutcomes[o]].Add(1)
}

var _ layer4.Zones = (*App)(nil)
