package floodgate

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	maphandler "github.com/caddyserver/caddy/v2/modules/caddyhttp/map"
	"go.uber.org/zap"
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

	// Distributed makes these zones cluster-wide, as a handler's
	// distributed does for its inline zones.
	Distributed *Distributed `json:"distributed,omitempty"`

	// StorageRaw is the storage the distributed zones sync through.
	// Default: the config's storage.
	StorageRaw json.RawMessage `json:"storage,omitempty" caddy:"namespace=caddy.storage inline_key=module"`

	ctx    caddy.Context
	logger *zap.Logger
	// global holds the provisioned Zones by name.
	global map[string]*zone
	// inline holds the zones defined inside handlers and layer4 matchers
	// by name.
	inline map[string]*zone
	// defs holds the JSON definition of every zone of this config, global
	// and inline, by name: a name defined again the same way is the same
	// zone, defined differently an error.
	defs map[string]string
	// live holds every zone of this config; Start applies their limits.
	live []*zone
	// warned is set once the zones' warnings are logged (see warn).
	warned bool
	// used holds the global zones a handler or a layer4 matcher of the
	// config uses, by name: a global zone none uses limits nothing.
	used map[string]bool
	// incumbent is set when a handler of the config has caddy-ratelimit's
	// sweep_interval: the config was most likely written for it.
	incumbent bool
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
	a.logger = ctx.Logger()
	a.global = make(map[string]*zone, len(a.Zones))
	a.inline = make(map[string]*zone)
	a.defs = make(map[string]string, len(a.Zones))
	a.used = make(map[string]bool, len(a.Zones))
	registerMetrics(ctx)
	for _, name := range slices.Sorted(maps.Keys(a.Zones)) {
		zc := a.Zones[name]
		if zc == nil {
			return fmt.Errorf("zone %q: no configuration", name)
		}
		def := zc.definition()
		z, err := provisionZone(ctx, name, zc)
		if err != nil {
			return err
		}
		a.global[name] = z
		a.defs[name] = def
		a.live = append(a.live, z)
	}
	if a.Distributed != nil && len(a.global) > 0 {
		var zones []*zone
		for _, name := range slices.Sorted(maps.Keys(a.global)) {
			zones = append(zones, a.global[name])
		}
		if err := distributeZones(ctx, a.Distributed, a, "StorageRaw", a.StorageRaw, zones); err != nil {
			return err
		}
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
	a.used[name] = true
	return z, nil
}

// zoneConfig returns the configuration of the global zone name, or nil if a
// (which may be nil) does not define it.
func (a *App) zoneConfig(name string) *Zone {
	if a == nil {
		return nil
	}
	return a.Zones[name]
}

// inlineZone returns the zone name that a handler or a layer4 matcher
// defines as zc, provisioning it with ctx if this config has no zone of that
// name yet; owned then says that the caller must release it. A definition
// the same as an earlier one (a snippet imported into several sites) is that
// zone, shared exactly as if it were defined once in the rate_limit global
// option: one table, one limit, one set of metrics. A different definition of
// a name the config already has is an error saying what differs.
func (a *App) inlineZone(ctx caddy.Context, name string, zc *Zone) (z *zone, owned bool, err error) {
	if zc == nil {
		return nil, false, fmt.Errorf("zone %q: no configuration", name)
	}
	def := zc.definition()
	if prev, ok := a.defs[name]; ok {
		if prev != def {
			return nil, false, fmt.Errorf("zone %q is defined twice, differently (%s): to share one zone, define it once in the rate_limit app (apps.rate_limit.zones; the Caddyfile's rate_limit global option) and use it by name (zones; rate_limit %s)",
				name, defDiff(prev, def), name)
		}
		if z := a.global[name]; z != nil {
			a.used[name] = true
			return z, false, nil
		}
		return a.inline[name], false, nil
	}
	z, err = provisionZone(ctx, name, zc)
	if err != nil {
		return nil, false, err
	}
	a.defs[name] = def
	a.inline[name] = z
	a.live = append(a.live, z)
	return z, true, nil
}

