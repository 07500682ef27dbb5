package floodgate

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/filestorage"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

func TestDistributedValidate(t *testing.T) {
	d := func(r, w, p time.Duration) *Distributed {
		return &Distributed{ReadInterval: caddy.Duration(r), WriteInterval: caddy.Duration(w), PurgeAge: caddy.Duration(p)}
	}
	for _, tc := range []struct {
		d    *Distributed
		want string
	}{
		{d(time.Millisecond, 0, 0), "distributed: read_interval 1ms: must be at least 10ms"},
		{d(0, -time.Second, 0), "distributed: write_interval -1s: must be at least 10ms"},
		{d(0, 0, -time.Second), "distributed: purge_age -1s: must not be negative"},
		{d(0, 0, 9*time.Second), "distributed: purge_age 9s: must be at least twice write_interval (5s)"},
		{d(0, time.Second, time.Second), "purge_age 1s: must be at least twice write_interval (1s)"},
	} {
		if err := tc.d.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.d, err, tc.want)
		}
	}
	for _, ok := range []*Distributed{d(0, 0, 0), d(10*time.Millisecond, 10*time.Millisecond, 20*time.Millisecond)} {
		if err := ok.Validate(); err != nil {
			t.Errorf("%+v: %v", ok, err)
		}
	}
}

func TestDistributedDefaults(t *testing.T) {
	iv := new(Distributed).intervals(time.Minute)
	if iv != (storage.Intervals{Read: 5 * time.Second, Write: 5 * time.Second, PurgeAge: 2 * time.Minute}) {
		t.Fatalf("defaults for a 1m window: %+v", iv)
	}
	if iv := new(Distributed).intervals(time.Second); iv.PurgeAge != time.Minute {
		t.Fatalf("purge_age for a 1s window: %v, want 1m", iv.PurgeAge)
	}
	d := &Distributed{WriteInterval: caddy.Duration(time.Hour)}
	if iv := d.intervals(time.Second); iv.PurgeAge != 2*time.Hour || iv.Read != 5*time.Second {
		t.Fatalf("with write_interval 1h: %+v", iv)
	}
}

// The rate_limit global option distributes its zones with its own
// distributed and storage.
func TestGlobalOptionDistributed(t *testing.T) {
	d := caddyfile.NewTestDispenser(`rate_limit {
		zone g {
			events 5
			window 1m
		}
		distributed {
			read_interval 1s
			write_interval 2s
		}
		storage file_system /tmp/x
	}`)
	v, err := parseGlobal(d, nil)
	if err != nil {
		t.Fatal(err)
	}
	var app App
	if err := json.Unmarshal(v.(httpcaddyfile.App).Value, &app); err != nil {
		t.Fatal(err)
	}
	if app.Distributed == nil || app.Distributed.ReadInterval != caddy.Duration(time.Second) || app.Distributed.WriteInterval != caddy.Duration(2*time.Second) {
		t.Fatalf("distributed: %+v", app.Distributed)
	}
	if !strings.Contains(string(app.StorageRaw), `"module":"file_system"`) {
		t.Fatalf("storage: %s", app.StorageRaw)
	}
	if _, err := parseGlobal(caddyfile.NewTestDispenser(`rate_limit {
		distributed {
			read_interval 1ms
		}
	}`), nil); err == nil || !strings.Contains(err.Error(), "read_interval 1ms: must be at least 10ms") {
		t.Fatalf("bad interval in the global option: %v", err)
	}
}

