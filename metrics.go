package floodgate

import (
	"errors"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
)

// An outcome is what a zone did with a request.
type outcome uint8

const (
	outcomeAllowed outcome = iota
	outcomeDenied
	// logged and delayed are for zones whose action is to log, or to hold,
	// an over-limit request instead of denying it (action log, action
	// delay).
	outcomeLogged
	outcomeDelayed
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"allowed", "denied", "logged", "delayed"}

// zoneCounts is what a zone has done, kept per zone name in countsPool so
// that every config holding a zone of that name shares it: counts survive a
// reload (the new config acquires them before the old one releases them) and
// go when the last config with the zone is cleaned up. It also holds the
// sketch of the zone's most denied sources, and the zone's table statistics
// computed at most once per statsEvery.
type zoneCounts struct {
	// requests by outcome. Each update is one atomic add on a line every
	// core writes, which is what a Prometheus counter would cost.
	requests [numOutcomes]atomic.Uint64
	// extraWeight by outcome is the weight beyond 1 per request, so that a
	// request of weight 1 costs one atomic add; the weight of an outcome is
	// requests + extraWeight.
	extraWeight [numOutcomes]atomic.Uint64
	// connections decided by layer4 matchers: allowed, denied and logged.
	connections [outcomeLogged + 1]atomic.Uint64
	// layer4 is set once a layer4 matcher uses the zone, which then reports
	// connections.
	layer4 atomic.Bool
	// concDenied counts the requests (and layer4 connections) denied for
	// want of a place (max_concurrent), among the denied ones.
	concDenied atomic.Uint64
	// held is the number of requests waiting for tokens now (the delayed
	// outcome, before its wait is over).
	held atomic.Int64

	// top ranks the sources the zone denied most.
	top *limiter.TopK[source]

	statsMu sync.Mutex
	statsAt time.Time
	statsOf limiter.Table
	stats   limiter.BucketStats
}

const (
	// topCapacity is how many sources a zone's sketch tracks: any source
	// with more than 1/64 of the zone's denials is sure to be among them.
	topCapacity = 64
	// topWindow is the sketch's window: /top covers the last one to two.
	topWindow = time.Minute
	// statsEvery bounds how often a zone's table is measured (up to
	// 65,536 lines read, about a millisecond), however often /metrics and
	// the admin API are asked.
	statsEvery = time.Second
)

// count records a request of the given weight.
func (c *zoneCounts) count(o outcome, weight int64) {
	c.requests[o].Add(1)
	if weight != 1 {
		c.extraWeight[o].Add(uint64(weight - 1))
	}
}

// weight returns the total weight of the requests with outcome o.
func (c *zoneCounts) weight(o outcome) uint64 {
	return c.requests[o].Load() + c.extraWeight[o].Load()
}

// tableStats measures b, or returns the figures measured less than
// statsEvery ago.
func (c *zoneCounts) tableStats(b limiter.Table, now time.Time) limiter.BucketStats {
	c.statsMu.Lock()
	defer c.statsMu.Unlock()
	if c.statsOf != b || now.Sub(c.statsAt) >= statsEvery || now.Before(c.statsAt) {
		c.stats, c.statsOf, c.statsAt = b.Stats(now), b, now
	}
	return c.stats
}

