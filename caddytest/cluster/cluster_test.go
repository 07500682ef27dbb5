package cluster

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
	"github.com/floodgate-rl/floodgate/internal/redistest"
)

// epsilon is the over-admission the tests accept for three instances
// syncing every 100ms and a client sending a request every 100ms: about
// instances × rate × sync lag, a few requests (see the README's bound).
const (
	limit   = 20
	epsilon = 0.25
)

// zoneBody is a site's rate_limit with a distributed zone "shared" keyed
// by X-Key: events 20 per window.
func zoneBody(window, purgeAge string) string {
	return fmt.Sprintf(`rate_limit {
		zone shared {
			key {http.request.header.X-Key}
			events %d
			window %s
			memory 64KiB
		}
		distributed {
			read_interval 100ms
			write_interval 100ms
			purge_age %s
		}
	}
	respond "ok"`, limit, window, purgeAge)
}

// freeBursts sets bursts free in a zoneBody: for the tests that exhaust a
// key on one node at once, which with bursts split gets its share there at
// first and the rest only once a sync shows that no other node counts it.
func freeBursts(body string) string {
	return strings.Replace(body, "\t\t\tpurge_age", "\t\t\tbursts free\n\t\t\tpurge_age", 1)
}

func fileStorage(dir string) string { return "storage file_system " + dir }

// startCluster starts n nodes on one storage, one after the other.
func startCluster(t *testing.T, n int, storage, body string) []*node {
	t.Helper()
	base := t.TempDir()
	nodes := make([]*node, n)
	for i := range nodes {
		nodes[i] = startNode(t, i, filepath.Join(base, fmt.Sprintf("node%d", i)), storage, body)
	}
	return nodes
}

// checkShared spreads 60 requests of one key over 6 s across the nodes and
// checks that the cluster allowed the limit, within epsilon.
func checkShared(t *testing.T, nodes []*node, key, storage string) {
	t.Helper()
	allowed := spread(t, nodes, key, 60, 100*time.Millisecond)
	t.Logf("%s: %d instances allowed %d of 60 requests for a limit of %d: ratio %.2f", storage, len(nodes), allowed, limit, float64(allowed)/limit)
	if allowed < limit || float64(allowed) > limit*(1+epsilon) {
		t.Fatalf("%s: allowed %d, want %d to %d", storage, allowed, limit, int(limit*(1+epsilon)))
	}
}

func TestFileSystemClusterSharesTheLimit(t *testing.T) {
	store := t.TempDir()
	nodes := startCluster(t, 3, fileStorage(store), zoneBody("1m", "1m"))
	checkShared(t, nodes, "spread", "file_system")
	// Each instance alone would have allowed 20.
	for _, n := range nodes {
		if n.exited() {
			t.Fatalf("node %d exited:\n%s", n.i, n.logs())
		}
	}
}