// bursts takes split or free; anything else fails naming the field.
func TestDistributedBursts(t *testing.T) {
	for _, c := range []struct {
		in, want, err string
	}{
		{"bursts free", BurstsFree, ""},
		{"bursts split", BurstsSplit, ""},
		{"", "", ""},
		{"bursts sometimes", "", `distributed: bursts "sometimes": must be split or free`},
		{"bursts", "", "wrong argument count"},
	} {
		v, err := parseGlobal(caddyfile.NewTestDispenser("rate_limit {\n\tdistributed {\n\t\t"+c.in+"\n\t}\n}"), nil)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q: error %v, want %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%q: %v", c.in, err)
		}
		var app App
		if err := json.Unmarshal(v.(httpcaddyfile.App).Value, &app); err != nil {
			t.Fatal(err)
		}
		if app.Distributed.Bursts != c.want {
			t.Errorf("%q: bursts %q, want %q", c.in, app.Distributed.Bursts, c.want)
		}
	}
}

// A distributed zone's decision is its bucket's, made stricter by the
// cluster's.
func TestStricter(t *testing.T) {
	bucket := limiter.Decision{Allowed: true, Limit: 10, Remaining: 7, Reset: time.Second}
	cl := limiter.Decision{Limit: 20, RetryAfter: 3 * time.Second, Reset: 4 * time.Second}
	got := stricter(bucket, cl)
	want := limiter.Decision{Allowed: false, Limit: 10, Remaining: 0, RetryAfter: 3 * time.Second, Reset: 4 * time.Second}
	if got != want {
		t.Fatalf("stricter = %+v, want %+v", got, want)
	}
	cl = limiter.Decision{Allowed: true, Limit: 20, Remaining: 12}
	if got := stricter(bucket, cl); got != bucket {
		t.Fatalf("a laxer cluster changed the decision: %+v", got)
	}
}

// distributedHandler is a handler with the zone zc, on clock, distributed
// through a file storage in dir as d says (from the first config: its
// counts restored, from nothing). Its syncs do not run on their own: a
// test calls them at its clock's times (syncCounts).
func distributedHandler(t *testing.T, clock *testclock.Clock, name string, zc *Zone, d *Distributed, dir string) *Handler {
	t.Helper()
	t.Setenv("XDG_DATA_HOME", t.TempDir()) // the instance id
	h := newTestHandler(t, clock, map[string]*Zone{name: zc})
	ctx := caddy.Context{Context: context.Background()}
	st := &certmagic.FileStorage{Path: dir}
	secret, err := hashSecretOf(storageID(nil, st))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.zones[0].distribute(ctx, d, zoneStorage{st: st}, secret); err != nil {
		t.Fatal(err)
	}
	return h
}

// syncCounts has every count of z's cluster state publish, then read, at
// now.
func syncCounts(z *zone, now time.Time) {
	for _, sc := range z.dist.synced {
		sc.syncer.Write(context.Background(), now)
	}
	for _, sc := range z.dist.synced {
		sc.syncer.Read(context.Background(), now)
	}
}

// A clusterPeer is another instance of one count of a distributed zone (its rate
// or a quota), in this process: a Cluster of the count's window and width
// under a name of its own, whose snapshots are moved to where the count's
// instances read them.
type clusterPeer struct {
	t        *testing.T
	c        *storage.Cluster
	s        *storage.Syncer
	dir      string
	own, to  string
	instance string
}

// newClusterPeer returns a clusterPeer, named instance, of the count of shape whose
// instances sync through the file storage in dir with intervals iv.
func newClusterPeer(t *testing.T, dir string, shape storage.Shape, quota int64, iv storage.Intervals, instance string) *clusterPeer {
	t.Helper()
	own := shape
	own.Zone = shape.Zone + " peer " + instance
	c, _, err := storage.Acquire(own, quota)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { storage.Release(own) })
	c.SplitBursts(true, iv.Read)
	s := storage.NewSyncer(c, &certmagic.FileStorage{Path: dir}, instance, iv, zap.NewNop())
	return &clusterPeer{t: t, c: c, s: s, dir: dir, own: own.Zone, to: shape.Zone, instance: instance}
}

