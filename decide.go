// The decision path: what a request meets after Handler.ServeHTTP. serveAt
// weighs the request in every zone that applies to it and takes its tokens
// from every policy of each (the zone's rate, in its cluster too if it is
// distributed, and its quotas) in one transaction, so that a request denied
// by one policy is charged in none. A denial is then offered to the zones
// that hold (action.go: delay), the zones with action log are decided on
// their own (dryRun), and the verdict is answered: passed on, with
// response-reported weights charged after it (weights.go), or denied with a
// 429, its headers (headers.go), placeholders, log line (denylog.go) and
// event.
//
// The calls run one way along that path: this file calls action.go,
// weights.go and headers.go, those call the zone's charging methods (zone.go:
// takeAll, peekAll, take, ask, peek, which fill a verdict), and the zone
// calls the limiter; none of them calls back into a step above it.

package floodgate

import (
	"errors"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/floodgate-rl/floodgate/limiter"
)

// verdict is one zone's answer to one request.
type verdict struct {
	z *zone
	// d is the zone's answer: its rate's and quotas' combined (combine).
	d limiter.Decision
	c charge
	// rate and q are the answers of the zone's rate and of each of its
	// quotas (the first len(z.quotas) of q). q is an array, not a slice
	// of a buffer, so that verdicts stay on the stack.
	rate   limiter.Decision
	q      [maxQuotas]limiter.Decision
	weight int64
	// logged: a zone with action log would have denied the request.
	// delayed: a zone with action delay held it; debt is its charge.
	logged, delayed bool
	debt            limiter.Reservation
	// conc is the answer of the zone's max_concurrent, if it has one
	// (zone.conc): a place admitted, denied, or only peeked at.
	conc limiter.Decision
}

// maxInlineVerdicts is how many zones a request can apply without the
// handler allocating to remember their verdicts.
const maxInlineVerdicts = limiter.MaxInlinePolicies

