// max_concurrent: a zone's places in flight. A zone that has it admits each
// request into its table of places (limiter.Concurrency) beside charging its
// rate and quotas; the request holds its place until the handler returns
// (after the response, an error, a panic of a later handler, a client gone
// away or an upstream timeout: every way out of ServeHTTP), and a denial by
// any policy of any zone releases every place the request took. The tables
// outlive configs as the rate's do, so a request admitted under one config
// releases its place into the table the next one uses. A layer4 matcher's
// connections take places in the same table, each held until its socket
// closes (layer4/places.go).

package floodgate

import (
	"context"
	cryptorand "crypto/rand"
	"encoding/binary"
	"fmt"
	"math"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/limiter"
)

// concTables holds every zone's table of places across reloads, keyed by a
// concKey. max_concurrent is not part of the key: a reload that changes it
// keeps the table, and with it the places in use (App.Start sets it). A
// reload that changes the table's size makes a new one, which counts the
// places still in use in the old one until they are given back (follow).
var concTables = caddy.NewUsagePool()

// A concKey identifies a table of places: a zone keeps it across a reload
// if its name and the table's size stay the same.
type concKey struct {
	zone  string
	lines int
}

// concEntry is the value held in concTables. secret is what table.secret
// is to a rate's table, for a zone that has max_concurrent alone: its keys'
// salts, drawn once per table so that a reload finds a key's places where
// it left them.
type concEntry struct {
	c      *limiter.Concurrency
	secret uint64
	queue  *concQueue    // the requests waiting for a place (action delay)
	gone   chan struct{} // closed by Destruct: ends unfollowLoop
}

// Destruct implements caddy.Destructor: a table is garbage once no config
// holds it; the requests that still hold places in it release them there
// (and the table that replaced it counts them meanwhile: follow).
func (e concEntry) Destruct() error {
	close(e.gone)
	return nil
}

// unfollowEvery is how often a table that replaced another looks whether
// the places in use there are all given back (limiter.Concurrency.Unfollow
// reads every line of it).
const unfollowEvery = time.Second

// resized returns the entry of the zone named zone's table of another
// size than key's that a config loaded now holds (a reload that changed
// the zone's memory), if there is one.
func resized(zone string, key concKey) (concEntry, bool) {
	var old concEntry
	found := false
	concTables.Range(func(k, v any) bool {
		if ck := k.(concKey); ck.zone == zone && ck != key {
			old, found = v.(concEntry), true
			return false
		}
		return true
	})
	return old, found
}

// follow makes e, a new table of places, count for each key the places
// still in use in old, the zone's table it replaces: the requests and
// connections admitted there give their places back to it, and until they
// have, a key must not get n in each. e has old's secret, so that a key
// hashes alike in both. A goroutine stops following once no place is
// left there, or when e goes.
func (e concEntry) follow(old concEntry) {
	e.c.Follow(old.c)
	go func() {
		t := time.NewTicker(unfollowEvery)
		defer t.Stop()
		for !e.c.Unfollow() {
			select {
			case <-t.C:
			case <-e.gone:
				return
			}
		}
	}()
}

// provisionConcurrency acquires zc's table of places, if it has
// max_concurrent, at its limit if the table is new.
func (z *zone) provisionConcurrency(zc *Zone) error {
	if zc.MaxConcurrent == 0 {
		return nil
	}
	z.ckey = concKey{zone: z.name, lines: zc.ConcurrencyLines()}
	// Looked up first: a UsagePool's Range waits for the values being
	// constructed.
	old, isResized := resized(z.name, z.ckey)
	v, loaded, err := concTables.LoadOrNew(z.ckey, func() (caddy.Destructor, error) {
		c, err := limiter.NewConcurrency(zc.Concurrency())
		if err != nil {
			return nil, err
		}
		secret := old.secret
		if !isResized {
			var b [8]byte
			if _, err := cryptorand.Read(b[:]); err != nil {
				return nil, fmt.Errorf("drawing the table's secret: %v", err)
			}
			secret = binary.LittleEndian.Uint64(b[:])
		}
		return concEntry{c: c, secret: secret, queue: &concQueue{waiting: make(map[uint64][]chan struct{})}, gone: make(chan struct{})}, nil
	})
	if err != nil {
		return fmt.Errorf("zone %q: %v", z.name, err)
	}
	e := v.(concEntry)
	if !loaded && isResized {
		e.follow(old)
	}
	z.conc, z.maxConcurrent, z.concSecret = e.c, zc.MaxConcurrent, e.secret
	if z.action.holds() {
		z.queue = e.queue
	}
	z.concPolicy = concPolicyItem(z.name, zc.MaxConcurrent)
	return nil
}

