package ops

import (
	"fmt"
	"runtime"
	"testing"
	"time"
)

// heapAlloc returns the live heap after a full collection.
func heapAlloc() uint64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// quietHeap returns the least of ten heapAlloc readings 50 ms apart: a
// cluster read in flight holds the sum it builds beside the one it
// replaces (8 MiB here) until it is done, which one reading may catch.
func quietHeap() uint64 {
	least := heapAlloc()
	for range 9 {
		time.Sleep(50 * time.Millisecond) // between syncs, not a rate
		least = min(least, heapAlloc())
	}
	return least
}

// What the admin API reports a zone holds is what this process's heap
// grows by when a config adds the zones: a token-bucket zone with a quota
// and a distributed window zone with a quota, 16 and 8 MiB each part. Caddy
// here runs in the test's process, so its heap is the test's.
func TestReportedMemoryIsTheHeapsGrowth(t *testing.T) {
	mustLoad(t, caddyfile("", `	respond "none"`))
	dir := t.TempDir()
	// Cleanups run last first: the distributed zone's sync stops (and
	// writes its last snapshot) before dir is removed.
	t.Cleanup(func() { mustLoad(t, caddyfile("", `	respond "none"`)) })
	before := quietHeap()
	mustLoad(t, caddyfile("", fmt.Sprintf(`	handle /cluster {
		rate_limit {
			zone heap_cluster {
				key {client_ip}
				events 2
				window 1h
				memory 8MiB
				quota 100 24h
			}
			distributed {
				read_interval 1h
				write_interval 1h
			}
			storage file_system %s
		}
		respond "cluster"
	}
	rate_limit {
		zone heap_local {
			key {client_ip}
			events 2
			window 1h
			burst 2
			memory 16MiB
			quota 100 24h
		}
	}
	respond "ok"`, dir)))
	after := quietHeap()
	// Decoded on its own (floodgate.ZoneInfo's fields), so that the test
	// also runs against code that reports less.
	var zones []struct {
		Name   string `json:"name"`
		Memory struct {
			Bytes int            `json:"bytes"`
			Parts map[string]int `json:"parts"`
		} `json:"memory"`
	}
	adminJSON(t, "GET", "/rate_limit/zones", &zones)
	reported := 0
	for _, z := range zones {
		t.Logf("zone %s: %d bytes: %v", z.Name, z.Memory.Bytes, z.Memory.Parts)
		reported += z.Memory.Bytes
	}
	growth := int64(after) - int64(before)
	t.Logf("heap %d → %d bytes: grew %d (%.1f MiB); the zones report %d (%.1f MiB)", before, after, growth, float64(growth)/(1<<20), reported, float64(reported)/(1<<20))
	// The rest of a config (its routes, modules, loggers) is a few
	// hundred KiB. A sync running as the heap is read holds a snapshot and
	// its peers' (up to 1.4 MiB each here), and a read the sum it builds
	// beside the one it replaces (8 MiB: seen once as a growth 8.0 MiB
	// over the report): the syncs run once, at the start (intervals of an
	// hour), and the heap is read at its quietest of ten readings.
	// A part left out is 8 MiB or more (the smallest, the cluster's table);
	// TestMemoryPartsMatchSizing (caddytest/cluster) checks the small ones.
	const slack = 6 << 20
	if reported < 56<<20 || growth < int64(reported)-slack/12 || growth > int64(reported)+slack {
		t.Errorf("the heap grew %d bytes with the zones, which report %d: want the report within -%d/+%d bytes of the growth", growth, reported, slack/12, slack)
	}
}