// serveAt is ServeHTTP at time now.
func (h *Handler) serveAt(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, now time.Time) error {
	if len(h.zones) == 0 {
		return next.ServeHTTP(w, r)
	}
	q := request{r: r}
	q.repl, _ = r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if q.repl == nil {
		q.repl = caddy.NewReplacer()
	}
	var txn limiter.Txn
	var buf [maxInlineVerdicts]verdict
	verdicts := buf[:0]
	// ps are the places the request holds in zones with max_concurrent,
	// given back when the handler returns, whichever way it does (a
	// response, an error, a panic of a later handler), and at once if the
	// request is denied.
	var ps *places
	defer func() { ps.release() }()
	var keys [maxInlineVerdicts]charge
	read := h.touchAll(&q, &keys)
	// A request that fails in a zone (a matcher's error, a weight it
	// refuses) is not served: the zones before it give back what they
	// took, as when a zone denies.
	for i, z := range h.zones {
		if len(z.matchers) > 0 {
			ok, err := z.matchers.AnyMatchWithError(r)
			if err != nil {
				if !z.action.enforces() {
					// A dry run changes nothing clients see; the
					// matcher logged its error.
					continue
				}
				txn.RollbackAt(now)
				return caddyhttp.Error(http.StatusInternalServerError, err)
			}
			if !ok {
				continue
			}
		}
		v := verdict{z: z}
		if read&(1<<i) != 0 {
			v.c = keys[i]
		} else {
			v.c = z.key(&q)
		}
		wt, err := z.weightOf(r, q.repl, h.Weight)
		if err != nil {
			h.logRefusedWeight(&q, z, v.c, err, now)
			if !z.action.enforces() {
				// A dry run changes nothing clients see: the request
				// would be refused for its weight, and is only logged.
				continue
			}
			txn.RollbackAt(now)
			return err
		}
		v.weight = wt
		if z.action.enforces() {
			if z.conc != nil {
				if txn.Denied() {
					v.conc = z.peekConc(v.c.hash)
				} else {
					if ps == nil {
						ps = newPlaces(len(h.zones))
					}
					var err error
					if v.conc, err = ps.admit(r.Context(), z, v.c.hash); err != nil {
						txn.RollbackAt(now)
						return err
					}
					if !v.conc.Allowed {
						txn.Deny(now)
					}
				}
			}
			z.takeAll(&txn, &v, now)
		}
		verdicts = append(verdicts, v)
	}
	if len(verdicts) == 0 {
		return next.ServeHTTP(w, r)
	}
	denied := txn.Denied()
	if denied {
		held, wait, err := h.delay(r, verdicts, now)
		if !held {
			ps.release() // a denied request takes no place anywhere
		}
		if err != nil {
			return err
		}
		denied, now = !held, now.Add(wait)
		// Zones that granted before the denial have been refunded, and a
		// held request waited: ask them again what the key holds now.
		// Zones that denied note the source in their top sketch.
		for i := range verdicts {
			v := &verdicts[i]
			if !v.z.action.enforces() {
				continue
			}
			if denied && !v.d.Allowed {
				v.z.recordDenied(now, &q, v.c, h.LogKey)
			}
			v.z.peekAll(v, held, now)
			if held {
				v.d.Allowed, v.d.RetryAfter = true, 0
			}
		}
	}
	// A dry run's max_concurrent counts the requests it admits, so that
	// what it would refuse is what enforcing would.
	for i := range verdicts {
		v := &verdicts[i]
		if v.z.conc == nil || v.z.action.enforces() {
			continue
		}
		if denied {
			v.conc = v.z.peekConc(v.c.hash)
			continue
		}
		if ps == nil {
			ps = newPlaces(len(h.zones))
		}
		v.conc, _ = ps.admit(r.Context(), v.z, v.c.hash) // a dry run never waits
	}
	logged := h.dryRun(verdicts, denied, now)
	if !h.DisableMetrics {
		count(verdicts, denied)
	}
	main := deciding(verdicts)
	if denied {
		return h.deny(w, &q, verdicts, main, now)
	}
	if logged {
		return h.passLogged(w, &q, verdicts, main, next, now)
	}
	if !h.DisableHeaders {
		new(responseHeaders).setRateLimit(w.Header(), verdicts, 0, h.policyOf(verdicts))
	}
	// Static values: no allocation, and Caddy's replacer holds up to 8 of
	// them before its map grows.
	v := verdicts[main]
	q.repl.Set("http.rate_limit.zone", v.z.nameValue)
	q.repl.Set("http.rate_limit.limit", v.z.burstValue)
	q.repl.Set("http.rate_limit.remaining", boxCount(v.d.Remaining))
	q.repl.Set("http.rate_limit.retry_after", boxCount(0))
	q.repl.Set("http.rate_limit.key_name", v.z.keyNameValue(v.c))
	if h.LogKey {
		q.repl.Set("http.rate_limit.key", v.z.keyText(&q, v.c))
	} else {
		q.repl.Set("http.rate_limit.key", "")
	}
	return h.serveCharged(w, r, verdicts, next)
}

// touchAll reads the keys of the zones that apply to every request and
// touch nothing but the request to read them, into keys, and touches the
// memory each zone's policies will read for them (limiter.Touch), before
// any zone decides: so the cache misses of several zones overlap rather
// than add up. It returns which zones it read a key of, bit i for zone i;
// none if the handler has one zone (nothing to overlap) or more than keys
// holds. A zone with matchers, or with a key that expands placeholders
// (which may read the body), has its key read in its turn, after the
// matchers of the zones before it.
func (h *Handler) touchAll(q *request, keys *[maxInlineVerdicts]charge) (read uint16) {
	if len(h.zones) < 2 || len(h.zones) > len(keys) {
		return 0
	}
	for i, z := range h.zones {
		if len(z.matchers) > 0 || !z.action.enforces() || !z.keysReadRequestOnly() {
			continue
		}
		keys[i] = z.key(q)
		limiter.Touch(z.buckets, keys[i].hash)
		for _, s := range z.quotas {
			limiter.Touch(s, keys[i].hash)
		}
		read |= 1 << i
	}
	return read
}

