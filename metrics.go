package floodgate

import (
	"errors"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// requests counts the requests the rate_limit handler decided and the
// connections the layer4 matcher decided, by zone and outcome (allowed or
// denied). Labels are bounded by the configuration: never a key.
var requests = prometheus.NewCounterVec(prometheus.CounterOpts{
	Namespace: "caddy",
	Subsystem: "rate_limit",
	Name:      "requests_total",
	Help:      "Requests (HTTP) and connections (layer4) checked by rate_limit, by zone and outcome.",
}, []string{"zone", "outcome"})

// clusterSkipped counts the entries under a distributed zone's storage
// directory that were not well-formed snapshots of it (temporary files,
// truncated or foreign files, other versions), each time they were read.
var clusterSkipped = prometheus.NewCounterVec(prometheus.CounterOpts{
	Namespace: "caddy",
	Subsystem: "rate_limit",
	Name:      "cluster_skipped_total",
	Help:      "Entries under a distributed zone's storage prefix skipped because they are not well-formed snapshots, by zone.",
}, []string{"zone"})

// clusterFailed counts failed cluster storage operations (op: read, write,
// restore): while they fail, the zone limits with what this instance knows.
var clusterFailed = prometheus.NewCounterVec(prometheus.CounterOpts{
	Namespace: "caddy",
	Subsystem: "rate_limit",
	Name:      "cluster_storage_errors_total",
	Help:      "Failed cluster storage operations of distributed zones, by zone and op (read, write, restore).",
}, []string{"zone", "op"})

// counter is a metric a zone increments; nil when metrics are disabled.
type counter = prometheus.Counter

// registerMetrics registers the collectors with the registry of the config
// being loaded: each config has its own registry, and the same collector
// registered again keeps its counts across reloads.
func registerMetrics(ctx caddy.Context) {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return
	}
	for _, c := range []prometheus.Collector{requests, clusterSkipped, clusterFailed} {
		if err := reg.Register(c); err != nil {
			var already prometheus.AlreadyRegisteredError
			if !errors.As(err, &already) {
				ctx.Logger().Error("registering rate_limit metrics: " + err.Error())
			}
		}
	}
}