// Metric descriptions. Labels are bounded by the configuration (zone, and an
// outcome from a fixed list): never a key.
var (
	requestsDesc = prometheus.NewDesc("caddy_rate_limit_requests_total",
		"HTTP requests checked by a rate_limit zone, by zone and outcome (allowed, denied, logged, delayed).",
		[]string{"zone", "outcome"}, nil)
	weightDesc = prometheus.NewDesc("caddy_rate_limit_weight_total",
		"Weight of the HTTP requests checked by a rate_limit zone, by zone and outcome: each request's weight when it arrived (1 unless a weight rule says otherwise), without the costs responses report later.",
		[]string{"zone", "outcome"}, nil)
	connectionsDesc = prometheus.NewDesc("caddy_rate_limit_connections_total",
		"Connections checked by a layer4 rate_limit matcher, by zone and outcome (allowed, denied, logged).",
		[]string{"zone", "outcome"}, nil)
	synsDesc = prometheus.NewDesc("caddy_rate_limit_xdp_syns_total",
		"TCP SYNs decided by a zone's XDP program, by zone and outcome (passed, dropped), since its table was made.",
		[]string{"zone", "outcome"}, nil)
	initialsDesc = prometheus.NewDesc("caddy_rate_limit_xdp_quic_initials_total",
		"QUIC Initials that open a connection, on the UDP ports a zone's XDP program limits, by zone and outcome (passed, dropped), since its table was made.",
		[]string{"zone", "outcome"}, nil)
	inFlightDesc = prometheus.NewDesc("caddy_rate_limit_in_flight_requests",
		"Places in use in a rate_limit zone with max_concurrent: its requests (or layer4 connections) in flight.",
		[]string{"zone"}, nil)
	concDeniedDesc = prometheus.NewDesc("caddy_rate_limit_concurrent_denied_total",
		"Requests (and layer4 connections) a rate_limit zone denied for want of a place (max_concurrent); they are also counted as denied in caddy_rate_limit_requests_total (caddy_rate_limit_connections_total).",
		[]string{"zone"}, nil)
	heldDesc = prometheus.NewDesc("caddy_rate_limit_held_requests",
		"Requests a rate_limit zone is holding until they may pass.",
		[]string{"zone"}, nil)
	memoryDesc = prometheus.NewDesc("caddy_rate_limit_memory_bytes",
		"Memory a rate_limit zone holds, by part (table, quotas, and a distributed zone's cluster_sketch, cluster_sums, cluster_shares, mitigation): sum by zone for its total.",
		[]string{"zone", "part"}, nil)
	occupancyDesc = prometheus.NewDesc("caddy_rate_limit_occupancy_ratio",
		"Share of a rate_limit zone's counters in use (not full), measured at most once a second.",
		[]string{"zone"}, nil)
	falseDenyDesc = prometheus.NewDesc("caddy_rate_limit_false_deny_ratio",
		"Estimated probability that a rate_limit zone denies a key never seen before, measured at most once a second.",
		[]string{"zone"}, nil)
	// The series a dashboard built for caddy-ratelimit reads, without its
	// per-key label (a raw key never reaches /metrics): see
	// docs/migration.md#dashboards.
	declinedDesc = prometheus.NewDesc("caddy_rate_limit_declined_requests_total",
		"HTTP requests a rate_limit zone declined with 429, by zone (caddy-ratelimit's series, without its key label).",
		[]string{"zone"}, nil)
	configDesc = prometheus.NewDesc("caddy_rate_limit_config",
		"A rate_limit zone's configuration in its labels (caddy-ratelimit's series); 1 for each zone of the running config.",
		[]string{"zone", "max_events", "window", "ipv4_prefix", "ipv6_prefix"}, nil)
	keysDesc = prometheus.NewDesc("caddy_rate_limit_keys_total",
		"Estimated number of keys a rate_limit zone holds state for (keys not back to their full limit), from the share of its counters in use, measured at most once a second.",
		[]string{"zone"}, nil)
	clusterSkippedDesc = prometheus.NewDesc("caddy_rate_limit_cluster_skipped_total",
		"Entries under a distributed zone's storage prefix skipped because they are not well-formed snapshots of it, each time they were read.",
		[]string{"zone"}, nil)
	clusterErrorsDesc = prometheus.NewDesc("caddy_rate_limit_cluster_storage_errors_total",
		"Failed cluster storage operations of a distributed zone (read, write, restore): meanwhile it limits with what this instance knows.",
		[]string{"zone", "op"}, nil)
	clusterConflictsDesc = prometheus.NewDesc("caddy_rate_limit_cluster_instance_conflicts_total",
		"Times a distributed zone found another process publishing under this process's Caddy instance id (processes sharing a data directory); after the first, this process publishes under a name of its own.",
		[]string{"zone"}, nil)
	clusterLastSuccessDesc = prometheus.NewDesc("caddy_rate_limit_cluster_last_success_timestamp_seconds",
		"When a distributed zone's cluster storage read (its view of the other instances) or write (theirs of it) last succeeded, as Unix time: time() minus it is how stale that view may be.",
		[]string{"zone", "op"}, nil)
)

// collector reports the zones of the running config when scraped. Zones a
// reload removed are not running, so their series are gone.
type collector struct{}

func (collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{requestsDesc, weightDesc, connectionsDesc, synsDesc, initialsDesc, heldDesc, memoryDesc, occupancyDesc, falseDenyDesc, inFlightDesc, concDeniedDesc,
		declinedDesc, configDesc, keysDesc, clusterSkippedDesc, clusterErrorsDesc, clusterConflictsDesc, clusterLastSuccessDesc} {
		ch <- d
	}
}

