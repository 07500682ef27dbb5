// Actions: what a zone does with a request it would deny. deny answers 429
// and log lets it pass, showing only what enforcing would do (both in
// decide.go: deny, dryRun, passLogged); delay holds it until its tokens
// return (delay, hold, here). An action is a constant, its Caddyfile and
// JSON forms (unmarshalAction, validateAction, parseAction) and its methods
// (enforces, holds), which are all the decision path asks of it. The calls
// run one way: decide.go calls delay, which charges through the zone's
// methods (zone.go) and never calls back up.

package floodgate

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// action is what a zone does with a request it would deny.
type action uint8

const (
	actionDeny  action = iota // answer 429 (the default)
	actionLog                 // let it pass, charging nothing; log and count it
	actionDelay               // hold it until its tokens return, within max_delay
)

// enforces reports whether the zone's denial denies the request: the zone is
// charged with the others in one transaction, advertises its policy in the
// RateLimit headers, and describes a request it denies. A zone that does not
// enforce (action log) is decided on its own afterwards, by dryRun.
func (a action) enforces() bool { return a != actionLog }

// holds reports whether the zone holds a request it would deny until its
// tokens return (see delay), rather than answering at once. Only an HTTP
// request can be held: a layer4 matcher decides a connection at its accept.
func (a action) holds() bool { return a == actionDelay }

// maxHeld is how many requests a zone holds at once with action delay. A
// held request keeps its goroutine, its connection and a timer; beyond this
// many, a request the zone would hold is denied at once, so that delaying
// cannot become a flood of waiting requests.
const maxHeld = 1024

// validateAction checks action and max_delay.
func (zc *Zone) validateAction(where string) error {
	switch zc.Action {
	case "", "deny", "log":
		if zc.MaxDelay != 0 {
			return fmt.Errorf("%smax_delay %v: only with action delay", where, time.Duration(zc.MaxDelay))
		}
	case "delay":
		if zc.MaxDelay <= 0 {
			return fmt.Errorf("%saction delay %v: the longest delay must be positive", where, time.Duration(zc.MaxDelay))
		}
	default:
		return fmt.Errorf("%saction %q: must be deny, log or delay", where, zc.Action)
	}
	return nil
}

func parseAction(s string) action {
	switch s {
	case "log":
		return actionLog
	case "delay":
		return actionDelay
	}
	return actionDeny
}

// unmarshalAction reads `action deny | log | delay <max>`.
func (zc *Zone) unmarshalAction(d *caddyfile.Dispenser, where string) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	switch a := d.Val(); a {
	case "deny", "log":
		if d.NextArg() {
			return d.ArgErr()
		}
		zc.Action = a
	case "delay":
		v, err := zoneconf.OneArg(d)
		if err != nil {
			return d.Errf("%saction delay: needs the longest delay, e.g. action delay 2s", where)
		}
		dur, err := caddy.ParseDuration(v)
		if err != nil || dur <= 0 {
			return d.Errf("%saction delay %q: the longest delay must be a positive duration", where, v)
		}
		zc.Action, zc.MaxDelay = a, caddy.Duration(dur)
	default:
		return d.Errf("%saction %q: must be deny, log or delay <max>", where, a)
	}
	return nil
}

// sleep waits for d or until ctx is done, whichever comes first, and
// returns ctx's error in the second case.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// delay tries to hold a request that the zones of verdicts denied (their
// charges already rolled back) instead of denying it. It holds only if every
// zone that denied it has action delay, denied it on its rate alone (a quota
// does not delay: its tokens return over minutes or hours) and would grant
// it within its max_delay, and no such zone already holds maxHeld requests.
// In a distributed zone the rate is the local bucket's and the cluster's
// together: a request the cluster's estimate denies is held until that
// estimate lets it through, within max_delay, and one that only this
// instance's share of the key keeps out (bursts split) is held until a
// read re-balances the shares and lets it through, up to max_delay
// (clusterWait).
//
// The request's tokens are reserved at once: in the zones that delay, by a
// charge that drives the key into debt (limiter.Buckets.Charge) or takes its
// place in the window (zone.reserve), so every later request waits behind
// this one and held requests never pass faster than the rate; in every other
// zone and quota, by a normal take. It then waits until its debt is repaid
// and the clusters of the zones that hold it let it through, and is counted
// in those clusters and windows when it goes (see hold).
//
// It returns (false, 0, nil) if the request must be denied after all, having
// charged nothing; true and the time it waited once the request may go on,
// charged everywhere; and an error if the client went away meanwhile, every
// charge returned.
func (h *Handler) delay(r *http.Request, verdicts []verdict, now time.Time) (bool, time.Duration, error) {
	for i := range verdicts {
		v := &verdicts[i]
		if !v.z.action.enforces() || v.d.Allowed {
			continue
		}
		// A request denied a place has waited for one already, up
		// to max_delay (concQueue): it is not held again.
		if !v.z.action.holds() || !v.quotasAllowed() || v.z.conc != nil && !v.conc.Allowed ||
			v.rate.RetryAfter > v.z.maxDelay && !v.shareDenied(now) {
			return false, 0, nil
		}
	}
	var txn limiter.Txn
	var wait time.Duration
	ok := true
	for i := range verdicts {
		v := &verdicts[i]
		if !v.z.action.enforces() {
			continue
		}
		held := &v.z.counts.held
		if !v.z.action.holds() || v.rate.Allowed {
			v.z.take(&txn, v.c.hash, v.weight, now)
		} else if ok = held.Add(1) <= maxHeld; !ok {
			held.Add(-1)
			break
		} else {
			d, res := v.z.reserve(v.c.hash, v.weight, now)
			v.delayed, v.debt = true, res
			if ok = d.Allowed && d.RetryAfter <= v.z.maxDelay; !ok {
				break
			}
			wait = max(wait, d.RetryAfter)
			if v.z.dist != nil {
				if c := v.z.dist.cluster.PeekHash(v.c.hash, v.weight, now); !c.Allowed {
					var cw time.Duration
					if cw, _, ok = v.clusterWait(c, now, 0); !ok {
						break
					}
					wait = max(wait, cw)
				}
			}
		}
		for _, s := range v.z.quotas {
			v.z.ask(&txn, s, v.c.hash, v.weight, now) // a zone charged after the response only checks
		}
	}
	var err error
	if ok = ok && !txn.Denied(); ok {
		ok, wait, err = h.hold(r, verdicts, now, wait)
	}
	if !ok {
		txn.Rollback()
		wait = 0
	}
	for i := range verdicts {
		if v := &verdicts[i]; v.delayed {
			v.z.counts.held.Add(-1)
			if !ok {
				v.z.buckets.Refund(v.debt)
				v.delayed = false
			}
		}
	}
	return ok, wait, err
}

