package cluster

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// aggregatingLog and notAggregatingLog are what an instance logs when it
// becomes its zone's aggregator and when it gives that up
// (storage/aggregator.go).
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
			var seen, why []string
			for _, n := range nodes {
				logs := n.logs()
				state := ""
				if n.exited() {
					state = " (exited)"
				}
				seen = append(seen, fmt.Sprintf("node %d%s: became it %d times, gave it up %d", n.i, state,
					strings.Count(logs, aggregatingLog), strings.Count(logs, notAggregatingLog)))
				// What the rate limiter said of the aggregate, and any
				// warning or error: the lines that tell why.
				for line := range strings.Lines(logs) {
					if strings.Contains(line, "aggregat") || strings.Contains(line, `"level":"warn"`) || strings.Contains(line, `"level":"error"`) {
						why = append(why, fmt.Sprintf("node %d: %s", n.i, strings.TrimSpace(line)))
					}
				}
			}
			t.Fatalf("no single aggregator within %v: %s\n%s\n%s", limit, strings.Join(seen, "; "), strings.Join(why, "\n"), syncStacks(nodes))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// syncStacks returns, for each live node, the stacks of its goroutines
// that run floodgate's cluster code or keep a lock file fresh, from the
// admin API's pprof endpoint (where each node's syncs were when a test
// gave up on them), and the file system storage's lock files.
func syncStacks(nodes []*node) string {
	var out []string
	client := &http.Client{Timeout: 5 * time.Second}
	for _, n := range nodes {
		if !n.alive {
			continue
		}
		resp, err := client.Get(fmt.Sprintf("http://localhost:%d/debug/pprof/goroutine?debug=2", n.admin))
		if err != nil {
			out = append(out, fmt.Sprintf("node %d: %v", n.i, err))
			continue
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
		resp.Body.Close()
		for stack := range strings.SplitSeq(string(body), "\n\n") {
			if strings.Contains(stack, "floodgate/storage") || strings.Contains(stack, "keepLockfileFresh") {
				out = append(out, fmt.Sprintf("node %d: %s", n.i, stack))
			}
		}
	}
	// The file system storage's lock files, with when each was made and
	// last freshened.
	if dir, ok := strings.CutPrefix(nodes[0].storage, "storage file_system "); ok {
		locks, _ := filepath.Glob(filepath.Join(dir, "locks", "*"))
		for _, l := range locks {
			data, err := os.ReadFile(l)
			out = append(out, fmt.Sprintf("lock file %s: %q %v (at %v)", filepath.Base(l), data, err, time.Now().Format(time.StampMicro)))
		}
	}
	return strings.Join(out, "\n\n")
}

// Five instances on one storage elect an aggregator, which publishes the
// sum of their snapshots for the others to read. Killed (SIGKILL), it
// leaves its lock behind: the others read every snapshot again as soon as
// its aggregate is stale, so the cluster keeps its limit, and once the
// storage expires the lock (FileStorage: 10 s without its refresh;
// caddy-storage-redis: 5 s) another instance takes over, and the cluster
// still holds its limit through the new aggregate. On a loaded machine the
// new aggregator may find too few instances live and give up, and its lock
// file stay fresh with nobody holding it; then an instance aggregates
// without the lock after orphanLockAge (20 s), hence the 60 s allowed.
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
			rest, killed := killOf(nodes, dead)
			// At once, while its lock is held and its aggregate goes stale.
			checkShared(t, rest, "during", store+", the aggregator killed")
			oneAggregator(t, rest, 60*time.Second)
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

// killOf kills dead, one of nodes, and returns the others and when it was
// killed.
func killOf(nodes []*node, dead *node) (rest []*node, killed time.Time) {
	for _, n := range nodes {
		if n != dead {
			rest = append(rest, n)
		}
	}
	dead.kill()
	return rest, time.Now()
}

// file_system's lock can elect two aggregators: certmagic removes a lock
// file it finds stale and creates it again, so two instances that find the
// dead holder's file stale at once can both hold it, and its Unlock removes
// the file whoever created it. The test does to the storage what that race
// does, while the aggregator lives: it removes the lock file, the
// aggregate and the aggregator's claim (as if all three were a dead
// aggregator's, gone stale) until another instance finds none of them and
// takes the lock. The two are down to one through the aggregator's claim
// within seconds (the first may yield to the other's claim before the test
// looks again: that is the two down to one, not a give-up of its own), and
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
	if len(aggregators([]*node{first})) != 1 && !yieldedToAnother(first) {
		t.Fatalf("the first aggregator gave the role up on its own:\n%s", first.logs())
	}
	two := time.Now()
	one := oneAggregator(t, nodes, 10*time.Second)
	t.Logf("node %d aggregated beside node %d; within %v, node %d alone aggregates", firstOther(nodes, first), first.i,
		time.Since(two).Round(10*time.Millisecond), one.i)
	checkShared(t, nodes, "after", "file_system, after two aggregators")
}

