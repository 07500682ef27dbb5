package cluster

import (
	"strings"
	"testing"
	"time"
)

// aggregatingLog is what an instance logs when it becomes its zone's
// aggregator (storage/aggregate.go).
const aggregatingLog = "this instance aggregates the zone's cluster state"

// aggregators returns the nodes that have logged becoming the aggregator.
func aggregators(nodes []*node) []*node {
	var found []*node
	for _, n := range nodes {
		if strings.Contains(n.logs(), aggregatingLog) {
			found = append(found, n)
		}
	}
	return found
}

// Five instances on one storage elect an aggregator, which publishes the
// sum of their snapshots for the others to read. Killed (SIGKILL), it
// leaves its lock behind: the others read every snapshot again as soon as
// its aggregate is stale, so the cluster keeps its limit, and once the
// storage expires the lock (FileStorage: 10 s without its refresh;
// caddy-storage-redis: 5 s) another instance takes over, and the cluster
// still holds its limit through the new aggregate.
func TestAggregatorKilledClusterStillLimits(t *testing.T) {
	for _, store := range []string{"file_system", "redis"} {
		t.Run(store, func(t *testing.T) {
			storage := fileStorage(t.TempDir())
			if store == "redis" {
				storage = redisStorage(startRedis(t))
			}
			nodes := startCluster(t, 5, storage, zoneBody(exhaustWindow, "1m"))
			var dead *node
			waitFor(t, 20*time.Second, "an aggregator", func() bool {
				found := aggregators(nodes)
				if len(found) == 1 {
					dead = found[0]
				}
				return len(found) == 1
			})
			var rest []*node
			for _, n := range nodes {
				if n != dead {
					rest = append(rest, n)
				}
			}
			checkShared(t, nodes, "before", store+", with an aggregator")

			dead.kill()
			killed := time.Now()
			// At once, while its lock is held and its aggregate goes stale.
			checkShared(t, rest, "during", store+", the aggregator killed")
			waitFor(t, 40*time.Second, "another instance aggregating", func() bool { return len(aggregators(rest)) == 1 })
			t.Logf("%s: another instance aggregated within %v of the aggregator's death", store, time.Since(killed).Round(100*time.Millisecond))
			checkShared(t, rest, "after", store+", after the aggregator's failover")
			for _, n := range rest {
				if n.exited() {
					t.Fatalf("node %d exited:\n%s", n.i, n.logs())
				}
			}
		})
	}
}
