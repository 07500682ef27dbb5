package cluster

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// quotaBody is a site's rate_limit with a distributed zone "shared" keyed
// by X-Key whose rate (1000 a minute) never binds here, and a quota of
// limit (20) per hour.
func quotaBody() string {
	return fmt.Sprintf(`rate_limit {
		zone shared {
			key {http.request.header.X-Key}
			events 1000
			window 1m
			burst 1000
			quota %d 1h
			memory 64KiB
		}
		distributed {
			read_interval 100ms
			write_interval 100ms
			purge_age 1m
		}
	}
	respond "ok"`, limit)
}

// responseSize is the body of every answer of bytesBody's site, and
// budget the bytes per window of its zone: budgetResponses answers.
const (
	responseSize    = 1000
	budgetResponses = 40
	budget          = budgetResponses * responseSize
)

// bytesBody is a site's rate_limit with a distributed zone "shared" keyed
// by X-Key that charges the response bytes, budget per hour (a bucket of
// that burst, so that nothing refills while a test runs), answering
// responseSize bytes.
func bytesBody() string {
	return fmt.Sprintf(`rate_limit {
		zone shared {
			key {http.request.header.X-Key}
			events %d
			window 1h
			burst %d
			weight response_bytes
			memory 64KiB
		}
		distributed {
			read_interval 100ms
			write_interval 100ms
			purge_age 1m
		}
	}
	respond "%s"`, budget, budget, strings.Repeat("x", responseSize))
}

// waitSyncedZone waits until every node has read every other's snapshot
// of the cluster state named zone (a quota's is "<zone>/<window> quota"),
// in any storage: every node writes after now, then every node reads after
// all those writes (the metric holds when the last successful op began).
// Twice, so that the metric's resolution (a float64 of seconds, about a
// quarter of a microsecond) cannot matter. Then until every node has read
// joinWait after that write, so that a window zone's instance, new to
// the others, takes its share of a key: until then it grants only its
// allowance (events/10 + 1, 3 here), and the tests that wait measure the
// split among counted instances (TestSimultaneousBurstOnThreeInstances
// wants about the limit at once); the fresh cluster's test
// (TestWindowZoneFreshClusterServesEveryInstanceAtOnce) does not wait.
func waitSyncedZone(t *testing.T, nodes []*node, zone string) {
	t.Helper()
	since := time.Now()
	wrote := make([]time.Time, len(nodes))
	for i, n := range nodes {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d publishing %s", n.i, zone), func() bool {
			wrote[i] = n.lastSuccessOf(zone, "write")
			return wrote[i].After(since)
		})
	}
	for range 2 {
		since = time.Now()
		for _, n := range nodes {
			waitFor(t, 10*time.Second, fmt.Sprintf("node %d reading %s", n.i, zone), func() bool { return n.lastSuccessOf(zone, "read").After(since) })
		}
	}
	for i, n := range nodes {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d counted by the others in %s", n.i, zone), func() bool { return n.lastSuccessOf(zone, "read").After(wrote[i].Add(joinWait)) })
	}
}

// together has one client per node send perNode requests for key, one
// after the other, all clients starting at once, and returns how many were
// allowed: the instances are hit at the same time, and each learns the
// cost of its own responses before it decides on its next request.
func together(t *testing.T, nodes []*node, key string, perNode int) int {
	t.Helper()
	return atOnce(t, nodes, key, 1, perNode)
}

// stores are the storages the cluster tests of quotas and reported costs
// run on: the file system, and a redis-server of their own.
var stores = []string{"file_system", "redis"}

func storageFor(t *testing.T, store string) string {
	t.Helper()
	if store == "redis" {
		return redisStorage(startRedis(t))
	}
	return fileStorage(t.TempDir())
}

