package floodgate

// What outlives a config: every zone's token-bucket table, its quotas'
// sketches and its counts live in package-level pools, so that a reload
// that keeps a zone keeps its state. And the reload-ownership protocol: the
// limit in force on a table is the one of the config that last went live
// with it.

import (
	cryptorand "crypto/rand"
	"encoding/binary"
	"fmt"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/limiter"
)

// tables holds every zone's token-bucket table across config reloads. The key
// is a tableKey; the value a *table.
var tables = caddy.NewUsagePool()

// A tableKey identifies a table: a zone keeps its table across a reload only
// if its name and the table's shape stay the same.
type tableKey struct {
	zone  string
	lines int
	k     int
	// window: the table holds windows (no burst), not token buckets; a
	// zone that gains or loses its burst starts a new table.
	window bool
	// xdp is the zone's xdp setting with the prefixes the program masks
	// sources with, or empty: a reload that changes any of these makes a
	// new table. (One that changes the limit keeps it: setLimit.)
	xdp string
}

func (k tableKey) String() string {
	kind := "buckets"
	if k.window {
		kind = "windows"
	}
	return fmt.Sprintf("%s (%d lines of %s, k=%d)", k.zone, k.lines, kind, k.k)
}

// table is the value held in tables.
type table struct {
	buckets limiter.Table // token buckets or windows
	stop    chan struct{} // closed by Destruct: ends sweepLoop
	xdp     *xdpTable     // the XDP side, if the zone has one
	// limitChanged wakes sweepLoop after SetLimit: the sweep interval
	// follows the limit in force, and a faster limit must not wait out
	// a timer set for the slower one (days at 10 a minute, while a
	// million a second needs a sweep every second).
	limitChanged chan struct{}
	// secret is mixed into the salt of every key but the source address
	// (zone.seal), so that nobody who does not hold it can choose a
	// header value whose counters are a given client's: drawn once per
	// zone (a table of the zone that replaces another takes its secret,
	// acquireTable), it lasts as long as the table, across reloads.
	secret uint64

	// The limit in force is the one of the config (App) that last started
	// with this table. A config whose start fails after its rate_limit app
	// started is stopped without ever going live; it then gives the limit
	// back to the config that had it (see putInForce and giveBack).
	mu        sync.Mutex
	owner     *App
	prevOwner *App
	prevLimit limiter.Limit
}

// putInForce applies limit on behalf of the starting config app.
func (t *table) putInForce(app *App, limit limiter.Limit) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.owner == app {
		return nil
	}
	// The XDP program goes on the interface only now, when a config using
	// it starts: one that is only validated (or fails before starting)
	// never touches the interface.
	if err := t.xdp.attach(); err != nil {
		return err
	}
	prev := t.buckets.Limit()
	if prev != limit {
		if err := t.setLimit(limit); err != nil {
			return err
		}
	}
	t.prevOwner, t.prevLimit, t.owner = t.owner, prev, app
	return nil
}

// giveBack undoes putInForce if app is still the config whose limit is in
// force: app is being stopped without a newer config having started with
// this table, which happens when a later part of app's config failed to
// start. A config replaced by a newer one no longer owns the table, and
// changes nothing.
func (t *table) giveBack(app *App) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.owner != app {
		return
	}
	if t.buckets.Limit() != t.prevLimit {
		// prevLimit was in force before, so it is valid.
		_ = t.setLimit(t.prevLimit)
	}
	t.owner, t.prevOwner = t.prevOwner, nil
}

// Destruct implements caddy.Destructor: it stops the table's sweeps. The
// table is garbage once no config refers to it.
func (t *table) Destruct() error {
	close(t.stop)
	t.xdp.close()
	return nil
}

// setLimit puts l in force and reschedules the sweeps for it.
func (t *table) setLimit(l limiter.Limit) error {
	set := t.buckets.SetLimit
	if t.xdp != nil { // the program's map: converted into a new one
		set = t.xdp.setLimit
	}
	if err := set(l, time.Now()); err != nil {
		return err
	}
	select {
	case t.limitChanged <- struct{}{}:
	default: // a wake-up is already pending
	}
	return nil
}