// defDiff names the top-level fields in which two zone definitions (JSON
// objects) differ, with both values, e.g. `max_events 5 and 10`.
func defDiff(a, b string) string {
	var ma, mb map[string]json.RawMessage
	_ = json.Unmarshal([]byte(a), &ma)
	_ = json.Unmarshal([]byte(b), &mb)
	keys := slices.Collect(maps.Keys(ma))
	for k := range mb {
		if _, ok := ma[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	var diffs []string
	for _, k := range keys {
		va, vb := showField(k, ma[k]), showField(k, mb[k])
		if va == vb {
			continue
		}
		diffs = append(diffs, fmt.Sprintf("%s %s and %s", k, va, vb))
	}
	return strings.Join(diffs, ", ")
}

// showField formats one field of a zone definition for defDiff: JSON, but a
// window as a duration rather than nanoseconds.
func showField(name string, v json.RawMessage) string {
	if v == nil {
		return "unset"
	}
	var d caddy.Duration
	if name == "window" && json.Unmarshal(v, &d) == nil {
		return time.Duration(d).String()
	}
	return string(v)
}

// warn logs, once per config load, what in its zones loads but does not
// limit the way its operator most likely means (see Zone.warnings), and
// whether their tables add up to more than bigTotal. It runs at Start, when
// every module of the config is provisioned, so that it knows the
// placeholders the config's handlers set. A config that is provisioned
// and never started (`caddy validate`, which cleans the config up right
// after provisioning it) warns at Cleanup instead, so that validating shows
// what running would log.
func (a *App) warn() {
	if a.warned {
		return
	}
	a.warned = true
	set := placeholdersSet(a.ctx)
	for _, z := range a.live {
		if a.global[z.name] == z && !a.used[z.name] {
			continue // said below, with the other unused zones
		}
		a.logger.Info(fmt.Sprintf("zone %q: %s", z.name, z.meaning()), zap.String("zone", z.name))
		warnings := z.conf.warnings(set, a.incumbent)
		if len(z.keys) == 0 && !z.counts.layer4.Load() {
			warnings = append(warnings, "has no key, so every request it applies to shares one bucket, whoever sends it; to limit each client, add key {client_ip} (key static keeps one bucket and says so)")
		}
		for _, w := range warnings {
			a.logger.Warn(fmt.Sprintf("zone %q: %s", z.name, w), zap.String("zone", z.name))
		}
	}
	if w := unusedZonesWarning(a.global, a.used); w != "" {
		a.logger.Warn(w)
	}
	if w := totalSizeWarning(a.live); w != "" {
		a.logger.Warn(w)
	}
}

// placeholdersSet returns the placeholders that the map handlers of the
// config's HTTP app set, at any depth of its routes.
func placeholdersSet(ctx caddy.Context) map[string]bool {
	set := make(map[string]bool)
	app, err := ctx.AppIfConfigured("http")
	if err != nil {
		return set
	}
	h, ok := app.(*caddyhttp.App)
	if !ok {
		return set
	}
	var walk func(caddyhttp.RouteList, *caddyhttp.HTTPErrorConfig)
	walk = func(routes caddyhttp.RouteList, errs *caddyhttp.HTTPErrorConfig) {
		if errs != nil {
			walk(errs.Routes, nil)
		}
		for _, r := range routes {
			for _, mh := range r.Handlers {
				switch mh := mh.(type) {
				case *maphandler.Handler:
					for _, d := range mh.Destinations {
						set[d] = true
					}
				case *caddyhttp.Subroute:
					walk(mh.Routes, mh.Errors)
				}
			}
		}
	}
	for _, srv := range h.Servers {
		walk(srv.Routes, srv.Errors)
	}
	return set
}

// Start puts the limits of this config's zones in force and starts the
// cluster sync of its distributed zones. A zone whose table
// survived a reload keeps what every key consumed: raising events from 3 to 5
// gives an exhausted key 2 more requests at once.
func (a *App) Start() error {
	a.warn()
	for _, z := range a.live {
		if err := z.table.putInForce(a, z.limit); err != nil {
			_ = a.Stop()
			return fmt.Errorf("zone %q: %v", z.name, err)
		}
		if z.conc != nil {
			// Validated at provisioning; the places in use stay.
			_ = z.conc.SetMax(z.maxConcurrent)
		}
		if z.dist != nil {
			if err := z.dist.start(); err != nil {
				_ = a.Stop()
				return fmt.Errorf("zone %q: %v", z.name, err)
			}
		}
	}
	goLive(a)
	return nil
}

// Stop gives the limits back to the config that had them before this one
// started, unless a newer config has started since: Caddy stops a config
// either when a newer one replaces it (nothing to undo) or when another app
// of the same config fails to start (the reload failed; undo). It also stops
// this config's cluster sync, after a last publish.
func (a *App) Stop() error {
	retire(a)
	for _, z := range slices.Backward(a.live) {
		z.table.giveBack(a)
		if z.dist != nil {
			z.dist.stop()
		}
	}
	return nil
}

// Cleanup releases the global zones' tables, after logging the zones'
// warnings if this is `caddy validate` cleaning up a config it provisioned
// and never starts (see warn). Only then: Caddy also cleans up a config
// that failed to provision or start, in which the other apps may not be
// loaded, and looking up the HTTP app's placeholders would load it.
// caddy.Validate names its cancellation "validation complete"; were that to
// change, validate would only show no zone warnings again.
func (a *App) Cleanup() error {
	if a.ctx.Context == nil {
		return nil // never provisioned: nothing to release
	}
	if cause := context.Cause(a.ctx); cause != nil && cause.Error() == "validation complete" {
		a.warn()
	}
	for _, z := range a.global {
		z.release()
	}
	a.global = nil
	return nil
}

// live is the rate_limit app of the running config, which the admin API and
// the metrics read at request time: admin modules are provisioned before the
// apps of their config, and the config they were loaded with may not be the
// one running when they are asked.
var live struct {
	sync.Mutex
	app *App
	// prev is the app that ran before app started, while it has not been
	// stopped: if app's config fails to start, prev runs again.
	prev *App
}

// goLive records that a's config is starting.
func goLive(a *App) {
	live.Lock()
	defer live.Unlock()
	live.prev, live.app = live.app, a
}

// retire records that a's config has stopped. Caddy stops a config when a
// newer one has started, when the next config has no rate_limit app, or when
// another app of a's config failed to start; only in the last case does the
// config before a run again.
func retire(a *App) {
	live.Lock()
	defer live.Unlock()
	if live.prev == a {
		live.prev = nil
	}
	if live.app == a {
		live.app, live.prev = live.prev, nil
	}
}

// liveZones returns the zones of the running config, by name.
func liveZones() []*zone {
	live.Lock()
	a := live.app
	live.Unlock()
	if a == nil {
		return nil
	}
	// a.live is complete once a's config has been provisioned.
	zs := slices.Clone(a.live)
	slices.SortFunc(zs, func(x, y *zone) int { return cmp.Compare(x.name, y.name) })
	return zs
}

// Interface guards
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
)
