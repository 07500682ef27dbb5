package cluster

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// edgeWindow is the window of the tests across window edges: short, so
// that a run crosses several of the sketch's windows (aligned to Unix
// time) in seconds.
const edgeWindow = 4 * time.Second

// grantTimes sends a request for key every gap, to the nodes in turn,
// until end, and returns when each allowed one was answered, in all and
// by node.
func grantTimes(t *testing.T, nodes []*node, key string, gap time.Duration, end time.Time) (at []time.Time, byNode [][]time.Time) {
	t.Helper()
	byNode = make([][]time.Time, len(nodes))
	for i, next := 0, time.Now(); next.Before(end); i++ {
		time.Sleep(time.Until(next))
		next = next.Add(gap)
		switch code, _ := nodes[i%len(nodes)].get(key); code {
		case http.StatusOK:
			now := time.Now()
			at = append(at, now)
			byNode[i%len(nodes)] = append(byNode[i%len(nodes)], now)
		case http.StatusTooManyRequests:
		default:
			t.Fatalf("request %d: status %d", i, code)
		}
	}
	return at, byNode
}

// mostInASpan is the most of times (in order) within any span of w, ends
// included.
func mostInASpan(times []time.Time, w time.Duration) int {
	most := 0
	for i, j := 0, 0; j < len(times); j++ {
		for times[j].Sub(times[i]) > w {
			i++
		}
		most = max(most, j-i+1)
	}
	return most
}

// What a window zone (no burst: events 20 in 4 s) promises in a cluster,
// across window edges. Each instance's own window is the hard bound for
// what that instance grants: never more than the limit in any span of a
// window. Across the instances the cluster's count is sliding (8
// sub-windows of W/7, each grant counted until its sub-window's end is W
// old), so the cluster holds the limit in any span of a window too, as
// bursts split promise (1.1 × the limit + 1), plus what the instances
// grant before they hear of each other's grants (a sync lag). Measured
// here: steady traffic at five times the rate over three instances for
// three windows, and a burst on every instance a second before an edge
// (of the windows a weighted estimate aligned to Unix time) followed by
// steady traffic. The weighted estimate gave up to 35 in a span.
func TestWindowZoneInAClusterAcrossWindowEdges(t *testing.T) {
	nodes := startCluster(t, 3, fileStorage(t.TempDir()), zoneBody(edgeWindow.String(), "1m"))
	waitSynced(t, nodes)
	// Split bursts' bound, and what the requests (20 a second) bring in
	// a sync lag (write and read intervals: 200 ms).
	ceiling := limit*11/10 + 1 + 20/5

	check := func(what string, all []time.Time, byNode [][]time.Time) {
		t.Helper()
		most := mostInASpan(all, edgeWindow)
		perNode := 0
		for _, at := range byNode {
			perNode = max(perNode, mostInASpan(at, edgeWindow))
		}
		t.Logf("%s: %d allowed, at most %d in any span of %v (limit %d, ratio %.2f), at most %d on one instance",
			what, len(all), most, edgeWindow, limit, float64(most)/limit, perNode)
		if most > ceiling {
			t.Errorf("%s: %d allowed within %v, want at most %d", what, most, edgeWindow, ceiling)
		}
		if perNode > limit {
			t.Errorf("%s: one instance allowed %d within %v, want at most %d", what, perNode, edgeWindow, limit)
		}
	}

	all, byNode := grantTimes(t, nodes, "spread-edges", 50*time.Millisecond, time.Now().Add(3*edgeWindow))
	check("a request every 50ms over 3 instances for 3 windows", all, byNode)

	edge := time.Now().Truncate(edgeWindow).Add(edgeWindow)
	if time.Until(edge) < 2*time.Second {
		edge = edge.Add(edgeWindow)
	}
	time.Sleep(time.Until(edge.Add(-time.Second)))
	burstBy := burstOnEach(nodes, "burst-edge")
	burst := slices.Concat(burstBy...)
	if len(burst) > limit*11/10+1 {
		t.Errorf("a burst of %d on each instance at once got %d, want at most %d", limit, len(burst), limit*11/10+1)
	}
	after, afterBy := grantTimes(t, nodes, "burst-edge", 50*time.Millisecond, edge.Add(edgeWindow))
	slices.SortFunc(burst, time.Time.Compare)
	for i := range burstBy {
		burstBy[i] = append(burstBy[i], afterBy[i]...)
	}
	check("a burst a second before an edge, then a request every 50ms", append(burst, after...), burstBy)
}