// sweepLoop runs the table's Sweep twice per SweepInterval until the table
// is released. SetLimit wakes it (limitChanged): it then sweeps at once and
// starts over with the interval of the new limit, so a raised limit never
// waits out a timer chosen by the one it replaced. Sweeps never run in a
// request.
func (t *table) sweepLoop() {
	for {
		timer := time.NewTimer(t.buckets.SweepInterval() / 2)
		select {
		case <-t.stop:
			timer.Stop()
			return
		case <-t.limitChanged:
			timer.Stop()
		case <-timer.C:
		}
		t.buckets.Sweep(time.Now())
	}
}

// acquireTable returns the table for key, creating it with newTable if no
// running or loading config holds one (newTable returns the zone's XDP side
// too, if it has one). It never changes an existing table: limits are
// applied by App.Start, when the config that asked for them goes live.
//
// A new table of a zone that a loaded config holds another table of (a
// reload that resized it, or changed its kind) takes that table's secret:
// a key hashes alike in both, so that the zone's quotas keep their counts
// and its places in flight (follow) are found where they were taken.
func acquireTable(key tableKey, newTable func() (limiter.Table, *xdpTable, error)) (*table, error) {
	// Looked up first: a UsagePool's Range waits for the values being
	// constructed.
	var secret uint64
	tables.Range(func(k, v any) bool {
		if k.(tableKey).zone == key.zone && k != key {
			secret = v.(*table).secret
			return false
		}
		return true
	})
	v, _, err := tables.LoadOrNew(key, func() (caddy.Destructor, error) {
		t := &table{stop: make(chan struct{}), limitChanged: make(chan struct{}, 1), secret: secret}
		if t.secret == 0 {
			var b [8]byte
			if _, err := cryptorand.Read(b[:]); err != nil {
				return nil, fmt.Errorf("drawing the table's secret: %v", err)
			}
			t.secret = binary.LittleEndian.Uint64(b[:])
		}
		var err error
		t.buckets, t.xdp, err = newTable()
		if err != nil {
			return nil, err
		}
		go t.sweepLoop()
		return t, nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*table), nil
}

// releaseTable gives back one reference taken by acquireTable.
func releaseTable(key tableKey) {
	_, _ = tables.Delete(key)
}

// sketches holds every quota's sketch across config reloads, keyed by a
// sketchKey, as tables holds the token buckets.
var sketches = caddy.NewUsagePool()

// A sketchKey identifies a quota's state. The count is part of it: a
// sketch's quota cannot be handed back to the running config if a reload
// fails, so a changed quota starts afresh instead.
type sketchKey struct {
	zone   string
	quota  int64
	window time.Duration
	width  int
}

// sketchEntry is the value held in sketches.
type sketchEntry struct{ s *limiter.Sketch }

// Destruct implements caddy.Destructor.
func (sketchEntry) Destruct() error { return nil }

// acquireSketch returns the sketch for key, creating it if no running or
// loading config holds one. Release it with releaseSketch.
func acquireSketch(key sketchKey) (*limiter.Sketch, error) {
	v, _, err := sketches.LoadOrNew(key, func() (caddy.Destructor, error) {
		s, err := limiter.NewSketch(limiter.SketchConfig{Quota: key.quota, Window: key.window, Rows: sketchRows, Width: key.width})
		return sketchEntry{s}, err
	})
	if err != nil {
		return nil, err
	}
	return v.(sketchEntry).s, nil
}

// releaseSketch gives back one reference taken by acquireSketch.
func releaseSketch(key sketchKey) { _, _ = sketches.Delete(key) }

// countsPool holds a *zoneCounts per zone name.
var countsPool = caddy.NewUsagePool()

// Destruct implements caddy.Destructor.
func (*zoneCounts) Destruct() error { return nil }

// acquireCounts returns the counts of the zone name, shared with every other
// config that holds it. Release them with releaseCounts.
func acquireCounts(name string) *zoneCounts {
	v, _, _ := countsPool.LoadOrNew(name, func() (caddy.Destructor, error) {
		return &zoneCounts{top: limiter.NewTopK[source](topCapacity, topWindow)}, nil
	})
	return v.(*zoneCounts)
}

// releaseCounts gives back one reference taken by acquireCounts.
func releaseCounts(name string) { _, _ = countsPool.Delete(name) }

// Interface guards
var (
	_ caddy.Destructor = (*table)(nil)
	_ caddy.Destructor = sketchEntry{}
	_ caddy.Destructor = (*zoneCounts)(nil)
)
