package floodgate

import (
	"sync"

	// The whole caddy-l4 app (servers, listener wrapper, handlers such as
	// close, proxy and echo), so that building Caddy with floodgate alone
	// gives the layer4 matcher something to run in.
	_ "github.com/mholt/caddy-l4"

	"github.com/floodgate-rl/floodgate/layer4"
)

// layer4Zones holds the inline zones that layer4 matchers created and have not
// released; matchers with the same name and settings share one of them.
var layer4Zones sync.Map // *zone → struct{}

// Layer4Zone returns the global zone name for a layer4 matcher.
func (a *App) Layer4Zone(name string) (layer4.Zone, error) {
	z, err := a.zone(name)
	if err != nil {
		return layer4.Zone{}, err
	}
	return z.layer4(), nil
}

// Layer4Inline sets up a layer4 matcher's own limit as an inline zone of this
// config: its table is found again after a reload if its name and size stay
// the same, and its limit is put in force by Start, when the config goes
// live. Matchers with the same name and settings share the zone; any other
// zone of that name in the config is a duplicate.
func (a *App) Layer4Inline(in layer4.Inline) (layer4.Zone, func(), error) {
	zc := &Zone{Limit: in.Limit}
	z, err := provisionZone(a.ctx, in.Name, zc)
	if err != nil {
		return layer4.Zone{}, nil, err
	}
	if !a.names[z.name] || !a.sharesLayer4Zone(z) {
		if err := a.addInline(z); err != nil {
			z.release()
			return layer4.Zone{}, nil, err
		}
	}
	layer4Zones.Store(z, struct{}{})
	release := func() {
		layer4Zones.Delete(z)
		z.release()
	}
	return z.layer4(), release, nil
}

// sharesLayer4Zone reports whether this config already has a layer4 inline
// zone that z is the same as: same name, limit, prefixes and table.
func (a *App) sharesLayer4Zone(z *zone) bool {
	for _, o := range a.live {
		if _, ok := layer4Zones.Load(o); ok && o.name == z.name && o.limit == z.limit &&
			o.v4 == z.v4 && o.v6 == z.v6 && o.tkey == z.tkey {
			return true
		}
	}
	return false
}

func (z *zone) layer4() layer4.Zone {
	z.counts.layer4.Store(true)
	return layer4.Zone{Name: z.name, Buckets: z.buckets, IPv4Prefix: z.v4, IPv6Prefix: z.v6, Count: z.count}
}

// count records one connection the zone decided.
func (z *zone) count(over bool) {
	o := outcomeAllowed
	if over {
		o = outcomeDenied
	}
	z.counts.connections[o].Add(1)
}

var _ layer4.Zones = (*App)(nil)
