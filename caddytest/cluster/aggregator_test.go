package cluster

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// aggregatingLog and notAggregatingLog are what an instance logs when it
// becomes its zone's aggregator and when it gives that up
// (storage/aggregate.go).
const (
	aggregatingLog    = "this instance aggregates the zone's cluster state"
	notAggregatingLog = "this instance no longer aggregates the zone's cluster state"
)

// aggregators returns the nodes whose last word on it is that they
// aggregate: an aggregator gives up when it finds too few instances live,
// which a loaded machine's late writes can make it find for a while, and
// another one takes over.
func aggregators(nodes []*node) []*node {
	var found []*node
	for _, n := range nodes {
		logs := n.logs()
		if strings.LastIndex(logs, aggregatingLog) > strings.LastIndex(logs, notAggregatingLog) {
			found = append(found, n)
		}
	}
	return found
}

// oneAggregator waits until exactly one of nodes aggregates and returns it,
// or fails with how often each became the aggregator and gave it up.
func oneAggregator(t *testing.T, nodes []*node, limit time.Duration) *node {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		if found := aggregators(nodes); len(found) == 1 {
			return found[0]
		}
		if time.Now().After(deadline) {
			var seen []string
			for _, n := range nodes {
				logs := n.logs()
				seen = append(seen, fmt.Sprintf("node %d: became it %d times, gave it up %d", n.i,
					strings.Count(logs, aggregatingLog), strings.Count(logs, notAggregatingLog)))
			}
			t.Fatalf("no single aggregator within %v: %s", limit, strings.Join(seen, "; "))
		}
		time.Sleep(20 * time.Millisecond)
	}
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
			oneAggregator(t, nodes, 20*time.Second)
			checkShared(t, nodes, "before", store+", with an aggregator")

			dead := oneAggregator(t, nodes, 20*time.Second) // the one now
			var rest []*node
			for _, n := range nodes {
				if n != dead {
					rest = append(rest, n)
				}
			}
			dead.kill()
			killed := time.Now()
			// At once, while its lock is held and its aggregate goes stale.
			checkShared(t, rest, "during", store+", the aggregator killed")
			oneAggregator(t, rest, 40*time.Second)
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

// file_system's lock can elect two aggregators: certmagic removes a lock
// file it finds stale and creates it again, so two instances that find the
// dead holder's file stale at once can both hold it, and its Unlock removes
// the file whoever created it. The test does to the storage what that race
// does, while the aggregator lives: it removes the lock file, the
// aggregate and the aggregator's claim (as if all three were a dead
// aggregator's, gone stale) until another instance finds none of them and
// takes the lock. The
// two are down to one through the aggregator's claim within seconds, and
// the cluster holds its limit.
func TestTwoAggregatorsOnTheFileSystemAreDownToOne(t *testing.T) {
	dir := t.TempDir()
	nodes := startCluster(t, 5, fileStorage(dir), zoneBody(exhaustWindow, "1m"))
	first := oneAggregator(t, nodes, 20*time.Second)
	others := func() (n int) {
		for _, o := range nodes {
			if o != first {
				n += strings.Count(o.logs(), aggregatingLog)
			}
		}
		return n
	}
	before := others()
	deadline := time.Now().Add(20 * time.Second)
	for others() == before {
		if time.Now().After(deadline) {
			t.Fatal("no other instance took the aggregator lock in 20 s of removing it and the aggregate")
		}
		locks, _ := filepath.Glob(filepath.Join(dir, "locks", "*aggregate*"))
		for _, l := range append(locks, filepath.Join(dir, "rate_limit_aggregate", "shared"), filepath.Join(dir, "rate_limit_aggregator", "shared")) {
			_ = os.Remove(l)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if len(aggregators([]*node{first})) != 1 {
		t.Fatalf("the first aggregator gave the role up on its own:\n%s", first.logs())
	}
	two := time.Now()
	one := oneAggregator(t, nodes, 10*time.Second)
	t.Logf("node %d aggregated beside node %d; within %v, node %d alone aggregates", firstOther(nodes, first), first.i,
		time.Since(two).Round(10*time.Millisecond), one.i)
	checkShared(t, nodes, "after", "file_system, after two aggregators")
}

// firstOther is the first of nodes other than n that has become an
// aggregator.
func firstOther(nodes []*node, n *node) int {
	for _, o := range nodes {
		if o != n && strings.Contains(o.logs(), aggregatingLog) {
			return o.i
		}
	}
	return -1
}