// instanceID is a node's Caddy instance id, kept in its data directory.
func (n *node) instanceID() string {
	n.t.Helper()
	b, err := os.ReadFile(filepath.Join(n.home, "caddy", "instance.uuid"))
	if err != nil {
		n.t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// snapshotFile is where a node publishes zone "shared" in a file_system
// storage.
func (n *node) snapshotFile(store string) string {
	return filepath.Join(store, "rate_limit", "shared", n.instanceID())
}

// waitWritten waits until the node has published a snapshot after since.
func (n *node) waitWritten(store string, since time.Time) {
	n.t.Helper()
	waitFor(n.t, 10*time.Second, fmt.Sprintf("node %d publishing", n.i), func() bool {
		fi, err := os.Stat(n.snapshotFile(store))
		return err == nil && fi.ModTime().After(since)
	})
}

// waitRead waits until the node has surely read the storage after since:
// reads and writes run in one loop on the same interval, so two writes
// after since bracket a read.
func (n *node) waitRead(store string, since time.Time) {
	n.t.Helper()
	n.waitWritten(store, since)
	fi, _ := os.Stat(n.snapshotFile(store))
	n.waitWritten(store, fi.ModTime())
}

// exhaustWindow is the window of the tests that exhaust a key on one node
// and expect its next request denied: long enough that no token returns
// while the requests are sent (one per 30 s), however loaded the machine.
// With a window of 1m one returned every 3 s, and a slow run let request
// 21 through.
const exhaustWindow = "10m"

func exhaust(t *testing.T, n *node, key string) {
	t.Helper()
	for i := range limit {
		if code, _ := n.get(key); code != http.StatusOK {
			t.Fatalf("node %d, request %d for %s: %d", n.i, i, key, code)
		}
	}
	if code, _ := n.get(key); code != http.StatusTooManyRequests {
		t.Fatalf("node %d: request %d for %s: %d, want 429", n.i, limit+1, key, code)
	}
}

func TestKilledInstanceCountsUntilItsWindowAgesOut(t *testing.T) {
	store := t.TempDir()
	const window = 10 * time.Second
	nodes := startCluster(t, 3, fileStorage(store), freeBursts(zoneBody("10s", "12s")))
	dead, b, c := nodes[0], nodes[1], nodes[2]
	// Start at the beginning of a window (windows are aligned to Unix
	// time), so that the key's count is all in one window.
	time.Sleep(time.Until(time.Now().Truncate(window).Add(window)))
	exhaust(t, dead, "k")
	last := time.Now()
	dead.waitWritten(store, last)
	dead.kill()
	b.waitRead(store, last)
	c.waitRead(store, last)
	for _, n := range []*node{b, c} {
		if code, _ := n.get("k"); code != http.StatusTooManyRequests {
			t.Fatalf("node %d allowed a key the killed instance exhausted: %d", n.i, code)
		}
		if code, _ := n.get("fresh"); code != http.StatusOK {
			t.Fatalf("node %d denied a fresh key: %d", n.i, code)
		}
	}
	nextWindow := last.Truncate(window).Add(window)
	var allowedAt time.Time
	waitFor(t, 2*window+5*time.Second, "the killed instance's count ageing out", func() bool {
		code, _ := b.get("k")
		if code == http.StatusOK {
			allowedAt = time.Now()
		}
		return code == http.StatusOK
	})
	if allowedAt.Before(nextWindow) {
		t.Fatalf("k allowed at %v, before the window of the killed instance's requests ended at %v", allowedAt, nextWindow)
	}
	waitFor(t, 30*time.Second, "the killed instance's file going after purge_age", func() bool {
		_, err := os.Stat(dead.snapshotFile(store))
		return os.IsNotExist(err)
	})
	for _, n := range []*node{b, c} {
		if _, err := os.Stat(n.snapshotFile(store)); err != nil {
			t.Fatalf("a live instance's file: %v", err)
		}
	}
}

func TestJunkUnderTheStorage(t *testing.T) {
	start := time.Now()
	store := t.TempDir()
	zdir := filepath.Join(store, "rate_limit", "shared")
	plant := func(name string, data []byte) {
		p := filepath.Join(zdir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	plant("../stray", []byte("not a zone"))
	plant("../other/zone", []byte("FGCL\x01junk"))
	plant("empty", nil)
	plant("random", []byte("\x00\x01\x02 random bytes \xff\xfe"))
	plant("dir/inside", []byte("x"))
	nodes := startCluster(t, 3, fileStorage(store), zoneBody("1m", "1m"))
	nodes[0].waitWritten(store, time.Time{})
	good, err := os.ReadFile(nodes[0].snapshotFile(store))
	if err != nil {
		t.Fatal(err)
	}
	plant("1234567890123456789", good) // a certmagic temporary file
	plant("truncated", good[:len(good)/2])
	plant("version3", append([]byte("FGCL\x03"), good[5:]...))
	checkShared(t, nodes, "junk", "file_system with junk")
	for _, n := range nodes {
		if n.exited() {
			t.Fatalf("node %d exited:\n%s", n.i, n.logs())
		}
		if got := n.metric("caddy_rate_limit_cluster_skipped_total"); got < 8 {
			t.Errorf("node %d counted %v skipped entries, want at least the 8 planted", n.i, got)
		}
		// Junk does not make a sync fail: the last successful read and
		// write (summed over both ops) are both since the test began.
		lo, hi := 2*float64(start.Unix()), 2*float64(time.Now().Unix()+1)
		if got := n.metric("caddy_rate_limit_cluster_last_success_timestamp_seconds"); got < lo || got > hi {
			t.Errorf("node %d: last read + last write = %.0f, want both within the test (%.0f to %.0f)", n.i, got, lo, hi)
		}
		if k := n.rateLimitWarnings(); k > 0 {
			t.Errorf("node %d: rate_limit logged %d warnings or errors over junk:\n%s", n.i, k, n.logs())
		}
	}
}

func TestRestartKeepsExhaustedKeys(t *testing.T) {
	store := t.TempDir()
	nodes := startCluster(t, 1, fileStorage(store), zoneBody(exhaustWindow, "20m"))
	a := nodes[0]
	exhaust(t, a, "graceful")
	a.stop()
	a.start()
	if code, _ := a.get("graceful"); code != http.StatusTooManyRequests {
		t.Fatalf("after a graceful restart an exhausted key got %d", code)
	}
	if code, _ := a.get("fresh"); code != http.StatusOK {
		t.Fatalf("after a restart a fresh key got %d", code)
	}
	exhaust(t, a, "crash")
	a.waitWritten(store, time.Now())
	a.kill()
	a.start()
	if code, _ := a.get("crash"); code != http.StatusTooManyRequests {
		t.Fatalf("after kill -9 an exhausted key got %d", code)
	}
	if code, _ := a.get("fresh2"); code != http.StatusOK {
		t.Fatalf("after kill -9 a fresh key got %d", code)
	}
}

// rateLimitWarnings counts the log lines of floodgate's loggers at WARN or
// above.
func (n *node) rateLimitWarnings() int {
	k := 0
	for _, line := range strings.Split(n.logs(), "\n") {
		if strings.Contains(line, `"logger":"http.handlers.rate_limit"`) || strings.Contains(line, `"logger":"rate_limit"`) {
			if strings.Contains(line, `"level":"warn"`) || strings.Contains(line, `"level":"error"`) {
				k++
			}
		}
	}
	return k
}

// startRedis starts a redis-server on a free port, or skips the test if
// there is none.
func startRedis(t *testing.T) *redistest.Server {
	t.Helper()
	r := newRedis(t)
	r.Start()
	return r
}

// newRedis returns a redis-server for a free port, not started, or skips
// the test if there is none.
func newRedis(t *testing.T) *redistest.Server {
	t.Helper()
	ports, err := testcaddy.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	r, err := redistest.New(t, ports[0])
	if err != nil {
		t.Skipf("%v (.ci/run installs it): skipping the Redis cluster test", err)
	}
	return r
}

// redisStorage is the Caddyfile storage option of a Redis storage on r.
func redisStorage(r *redistest.Server) string {
	return fmt.Sprintf(`storage redis {
		address 127.0.0.1:%d
		key_prefix floodgate-test
		timeout 1
	}`, r.Port)
}

func TestRedisClusterSharesTheLimitAndSurvivesAnOutage(t *testing.T) {
	r := startRedis(t)
	nodes := startCluster(t, 3, redisStorage(r), zoneBody("1m", "1m"))
	const snapshots = "floodgate-test/rate_limit/shared/*"
	waitFor(t, 10*time.Second, "three snapshots in Redis", func() bool {
		n, err := r.Keys(snapshots)
		return err == nil && n >= 3
	})
	checkShared(t, nodes, "redis", "redis")

	// Outage: every request is still answered at once, under each
	// instance's own limits.
	r.Stop()
	outage := time.Now()
	for _, n := range nodes {
		// A failed read, not only a failed write: the read is what drops
		// the instance's burst shares and leaves it its whole local limit.
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d noticing the outage on a read", n.i), func() bool {
			return n.logged("cluster storage failed", `"op":"read"`)
		})
	}
	allowed := 0
	var slowest time.Duration
	for i := range 30 {
		code, took := nodes[i%3].get("outage")
		slowest = max(slowest, took)
		if code == http.StatusOK {
			allowed++
		}
	}
	t.Logf("Redis down: 30 requests for a fresh key, 10 per instance: %d allowed, slowest answer %v", allowed, slowest)
	if allowed != 30 {
		t.Errorf("during the outage %d of 30 allowed, want all (10 per instance, local limit 20)", allowed)
	}
	if slowest > time.Second {
		t.Errorf("a request waited %v during the outage", slowest)
	}
	for _, n := range nodes {
		if code, _ := n.get("outage-local"); code != http.StatusOK {
			t.Fatalf("node %d: %d", n.i, code)
		}
	}
	// The local limit still holds on each instance.
	for range limit {
		nodes[0].get("outage-local")
	}
	if code, _ := nodes[0].get("outage-local"); code != http.StatusTooManyRequests {
		t.Fatalf("during the outage an instance went past its own limit: %d", code)
	}

	// Redis returns (empty): the cluster is whole again.
	r.Start()
	down := time.Since(outage)
	waitFor(t, 20*time.Second, "three snapshots back in Redis", func() bool {
		n, err := r.Keys(snapshots)
		return err == nil && n >= 3
	})
	for _, n := range nodes {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d logging its recovery", n.i), func() bool {
			return strings.Contains(n.logs(), "cluster storage works again")
		})
		warns := strings.Count(n.logs(), "cluster storage failed")
		t.Logf("node %d: %d storage warnings over an outage of %v", n.i, warns, down.Round(time.Millisecond))
		// One per op (read, write, restore) per interval at most.
		if max := 3 * (int(down/(100*time.Millisecond)) + 2); warns == 0 || warns > max {
			t.Errorf("node %d logged %d storage warnings, want 1 to %d", n.i, warns, max)
		}
	}
	checkShared(t, nodes, "after", "redis after the outage")
}

