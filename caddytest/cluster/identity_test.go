package cluster

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Two Caddy processes with one data directory (one XDG_DATA_HOME, hence
// one instance id) on one file storage: one of them notices the other's
// snapshot under its id, says so once, counts it, and publishes under a name
// of its own; together they hold the limit.
func TestTwoProcessesOnOneDataDirectoryShareTheLimit(t *testing.T) {
	store := t.TempDir()
	home := filepath.Join(t.TempDir(), "shared")
	// One after the other: the first creates the instance id the second
	// then finds.
	a := startNode(t, 0, home, fileStorage(store), zoneBody("1m", "1m"))
	b := startNode(t, 1, home, fileStorage(store), zoneBody("1m", "1m"))
	if a.instanceID() != b.instanceID() {
		t.Fatal("the two processes have different instance ids")
	}
	allowed := spread(t, []*node{a, b}, "one-home", 60, 100*time.Millisecond)
	t.Logf("two processes with one data directory allowed %d of 60 requests for a limit of %d: ratio %.2f", allowed, limit, float64(allowed)/limit)
	if max := limit*11/10 + 1; allowed < limit || allowed > max {
		t.Fatalf("allowed %d, want %d to %d", allowed, limit, max)
	}
	const msg = "another process publishes cluster state under this instance's id"
	errs := strings.Count(a.logs(), msg) + strings.Count(b.logs(), msg)
	conflicts := a.metric("caddy_rate_limit_cluster_instance_conflicts_total") + b.metric("caddy_rate_limit_cluster_instance_conflicts_total")
	t.Logf("logged %d times, caddy_rate_limit_cluster_instance_conflicts_total %v", errs, conflicts)
	if errs < 1 || errs > 2 || conflicts < 1 {
		t.Fatalf("the conflict was logged %d times (want once, or once by each) and counted %v times:\n%s\n%s", errs, conflicts, a.logs(), b.logs())
	}
}
