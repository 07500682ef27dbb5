package cluster

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"
)

// burst sends perNode requests for key to every node at once and returns
// how many were allowed.
func burst(t *testing.T, nodes []*node, key string, perNode int) int {
	t.Helper()
	return atOnce(t, nodes, key, perNode, 1)
}

// atOnce has clients clients per node, all starting at once, each send
// perClient requests for key one after the other, and returns how many
// were allowed.
func atOnce(t *testing.T, nodes []*node, key string, clients, perClient int) int {
	t.Helper()
	var mu sync.Mutex
	allowed := 0
	var wg sync.WaitGroup
	start := make(chan struct{})
	for _, n := range nodes {
		for range clients {
			wg.Go(func() {
				<-start
				for range perClient {
					if code, _ := n.get(key); code == http.StatusOK {
						mu.Lock()
						allowed++
						mu.Unlock()
					}
				}
			})
		}
	}
	close(start)
	wg.Wait()
	return allowed
}

// lastSuccess returns when the node's zone "shared" last succeeded at op
// (read or write), from its metrics.
func (n *node) lastSuccess(op string) time.Time { return n.lastSuccessOf("shared", op) }

// lastSuccessOf returns when the node's cluster state named zone (a
// quota's is "<zone>/<window> quota") last succeeded at op.
func (n *node) lastSuccessOf(zone, op string) time.Time {
	n.t.Helper()
	secs := n.metric(fmt.Sprintf(`caddy_rate_limit_cluster_last_success_timestamp_seconds{op=%q,zone=%q}`, op, zone))
	return time.Unix(0, int64(secs*1e9))
}

// waitSynced waits until every node has read every other's snapshot, in
// any storage, and takes its share (see waitSyncedZone).
func waitSynced(t *testing.T, nodes []*node) { waitSyncedZone(t, nodes, "shared") }

// joinWait is how long after its first snapshot a window zone's instance
// takes its share of a key, not only its allowance (storage's
// Syncer.shareRank): the others have
// read it and published since, and it has read that; a read interval more
// through an aggregate. The tests' intervals are 100 ms.
const joinWait = 100*time.Millisecond + 3*100*time.Millisecond

// A fresh key hit on three instances at the same instant gets at most 1.1×
// its limit (+1) with bursts split (the default), where with bursts free
// each instance grants it a whole limit. A key that only reaches one
// instance still gets its whole limit, after a sync or two.
func TestSimultaneousBurstOnThreeInstances(t *testing.T) {
	for _, c := range []struct{ mode, store string }{{"split", "file_system"}, {"split", "redis"}, {"free", "file_system"}} {
		mode := c.mode
		t.Run(mode+"/"+c.store, func(t *testing.T) {
			storage := fileStorage(t.TempDir())
			if c.store == "redis" {
				storage = redisStorage(startRedis(t))
			}
			body := zoneBody("1m", "1m")
			if mode == "free" {
				body = freeBursts(body)
			}
			nodes := startCluster(t, 3, storage, body)
			waitSynced(t, nodes)
			allowed := burst(t, nodes, "simultaneous", limit)
			t.Logf("bursts %s: a fresh key, %d requests on each of 3 instances at once: %d allowed for a limit of %d (ratio %.2f)",
				mode, limit, allowed, limit, float64(allowed)/limit)
			if mode == "free" {
				if allowed < 2*limit {
					t.Fatalf("bursts free: %d allowed, want each instance's whole limit", allowed)
				}
				return
			}
			if max := limit*11/10 + 1; allowed > max {
				t.Fatalf("bursts split: %d allowed, want at most %d", allowed, max)
			}
			// The shares add up to what is left: the cluster grants about
			// the limit at once (7 + 7 + 6), not a fraction of it. Half is
			// the bound: requests that reach an instance after a read
			// that saw the others grant get a smaller share.
			if least := limit / 2; allowed < least {
				t.Fatalf("bursts split: %d allowed at once, want at least %d: the shares should add up to about the limit", allowed, least)
			}
			// One instance alone: a burst there gets its share at once, the
			// rest after a sync or two.
			start := time.Now()
			first := burst(t, nodes[:1], "alone", limit)
			got, sent := first, limit
			waitFor(t, 10*time.Second, "a single-instance key reaching its whole limit", func() bool {
				sent++
				if code, _ := nodes[0].get("alone"); code == http.StatusOK {
					got++
				}
				return got == limit
			})
			took := time.Since(start)
			t.Logf("bursts split: a key on one instance: %d of a burst of %d at once, its whole %d after %v (%d requests; read_interval 100ms)",
				first, limit, limit, took.Round(time.Millisecond), sent)
			if code, _ := nodes[0].get("alone"); code != http.StatusTooManyRequests {
				t.Fatalf("request %d for a key on one instance: %d, want 429", got+1, code)
			}
		})
	}
}
