package floodgate

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/weight"
)

// Handler limits the rate of requests. Each request is checked against every
// zone that applies to it and charged only if all of them allow it: a request
// denied by one zone consumes nothing in the others.
//
// A denied request gets an HTTP error with status 429 and a Retry-After
// header (whole seconds, rounded up). It can be handled with handle_errors,
// where the placeholder `{http.rate_limit.exceeded.name}` holds the name of
// the zone that denied it. Allowed and denied responses carry the
// `RateLimit-Policy` and `RateLimit` headers of
// draft-ietf-httpapi-ratelimit-headers-10, one item per zone that applied.
//
// Placeholders set for every request a zone applied to, describing the zone
// that denied it or, if allowed, the zone with the fewest requests left:
// `{http.rate_limit.zone}`, `{http.rate_limit.limit}` (the burst),
// `{http.rate_limit.remaining}`, `{http.rate_limit.retry_after}` (seconds,
// 0 if allowed) and `{http.rate_limit.key}` (the raw key with log_key, cut
// to 256 bytes, else empty).
//
// A denial is logged at INFO the first time a source (what the zone charged:
// a network or a key) is denied in a 10 s interval, with the count of its
// denials logged at DEBUG since its previous INFO line; see denialLog.
type Handler struct {
	// RateLimits defines zones for this handler, keyed by zone name. Zone
	// names are unique across the whole config.
	RateLimits map[string]*Zone `json:"rate_limits,omitempty"`

	// Zones names zones defined in the rate_limit app (the Caddyfile's
	// rate_limit global option) that this handler also enforces.
	Zones []string `json:"zones,omitempty"`

	// Jitter adds a random fraction of the wait, from 0 up to jitter times
	// the wait, to Retry-After, so clients told to wait do not all return
	// at once. 0.2 adds up to 20%. Default 0; from 0 to 1 (a jitter of 1
	// at most doubles the wait).
	Jitter float64 `json:"jitter,omitempty"`

	// SweepInterval is accepted for compatibility with caddy-ratelimit and
	// has no effect: a zone's memory is fixed, there is nothing to sweep.
	// Must not be negative.
	SweepInterval caddy.Duration `json:"sweep_interval,omitempty"`

	// Distributed makes this handler's inline zones cluster-wide: every
	// instance sharing the storage counts what the others granted (see
	// package storage and docs/cluster.md). Zones of the rate_limit app
	// are distributed by the app's own setting.
	Distributed *Distributed `json:"distributed,omitempty"`

	// StorageRaw is the storage distributed zones sync through. Default:
	// the config's storage (Caddy's `storage` global option).
	StorageRaw json.RawMessage `json:"storage,omitempty" caddy:"namespace=caddy.storage inline_key=module"`

	// LogKey puts the raw key in the log line and event of a denied
	// request and in the `{http.rate_limit.key}` placeholder, cut to its
	// first 256 bytes (marked "…") if longer. Default false: keys may be
	// secrets (API keys, session tokens).
	LogKey bool `json:"log_key,omitempty"`

	// DisableMetrics stops this handler from counting requests: in the
	// caddy_rate_limit_requests_total and caddy_rate_limit_weight_total
	// metrics and in the admin API's counts. The zone's top sources are
	// still recorded.
	DisableMetrics bool `json:"disable_metrics,omitempty"`

	// DisableHeaders turns off the RateLimit-Policy and RateLimit response
	// headers. Retry-After is always sent on a denial.
	DisableHeaders bool `json:"disable_headers,omitempty"`

	// Weight is what a request through this handler costs in every zone it
	// charges, unless the zone's own weights price it: a whole number of at
	// least 1 (JSON number), or a string with a placeholder. It gives routes
	// different costs on a shared zone. Default 1. A fixed weight above what
	// a zone can grant fails at load.
	Weight weight.Value `json:"weight,omitzero"`

	zones []*zone // inline zones by name, then referenced global zones
	// policy is the RateLimit-Policy value of a request every zone
	// applied to (policyOf), made once (setZones).
	policy string
	owned  []*zone // inline zones, released at Cleanup
	ctx    caddy.Context
	logger *zap.Logger
	events emitter
	// sleep holds a delayed request, and now reads the clock when a
	// response reports its weight, after the request's decision; tests
	// replace both to drive time.
	sleep func(context.Context, time.Duration) error
	now   func() time.Time
	// meter charges the time of requests in zones with weight
	// response_time (timemeter.go); tests give a handler its own.
	meter *timeMeter
}

// emitter is what the handler uses of Caddy's events app (caddyevents.App).
type emitter interface {
	// ShouldEmit reports whether anything observes the named event: a
	// subscriber, or the events app's own debug log.
	ShouldEmit(name string) bool
	Emit(ctx caddy.Context, name string, data map[string]any) caddy.Event
}

