package floodgate

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
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
// 0 if allowed) and `{http.rate_limit.key}` (the raw key with log_key, else
// empty).
type Handler struct {
	// RateLimits defines zones for this handler, keyed by zone name. Zone
	// names are unique across the whole config.
	RateLimits map[string]*Zone `json:"rate_limits,omitempty"`

	// Zones names zones defined in the rate_limit app (the Caddyfile's
	// rate_limit global option) that this handler also enforces.
	Zones []string `json:"zones,omitempty"`

	// Jitter adds a random fraction of the wait, from 0 up to jitter times
	// the wait, to Retry-After, so clients told to wait do not all return
	// at once. 0.2 adds up to 20%. Default 0; must not be negative.
	Jitter float64 `json:"jitter,omitempty"`

	// SweepInterval is accepted for compatibility with caddy-ratelimit and
	// has no effect: a zone's memory is fixed, there is nothing to sweep.
	// Must not be negative.
	SweepInterval caddy.Duration `json:"sweep_interval,omitempty"`

	// Distributed is accepted and validated for compatibility with
	// caddy-ratelimit; cluster synchronisation is not implemented yet, so
	// each instance limits on its own.
	Distributed *Distributed `json:"distributed,omitempty"`

	// StorageRaw is accepted for compatibility with caddy-ratelimit (the
	// storage distributed limiting would sync through); it is not used yet.
	StorageRaw json.RawMessage `json:"storage,omitempty" caddy:"namespace=caddy.storage inline_key=module"`

	// LogKey puts the raw key in the log line of a denied request and in
	// the `{http.rate_limit.key}` placeholder. Default false: keys may be
	// secrets (API keys, session tokens).
	LogKey bool `json:"log_key,omitempty"`

	// DisableMetrics stops this handler from counting requests in the
	// caddy_rate_limit_requests_total metric.
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

	zones  []*zone // inline zones by name, then referenced global zones
	owned  []*zone // inline zones, released at Cleanup
	ctx    caddy.Context
	logger *zap.Logger
	events *caddyevents.App
	// sleep holds a delayed request; tests replace it to drive time.
	sleep func(context.Context, time.Duration) error
}