// yieldedToAnother reports whether n's last word on aggregating is that it
// gave the role up to another instance's claim: how two aggregators are
// down to one, which a loaded machine may let happen before the test's
// next look.
func yieldedToAnother(n *node) bool {
	logs := n.logs()
	i := strings.LastIndex(logs, notAggregatingLog)
	if i < 0 || i < strings.LastIndex(logs, aggregatingLog) {
		return false
	}
	line, _, _ := strings.Cut(logs[i:], "\n")
	return strings.Contains(line, `"why":"another instance aggregates"`)
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

// orphanLog is what an instance logs when it aggregates without the lock
// (storage/aggregator.go).
const orphanLog = "the aggregator lock is held, but nobody has aggregated or claimed the role since"

// The aggregator dies and its lock file stays fresh with nobody holding it,
// as certmagic's FileStorage can leave one (the goroutine that freshens a
// lock file outlives its holder's Unlock; docs/cluster.md, "When the
// aggregator dies"). The test plays that goroutine: it keeps the file
// fresh, as a holder would. No instance can take the lock, so after
// orphanLockAge (20 s) of finding no aggregate and no claim one
// aggregates without it, says so at WARN, and the cluster holds its limit
// through its aggregate.
func TestALockFileNobodyHoldsIsAggregatedWithout(t *testing.T) {
	dir := t.TempDir()
	nodes := startCluster(t, 5, fileStorage(dir), zoneBody(exhaustWindow, "1m"))
	dead := oneAggregator(t, nodes, 20*time.Second)
	locks, _ := filepath.Glob(filepath.Join(dir, "locks", "*aggregate*"))
	if len(locks) != 1 {
		t.Fatalf("lock files %v, want the aggregator's one", locks)
	}
	rest, killed := killOf(nodes, dead)
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			// certmagic's lock file: when it was made and last freshened.
			meta := fmt.Sprintf(`{"created":%q,"updated":%q}`, killed.Format(time.RFC3339Nano), time.Now().Format(time.RFC3339Nano))
			tmp := locks[0] + ".ghost"
			if os.WriteFile(tmp, []byte(meta), 0o644) == nil {
				_ = os.Rename(tmp, locks[0])
			}
			select {
			case <-stop:
				return
			case <-time.After(time.Second):
			}
		}
	}()
	defer func() { close(stop); <-stopped }()

	waitFor(t, 60*time.Second, "an instance aggregating without the lock", func() bool {
		for _, n := range rest {
			if strings.Contains(n.logs(), orphanLog) {
				return true
			}
		}
		return false
	})
	took := time.Since(killed)
	t.Logf("an instance aggregated without the lock %v after the aggregator's death", took.Round(100*time.Millisecond))
	if took < 20*time.Second {
		t.Fatalf("an instance went without the lock %v after the aggregator's death, before orphanLockAge (20 s)", took)
	}
	oneAggregator(t, rest, 10*time.Second)
	checkShared(t, rest, "orphan", "file_system, its lock file kept fresh by nobody")
}