// Distributed configures cluster-wide limiting through storage, with
// caddy-ratelimit's settings.
type Distributed struct {
	// How often to read the other instances' state. Default 5s; at least
	// 10ms.
	ReadInterval caddy.Duration `json:"read_interval,omitempty"`
	// How often to publish this instance's state. Default 5s; at least
	// 10ms.
	WriteInterval caddy.Duration `json:"write_interval,omitempty"`
	// How old another instance's state may be before it is ignored and
	// deleted (that instance is gone). Default: the longest of 1m, two
	// windows and two write intervals; at least two write intervals.
	PurgeAge caddy.Duration `json:"purge_age,omitempty"`
	// How a key's burst is shared between instances: "split" (default) or
	// "free". With split, each instance grants a key at most its share of
	// what the cluster has left for it, re-balanced at every read (what it
	// left the others stays theirs until they are seen to use it, or for
	// two write and two read intervals), so a key hit on every instance at
	// once gets about its limit; a key that only reaches one instance gets
	// its share at first and the rest once two syncs show no other instance
	// counts it. With free, each instance grants whatever the cluster's
	// counts leave, so a key hit on N instances at once can get up to N
	// times its limit before the syncs catch up.
	Bursts string `json:"bursts,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision validates the handler, sets up its inline zones and looks up the
// global zones it names.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.ctx = ctx
	h.logger = ctx.Logger()
	if h.Distributed == nil && len(h.StorageRaw) > 0 {
		h.logger.Warn("storage is used only with distributed: this handler's zones limit on this instance alone")
	}
	appIface, err := ctx.App("rate_limit")
	if err != nil {
		return fmt.Errorf("loading rate_limit app: %v", err)
	}
	app := appIface.(*App)
	eventsIface, err := ctx.App("events")
	if err != nil {
		return fmt.Errorf("loading events app: %v", err)
	}
	if ev := eventsIface.(*caddyevents.App); ev != nil {
		h.events = ev
	}
	if !h.DisableMetrics {
		registerMetrics(ctx)
	}
	if h.SweepInterval > 0 {
		app.incumbent = true
	}
	if h.Weight.IsTemplate() {
		h.logger.Warn(placeholderWeightWarning("the rate_limit block's weight", h.Weight.String()))
	}
	if len(h.RateLimits) == 0 && len(h.Zones) == 0 {
		h.logger.Warn("this rate_limit handler has no zone, so it limits nothing: define one (zone <name> { … }; rate_limits) or name a global one (zone <name>; zones)")
	}
	var shared []*zone
	for _, name := range slices.Sorted(maps.Keys(h.RateLimits)) {
		z, owned, err := app.inlineZone(ctx, name, h.RateLimits[name])
		if err != nil {
			return err
		}
		if owned {
			h.owned = append(h.owned, z)
		} else {
			shared = append(shared, z)
		}
		h.zones = append(h.zones, z)
	}
	// A zone defined the same way in several places is one zone, made
	// cluster-wide (or not) where it was first provisioned. A handler that
	// disagrees would silently get the other handler's choice.
	for _, z := range shared {
		if _, none := z.buckets.(noRate); none {
			continue // max_concurrent alone is never distributed
		}
		if (z.dist != nil) != (h.Distributed != nil) {
			return fmt.Errorf("zone %q is also defined (the same way) where it is %s, so it is one zone; write the same distributed block wherever it is defined, or define it once in the rate_limit global option",
				z.name, map[bool]string{true: "distributed", false: "not distributed"}[z.dist != nil])
		}
	}
	if h.Distributed != nil && len(h.owned) > 0 {
		if err := distributeZones(ctx, h.Distributed, h, "StorageRaw", h.StorageRaw, h.owned); err != nil {
			return err
		}
	}
	seen := make(map[string]bool, len(h.Zones))
	for _, name := range h.Zones {
		if seen[name] || h.RateLimits[name] != nil {
			return fmt.Errorf("zones: zone %q is listed twice", name)
		}
		seen[name] = true
		z, err := app.zone(name)
		if err != nil {
			return fmt.Errorf("zones: %v", err)
		}
		h.zones = append(h.zones, z)
	}
	for _, z := range h.zones {
		if err := z.checkHandlerWeight(h.Weight); err != nil {
			return err
		}
	}
	h.setZones(h.zones)
	h.sleep, h.now, h.meter = sleep, time.Now, sharedMeter
	return nil
}

// setZones makes zones the handler's, in the order requests meet them,
// and makes the RateLimit-Policy value of a request they all apply to.
func (h *Handler) setZones(zones []*zone) {
	h.zones = zones
	var b []byte
	for _, z := range zones {
		b = appendPolicy(b, z)
	}
	h.policy = string(b)
}

// jitterProblem says why j cannot be a jitter, or "". Jitter is a fraction of
// the wait (Handler.Jitter; docs/directives.md, "jitter"), so above 1 it is
// most likely a percentage (20 for 20%), which would tell clients to wait 21
// times as long as they must.
func jitterProblem(j float64) string {
	if !(j >= 0 && j <= 1) {
		return fmt.Sprintf("must be a fraction of the wait from 0 to 1 (0.2 adds up to 20%%); %v would make Retry-After up to %v times the wait", j, 1+j)
	}
	return ""
}

// Validate checks the handler's own settings, naming the field at fault.
// Zones are checked as they are provisioned.
func (h *Handler) Validate() error {
	if why := jitterProblem(h.Jitter); why != "" {
		return fmt.Errorf("jitter %v: %s", h.Jitter, why)
	}
	if h.SweepInterval < 0 {
		return fmt.Errorf("sweep_interval %v: must not be negative", time.Duration(h.SweepInterval))
	}
	if h.Distributed != nil {
		return h.Distributed.Validate()
	}
	return nil
}

// Cleanup releases the tables of the handler's inline zones.
func (h *Handler) Cleanup() error {
	for _, z := range h.owned {
		z.release()
	}
	h.owned = nil
	return nil
}

// ServeHTTP checks r against every zone that applies to it, reading the
// clock once for all of them.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	return h.serveAt(w, r, next, time.Now())
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ emitter                     = (*caddyevents.App)(nil)
)