// Distributed configures cluster-wide limiting through storage. It is parsed
// and validated only, for compatibility with caddy-ratelimit.
type Distributed struct {
	// How often to read the other instances' state. Must not be negative.
	ReadInterval caddy.Duration `json:"read_interval,omitempty"`
	// How often to write this instance's state. Must not be negative.
	WriteInterval caddy.Duration `json:"write_interval,omitempty"`
	// How old another instance's state may be before it is ignored. Must
	// not be negative.
	PurgeAge caddy.Duration `json:"purge_age,omitempty"`
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
	if h.Distributed != nil || len(h.StorageRaw) > 0 {
		h.logger.Warn("distributed and storage are accepted for compatibility but not implemented yet: this instance limits on its own")
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
	h.events = eventsIface.(*caddyevents.App)
	if !h.DisableMetrics {
		registerMetrics(ctx)
	}
	for _, name := range slices.Sorted(maps.Keys(h.RateLimits)) {
		zc := h.RateLimits[name]
		if zc == nil {
			return fmt.Errorf("zone %q: no configuration", name)
		}
		z, err := provisionZone(ctx, name, zc)
		if err != nil {
			return err
		}
		h.owned = append(h.owned, z)
		if err := app.addInline(z); err != nil {
			return err
		}
		h.zones = append(h.zones, z)
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
	h.sleep = sleep
	return nil
}

// Validate checks the handler's own settings, naming the field at fault.
// Zones are checked as they are provisioned.
func (h *Handler) Validate() error {
	if h.Jitter < 0 || math.IsNaN(h.Jitter) {
		return fmt.Errorf("jitter %v: must be a fraction of the wait, at least 0", h.Jitter)
	}
	if h.SweepInterval < 0 {
		return fmt.Errorf("sweep_interval %v: must not be negative", time.Duration(h.SweepInterval))
	}
	if d := h.Distributed; d != nil {
		for _, f := range []struct {
			name string
			v    caddy.Duration
		}{{"read_interval", d.ReadInterval}, {"write_interval", d.WriteInterval}, {"purge_age", d.PurgeAge}} {
			if f.v < 0 {
				return fmt.Errorf("distributed: %s %v: must not be negative", f.name, time.Duration(f.v))
			}
		}
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

// verdict is one zone's answer to one request.
type verdict struct {
	z *zone
	// d is the zone's answer: its rate's and quotas' combined (combine).
	d limiter.Decision
	// rate and q are the answers of the zone's rate and of each quota.
	rate limiter.Decision
	q    []limiter.Decision
	hash uint64
	key  string
	// keyName is the key as configured that gave key, "" for none.
	keyName string
	weight  int64
	// logged: a zone with action log would have denied the request.
	// delayed: a zone with action delay held it; debt is its charge.
	logged, delayed bool
	debt            limiter.Reservation
}

// maxInlineVerdicts is how many zones a request can apply without the
// handler allocating to remember their verdicts.
const maxInlineVerdicts = limiter.MaxInlinePolicies

// ServeHTTP checks r against every zone that applies to it.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if len(h.zones) == 0 {
		return next.ServeHTTP(w, r)
	}
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	var txn limiter.Txn
	var buf [maxInlineVerdicts]verdict
	verdicts := buf[:0]
	var qbuf [maxInlineVerdicts]limiter.Decision
	quotas := qbuf[:0]
	for _, z := range h.zones {
		if len(z.matchers) > 0 {
			ok, err := z.matchers.AnyMatchWithError(r)
			if err != nil {
				return caddyhttp.Error(http.StatusInternalServerError, err)
			}
			if !ok {
				continue
			}
		}
		v := verdict{z: z}
		v.hash, v.key, v.keyName = z.key(r, repl)
		wt, err := z.weightOf(r, repl, h.Weight)
		if err != nil {
			txn.Rollback()
			return err
		}
		v.weight = wt
		quotas = z.reserveQuotas(&v, quotas)
		if z.action != actionLog {
			z.take(&txn, &v)
		}
		verdicts = append(verdicts, v)
	}
	if len(verdicts) == 0 {
		return next.ServeHTTP(w, r)
	}
	denied := txn.Denied()
	if denied {
		held, err := h.delay(r, verdicts)
		if err != nil {
			return err
		}
		denied = !held
		// Zones that granted before the denial have been refunded, and
		// a held request waited: ask them again what the key holds now.
		for i := range verdicts {
			if v := &verdicts[i]; v.z.action != actionLog {
				v.z.peek(v, held)
				if held {
					v.d.Allowed, v.d.RetryAfter = true, 0
				}
			}
		}
	}
	logged := h.dryRun(verdicts, denied)
	if !h.DisableMetrics {
		count(verdicts, denied)
	}
	if !h.DisableHeaders {
		setHeaders(w.Header(), verdicts)
	}
	main := deciding(verdicts)
	v := verdicts[main]
	repl.Set("http.rate_limit.zone", v.z.nameValue)
	repl.Set("http.rate_limit.limit", v.z.burstValue)
	repl.Set("http.rate_limit.remaining", v.d.Remaining)
	repl.Set("http.rate_limit.key_name", v.keyName)
	if h.LogKey {
		repl.Set("http.rate_limit.key", v.key)
	} else {
		repl.Set("http.rate_limit.key", "")
	}
	if !denied {
		if logged {
			return h.passLogged(w, r, repl, verdicts, main, next)
		}
		repl.Set("http.rate_limit.retry_after", 0)
		return h.serveCharged(w, r, verdicts, next)
	}
	return h.deny(w, r, repl, verdicts, main)
}

// deciding picks the verdict that describes the request: the first denial
// (by a zone with action log, if the request passed), or if none, the zone
// with the fewest requests left.
func deciding(verdicts []verdict) int {
	best, logged := 0, -1
	for i, v := range verdicts {
		if !v.d.Allowed {
			if v.z.action != actionLog {
				return i
			}
			if logged < 0 {
				logged = i
			}
		}
		if v.d.Remaining < verdicts[best].d.Remaining {
			best = i
		}
	}
	if logged >= 0 {
		return logged
	}
	return best
}

// deny answers a request that some zone denied: Retry-After, a log line, an
// event, and the 429 error, returned unwrapped so handle_errors sees it.
func (h *Handler) deny(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, verdicts []verdict, main int) error {
	wait, _ := h.retryAfter(w, repl, verdicts, main, true)
	zoneName := verdicts[main].z.name

	ip := clientIP(r)
	if ce := h.logger.Check(zap.InfoLevel, "rate limit exceeded"); ce != nil {
		fields := []zap.Field{
			zap.String("zone", zoneName),
			zap.String("client_ip", ip),
			zap.Duration("wait", wait),
		}
		if h.LogKey {
			fields = append(fields, zap.String("key", verdicts[main].key))
		}
		ce.Write(fields...)
	}
	if h.events != nil {
		data := map[string]any{"zone": zoneName, "wait": wait, "client_ip": ip}
		if h.LogKey {
			data["key"] = verdicts[main].key
		}
		h.events.Emit(h.ctx, "rate_limit_exceeded", data)
	}
	return caddyhttp.Error(http.StatusTooManyRequests, fmt.Errorf("rate limit exceeded in zone %q", zoneName))
}

// retryAfter sets Retry-After and the placeholders of a denial, and returns
// the wait and its seconds. The request passes when every zone allows it:
// the wait is the slowest of the zones that deny it, counting only zones
// that enforce (enforcing) or only zones with action log (not enforcing).
func (h *Handler) retryAfter(w http.ResponseWriter, repl *caddy.Replacer, verdicts []verdict, main int, enforcing bool) (time.Duration, int64) {
	var wait time.Duration
	for _, v := range verdicts {
		if !v.d.Allowed && (v.z.action != actionLog) == enforcing {
			wait = max(wait, v.d.RetryAfter)
		}
	}
	if h.Jitter > 0 && wait < limiter.Never {
		extra := time.Duration(float64(wait) * h.Jitter * rand.Float64())
		if extra > 0 && wait <= limiter.Never-extra {
			wait += extra
		}
	}
	secs := max(ceilSeconds(wait), 1)
	w.Header().Set("Retry-After", strconv.FormatInt(secs, 10))
	repl.Set("http.rate_limit.exceeded.name", verdicts[main].z.nameValue)
	repl.Set("http.rate_limit.retry_after", secs)
	return wait, secs
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