// maxHoldRounds bounds how many times a held request waits for a cluster
// that is full: again after its wait each time the clusters of the zones
// that hold it are found full (other instances spent what it waited for),
// within max_delay. Waits for a share (clusterWait) are not counted: each
// is at least minShareWait, so max_delay bounds them.
const maxHoldRounds = 4

// minShareWait is the least a held request waits for a read to re-balance
// the shares (clusterWait): the shortest read interval.
const minShareWait = storage.MinInterval

// hold waits for a request that delay reserved, first for wait from now.
// Then the window zones and the clusters of the distributed zones that
// hold it must let it through at the time it goes, and count it: neither
// counts a request ahead of time as a bucket does (a window counts when
// requests went; a cluster's estimate is of what was granted). A window
// zone gives back the place it reserved (zone.reserve) and takes the
// request at once, checked as any request is; one that is still (or
// again) full (the window's sub-windows count a grant up to a sub-window
// longer than the reservation's wait said, or a key sharing its
// counters came), or a cluster whose share for this instance still keeps
// the key out, makes it wait again, its place reserved again, for as long
// as it says (clusterWait for a cluster), within each zone's max_delay;
// waits that are not for a share count against maxHoldRounds. It reports
// whether the request may go, how long it waited in all if so, and an
// error if the client went away. A request that may not go has no charge
// left in any of them but its reservations, which delay gives back.
func (h *Handler) hold(r *http.Request, verdicts []verdict, now time.Time, wait time.Duration) (bool, time.Duration, error) {
	var waited time.Duration
	for full := 0; ; {
		if err := h.sleep(r.Context(), wait); err != nil {
			return false, 0, caddyhttp.Error(499, fmt.Errorf("client went away while held by rate_limit: %w", err))
		}
		waited += wait
		at := now.Add(waited)
		var late limiter.Txn
		wait = 0
		shares := true
		for i := range verdicts {
			v := &verdicts[i]
			if !v.delayed {
				continue
			}
			if p := v.z.windowTable(); p != nil {
				v.z.buckets.Refund(v.debt)
				v.debt = limiter.Reservation{}
				if d := late.Take(p, v.c.hash, v.weight, at); !d.Allowed {
					if d.RetryAfter <= 0 || waited+d.RetryAfter > v.z.maxDelay {
						return false, 0, nil
					}
					shares = false
					wait = max(wait, d.RetryAfter)
				}
			}
			if v.z.dist == nil {
				continue
			}
			if d := late.Take(v.z.dist.cluster, v.c.hash, v.weight, at); !d.Allowed {
				cw, share, ok := v.clusterWait(d, at, waited)
				if !ok || !share && d.RetryAfter <= 0 {
					return false, 0, nil
				}
				shares = shares && share
				wait = max(wait, cw)
			}
		}
		if !late.Denied() {
			return true, waited, nil
		}
		for i := range verdicts {
			if v := &verdicts[i]; v.delayed && v.z.windowTable() != nil {
				_, v.debt = v.z.reserve(v.c.hash, v.weight, at)
			}
		}
		if !shares {
			if full++; full == maxHoldRounds {
				return false, 0, nil
			}
		}
	}
}

// clusterWait is how long a request held in v's distributed zone waits for
// the zone's cluster, which denied it with d at `at` when it had waited
// `waited`, before it asks again; share, if only the share of the key this
// instance leaves the other instances keeps it out (bursts split); and
// whether it may wait at all. A full cluster is waited for as long as d
// says, if that ends within max_delay. A share is waited for until the
// next read re-balances it (d's wait), at least minShareWait, as long as
// max_delay has not passed: a key that only reaches this instance gets its
// whole limit within a few reads, and meanwhile its requests are held
// rather than refused although the cluster has room for them.
func (v *verdict) clusterWait(d limiter.Decision, at time.Time, waited time.Duration) (wait time.Duration, share, ok bool) {
	left := v.z.maxDelay - waited
	if v.z.dist.cluster.ShareDenies(v.c.hash, v.weight, at) {
		return min(max(d.RetryAfter, minShareWait), left), true, left > 0
	}
	return d.RetryAfter, false, d.RetryAfter <= left
}

// shareDenied reports whether only the share of its key that this instance
// leaves the others keeps v's request out of v's distributed zone at now.
func (v *verdict) shareDenied(now time.Time) bool {
	return v.z.dist != nil && v.z.dist.cluster.ShareDenies(v.c.hash, v.weight, now)
}

// quotasAllowed reports whether every quota of v's zone allowed the request.
func (v *verdict) quotasAllowed() bool {
	for _, q := range v.quotas() {
		if !q.Allowed {
			return false
		}
	}
	return true
}