// policyOf returns the RateLimit-Policy value of verdicts if it is made
// already: the handler's, when every zone of the handler applied (verdicts
// are in the order of h.zones, one at most per zone); else "".
func (h *Handler) policyOf(verdicts []verdict) string {
	if len(verdicts) == len(h.zones) {
		return h.policy
	}
	return ""
}

// deciding picks the verdict that describes the request: the first denial
// by a zone that enforces, else the first by a zone with action log, else
// the zone with the fewest requests left.
func deciding(verdicts []verdict) int {
	best, logged := 0, -1
	for i, v := range verdicts {
		if !v.d.Allowed {
			if v.z.action.enforces() {
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

// dryRun decides the zones with action log, each on its own, after the
// zones that enforce: a request they would deny passes, and is charged
// nothing in them, so that their state is what enforcing would have left.
// A request the enforcing zones denied is charged nothing anywhere; the log
// zones are then only asked what they hold. It reports whether a log zone
// would have denied the request, and marks its verdict logged.
func (h *Handler) dryRun(verdicts []verdict, denied bool, now time.Time) bool {
	logged := false
	var txn limiter.Txn
	for i := range verdicts {
		v := &verdicts[i]
		if v.z.action.enforces() {
			continue
		}
		if denied {
			v.z.peekAll(v, true, now)
		} else {
			txn = limiter.Txn{} // keeps the previous zone's charges
			v.z.takeAll(&txn, v, now)
		}
		if !v.d.Allowed {
			v.logged, logged = true, true
		}
	}
	return logged
}

// retryAfter is when v's zone lets the request through, as told to a
// client: the longest wait of its policies that deny it, each at most its
// RateLimit item's w (zone.told, zone.quotaTold); and most, the longest w
// of those policies, which no wait told the client exceeds, jitter
// included (Handler.overLimit).
func (v *verdict) retryAfter() (wait, most time.Duration) {
	if !v.rate.Allowed {
		wait, most = v.z.told(v.rate.RetryAfter), v.z.rateW
	}
	for j, q := range v.quotas() {
		if !q.Allowed {
			wait, most = max(wait, v.z.quotaTold(j, q.RetryAfter)), max(most, v.z.quotaW[j])
		}
	}
	if v.z.conc != nil && !v.conc.Allowed {
		// No table knows when a place frees: the wait told is its own
		// (1 s), not capped by any window.
		wait, most = max(wait, v.conc.RetryAfter), max(most, v.conc.RetryAfter)
	}
	return wait, most
}

// count adds the request to each zone's counts: allowed where it was
// charged, denied where an enforcing zone would deny it, logged where a log
// zone would, delayed where it was held; each with the request's weight. A
// zone that granted a request another zone denied counts nothing, as it was
// charged nothing.
func count(verdicts []verdict, denied bool) {
	for i := range verdicts {
		v := &verdicts[i]
		switch {
		case v.delayed:
			v.z.counts.count(outcomeDelayed, v.weight)
		case v.logged:
			v.z.counts.count(outcomeLogged, v.weight)
		case !v.d.Allowed:
			v.z.counts.count(outcomeDenied, v.weight)
			if v.z.conc != nil && !v.conc.Allowed {
				v.z.counts.concDenied.Add(1)
			}
		case !denied:
			v.z.counts.count(outcomeAllowed, v.weight)
		}
	}
}

// A denial is what the answer to one denied request needs beyond the zone's
// own values: its header values and its placeholders. It is the denial's one
// allocation, and its placeholder method the other.
type denial struct {
	headers    responseHeaders
	z          *zone
	remaining  int64
	retryAfter int64
	key        string
	keyName    string
}

// placeholder answers the rate_limit placeholders of a denied request.
// Registering it once (Replacer.Map) instead of setting six values keeps
// Caddy's map of set values, which the error handling then fills, small
// enough not to grow.
func (d *denial) placeholder(name string) (any, bool) {
	switch name {
	case "http.rate_limit.exceeded.name", "http.rate_limit.zone":
		return d.z.nameValue, true
	case "http.rate_limit.limit":
		return d.z.burstValue, true
	case "http.rate_limit.remaining":
		return d.remaining, true
	case "http.rate_limit.retry_after":
		return d.retryAfter, true
	case "http.rate_limit.key":
		return d.key, true
	case "http.rate_limit.key_name":
		return d.keyName, true
	}
	return nil, false
}

// deny answers a request that some zone denied: Retry-After, the
// placeholders, a log line (see denialLog), an event if anything listens,
// and the zone's 429 error, returned unwrapped so handle_errors sees it.
func (h *Handler) deny(w http.ResponseWriter, q *request, verdicts []verdict, main int, now time.Time) error {
	h.overLimit(w, q, verdicts, main, now, true)
	return verdicts[main].z.exceeded
}

// passLogged lets through a request that a zone with action log would have
// denied, with what a denial would have set for operators to see what
// enforcing would do (the placeholders, a log line, the counts), but nothing
// a client sees: no Retry-After, and the RateLimit headers of the enforcing
// zones only, as without the dry run.
func (h *Handler) passLogged(w http.ResponseWriter, q *request, verdicts []verdict, main int, next caddyhttp.Handler, now time.Time) error {
	h.overLimit(w, q, verdicts, main, now, false)
	return h.serveCharged(w, q.r, verdicts, next)
}

// overLimit answers a request over a limit, which enforcing zones deny, or
// which only zones with action log would deny (not enforcing: the request
// passes, with everything below for operators to see).
func (h *Handler) overLimit(w http.ResponseWriter, q *request, verdicts []verdict, main int, now time.Time, enforcing bool) {
	// The request passes when every zone allows it: wait for the slowest
	// of those that deny it (or, for a dry run, would).
	var wait, most time.Duration
	for _, v := range verdicts {
		if !v.d.Allowed && v.z.action.enforces() == enforcing {
			w, m := v.retryAfter()
			wait, most = max(wait, w), max(most, m)
		}
	}
	if h.Jitter > 0 && wait < limiter.Never {
		extra := time.Duration(float64(wait) * h.Jitter * rand.Float64())
		if extra > 0 && wait <= limiter.Never-extra {
			wait = min(wait+extra, max(most, wait))
		}
	}
	v := verdicts[main]
	d := &denial{z: v.z, remaining: v.d.Remaining, retryAfter: max(ceilSeconds(wait), 1), keyName: v.z.keyName(v.c)}
	hdr := w.Header()
	if enforcing {
		// A dry run sends no Retry-After: clients see what they would
		// see without the zones that only log.
		d.headers.setRetryAfter(hdr, d.retryAfter)
	}
	if !h.DisableHeaders {
		var told time.Duration
		if enforcing {
			told = wait
		}
		d.headers.setRateLimit(hdr, verdicts, told, h.policyOf(verdicts))
	}
	if h.LogKey {
		d.key = v.z.keyText(q, v.c)
	}
	// A rate_limit handler earlier in this request may have set the
	// placeholders; they would hide the provider's answers.
	q.repl.DeleteByPrefix("http.rate_limit.")
	q.repl.Map(d.placeholder)

	if h.logger.Core().Enabled(zapcore.InfoLevel) {
		info, suppressed := logOf(&v.z.denials).note(v.c.hash, now)
		level := zapcore.DebugLevel
		if info {
			level = zapcore.InfoLevel
		}
		// A dry run's line has a message of its own, so that the
		// fail2ban and CrowdSec filters of denials never ban for it.
		msg := "rate limit exceeded"
		if !enforcing {
			msg = "rate limit would be exceeded"
		}
		if ce := h.logger.Check(level, msg); ce != nil {
			fields := []zap.Field{
				zap.String("zone", v.z.name),
				zap.String("client_ip", q.clientIP().text),
				zap.String("source", v.z.source(v.c)),
				zap.String("key_name", d.keyName),
				zap.Int64("retry_after", d.retryAfter),
			}
			if !enforcing {
				fields = append(fields, zap.String("action", "log"))
			}
			if info {
				fields = append(fields, zap.Int64("suppressed", suppressed))
			}
			if h.LogKey {
				fields = append(fields, zap.String("key", d.key))
			}
			ce.Write(fields...)
		}
	}
	if enforcing && h.events != nil && h.events.ShouldEmit(exceededEvent) {
		data := map[string]any{
			"zone":        v.z.name,
			"client_ip":   q.clientIP().text,
			"source":      v.z.source(v.c),
			"wait":        wait,
			"retry_after": d.retryAfter,
		}
		if h.LogKey {
			data["key"] = d.key
		}
		h.events.Emit(h.ctx, exceededEvent, data)
	}
}

// logRefusedWeight logs a request that z answered with an error because of
// its weight (a 400 for a weight that is missing or not a number it can
// grant): at INFO for the first of a source's such requests in each
// interval of the denial log, which bounds the lines under a flood as for
// denials (denylog.go), at DEBUG for the others. Without it, a client sent
// a bare 400 and the operator saw nothing. A dry-run zone (action log)
// refuses nothing: it logs that it would have.
func (h *Handler) logRefusedWeight(q *request, z *zone, c charge, err error, now time.Time) {
	if !h.logger.Core().Enabled(zapcore.InfoLevel) {
		return
	}
	info, suppressed := logOf(&z.refusals).note(c.hash, now)
	level := zapcore.DebugLevel
	if info {
		level = zapcore.InfoLevel
	}
	msg := "rate limit weight refused"
	if !z.action.enforces() {
		msg = "rate limit weight would be refused"
	}
	if ce := h.logger.Check(level, msg); ce != nil {
		var he caddyhttp.HandlerError
		if errors.As(err, &he) {
			err = he.Err // without the trace and ID, which say nothing here
		}
		fields := []zap.Field{
			zap.String("zone", z.name),
			zap.String("client_ip", q.clientIP().text),
			zap.String("source", z.source(c)),
			zap.Error(err),
		}
		if info {
			fields = append(fields, zap.Int64("suppressed", suppressed))
		}
		ce.Write(fields...)
	}
}

// exceededEvent is the name of the event emitted for each denial.
const exceededEvent = "rate_limit_exceeded"

// denialError makes the error a zone returns for each request it denies. It
// is made once: Caddy's server only reads a HandlerError (by value, after a
// type assertion), so one value can answer every denial. That leaves out
// what caddyhttp.Error adds per call, a random ID and a stack trace: a
// flood should not pay for a runtime.Caller and a random string per request.
// `{http.error.id}` is therefore empty for a denial, and the trace names
// this handler.
func denialError(zoneName string) error {
	return caddyhttp.HandlerError{
		Err:        errors.New("rate limit exceeded in zone " + strconv.Quote(zoneName)),
		StatusCode: http.StatusTooManyRequests,
		Trace:      "floodgate.(*Handler).deny",
	}
}

// boxedCounts holds small counts converted to interface values once, so that
// setting a placeholder to one allocates nothing. (Go boxes integers below
// 256 without allocating; a zone's remaining requests are often more.)
var boxedCounts = func() (t [4096]any) {
	for i := range t {
		t[i] = int64(i)
	}
	return t
}()

// boxCount returns n as an interface value, without allocating if it is
// small.
func boxCount(n int64) any {
	if uint64(n) < uint64(len(boxedCounts)) {
		return boxedCounts[n]
	}
	return n
}
