package floodgate

import (
	"github.com/floodgate-rl/floodgate/limiter"
)

// The parts of a zone's memory, as the admin API (memory.parts) and
// /metrics (caddy_rate_limit_memory_bytes's part label) name them; sizing.md
// gives each one's formula.
const (
	// partTable is the zone's table of counters (token buckets or
	// windows).
	partTable = "table"
	// partQuotas is the sketches of the quotas of a zone that is not
	// distributed: a distributed zone's quotas count in its cluster's
	// sketches instead.
	partQuotas = "quotas"
	// The parts of a distributed zone's cluster state, summed over its
	// rate's and each quota's (storage.Memory).
	partClusterSketch = "cluster_sketch"
	partClusterSums   = "cluster_sums"
	partClusterShares = "cluster_shares"
	partMitigation    = "mitigation"
)

// memoryPartOrder is the order `zones` prints a zone's memory parts in.
var memoryPartOrder = []string{partTable, partQuotas, partClusterSketch, partClusterSums, partClusterShares, partMitigation}

// memory returns what the zone holds now, by part. Every part the zone has
// is listed, at 0 while it holds nothing yet (a cluster's sums before the
// first read).
func (z *zone) memory() map[string]int {
	parts := map[string]int{partTable: z.buckets.Bytes()}
	if z.dist == nil {
		for _, q := range z.quotas {
			if s, ok := q.(*limiter.Sketch); ok {
				parts[partQuotas] += s.Bytes()
			}
		}
		return parts
	}
	for _, p := range []string{partClusterSketch, partClusterSums, partClusterShares, partMitigation} {
		parts[p] = 0
	}
	for _, sc := range z.dist.synced {
		m := sc.cluster.Memory()
		parts[partClusterSketch] += m.Sketch
		parts[partClusterSums] += m.Sums
		parts[partClusterShares] += m.Shares
		parts[partMitigation] += m.Mitigation
	}
	return parts
}

// memoryTotal is the sum of parts.
func memoryTotal(parts map[string]int) int {
	n := 0
	for _, b := range parts {
		n += b
	}
	return n
}
