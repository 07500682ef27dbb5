package cluster

import (
	"net/http"
	"path/filepath"
	"testing"
	"time"
)

// A Redis that restarts empty (without persistence, as a rate limiter's
// Redis often runs: snapshots are published again every write_interval)
// loses rate_limit/hash secret as well. The running instances store it
// again after their next write (Syncer.rejoin), as they republish their
// snapshots; without that, the next instance to start found none, made a
// new one and hashed every header key apart from the running ones: a key
// that used its whole limit on one got it all again on the other.
func TestARedisThatRestartsEmptyKeepsOneSecret(t *testing.T) {
	r := startRedis(t)
	body := freeBursts(zoneBody(exhaustWindow, exhaustWindow))
	base := t.TempDir()
	first := startNode(t, 0, filepath.Join(base, "node0"), redisStorage(r), body)
	const secret = "floodgate-test/rate_limit/hash*"
	const snapshots = "floodgate-test/rate_limit/shared/*"
	waitFor(t, 10*time.Second, "the secret and a snapshot in Redis", func() bool {
		s, err1 := r.Keys(secret)
		n, err2 := r.Keys(snapshots)
		return err1 == nil && err2 == nil && s >= 1 && n >= 1
	})
	// Redis restarts, empty; the running instance publishes again.
	r.Stop()
	r.Start()
	waitFor(t, 20*time.Second, "the running instance's snapshot and the secret back in Redis", func() bool {
		s, err1 := r.Keys(secret)
		n, err2 := r.Keys(snapshots)
		return err1 == nil && err2 == nil && s >= 1 && n >= 1
	})
	// A new instance joins.
	second := startNode(t, 1, filepath.Join(base, "node1"), redisStorage(r), body)
	nodes := []*node{first, second}
	waitSynced(t, nodes)
	exhaust(t, first, "lost-secret")
	waitSynced(t, nodes)
	if code, _ := second.get("lost-secret"); code != http.StatusTooManyRequests {
		n, _ := r.Keys(secret)
		t.Errorf("a key that used its %d on the running instance got %d on the one started after Redis restarted empty (%d secret entries in Redis): the two hash it apart", limit, code, n)
		allowed := 1
		for range limit {
			if code, _ := second.get("lost-secret"); code == http.StatusOK {
				allowed++
			}
		}
		t.Logf("the second instance allowed %d of the key after the first allowed %d (limit %d cluster-wide)", allowed, limit, limit)
	}
}
