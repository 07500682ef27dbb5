//go:build linux

package netnstest

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// A namespace left behind under the name the next pair takes (a killed
// run of a process with the same pid) is replaced, not a reason to skip:
// an XDP test that skipped here would pass without running.
func TestAStaleNamespaceIsReplaced(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	stale := fmt.Sprintf("fgx%d.%d", os.Getpid()%100000, pairs.Load()+1)
	if out, err := exec.Command("ip", "netns", "add", stale+"s").CombinedOutput(); err != nil {
		t.Skipf("creating a network namespace is not permitted here: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", stale+"s").Run() })
	v := NewVethPair(t)
	if v.Server != stale+"s" {
		t.Fatalf("the pair's server namespace is %q, want %q (the stale one's name)", v.Server, stale+"s")
	}
	second := NewVethPair(t)
	if second.Server == v.Server {
		t.Fatalf("two pairs of one process share the namespace %q", v.Server)
	}
}
