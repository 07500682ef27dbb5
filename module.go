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

// testNow, when set by a test in this package, is the clock of every table
// created afterwards.
var testNow func() time.Time

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
}

// Destruct implements caddy.Destructor. The table is garbage once no config
// refers to it.
func (*table) Destruct() error { return nil }

// acquireTable returns the table for key, creating it with cfg if no running
// or loading config holds one. It never changes an existing table: limits are
// applied by App.Start, when the config that asked for them goes live.
func acquireTable(key tableKey, cfg limiter.BucketsConfig) (*limiter.Buckets, error) {
	v, _, err := tables.LoadOrNew(key, func() (caddy.Destructor, error) {
		if testNow != nil {
			cfg.Now = testNow
		}
		b, err := limiter.NewBuckets(cfg)
		if err != nil {
			return nil, err
		}
		return &table{buckets: b}, nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*table).buckets, nil
}

// releaseTable gives back one reference taken by acquireTable.
func releaseTable(key tableKey) {
	_, _ = tables.Delete(key)
}