// rateLimit runs `caddy rate-limit args...` against node n's admin API and
// returns its output.
func (n *node) rateLimit(args ...string) string {
	n.t.Helper()
	cmd := exec.Command(caddyBin, append(append([]string{"rate-limit"}, args...), "--address", fmt.Sprintf("localhost:%d", n.admin))...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		n.t.Fatalf("caddy rate-limit %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// adminDelete resets a key through node n's admin API and returns the
// answer.
func (n *node) adminDelete(zone, key string) floodgate.KeyInfo {
	n.t.Helper()
	var k floodgate.KeyInfo
	testcaddy.JSON(n.t, http.DefaultClient, testcaddy.Request(n.t, http.MethodDelete, fmt.Sprintf("http://localhost:%d/rate_limit/zones/%s/keys/%s", n.admin, zone, key)), &k)
	return k
}

// A key exhausted through three instances, one of which then dies, passes
// again on the one that resets it at once, and on another once it has read
// the reset; the dead one's snapshot, which predates the reset, does not
// bring the key's counts back. Then the key has its limit again,
// cluster-wide.
func TestResetReachesTheCluster(t *testing.T) {
	store := t.TempDir()
	nodes := startCluster(t, 3, fileStorage(store), freeBursts(zoneBody(exhaustWindow, "20m")))
	a, b, dead := nodes[0], nodes[1], nodes[2]
	// One key's requests all go to node 1, draining its token bucket too.
	exhaust(t, b, "sticky")
	for i := range limit {
		if code, _ := nodes[i%3].get("reset"); code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	synced := time.Now()
	dead.waitWritten(store, synced)
	dead.kill()
	a.waitRead(store, synced)
	b.waitRead(store, synced)
	for _, n := range nodes[:2] {
		if code, _ := n.get("reset"); code != http.StatusTooManyRequests {
			t.Fatalf("node %d let the key through over its cluster limit: %d", n.i, code)
		}
	}
	out := a.rateLimit("reset", "shared", "reset")
	t.Logf("caddy rate-limit reset on node 0:\n%s", out)
	if !strings.Contains(out, "a request now would be allowed\ncluster: published with this instance's next write (every 100ms); each other instance lets the key through after its next read (every 100ms)\n") {
		t.Fatalf("reset output:\n%s", out)
	}
	if code, _ := a.get("reset"); code != http.StatusOK {
		t.Fatalf("node 0 right after the reset: %d", code)
	}
	k := a.adminDelete("shared", "sticky")
	if !k.Allowed || !strings.HasPrefix(k.ClusterReset, "published with this instance's next write") || len(k.Policies) != 2 {
		t.Fatalf("DELETE of sticky on node 0: %+v", k)
	}
	// Both the bucket and the cluster estimate report what the key holds
	// now, not counting the request the answer is about: the whole limit.
	for _, p := range k.Policies {
		if p.Remaining != limit {
			t.Fatalf("DELETE of sticky on node 0: %s remaining %d, want %d", p.Policy, p.Remaining, limit)
		}
	}
	reset := time.Now()
	a.waitRead(store, reset) // reading the dead node's snapshot again
	fi, err := os.Stat(a.snapshotFile(store))
	if err != nil {
		t.Fatal(err)
	}
	b.waitRead(store, fi.ModTime())
	for _, n := range nodes[:2] {
		if code, _ := n.get("reset"); code != http.StatusOK {
			t.Fatalf("node %d after the reset and a sync: %d", n.i, code)
		}
	}
	// Node 1 filled its bucket of the key it had drained.
	if code, _ := b.get("sticky"); code != http.StatusOK {
		t.Fatalf("node 1, whose bucket the key had drained, after the reset and a sync: %d", code)
	}
	// The limit holds again: 3 taken above, then the rest of 20.
	allowed := 3 + spread(t, nodes[:2], "reset", 30, 100*time.Millisecond)
	t.Logf("after the reset: %d allowed for a limit of %d", allowed, limit)
	if allowed < limit || float64(allowed) > limit*(1+epsilon) {
		t.Fatalf("after the reset: allowed %d, want %d to %d", allowed, limit, int(limit*(1+epsilon)))
	}
}