// publish writes the peer's snapshot at now where the count's instances
// read it.
func (p *clusterPeer) publish(now time.Time) {
	p.t.Helper()
	p.s.Write(context.Background(), now)
	to := filepath.Join(p.dir, filepath.FromSlash(storage.Key(p.to, p.instance)))
	if err := os.MkdirAll(filepath.Dir(to), 0o700); err != nil {
		p.t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(p.dir, filepath.FromSlash(storage.Key(p.own, p.instance))), to); err != nil {
		p.t.Fatal(err)
	}
}

// countsOf returns the shape of z's count i (0 its rate's, then its
// quotas') and its cluster.
func countsOf(z *zone, i int) (storage.Shape, *storage.Cluster) {
	return z.dist.synced[i].shape, z.dist.synced[i].cluster
}

// A distributed zone's quota decides on the cluster's counts: it is
// published under its own name beside the zone's, and what another
// instance granted a key counts against the key's quota here.
func TestDistributedQuotaDecidesOnTheClustersCounts(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour))
	dir := t.TempDir()
	iv := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second), Bursts: BurstsFree}
	h := distributedHandler(t, clock, "dq", &Zone{
		Limit:  zoneconf.Limit{MaxEvents: 100, Window: caddy.Duration(time.Minute), Burst: 100, Memory: 4096},
		Quotas: []Quota{{MaxEvents: 10, Window: caddy.Duration(time.Hour)}},
	}, iv, dir)
	z := h.zones[0]
	shape, cl := countsOf(z, 1)
	if shape.Zone != "dq/1h quota" || shape.Window != time.Hour || z.quotas[0] != quotaPolicy(cl) {
		t.Fatalf("the quota's count: %+v, policy %T, want dq/1h quota over 1h deciding the quota", shape, z.quotas[0])
	}
	now := clock.Now()
	p := newClusterPeer(t, dir, shape, 10, iv.intervals(time.Minute), "peer")
	key := keyOf(z, "192.0.2.1:1", "", nil)
	for range 6 {
		if d, _ := p.c.TakeHash(key, 1, now); !d.Allowed {
			t.Fatal("the peer denied a fresh key")
		}
	}
	p.publish(now)
	syncCounts(z, now)
	inst, err := caddy.InstanceID()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "rate_limit", "dq%2F1h%20quota", inst.String())); err != nil {
		t.Fatalf("the quota's snapshot: %v", err)
	}
	for i := range 4 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("request %d of the 4 a quota of 10 the other instance used 6 of leaves: %v", i+1, err)
		}
	}
	if d := z.quotas[0].PeekHash(key, 1, now); d.Allowed {
		t.Fatalf("after 4 here and 6 on the other instance, a quota of 10 still lets the key through: %+v", d)
	}
	// The other instance falls silent: its counts of the quota still
	// count after two of the zone's windows, a quota's snapshot being
	// kept for two of the quota's. (Peeked, not served: a denial would
	// block the key here whatever the counts.)
	clock.Advance(3 * time.Minute)
	syncCounts(z, clock.Now())
	if d := z.quotas[0].PeekHash(key, 1, clock.Now()); d.Allowed {
		t.Fatalf("3 minutes after the other instance's last snapshot the quota lets the key through (%+v): its 6 of the hour's 10 still count", d)
	}
	if _, err := serve(h, weightedRequest("/")); status(err) != http.StatusTooManyRequests {
		t.Fatalf("3 minutes after the other instance's last snapshot: %v, want 429", err)
	}
}

