package cluster

import (
	"fmt"
	"math"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// opsBody has a distributed zone with a quota (shared) and, on /local, a
// zone of this instance alone with a quota (local): every part of a zone's
// memory.
const opsBody = `route /local {
		rate_limit {
			zone local {
				key {http.request.header.X-Key}
				events 5
				window 1m
				sources 1000
				quota 100 1h
			}
		}
		respond "ok"
	}
	rate_limit {
		zone shared {
			key {http.request.header.X-Key}
			events 20
			window 10m
			memory 64KiB
			quota 1000 1h
		}
		distributed {
			read_interval 100ms
			write_interval 100ms
		}
	}
	respond "ok"`

// The shapes opsBody gives: shared's table of 64 KiB has 1,024 lines, and
// its rate's and its quota's cluster sketches (memory/64 for a quota) as
// many cells per row; local's quota is sized by sources 1000 and the
// default false_deny.
const (
	sharedLines = 65536 / 64
	sharedCells = 4 * sharedLines
	// sharedCounts is the cluster counts of shared: its rate and its
	// quota.
	sharedCounts = 2
)

// sizingParts restates docs/sizing.md's formulas of the memory parts, as
// its table writes them: the test fails if the page's table changes
// without this, and checks below that what a running Caddy reports is
// what these give.
var sizingParts = map[string]string{
	"table":          "64 × lines",
	"quotas":         "16 × cells + 2 × bitmap, per quota",
	"cluster_sketch": "16 × cells (64 × for a window zone's rate) + 2 × bitmap + 4 × listed, per count",
	"cluster_sums":   "8 × cells (32 × for a window zone's rate) + bitmap, per count, once read",
	"cluster_shares": "4 × bitmap + 8 × cells (36 × for a window zone's rate) + 16 × shared (44 × for a window zone's rate), per count with bursts split",
	"mitigation":     "32768 + 32 × blocked, per count",
}

// docParts reads the table of memory parts of docs/sizing.md.
func docParts(t *testing.T) map[string]string {
	t.Helper()
	raw, err := os.ReadFile("../../docs/sizing.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(raw), "<!-- memory parts: checked by TestMemoryPartsMatchSizing (caddytest/cluster) -->\n")
	table, _, ok2 := strings.Cut(table, "<!-- end of the memory parts -->")
	if !ok || !ok2 {
		t.Fatal("docs/sizing.md has no table of memory parts between its markers")
	}
	row := regexp.MustCompile("^\\| `([a-z_]+)` \\| ([^|]+) \\|")
	parts := map[string]string{}
	for _, line := range strings.Split(table, "\n") {
		if m := row.FindStringSubmatch(line); m != nil {
			parts[m[1]] = strings.TrimSpace(m[2])
		}
	}
	return parts
}

// bitmap is a bitmap of one bit per cell, in bytes: 8 × ⌈cells / 64⌉.
func bitmap(cells int) int { return 8 * ((cells + 63) / 64) }

// quotaWidth is docs/sizing.md's width of a quota's sketch:
// −sources / ln(1 − false_deny^¼), rounded up.
func quotaWidth(sources int, falseDeny float64) int {
	return int(math.Ceil(-float64(sources) / math.Log(1-math.Pow(falseDeny, 0.25))))
}

// runtimeTerm checks that got is fixed plus n units, 0 ≤ n ≤ most, and
// returns n.
func runtimeTerm(t *testing.T, what string, got, fixed, unit, most int) int {
	t.Helper()
	n := (got - fixed) / unit
	if got < fixed || (got-fixed)%unit != 0 || n > most {
		t.Errorf("%s: %d bytes, want %d + %d × n with 0 ≤ n ≤ %d", what, got, fixed, unit, most)
	}
	return n
}

// sharesTerm is the cells shared in the zone shared's two counts, whose
// cluster_shares are fixed + 44 × a (its rate's, sliding) + 16 × b (its
// quota's), each from least to most. 44a + 16b does not say a and b alone
// (44 × 4 = 16 × 11), so it returns a + b of a decomposition within those
// bounds, a = b where one is, or an error where none makes got.
func sharesTerm(t *testing.T, got, fixed, least, most int) int {
	t.Helper()
	found := -1
	for a := least; a <= most && fixed+44*a <= got; a++ {
		if rest := got - fixed - 44*a; rest%16 == 0 && rest/16 >= least && rest/16 <= most {
			if found < 0 || rest/16 == a {
				found = a + rest/16
			}
		}
	}
	if found < 0 {
		t.Errorf("cluster_shares: %d bytes, want %d + 44 × a + 16 × b with %d ≤ a, b ≤ %d", got, fixed, least, most)
	}
	return found
}

// zoneView and keyView are what the tests read of the admin API's
// answers (floodgate.ZoneInfo, floodgate.KeyInfo), decoded on their own so
// that they also run against code that lacks some of it.
type zoneView struct {
	Memory struct {
		Bytes int            `json:"bytes"`
		Parts map[string]int `json:"parts"`
		Lines int            `json:"lines"`
	} `json:"memory"`
	Cluster *struct {
		Instances     int        `json:"instances"`
		LastRead      *time.Time `json:"last_read"`
		LastWrite     *time.Time `json:"last_write"`
		Bursts        string     `json:"bursts"`
		ReadInterval  string     `json:"read_interval"`
		WriteInterval string     `json:"write_interval"`
	} `json:"cluster"`
}

type keyView struct {
	Allowed  bool `json:"allowed"`
	Policies []struct {
		Policy    string `json:"policy"`
		Limit     int64  `json:"limit"`
		Remaining int64  `json:"remaining"`
		Window    string `json:"window"`
		Cluster   *struct {
			Here         int64      `json:"here"`
			Others       int64      `json:"others"`
			LeftToOthers int64      `json:"left_to_others"`
			Blocked      int64      `json:"blocked"`
			Instances    int        `json:"instances"`
			LastRead     *time.Time `json:"last_read"`
		} `json:"cluster"`
	} `json:"policies"`
}

func zoneInfo(t *testing.T, n *node, zone string) zoneView {
	t.Helper()
	var z zoneView
	testcaddy.JSON(t, http.DefaultClient, testcaddy.Request(t, http.MethodGet, fmt.Sprintf("http://localhost:%d/rate_limit/zones/%s", n.admin, zone)), &z)
	return z
}

func keyInfo(t *testing.T, n *node, zone, key string) keyView {
	t.Helper()
	var k keyView
	testcaddy.JSON(t, http.DefaultClient, testcaddy.Request(t, http.MethodGet, fmt.Sprintf("http://localhost:%d/rate_limit/zones/%s/keys/%s", n.admin, zone, key)), &k)
	return k
}

// getPath is node.get on path.
func (n *node) getPath(path, key string) int {
	n.t.Helper()
	req := testcaddy.Request(n.t, http.MethodGet, "http://"+n.addr()+path, "X-Key: "+key)
	req.Close = true
	code, _, _ := testcaddy.Do(n.t, &http.Client{Timeout: 10 * time.Second}, req)
	return code
}

// Every part of a zone's memory is reported, in total and by part, on the
// admin API, /metrics and `caddy rate-limit zones`, and is what
// docs/sizing.md's formulas give for the zone's settings and its state:
// two instances sharing file storage, one key counted on both and driven
// over its limit on one.
func TestMemoryPartsMatchSizing(t *testing.T) {
	if got := docParts(t); fmt.Sprint(got) != fmt.Sprint(sizingParts) {
		t.Fatalf("docs/sizing.md's memory parts:\n%v\nthe test's (which it checks against a running Caddy):\n%v", got, sizingParts)
	}
	store := t.TempDir()
	nodes := startCluster(t, 2, fileStorage(store), opsBody)
	a, b := nodes[0], nodes[1]
	for range 3 {
		b.get("carol")
		a.getPath("/local", "carol")
	}
	// dave over his cluster limit, on both: blocked.
	spread(t, nodes, "dave", 30, 100*time.Millisecond)
	a.waitRead(store, time.Now())
	b.waitRead(store, time.Now())

	// local: the table and its quota's sketch.
	local := zoneInfo(t, a, "local")
	qc := 4 * quotaWidth(1000, 0.005)
	wantLocal := map[string]int{"table": 64 * local.Memory.Lines, "quotas": 16*qc + 2*bitmap(qc)}
	if fmt.Sprint(local.Memory.Parts) != fmt.Sprint(wantLocal) {
		t.Errorf("zone local: memory parts %v, want %v (docs/sizing.md)", local.Memory.Parts, wantLocal)
	}
	if local.Memory.Bytes != wantLocal["table"]+wantLocal["quotas"] {
		t.Errorf("zone local: memory %d bytes, want the sum of its parts %v", local.Memory.Bytes, wantLocal)
	}

	// shared: the table and the cluster's parts, the rate's and the
	// quota's counts. Shares (bursts split, two instances) need a read a
	// write and a read interval after the first count.
	var z zoneView
	// shared is a window zone: its rate's cluster count is sliding, of
	// 64-byte cells, where its quota's has 16-byte ones; its shares list
	// what leaves the view in each of 7 sub-windows and index its cells.
	const perCell = 16 + 64
	fixedShares := sharedCounts*4*bitmap(sharedCells) + (36+8)*sharedCells
	waitFor(t, 10*time.Second, "node 0's shares in use", func() bool {
		z = zoneInfo(t, a, "shared")
		return z.Memory.Parts["cluster_shares"] >= fixedShares
	})
	p := z.Memory.Parts
	t.Logf("zone shared on node 0: %d bytes: %v", z.Memory.Bytes, p)
	if len(p) != len(sizingParts)-1 || p["table"] != 64*sharedLines || z.Memory.Lines != sharedLines {
		t.Errorf("zone shared: parts %v, lines %d; want every part but quotas (its quota is a cluster count), table %d", p, z.Memory.Lines, 64*sharedLines)
	}
	listed := runtimeTerm(t, "cluster_sketch", p["cluster_sketch"], perCell*sharedCells+sharedCounts*2*bitmap(sharedCells), 4, sharedCounts*2*sharedCells)
	if want := perCell/2*sharedCells + sharedCounts*bitmap(sharedCells); p["cluster_sums"] != want {
		t.Errorf("cluster_sums: %d bytes, want %d (both counts read)", p["cluster_sums"], want)
	}
	// dave and carol are counted in each count's 4 rows: 8 cells each.
	shared := sharesTerm(t, p["cluster_shares"], fixedShares, 8, sharedCells)
	blocked := runtimeTerm(t, "mitigation", p["mitigation"], sharedCounts*32768, 32, sharedCounts*4096)
	// dave and carol are counted in each count's 4 rows: 8 cells.
	if listed < sharedCounts*8 || shared < sharedCounts*8 || blocked < 1 {
		t.Errorf("cells listed %d, shared %d (want at least %d: two keys in two counts of 4 rows); keys blocked %d (want dave's)",
			listed, shared, sharedCounts*8, blocked)
	}
	sum := 0
	for _, n := range p {
		sum += n
	}
	if z.Memory.Bytes != sum {
		t.Errorf("zone shared: memory %d bytes, want the sum of its parts, %d", z.Memory.Bytes, sum)
	}

	// /metrics: a series per part; the fixed ones as the admin API says.
	m := testcaddy.Metrics(t, a.admin)
	for part, want := range map[string]int{"table": 64 * sharedLines, "cluster_sums": p["cluster_sums"]} {
		series := fmt.Sprintf(`caddy_rate_limit_memory_bytes{part=%q,zone="shared"}`, part)
		if got := testcaddy.MetricSum(m, series); got != float64(want) {
			t.Errorf("%s = %v, want %d", series, got, want)
		}
	}
	for part := range sizingParts {
		if part != "quotas" && !strings.Contains(m, fmt.Sprintf(`caddy_rate_limit_memory_bytes{part=%q,zone="shared"}`, part)) {
			t.Errorf("/metrics has no series of part %s for zone shared", part)
		}
	}
	if got := testcaddy.MetricSum(m, `caddy_rate_limit_memory_bytes{part="quotas",zone="local"}`); got != float64(wantLocal["quotas"]) {
		t.Errorf("local's quotas on /metrics: %v, want %d", got, wantLocal["quotas"])
	}

	// The CLI: the total in the table, the parts below it.
	out := a.rateLimit("zones")
	t.Logf("caddy rate-limit zones:\n%s", out)
	if !regexp.MustCompile(`(?m)^zone shared: memory [0-9.]+ KiB: table 64\.0 KiB, cluster_sketch 3[23][0-9]\.[0-9] KiB, cluster_sums 161\.0 KiB, cluster_shares [0-9.]+ KiB, mitigation 64\.[0-9] KiB$`).MatchString(out) ||
		!regexp.MustCompile(`(?m)^zone local: memory [0-9.]+ KiB: table [0-9.]+ KiB, quotas [0-9.]+ KiB$`).MatchString(out) {
		t.Errorf("caddy rate-limit zones does not list the memory parts:\n%s", out)
	}
}

// A distributed zone's cluster view is shown by the admin API and `caddy
// rate-limit` in `zones` (its sync state), `key` and `reset` (what this
// instance and the others counted for the key, what it leaves the others,
// whether the cluster blocks it), for the rate and for each quota; the
// remaining count the cluster policy reports is what those leave; a reset
// empties this instance's view of the key, so that a request passes here
// at once, and says what it cannot do at once: the other instances.
func TestClusterViewInZonesKeyAndReset(t *testing.T) {
	store := t.TempDir()
	nodes := startCluster(t, 2, fileStorage(store), opsBody)
	waitSynced(t, nodes) // each takes its share of a key (bursts split)
	a, b := nodes[0], nodes[1]
	for range 5 {
		a.get("erin")
	}
	for range 3 {
		b.get("erin")
	}
	synced := time.Now()
	b.waitWritten(store, synced)
	a.waitRead(store, synced)

	z := zoneInfo(t, a, "shared")
	c := z.Cluster
	if c == nil || c.Instances != 2 || c.LastRead == nil || c.LastWrite == nil || c.Bursts != "split" || c.ReadInterval != "100ms" || c.WriteInterval != "100ms" {
		t.Errorf("zone shared's cluster on node 0: %+v, want 2 instances, its last read and write, bursts split, intervals of 100ms", c)
	}
	out := a.rateLimit("zones")
	if !regexp.MustCompile(`(?m)^zone shared: cluster: 2 instances live \(this one included\); last read [0-9.]+m?s ago \(every 100ms\), last write [0-9.]+m?s ago \(every 100ms\); bursts split; errors: 0 read, 0 write, 0 restore$`).MatchString(out) {
		t.Errorf("caddy rate-limit zones does not show the cluster's state:\n%s", out)
	}

	k := keyInfo(t, a, "shared", "erin")
	t.Logf("key erin on node 0: %+v", k)
	views := 0
	for _, p := range k.Policies {
		v := p.Cluster
		switch p.Policy {
		case "cluster", "quota":
			if v == nil {
				t.Errorf("policy %s %s of a distributed zone has no cluster view: %+v", p.Policy, p.Window, p)
				continue
			}
			views++
			if v.Here != 5 || v.Others != 3 || v.Instances != 2 || v.LastRead == nil || v.Blocked != 0 {
				t.Errorf("policy %s %s: cluster view %+v, want 5 here, 3 by the others, 2 instances, not blocked", p.Policy, p.Window, *v)
			}
			// What decisions read: the limit less what both counted
			// and what this instance leaves the other.
			if want := max(p.Limit-v.Here-v.Others-v.LeftToOthers, 0); p.Remaining != want || v.LeftToOthers < 0 {
				t.Errorf("policy %s %s: remaining %d, want %d − %d − %d − %d left to the others = %d", p.Policy, p.Window, p.Remaining,
					p.Limit, v.Here, v.Others, v.LeftToOthers, want)
			}
		default:
			if v != nil {
				t.Errorf("policy %s of this instance alone has a cluster view %+v", p.Policy, *v)
			}
		}
	}
	if views != 2 {
		t.Errorf("key erin: %d cluster views, want 2 (the rate's, the quota's): %+v", views, k)
	}
	out = a.rateLimit("key", "shared", "erin")
	t.Logf("caddy rate-limit key shared erin on node 0:\n%s", out)
	for _, name := range []string{"cluster", "quota 1h0m0s"} {
		if !regexp.MustCompile(`(?m)^` + name + `: 5 counted here, 3 by the other instances \(as of the last read, [0-9.]+m?s ago; 2 instances live \(this one included\)\)`).MatchString(out) {
			t.Errorf("caddy rate-limit key: no cluster view of %s:\n%s", name, out)
		}
	}

	// erin over her cluster limit: node 0 denies her.
	spread(t, nodes, "erin", 30, 100*time.Millisecond)
	synced = time.Now()
	b.waitWritten(store, synced)
	a.waitRead(store, synced)
	if code, _ := a.get("erin"); code != http.StatusTooManyRequests {
		t.Fatalf("node 0, erin over her cluster limit: %d", code)
	}
	out = a.rateLimit("key", "shared", "erin")
	t.Logf("caddy rate-limit key shared erin on node 0, over the limit:\n%s", out)
	if !strings.Contains(out, "a request now would be denied") || !regexp.MustCompile(`(?m)^cluster: [0-9]+ counted here, [0-9]+ by the other instances .*; blocked cluster-wide for [0-9]+s more$`).MatchString(out) {
		t.Errorf("caddy rate-limit key over the limit does not say the cluster blocks erin:\n%s", out)
	}

	out = a.rateLimit("reset", "shared", "erin")
	t.Logf("caddy rate-limit reset shared erin on node 0:\n%s", out)
	if !strings.Contains(out, "a request now would be allowed\ncluster: published with this instance's next write (every 100ms); each other instance lets the key through after its next read (every 100ms)\n") ||
		!regexp.MustCompile(`(?m)^cluster: 0 counted here, 0 by the other instances `).MatchString(out) ||
		!regexp.MustCompile(`(?m)^quota 1h0m0s: 0 counted here, 0 by the other instances `).MatchString(out) ||
		strings.Contains(out, "blocked") {
		t.Errorf("reset: want allowed, the cluster's part emptied here and what the other instances do:\n%s", out)
	}
	if code, _ := a.get("erin"); code != http.StatusOK {
		t.Fatalf("node 0 right after the reset said allowed: %d", code)
	}
}

// A reset on an instance whose storage writes fail says that the other
// instances cannot learn of it yet, rather than that they will after their
// next read; the key passes on this instance, as the answer says.
func TestResetWhileWritesFailSaysSo(t *testing.T) {
	r := startRedis(t)
	nodes := startCluster(t, 1, redisStorage(r), zoneBody(exhaustWindow, "20m"))
	a := nodes[0]
	exhaust(t, a, "frank")
	waitFor(t, 10*time.Second, "node 0's snapshot in Redis", func() bool {
		n, err := r.Keys("floodgate-test/rate_limit/shared/*")
		return err == nil && n >= 1
	})
	r.Stop()
	waitFor(t, 10*time.Second, "node 0 failing to write", func() bool {
		return a.logged("cluster storage failed", `"op":"write"`)
	})
	waitFor(t, 10*time.Second, "node 0's last write over three intervals and a second old", func() bool {
		c := zoneInfo(t, a, "shared").Cluster
		return c != nil && (c.LastWrite == nil || time.Since(*c.LastWrite) > 3*100*time.Millisecond+time.Second)
	})
	out := a.rateLimit("reset", "shared", "frank")
	t.Logf("caddy rate-limit reset with Redis down:\n%s", out)
	if !regexp.MustCompile(`(?m)^reset: zone shared, source key:[0-9a-f]+: a request now would be allowed\ncluster: NOT yet published: this instance's writes to the cluster storage are failing \(last [0-9.]+m?s ago succeeded\); until one does, the other instances keep counting the key as before and may still deny it$`).MatchString(out) {
		t.Errorf("reset with the storage down does not say the others cannot learn of it:\n%s", out)
	}
	if code, _ := a.get("frank"); code != http.StatusOK {
		t.Fatalf("node 0 after the reset said allowed: %d", code)
	}
}
