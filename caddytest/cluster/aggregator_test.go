package cluster

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// aggregator returns the name of the instance that published zone
// "shared"'s aggregate in a file_system storage, and when, or "" if there
// is none. The stored form starts "FGAG", a version byte and the
// aggregator's name (a uvarint length, then the name): see
// storage/aggregate.go.
func aggregator(store string) (string, time.Time) {
	file := filepath.Join(store, "rate_limit_aggregate", "shared")
	data, err := os.ReadFile(file)
	fi, err2 := os.Stat(file)
	if err != nil || err2 != nil || len(data) < 6 || string(data[:4]) != "FGAG" {
		return "", time.Time{}
	}
	n, k := binary.Uvarint(data[5:])
	if k <= 0 || uint64(len(data)-5-k) < n {
		return "", time.Time{}
	}
	return string(data[5+k : 5+k+int(n)]), fi.ModTime()
}

// Five instances on file storage elect an aggregator, which publishes the
// sum of their snapshots for the others to read. Killed (SIGKILL), it
// leaves its lock behind: the others read every snapshot again as soon as
// its aggregate is stale, so the cluster keeps its limit, and once the
// storage finds the lock stale (10 s without its refresh) another
// instance takes over, and the cluster still holds its limit through the
// new aggregate.
func TestAggregatorKilledClusterStillLimits(t *testing.T) {
	store := t.TempDir()
	nodes := startCluster(t, 5, fileStorage(store), zoneBody(exhaustWindow, "1m"))
	var name string
	waitFor(t, 20*time.Second, "an aggregate", func() bool {
		name, _ = aggregator(store)
		return name != ""
	})
	var dead *node
	var rest []*node
	for _, n := range nodes {
		if n.instanceID() == name {
			dead = n
		} else {
			rest = append(rest, n)
		}
	}
	if dead == nil {
		t.Fatalf("the aggregate's aggregator %q is none of the instances", name)
	}
	checkShared(t, nodes, "before", "file_system, with an aggregator")

	dead.kill()
	killed := time.Now()
	// At once, while its lock is held and its aggregate goes stale.
	checkShared(t, rest, "during", "file_system, the aggregator killed")
	var next string
	var at time.Time
	waitFor(t, 40*time.Second, "another instance aggregating", func() bool {
		next, at = aggregator(store)
		return next != "" && next != name && at.After(killed)
	})
	t.Logf("a new aggregator published %v after the last one was killed", at.Sub(killed).Round(100*time.Millisecond))
	checkShared(t, rest, "after", "file_system, after the aggregator's failover")
	for _, n := range rest {
		if n.exited() {
			t.Fatalf("node %d exited:\n%s", n.i, n.logs())
		}
	}
}