// A quota of a distributed zone is the cluster's: three instances grant a
// key hit across all of them at most 1.1× the quota, spread over time or
// at the same instant, where each used to grant it a whole quota.
func TestQuotaIsClusterWide(t *testing.T) {
	for _, store := range stores {
		t.Run(store, func(t *testing.T) {
			nodes := startCluster(t, 3, storageFor(t, store), quotaBody())
			waitSyncedZone(t, nodes, "shared/1h quota")
			most := limit * 11 / 10

			allowed := spread(t, nodes, "spread", 3*limit, 100*time.Millisecond)
			t.Logf("%s: a quota of %d per hour, %d requests spread over 3 instances: %d allowed (ratio %.2f)",
				store, limit, 3*limit, allowed, float64(allowed)/limit)
			if allowed < limit || allowed > most {
				t.Errorf("%s, spread: %d allowed for a quota of %d, want %d to %d", store, allowed, limit, limit, most)
			}

			allowed = burst(t, nodes, "simultaneous", limit)
			t.Logf("%s: a quota of %d per hour, %d requests on each of 3 instances at once: %d allowed (ratio %.2f)",
				store, limit, limit, allowed, float64(allowed)/limit)
			// Half is the bound of the burst test of the rate: requests
			// that reach an instance after a read that saw the others
			// grant get a smaller share.
			if allowed < limit/2 || allowed > most {
				t.Fatalf("%s, simultaneous: %d allowed for a quota of %d, want %d to %d", store, allowed, limit, limit/2, most)
			}
		})
	}
}

// A budget of response bytes (weight response_bytes) in a distributed zone
// is the cluster's: three instances grant a key at most 1.1× its budget in
// bytes, spread over time or hit at the same time, where each used to
// grant it a whole budget. A request passes while its key has a byte left,
// so an instance may answer one response more than its share holds: the
// budget is 40 responses, so that three of them stay within 10%.
func TestResponseBytesBudgetIsClusterWide(t *testing.T) {
	for _, store := range stores {
		t.Run(store, func(t *testing.T) {
			nodes := startCluster(t, 3, storageFor(t, store), bytesBody())
			waitSynced(t, nodes)
			most := budget * 11 / 10

			allowed := spread(t, nodes, "spread", 3*budgetResponses, 50*time.Millisecond) * responseSize
			t.Logf("%s: a budget of %d bytes per hour, %d responses of %d bytes spread over 3 instances: %d bytes allowed (ratio %.2f)",
				store, budget, 3*budgetResponses, responseSize, allowed, float64(allowed)/budget)
			if allowed < budget || allowed > most {
				t.Errorf("%s, spread: %d bytes allowed for a budget of %d, want %d to %d", store, allowed, budget, budget, most)
			}

			allowed = together(t, nodes, "simultaneous", budgetResponses) * responseSize
			t.Logf("%s: a budget of %d bytes per hour, 3 clients at once, one per instance, %d requests each: %d bytes allowed (ratio %.2f)",
				store, budget, budgetResponses, allowed, float64(allowed)/budget)
			if allowed < budget/2 || allowed > most {
				t.Fatalf("%s, simultaneous: %d bytes allowed for a budget of %d, want %d to %d", store, allowed, budget, budget/2, most)
			}
		})
	}
}

// A zone with action delay in a cluster holds a lone key's requests that
// only its instance's share of the key keeps out (bursts split), until a
// read lets them through, rather than answer 429 at once: two instances,
// events 5 per minute, five requests to one instance all pass, the last
// ones held, and the sixth, over the cluster's limit, is denied.
func TestDelayZoneHoldsWhatItsShareDenies(t *testing.T) {
	nodes := startCluster(t, 2, fileStorage(t.TempDir()), `rate_limit {
		zone shared {
			key {http.request.header.X-Key}
			events 5
			window 1m
			memory 64KiB
			action delay 2s
		}
		distributed {
			read_interval 100ms
			write_interval 100ms
			purge_age 1m
		}
	}
	respond "ok"`)
	waitSynced(t, nodes)
	var codes []int
	var took []time.Duration
	for range 5 {
		code, d := nodes[0].get("lone")
		codes = append(codes, code)
		took = append(took, d.Round(time.Millisecond))
	}
	t.Logf("five requests of a key to one of two instances: %v, in %v", codes, took)
	for i, c := range codes {
		if c != http.StatusOK {
			t.Fatalf("request %d of 5: %d (all: %v in %v), want every one passed: the share alone kept it out, and action delay 2s holds it until a read lets it through",
				i+1, c, codes, took)
		}
	}
	if held := nodes[0].metric(`caddy_rate_limit_requests_total{outcome="delayed",zone="shared"}`); held < 1 {
		t.Fatalf("%v requests were held (%v): the first share of a key hit on one of two instances is not all of its limit", held, took)
	}
	if code, _ := nodes[0].get("lone"); code != http.StatusTooManyRequests {
		t.Fatalf("request 6 of a limit of 5: %d, want 429", code)
	}
}