// A cost the response reports is counted in a distributed zone's cluster:
// in the rate's estimate and in the quota's, up to each one's count, so
// that the other instances deny the key as they would had it been granted
// that much.
func TestReportedCostIsCountedInTheCluster(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour))
	h := distributedHandler(t, clock, "dc", &Zone{
		Limit:                zoneconf.Limit{MaxEvents: 100, Window: caddy.Duration(time.Minute), Burst: 100, Memory: 4096},
		Quotas:               []Quota{{MaxEvents: 50, Window: caddy.Duration(time.Hour)}},
		WeightResponseHeader: "X-Cost",
	}, &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second)}, t.TempDir())
	z := h.zones[0]
	key := keyOf(z, "192.0.2.1:1", "", nil)
	if _, err := serveThrough(h, weightedRequest("/"), slowWeight(h, clock, 0, "30")); err != nil {
		t.Fatal(err)
	}
	now := clock.Now()
	_, rate := countsOf(z, 0)
	_, quota := countsOf(z, 1)
	if d := rate.PeekHash(key, 1, now); d.Remaining != 70 {
		t.Errorf("the rate's cluster holds %d of 100 after a response costing 30, want 70", d.Remaining)
	}
	if d := quota.PeekHash(key, 1, now); d.Remaining != 20 {
		t.Errorf("the quota's cluster holds %d of 50 after a response costing 30, want 20", d.Remaining)
	}
	// A wild report drives the key over both: the cluster denies it.
	if _, err := serveThrough(h, weightedRequest("/"), slowWeight(h, clock, 0, "1000000")); err != nil {
		t.Fatal(err)
	}
	now = clock.Now()
	for i := range 2 {
		if _, cl := countsOf(z, i); cl.PeekHash(key, 1, now).Allowed {
			t.Errorf("count %d: a key whose response reported a million passes", i)
		}
	}
}

// A zone with action delay holds a request that only its instance's share
// of the key keeps out (bursts split), until a read lets it through, up to
// max_delay, rather than answer 429 at once: two instances, 5 per minute,
// a key that only reaches this one gets its five, the fourth and fifth
// held, and the sixth, over the cluster's limit, is denied at once.
func TestDelayHoldsARequestOnlyItsShareKeepsOut(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour))
	dir := t.TempDir()
	d := &Distributed{ReadInterval: caddy.Duration(100 * time.Millisecond), WriteInterval: caddy.Duration(100 * time.Millisecond)}
	h := distributedHandler(t, clock, "dd", &Zone{
		Limit:  zoneconf.Limit{MaxEvents: 5, Window: caddy.Duration(time.Minute), Burst: 5, Memory: 4096},
		Action: "delay", MaxDelay: caddy.Duration(2 * time.Second),
	}, d, dir)
	held := &heldClock{clock: clock}
	h.sleep = held.sleep
	z := h.zones[0]
	shape, cl := countsOf(z, 0)
	p := newClusterPeer(t, dir, shape, 5, d.intervals(time.Minute), "zz-peer") // ranked after this instance
	// The instances sync every read interval, as their loops would.
	next := clock.Now()
	held.meanwhile = func(now time.Time) {
		for !next.After(now) {
			p.publish(next)
			syncCounts(z, next)
			next = next.Add(100 * time.Millisecond)
		}
	}
	held.meanwhile(clock.Now())
	key := keyOf(z, "192.0.2.1:1", "", nil)
	var codes []int
	for range 5 {
		_, err := serve(h, weightedRequest("/"))
		codes = append(codes, status(err))
	}
	waits := held.held()
	t.Logf("five requests of a key on one of two instances: %v, held %v", codes, waits)
	for i, c := range codes {
		if c != http.StatusOK {
			t.Fatalf("request %d: %d (all %v, held %v), want all passed, held while only the share kept them out", i+1, c, codes, waits)
		}
	}
	var total time.Duration
	for _, w := range waits {
		if w <= 0 || w > 100*time.Millisecond {
			t.Errorf("held %v: each wait is at most until the next read (100ms)", waits)
		}
		total += w
	}
	if len(waits) == 0 || total > 2*time.Second {
		t.Errorf("held %v (%v in all), want some, within max_delay", waits, total)
	}
	// Counted in the cluster when they went: the sixth is over the limit.
	if d := cl.PeekHash(key, 1, clock.Now()); d.Allowed || cl.ShareDenies(key, 1, clock.Now()) {
		t.Errorf("after five of five, the cluster: %+v", d)
	}
	before := len(held.held())
	if _, err := serve(h, weightedRequest("/")); status(err) != http.StatusTooManyRequests {
		t.Fatalf("request 6 of a limit of 5: %v, want 429", err)
	}
	if len(held.held()) != before {
		t.Errorf("request 6, over the cluster's limit, was held: %v", held.held()[before:])
	}
}