func (collector) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	for _, z := range liveZones() {
		c := z.counts
		for o := range numOutcomes {
			ch <- prometheus.MustNewConstMetric(requestsDesc, prometheus.CounterValue, float64(c.requests[o].Load()), z.name, outcomeNames[o])
			ch <- prometheus.MustNewConstMetric(weightDesc, prometheus.CounterValue, float64(c.weight(o)), z.name, outcomeNames[o])
		}
		if c.layer4.Load() {
			for o := range outcome(len(c.connections)) {
				ch <- prometheus.MustNewConstMetric(connectionsDesc, prometheus.CounterValue, float64(c.connections[o].Load()), z.name, outcomeNames[o])
			}
		}
		if x := z.table.xdp.info(); x != nil {
			ch <- prometheus.MustNewConstMetric(synsDesc, prometheus.CounterValue, float64(x.Passed), z.name, "passed")
			ch <- prometheus.MustNewConstMetric(synsDesc, prometheus.CounterValue, float64(x.Dropped), z.name, "dropped")
			ch <- prometheus.MustNewConstMetric(initialsDesc, prometheus.CounterValue, float64(x.InitialsPassed), z.name, "passed")
			ch <- prometheus.MustNewConstMetric(initialsDesc, prometheus.CounterValue, float64(x.InitialsDropped), z.name, "dropped")
		}
		if z.conc != nil {
			ch <- prometheus.MustNewConstMetric(inFlightDesc, prometheus.GaugeValue, float64(z.conc.InUse()), z.name)
			ch <- prometheus.MustNewConstMetric(concDeniedDesc, prometheus.CounterValue, float64(c.concDenied.Load()), z.name)
		}
		s := c.tableStats(z.buckets, now)
		ch <- prometheus.MustNewConstMetric(heldDesc, prometheus.GaugeValue, float64(c.held.Load()), z.name)
		for part, n := range z.memory() {
			ch <- prometheus.MustNewConstMetric(memoryDesc, prometheus.GaugeValue, float64(n), z.name, part)
		}
		ch <- prometheus.MustNewConstMetric(occupancyDesc, prometheus.GaugeValue, s.Busy, z.name)
		ch <- prometheus.MustNewConstMetric(falseDenyDesc, prometheus.GaugeValue, s.FalseDeny, z.name)
		ch <- prometheus.MustNewConstMetric(declinedDesc, prometheus.CounterValue, float64(c.requests[outcomeDenied].Load()), z.name)
		ch <- prometheus.MustNewConstMetric(configDesc, prometheus.CounterValue, 1, z.name, strconv.FormatInt(z.limit.Events, 10),
			z.limit.Window.String(), strconv.Itoa(z.v4), strconv.Itoa(z.v6))
		ch <- prometheus.MustNewConstMetric(keysDesc, prometheus.GaugeValue, activeKeys(s), z.name)
		if z.dist == nil {
			continue
		}
		// A quota's cluster state syncs on its own: its series are
		// labelled with its name ("api/24h quota").
		for _, sc := range z.dist.synced {
			cl, name := sc.cluster, sc.shape.Zone
			ch <- prometheus.MustNewConstMetric(clusterSkippedDesc, prometheus.CounterValue, float64(cl.Skipped()), name)
			ch <- prometheus.MustNewConstMetric(clusterConflictsDesc, prometheus.CounterValue, float64(cl.Conflicts()), name)
			for _, op := range storage.Ops {
				ch <- prometheus.MustNewConstMetric(clusterErrorsDesc, prometheus.CounterValue, float64(cl.Failed(op)), name, op.String())
			}
			for _, op := range []storage.Op{storage.OpRead, storage.OpWrite} {
				if at, ok := cl.LastSuccess(op); ok {
					ch <- prometheus.MustNewConstMetric(clusterLastSuccessDesc, prometheus.GaugeValue, float64(at.UnixNano())/1e9, name, op.String())
				}
			}
		}
	}
}

// activeKeys estimates how many keys hold state in a table measured as s:
// keys whose counters are not back to full. No key is stored, so it is
// counted as a Bloom filter's linear counting does: each key busies K of the
// m counters of a line picked by its hash (16 in a token-bucket table, 8 in a
// window table), so with n keys over L lines (Poisson, n/L a line) a counter
// is still idle with probability e^(−(n/L)·K/m), and
//
//	n = −(m·L/K)·ln(1 − busy).
//
// Keys whose counters collide count once; a table with every counter busy
// reports what one idle counter in the sample would give.
func activeKeys(s limiter.BucketStats) float64 {
	if s.Lines == 0 || s.K == 0 || s.Sampled == 0 {
		return 0
	}
	m := s.Counters / s.Lines
	idle := 1 - s.Busy
	if floor := 1 / float64(s.Sampled*m); idle < floor {
		idle = floor
	}
	return math.Round(-float64(m*s.Lines) / float64(s.K) * math.Log(idle))
}

// registerMetrics registers the collector with the registry of the config
// being loaded: each config has its own registry, and the collector reads
// counts that outlive any one config.
func registerMetrics(ctx caddy.Context) {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return
	}
	if err := reg.Register(collector{}); err != nil {
		var already prometheus.AlreadyRegisteredError
		if !errors.As(err, &already) {
			ctx.Logger().Error("registering rate_limit metrics: " + err.Error())
		}
	}
}
