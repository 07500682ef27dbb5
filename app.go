package floodgate

import (
	"fmt"
	"maps"
	"slices"

	"github.com/caddyserver/caddy/v2"
)

// App is the rate_limit app. It holds the zones defined once, in the
// Caddyfile's rate_limit global option, which any rate_limit handler can use
// by name; and it puts every zone's limit in force when its config goes live.
//
// Handlers always load this app (an empty one if the config has none), so its
// Start runs for every config that uses a zone.
type App struct {
	// Zones usable by name from any rate_limit handler (`zones` in the
	// handler's JSON, `zone <name>` without a block in the Caddyfile). A
	// zone used by several handlers is one set of buckets: a request counts
	// against it wherever it is served.
	Zones map[string]*Zone `json:"zones,omitempty"`

	ctx caddy.Context
	// global holds the provisioned Zones by name.
	global map[string]*zone
	// names holds every zone name of this config, global and inline, to
	// reject duplicates.
	names map[string]bool
	// live holds every zone of this config; Start applies their limits.
	live []*zone
}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "rate_limit",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision sets up the global zones. It acquires their tables but does not
// change them: a config that fails to load must leave running state alone.
func (a *App) Provision(ctx caddy.Context) error {
	a.ctx = ctx
	a.global = make(map[string]*zone, len(a.Zones))
	a.names = make(map[string]bool, len(a.Zones))
	registerMetrics(ctx)
	for _, name := range slices.Sorted(maps.Keys(a.Zones)) {
		zc := a.Zones[name]
		if zc == nil {
			return fmt.Errorf("zone %q: no configuration", name)
		}
		z, err := provisionZone(ctx, name, zc)
		if err != nil {
			return err
		}
		a.global[name] = z
		a.names[name] = true
		a.live = append(a.live, z)
	}
	return nil
}

// zone returns the global zone name, or an error naming it if the config
// does not define it.
func (a *App) zone(name string) (*zone, error) {
	z, ok := a.global[name]
	if !ok {
		return nil, fmt.Errorf("zone %q is not defined in the rate_limit global option (apps.rate_limit.zones)", name)
	}
	return z, nil
}

// addInline records a zone defined inside a handler, so that its limit is
// applied at Start and its name is unique in the config. Inline zones are
// owned (and released) by their handler.
func (a *App) addInline(z *zone) error {
	if a.names[z.name] {
		return fmt.Errorf("duplicate zone name %q: zone names must be unique across the rate_limit global option and every rate_limit handler", z.name)
	}
	a.names[z.name] = true
	a.live = append(a.live, z)
	return nil
}

// Start puts the limits of this config's zones in force. A zone whose table
// survived a reload keeps what every key consumed: raising events from 3 to 5
// gives an exhausted key 2 more requests at once.
func (a *App) Start() error {
	for _, z := range a.live {
		if err := z.table.putInForce(a, z.limit); err != nil {
			_ = a.Stop()
			return fmt.Errorf("zone %q: %v", z.name, err)
		}
	}
	goLive(a)
	return nil
}

// Stop gives the limits back to the config that had them before this one
// started, unless a newer config has started since: Caddy stops a config
// either when a newer one replaces it (nothing to undo) or when another app
// of the same config fails to start (the reload failed; undo).
func (a *App) Stop() error {
	retire(a)
	for _, z := range slices.Backward(a.live) {
		z.table.giveBack(a)
	}
	return nil
}

// Cleanup releases the global zones' tables.
func (a *App) Cleanup() error {
	for _, z := range a.global {
		z.release()
	}
	a.global = nil
	return nil
}

// Interface guards
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
)