// A distributed zone with weight response_status or response_time counts
// what the responses cost in the cluster, as a reported cost is, and
// admits a key only while the cluster has room for it: a key spent on
// another instance is refused here before its request is served.
func TestDeferredCostsAreCountedInTheCluster(t *testing.T) {
	for _, tt := range []struct {
		name string
		edit func(*Zone)
		next caddyhttp.Handler
		cost int64
	}{
		{"status", func(z *Zone) { z.WeightResponseStatus = []string{"401"} }, &upstream{status: http.StatusUnauthorized}, 1},
		{"time", func(z *Zone) { z.WeightResponseTime = true }, nil, 300},
	} {
		t.Run(tt.name, func(t *testing.T) {
			clock := testclock.New(time.Now().Add(time.Hour))
			zc := &Zone{Limit: zoneconf.Limit{MaxEvents: 1000, Window: caddy.Duration(time.Hour), Burst: 1000, Memory: 4096}}
			tt.edit(zc)
			dir := t.TempDir()
			d := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second), Bursts: "free"}
			h := distributedHandler(t, clock, "dd_"+tt.name, zc, d, dir)
			z := h.zones[0]
			key := keyOf(z, "192.0.2.1:1", "", nil)
			next := tt.next
			if next == nil {
				next = slowWeight(h, clock, 300*time.Millisecond, "")
			}
			if _, err := serveThrough(h, weightedRequest("/"), next); status(err) == http.StatusTooManyRequests {
				t.Fatal(err)
			}
			_, rate := countsOf(z, 0)
			if d := rate.PeekHash(key, 1, clock.Now()); d.Remaining < 1000-tt.cost || d.Remaining > 1000-tt.cost+1 {
				t.Errorf("the cluster holds %d of 1000 after a response costing %d, want %d", d.Remaining, tt.cost, 1000-tt.cost)
			}
			// Another instance spends the key: this one refuses it
			// before the upstream once it has read that.
			shape, _ := countsOf(z, 0)
			p := newClusterPeer(t, dir, shape, 1000, d.intervals(time.Hour), "zz-peer")
			p.c.Add(key, 2000, clock.Now())
			p.publish(clock.Now())
			syncCounts(z, clock.Now())
			u := &upstream{status: http.StatusOK}
			if _, err := serveThrough(h, weightedRequest("/"), u); status(err) != http.StatusTooManyRequests || u.hits != 0 {
				t.Errorf("a key the cluster has spent: %v after %d upstream hits, want a 429 before the upstream", err, u.hits)
			}
		})
	}
}

// A window zone whose window holds fewer than three read intervals is
// warned of at provisioning: the cluster cannot hold its bound
// (storage's TestWindowZoneOfThreeReadsHoldsTheBound and
// TestWindowZoneRandomClockSkewSchedulesKeepTheBound show where it holds).
func TestWindowTooShortForTheReads(t *testing.T) {
	iv := storage.Intervals{Read: time.Second, Write: time.Second}
	for _, c := range []struct {
		window time.Duration
		short  bool
	}{{time.Millisecond, true}, {500 * time.Millisecond, true}, {2 * time.Second, true}, {2999 * time.Millisecond, true}, {3 * time.Second, false}, {time.Minute, false}} {
		if got := windowTooShort(c.window, iv); got != c.short {
			t.Errorf("window %v, reads every %v: too short %v, want %v", c.window, iv.Read, got, c.short)
		}
	}
}