// A burst of limit on each of the three instances at once, then again 5 ms
// after the sub-window (W/7, aligned to Unix time) the last burst began in
// stops counting, four times: that sub-window's counts leave every
// instance's view at the same instant, before their next read, and each
// instance may take only its share of the room they free, so the cluster
// keeps its bound for simultaneous bursts. Taking that room whole, each
// instance granted the key its limit again: 60 within 4 s.
func TestWindowZoneInAClusterBurstAtSubWindowExpiry(t *testing.T) {
	nodes := startCluster(t, 3, fileStorage(t.TempDir()), zoneBody(edgeWindow.String(), "1m"))
	waitSynced(t, nodes)
	L := (int64(edgeWindow) + 6) / 7
	var all []time.Time
	var got []int
	for range 4 {
		start := time.Now()
		burst := slices.Concat(burstOnEach(nodes, "expiry")...)
		all = append(all, burst...)
		got = append(got, len(burst))
		// The sub-window the burst began in stops counting at the end of
		// the seventh after it.
		next := time.Unix(0, (start.UnixNano()/L+8)*L).Add(5 * time.Millisecond)
		time.Sleep(time.Until(next))
	}
	slices.SortFunc(all, time.Time.Compare)
	most := mostInASpan(all, edgeWindow)
	t.Logf("bursts of %d on each of 3 instances, each at the expiry of the last one's sub-window: granted %v, at most %d in a span of %v (limit %d)", limit, got, most, edgeWindow, limit)
	if got[0] < limit*9/10 {
		t.Errorf("the first burst got %d, want about the limit %d", got[0], limit)
	}
	// 1.1 × limit + 1, plus the 4 requests the instances can be sent in a
	// sync lag, as TestWindowZoneInAClusterAcrossWindowEdges allows.
	if ceiling := limit*11/10 + 1 + 20/5; most > ceiling {
		t.Errorf("%d allowed within %v, want at most %d", most, edgeWindow, ceiling)
	}
}

// burstOnEach sends limit requests of key to each of the nodes, all at
// once, and returns the times of the grants, by node, in order.
func burstOnEach(nodes []*node, key string) [][]time.Time {
	var mu sync.Mutex
	by := make([][]time.Time, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		for range limit {
			wg.Go(func() {
				if code, _ := n.get(key); code == http.StatusOK {
					at := time.Now()
					mu.Lock()
					by[i] = append(by[i], at)
					mu.Unlock()
				}
			})
		}
	}
	wg.Wait()
	for i := range by {
		slices.SortFunc(by[i], time.Time.Compare)
	}
	return by
}

// A window zone's cluster deployed afresh: three processes started one
// after the other, syncing every second, so that each is new to the others
// (uncounted: storage's Syncer.shareRank) for a write and two read
// intervals, 3 s, after its first publish. Right after every instance has
// read every other's first snapshot (the shares are split from then on), a
// fresh key sent to each instance at once gets something from every one:
// an instance the others do not count yet grants its allowance (events/10
// + 1, here 3, at most its share), where before the zone denied every key
// on every uncounted instance until the others counted it. The burst stays
// within the bound with three joining at once: limit + 3 × 3.
func TestWindowZoneFreshClusterServesEveryInstanceAtOnce(t *testing.T) {
	body := strings.NewReplacer("read_interval 100ms", "read_interval 1s", "write_interval 100ms", "write_interval 1s").Replace(zoneBody("1m", "1m"))
	nodes := startCluster(t, 3, fileStorage(t.TempDir()), body)
	var last time.Time
	for _, n := range nodes {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d publishing", n.i), func() bool { return n.lastSuccess("write").Unix() > 0 })
		last = maxTime(last, n.lastSuccess("write"))
	}
	for _, n := range nodes {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d reading every first snapshot", n.i), func() bool { return n.lastSuccess("read").After(last) })
	}
	since := time.Since(last)
	by := burstOnEach(nodes, "fresh-deploy")
	var got []int
	total := 0
	for _, b := range by {
		got = append(got, len(b))
		total += len(b)
	}
	allow := limit/10 + 1
	t.Logf("a fresh cluster of 3 (intervals 1 s), %v after the last first publish: a burst of %d on each instance got %v, %d in all (bound limit + 3 × %d = %d)",
		since.Round(time.Millisecond), limit, got, total, allow, limit+3*allow)
	for i, g := range got {
		if g == 0 {
			t.Errorf("node %d granted nothing of a fresh key right after it found the others", i)
		}
	}
	if total > limit+3*allow {
		t.Errorf("the burst got %d, want at most %d", total, limit+3*allow)
	}
}

// maxTime is the later of a and b.
func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