// releaseConcurrency gives back the zone's reference to its table.
func (z *zone) releaseConcurrency() {
	if z.conc != nil {
		_, _ = concTables.Delete(z.ckey)
	}
}

// concName is the name of a zone's max_concurrent in the RateLimit headers.
func concName(zone string) string { return zone + "-concurrent" }

// concPolicyItem is the RateLimit-Policy item of a zone's max_concurrent:
// `"<zone>-concurrent";q=<n>;qu="concurrent-requests"`, the draft's unit
// for requests in flight, with no window (a place has none).
func concPolicyItem(zone string, n int64) string {
	return fmt.Sprintf(`"%s";q=%d;qu="concurrent-requests"`, concName(zone), n)
}

// concRetryAfter is the wait told to a request denied for want of a place:
// no table knows when a request in flight will end, so the honest answer
// is the shortest Retry-After there is, a second; a client that retries
// then finds a place if one of the key's requests ended meanwhile.
const concRetryAfter = time.Second

// places are the places one request holds, one per zone with
// max_concurrent that admitted it. It is the request's one allocation for
// them, made only when it meets such a zone.
type places struct {
	held []limiter.Place
	// wakes[i] is the queue to wake when held[i] is released, and the
	// key's hash: the zone's, if it has action delay.
	wakes []placeWake
	n     int
}

type placeWake struct {
	q *concQueue
	h uint64
}

func newPlaces(zones int) *places {
	return &places{held: make([]limiter.Place, zones), wakes: make([]placeWake, zones)}
}

// admit takes a place in z for the key with hash h and returns the
// decision, RetryAfter set for a denial. In a zone with action delay it
// waits for a place, up to max_delay, behind the key's earlier requests
// (concQueue), and returns an error if the client goes away meanwhile.
func (ps *places) admit(ctx context.Context, z *zone, h uint64) (limiter.Decision, error) {
	var d limiter.Decision
	if z.queue != nil {
		var err error
		if d, _, err = z.queue.admit(ctx, z.conc, h, &ps.held[ps.n], z.maxDelay); err != nil {
			return d, err
		}
	} else {
		d = z.conc.AdmitHash(h, &ps.held[ps.n])
	}
	if d.Allowed {
		ps.wakes[ps.n] = placeWake{z.queue, h}
		ps.n++
	} else {
		d.RetryAfter = concRetryAfter
	}
	return d, nil
}

// release gives back every place held, waking the first request of its
// key that waits for one; a second call gives back nothing.
func (ps *places) release() {
	if ps == nil {
		return
	}
	for i := range ps.held[:ps.n] {
		if ps.held[i].Release() && ps.wakes[i].q != nil {
			ps.wakes[i].q.wake(ps.wakes[i].h)
		}
	}
	ps.n = 0
}

// peekConc is what z's table says of the key with hash h now, taking
// nothing: the decision a request would get.
func (z *zone) peekConc(h uint64) limiter.Decision {
	d := z.conc.PeekHash(h)
	if !d.Allowed {
		d.RetryAfter = concRetryAfter
	}
	return d
}

// noRate is the rate of a zone that has max_concurrent alone: it grants
// every request, charges nothing and holds no memory, so that the decision
// path, the admin API and the metrics treat every zone alike.
type noRate struct{}

func (noRate) TakeHash(uint64, int64, time.Time) (limiter.Decision, limiter.Reservation) {
	return noRateDecision, limiter.Reservation{}
}
func (noRate) PeekHash(uint64, int64, time.Time) limiter.Decision { return noRateDecision }
func (noRate) Refund(limiter.Reservation)                         {}
func (noRate) Allow([]byte, int64, time.Time) limiter.Decision    { return noRateDecision }
func (noRate) Charge(uint64, int64, time.Time) (limiter.Decision, limiter.Reservation) {
	return noRateDecision, limiter.Reservation{}
}
func (noRate) Fill(uint64)                             {}
func (noRate) Limit() limiter.Limit                    { return limiter.Limit{} }
func (noRate) SetLimit(limiter.Limit, time.Time) error { return nil }
func (noRate) Sweep(time.Time)                         {}
func (noRate) SweepInterval() time.Duration            { return time.Hour }
func (noRate) Stats(time.Time) limiter.BucketStats     { return limiter.BucketStats{} }
func (noRate) Bytes() int                              { return 0 }
func (noRate) Lines() int                              { return 0 }
func (noRate) K() int                                  { return limiter.DefaultK }

// noRateDecision grants with as much left as a count can say, so that a
// zone's remaining count is its places' (verdict.combine takes the least).
var noRateDecision = limiter.Decision{Allowed: true, Limit: math.MaxInt64, Remaining: math.MaxInt64}

var _ limiter.Table = noRate{}
