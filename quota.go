package floodgate

import (
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Quota is a rolling limit: at most max_events tokens in any window of the
// given length, enforced with Cloudflare's two-window estimate in a
// count-min sketch of fixed size (limiter.Sketch). It suits long windows
// (10,000 per day) beside a zone's short-term rate.
type Quota struct {
	// MaxEvents is how many tokens a key may take in any window. At least
	// 1, at most 4294967295.
	MaxEvents int64 `json:"max_events,omitempty"`
	// Window is the length of the rolling window. At least 1ms.
	Window caddy.Duration `json:"window,omitempty"`
}

// maxQuotas is how many quotas a zone may have (an hour's and a day's, say):
// each is one more decision per request, and every zone's room for them is
// on the stack of every request.
const maxQuotas = 2

// sketchRows is the depth of every quota's sketch: limiter's default.
const sketchRows = limiter.DefaultSketchRows

// A quotaPolicy is what decides a zone's quota: its limiter.Sketch, or in a
// distributed zone its storage.Cluster, whose own sketch counts what this
// instance granted and whose decisions add the other instances' counts
// (cluster.go). Add charges a cost learned after the request, Quota is the
// quota's count.
type quotaPolicy interface {
	limiter.Policy
	Add(h uint64, n int64, now time.Time)
	Quota() int64
	// Reset forgets the key with hash h at now (the admin API's reset):
	// in a cluster, on every instance once they have read it.
	Reset(h uint64, now time.Time)
}

// validateQuotas checks the zone's quotas, naming the one at fault.
func (zc *Zone) validateQuotas(where string) error {
	if len(zc.Quotas) > maxQuotas {
		return fmt.Errorf("%squota: at most %d quotas per zone, got %d", where, maxQuotas, len(zc.Quotas))
	}
	for i, q := range zc.Quotas {
		w := time.Duration(q.Window)
		if q.MaxEvents < 1 || q.MaxEvents > limiter.MaxSketchQuota {
			return fmt.Errorf("%squota %d %v: the count must be between 1 and %d", where, q.MaxEvents, w, int64(limiter.MaxSketchQuota))
		}
		if w < limiter.MinSketchWindow || w > limiter.MaxSketchWindow {
			return fmt.Errorf("%squota %d %v: the window must be at least %v", where, q.MaxEvents, w, limiter.MinSketchWindow)
		}
		for _, p := range zc.Quotas[:i] {
			if p.Window == q.Window {
				return fmt.Errorf("%squota %d %v: the zone already has a quota over %v", where, q.MaxEvents, w, w)
			}
		}
	}
	return nil
}

// sketchWidth sizes a quota's sketch from the zone's settings. With memory
// set, each quota gets that much memory too. Otherwise the width is the
// smallest at which a key shares a cell with one of `sources` other active
// keys in every row with a probability of at most false_deny:
// (1 − e^(−sources/width))^rows ≤ false_deny. Sharing a cell is necessary
// for a key under its quota to be denied, not sufficient, so this bounds
// the false-deny rate from above.
func (zc *Zone) sketchWidth() int {
	if zc.Memory != 0 {
		return int(min(max(zc.Memory/(16*sketchRows), 1), limiter.MaxSketchWidth))
	}
	sources, fd := float64(zc.EffectiveSources()), zc.EffectiveFalseDeny()
	w := -sources / math.Log1p(-math.Pow(fd, 1.0/sketchRows))
	return int(min(math.Ceil(w), limiter.MaxSketchWidth))
}

// provisionQuotas acquires the zone's sketches, names them and adds their
// RateLimit-Policy items to z.policy. The caller releases them (z.release).
func (z *zone) provisionQuotas(zc *Zone) error {
	width := zc.sketchWidth()
	for _, q := range zc.Quotas {
		key := sketchKey{zone: z.name, quota: q.MaxEvents, window: time.Duration(q.Window), width: width}
		s, err := acquireSketch(key)
		if err != nil {
			return fmt.Errorf("zone %q: quota %d %v: %v", z.name, q.MaxEvents, key.window, err)
		}
		z.skeys = append(z.skeys, key)
		z.quotas = append(z.quotas, s)
		qn := quotaName(z.name, key.window)
		z.quotaNames = append(z.quotaNames, qn)
		z.quotaW = append(z.quotaW, key.window)
		z.policy += ", " + policyItem(qn, limiter.Limit{Events: q.MaxEvents, Window: key.window, Burst: q.MaxEvents}) + z.unit
	}
	return nil
}

// releaseQuotas gives back the zone's references to its sketches.
func (z *zone) releaseQuotas() {
	for _, k := range z.skeys {
		releaseSketch(k)
	}
}

// quotaName names a quota in the RateLimit headers: the zone and the window
// in its largest whole unit up to hours, e.g. "api/24h" or "api/90s".
func quotaName(zone string, w time.Duration) string {
	s := int64(w / time.Second)
	switch {
	case w%time.Second != 0:
		return zone + "/" + strconv.FormatInt(int64(w/time.Millisecond), 10) + "ms"
	case s%3600 == 0:
		return zone + "/" + strconv.FormatInt(s/3600, 10) + "h"
	case s%60 == 0:
		return zone + "/" + strconv.FormatInt(s/60, 10) + "m"
	}
	return zone + "/" + strconv.FormatInt(s, 10) + "s"
}

// unmarshalQuota reads `quota <n> <duration>`.
func (zc *Zone) unmarshalQuota(d *caddyfile.Dispenser, where string) error {
	args := d.RemainingArgs()
	if len(args) != 2 {
		return d.Errf("%squota %v: needs a count and a duration, e.g. quota 10000 24h", where, args)
	}
	n, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || n < 1 {
		return d.Errf("%squota %q: the count must be a whole number of at least 1", where, args[0])
	}
	dur, err := caddy.ParseDuration(args[1])
	if err != nil || dur <= 0 {
		return d.Errf("%squota %s %q: the window must be a positive duration", where, args[0], args[1])
	}
	zc.Quotas = append(zc.Quotas, Quota{MaxEvents: n, Window: caddy.Duration(dur)})
	return nil
}
