// Package floodgate is a rate limiter for the Caddy web server whose memory is
// fixed by configuration, not by the number of clients.
//
// It registers with Caddy:
//
//   - the HTTP handler http.handlers.rate_limit (handler.go), which checks a
//     request against every zone that applies to it and answers 429 when any
//     of them is exhausted;
//   - the app rate_limit (app.go), which holds zones defined once in the
//     Caddyfile's rate_limit global option and shared by any number of sites
//     and routes, and which applies limit changes when a config goes live;
//   - the Caddyfile directive and global option rate_limit (caddyfile.go);
//   - the admin API admin.api.rate_limit (admin.go) and the command
//     `caddy rate-limit` over it (command.go), each registered beside its
//     code.
//
// Importing it also registers the layer4 connection matcher
// layer4.matchers.rate_limit (package layer4, through layer4.go), which draws
// on the same zones.
//
// A zone (zone.go) is a named policy: its keys, its rate and burst, its
// matchers, and a fixed-size table of token buckets from package limiter.
// Start reading at Zone, then Handler.ServeHTTP and decide.go.
//
// Tables live in a package-level caddy.UsagePool keyed by zone name and table
// shape, so they survive config reloads: a reload that keeps a zone's name
// and memory keeps its state, and a changed rate is applied to that state when
// the new config starts (see App.Start). A reload that fails never reaches
// Start, so it leaves the running state untouched. tables.go holds that pool,
// the pools of the quotas' sketches and of the zones' counts, and the
// protocol by which configs take and give back a table's limit.
//
// Where things are:
//
//   - zone.go: Zone (a zone's configuration), its validation and
//     provisioning, and the charging of its policies (takeAll, peekAll,
//     take, ask, peek) that the decision path and action.go call; key.go: how
//     a zone reads a key from a request; quota.go: quotas; weights.go: a zone's weights, checked
//     against what it can grant, their Caddyfile forms and the charging of
//     what a response reports (the rules, their matchers and the response
//     writer are package weight); action.go: what a zone does with a request
//     it would deny (deny, log, delay), as methods the decision path asks,
//     and the holding of a delayed request;
//   - handler.go: the HTTP handler's configuration and lifecycle; decide.go:
//     the way of a request, from taking every zone to the verdict, whose
//     calls run one way (decide.go → action.go, weights.go, headers.go →
//     zone.go → package limiter); headers.go: the RateLimit and Retry-After
//     headers; denylog.go: the denial log and the record of denied sources;
//   - app.go: the rate_limit app and the registry of the running config;
//     tables.go: the state that outlives a config; cluster.go: distributed
//     zones (their rate's and quotas' cluster state) and their storage;
//     xdp.go: a zone's XDP side;
//   - caddyfile.go: the Caddyfile directive and global option (each
//     setting's parser sits beside its concept); warnings.go: checks at
//     load; admin.go, command.go: the admin API and `caddy rate-limit`;
//     metrics.go: the Prometheus series; layer4.go: the zones as package
//     layer4 sees them.
package floodgate

import (
	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(Handler{})
	caddy.RegisterModule(App{})
}
