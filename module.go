// Package floodgate is a rate limiter for the Caddy web server whose memory is
// fixed by configuration, not by the number of clients.
//
// It registers three things with Caddy:
//
//   - the HTTP handler http.handlers.rate_limit (handler.go), which checks a
//     request against every zone that applies to it and answers 429 when any
//     of them is exhausted;
//   - the app rate_limit (app.go), which holds zones defined once in the
//     Caddyfile's rate_limit global option and shared by any number of sites
//     and routes, and which applies limit changes when a config goes live;
//   - the Caddyfile directive and global option rate_limit (caddyfile.go).
//
// A zone (zone.go) is a named policy: its keys, its rate and burst, its
// matchers, and a fixed-size table of token buckets from package limiter.
// Start reading at Zone, then Handler.ServeHTTP.
//
// Tables live in a package-level caddy.UsagePool keyed by zone name and table
// shape, so they survive config reloads: a reload that keeps a zone's name
// and memory keeps its state, and a changed rate is applied to that state when
// the new config starts (see App.Start). A reload that fails never reaches
// Start, so it leaves the running state untouched.
package floodgate

import (
	"fmt"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/limiter"
)

func init() {
	caddy.RegisterModule(Handler{})
	caddy.RegisterModule(App{})
}

// tables holds every zone's token-bucket table across config reloads. The key
// is a tableKey; the value a *table.
var tables = caddy.NewUsagePool()

// A tableKey identifies a table: a zone keeps its table across a reload only
// if its name and the table's shape stay the same.
type tableKey struct {
	zone  string
	lines int
	k     int
}

func (k tableKey) String() string {
	return fmt.Sprintf("%s (%d lines, k=%d)", k.zone, k.lines, k.k)
}

// table is the value held in tables.
type table struct {
	buckets *limiter.Buckets

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
	prev := t.buckets.Limit()
	if prev != limit {
		if err := t.buckets.SetLimit(limit, time.Now()); err != nil {
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
		_ = t.buckets.SetLimit(t.prevLimit, time.Now())
	}
	t.owner, t.prevOwner = t.prevOwner, nil
}

// Destruct implements caddy.Destructor. The table is garbage once no config
// refers to it.
func (*table) Destruct() error { return nil }

// acquireTable returns the table for key, creating it with cfg if no running
// or loading config holds one. It never changes an existing table: limits are
// applied by App.Start, when the config that asked for them goes live.
func acquireTable(key tableKey, cfg limiter.BucketsConfig) (*table, error) {
	v, _, err := tables.LoadOrNew(key, func() (caddy.Destructor, error) {
		b, err := limiter.NewBuckets(cfg)
		if err != nil {
			return nil, err
		}
		return &table{buckets: b}, nil
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

// Interface guards
var _ caddy.Destructor = (*table)(nil)
