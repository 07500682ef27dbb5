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

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// zoneBodyWithStorage is zoneBody with the zone's own storage in the
// handler's rate_limit block.
func zoneBodyWithStorage(storage string) string {
	return strings.Replace(zoneBody("1m", "1m"), "\t\tdistributed {", "\t\t"+storage+"\n\t\tdistributed {", 1)
}

// reload loads the node's config again through its admin API, forcing a
// reload although it has not changed.
func (n *node) reload() {
	n.t.Helper()
	if err := testcaddy.Load(n.t, n.admin, n.cfg, "caddyfile", n.http); err != nil {
		n.t.Fatalf("node %d: reload: %v", n.i, err)
	}
}

// globalZone is zoneBody's zone "shared" defined in the rate_limit global
// option with storage, for a site that names it.
func globalZone(storage string) (global, body string) {
	def := strings.TrimSuffix(strings.TrimSpace(zoneBody("1m", "1m")), `respond "ok"`)
	def = strings.Replace(strings.TrimSpace(def), "\t\tdistributed {", "\t\t"+storage+"\n\t\tdistributed {", 1)
	return def, "rate_limit shared\n\trespond \"ok\""
}

// A zone whose own storage (Redis) is down when Caddy starts and when it
// reloads: Caddy starts and reloads all the same, the zone limits locally
// and says so once per load, and it joins the cluster once Redis answers;
// whether the storage is the handler's own or the rate_limit global
// option's.
func TestZoneStorageDownAtStartAndReload(t *testing.T) {
	for _, where := range []string{"handler", "global_option"} {
		t.Run(where, func(t *testing.T) { testZoneStorageDown(t, where) })
	}
}

func testZoneStorageDown(t *testing.T, where string) {
	r := newRedis(t) // not started
	global, body := "", zoneBodyWithStorage(redisStorage(r))
	if where == "global_option" {
		global, body = globalZone(redisStorage(r))
	}
	nodes := startCluster(t, 2, global, body)
	const warning = "the zones' storage is not available"
	for _, n := range nodes {
		waitFor(t, 5*time.Second, fmt.Sprintf("node %d logging the storage being down", n.i), func() bool {
			return strings.Count(n.logs(), warning) >= 1
		})
		if got := strings.Count(n.logs(), warning); got != 1 {
			t.Fatalf("node %d logged the storage being down %d times, want once:\n%s", n.i, got, n.logs())
		}
	}
	// Local limits hold meanwhile, on each instance alone.
	exhaust(t, nodes[0], "down")
	if code, _ := nodes[1].get("down"); code != http.StatusOK {
		t.Fatalf("node 1, which never saw the key, while storage is down: %d", code)
	}
	for _, n := range nodes {
		n.reload()
		// Its log reaches the test through a pipe, a moment later.
		waitFor(t, 5*time.Second, fmt.Sprintf("node %d logging the storage being down again", n.i), func() bool {
			return strings.Count(n.logs(), warning) >= 2
		})
		if got := strings.Count(n.logs(), warning); got != 2 {
			t.Fatalf("node %d after a reload logged the storage being down %d times, want once per load", n.i, got)
		}
	}
	r.Start()
	for _, n := range nodes {
		waitFor(t, 20*time.Second, fmt.Sprintf("node %d joining the cluster", n.i), func() bool {
			return strings.Contains(n.logs(), "cluster storage answers: this instance joins the cluster")
		})
	}
	waitFor(t, 10*time.Second, "two snapshots in Redis", func() bool {
		k, err := r.Keys("floodgate-test/rate_limit/shared/*")
		return err == nil && k >= 2
	})
	checkShared(t, nodes, "joined", "redis that was down at start")
	for _, n := range nodes {
		if n.exited() {
			t.Fatalf("node %d exited:\n%s", n.i, n.logs())
		}
	}
}

// caddy-storage-redis with compression on loads no value that decompresses
// to more than 4 MiB, so a zone whose snapshots can be larger would skip
// its peers' counts. Such a zone is refused when the config loads, with
// what to change; a small zone on the same storage loads; and a zone
// whose Redis was down at the config's load says so in the log when the
// storage answers, and limits on its own counts.
func TestRedisCompressionRefusesZonesItCannotHold(t *testing.T) {
	r := newRedis(t) // not started yet
	compressed := strings.Replace(redisStorage(r), "timeout 1", "timeout 1\n\t\tcompression true", 1)
	large := strings.Replace(zoneBodyWithStorage(compressed), "\t\t\tmemory 64KiB\n", "", 1)
	if large == zoneBodyWithStorage(compressed) {
		t.Fatal("the zone body has no memory setting to drop")
	}
	down := startCluster(t, 1, "", large)[0]
	r.Start()
	waitFor(t, 20*time.Second, "the zone refusing the compressed storage once it answers", func() bool {
		return strings.Contains(down.logs(), "cluster storage cannot hold this zone") &&
			strings.Contains(down.logs(), "turn compression off")
	})
	exhaust(t, down, "local") // on its own counts

	validate := func(body string) (string, error) {
		n := newNode(t, 1, t.TempDir(), "", body)
		file := filepath.Join(n.home, "Caddyfile")
		if err := os.WriteFile(file, []byte(n.cfg), 0o600); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(caddyBin, "validate", "--config", file, "--adapter", "caddyfile")
		cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+n.home, "XDG_CONFIG_HOME="+n.home, "HOME="+n.home)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := validate(large)
	if err == nil || !strings.Contains(out, "compression on") || !strings.Contains(out, "turn compression off") {
		t.Fatalf("a large zone on a compressed Redis storage validated (%v):\n%s", err, out)
	}
	if out, err := validate(zoneBodyWithStorage(compressed)); err != nil {
		t.Fatalf("a 64 KiB zone on a compressed Redis storage did not validate: %v\n%s", err, out)
	}
}
