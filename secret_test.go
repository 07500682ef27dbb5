package floodgate

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// newProcess makes the zones distributed from now on behave as in another
// process: one that does not know any cluster's hash secret yet.
func newProcess(t *testing.T) {
	t.Helper()
	hashSecrets.Lock()
	saved := hashSecrets.m
	hashSecrets.m = make(map[string]*hashSecret)
	hashSecrets.Unlock()
	t.Cleanup(func() {
		hashSecrets.Lock()
		hashSecrets.m = saved
		hashSecrets.Unlock()
	})
}

func secretZone() *Zone {
	return &Zone{
		Key:   "{http.request.header.X-API-Key}",
		Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Memory: 4096},
	}
}

// headerHash is the hash z gives the header value 203.0.113.7.
func headerHash(z *zone) uint64 {
	return keyOf(z, "10.9.9.9:5", "", map[string]string{"X-API-Key": "203.0.113.7"})
}

// With the public salt alone, a distributed zone's counters would be as
// computable as an unsalted table's (TestAZonesSaltsHoldItsTablesSecret):
// a reviewer found a header value landing on a chosen client's counters in
// 4.6 s. Instances of a cluster share a secret through their storage
// instead: two processes on one storage hash a value alike, not as the
// public salt does, and a cluster on another storage hashes it elsewhere.
func TestDistributedZonesShareASecretHashNoOneElseKnows(t *testing.T) {
	clock := testclock.New(time.Now())
	d := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second)}
	dir := t.TempDir()
	newProcess(t)
	first := headerHash(distributedHandler(t, clock, "sa", secretZone(), d, dir).zones[0])
	newProcess(t)
	second := headerHash(distributedHandler(t, clock, "sa", secretZone(), d, dir).zones[0])
	newProcess(t)
	elsewhere := headerHash(distributedHandler(t, clock, "sa", secretZone(), d, t.TempDir()).zones[0])
	if first != second {
		t.Errorf("two instances of one cluster hash the value to %x and %x: they cannot count it together", first, second)
	}
	public := parseKeySpec("{http.request.header.X-API-Key}")
	value := limiter.NetworkKey(mustAddr(t, "203.0.113.7"), 32, 64)
	if guess := public.salted(limiter.Hash(value.Bytes())); first == guess {
		t.Errorf("the cluster's hash %x is the public salt's: computable without its secret", first)
	}
	if elsewhere == first {
		t.Errorf("two clusters on different storages hash the value alike (%x): their secret is not theirs", first)
	}
	if _, err := os.Stat(filepath.Join(dir, filepath.FromSlash(storage.SecretKey))); err != nil {
		t.Errorf("the cluster's secret is not in its storage: %v", err)
	}
}

// A zone that loads while its storage does not answer hashes with a
// provisional secret and limits on its own; when its syncer reaches the
// storage it adopts the cluster's secret before publishing: it then hashes
// as the cluster does, and its cluster state has forgotten what it counted
// under the provisional secret (in cells that are other keys' under the
// cluster's), so no peer ever reads those counts.
func TestAZoneThatLoadsWithoutItsStorageAdoptsTheClustersSecret(t *testing.T) {
	clock := testclock.New(time.Now())
	d := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second)}
	dir := t.TempDir()
	newProcess(t)
	cluster := headerHash(distributedHandler(t, clock, "sb", secretZone(), d, dir).zones[0])

	newProcess(t)
	// A storage whose directory is a file: every call fails, as a storage
	// that does not answer does.
	down := filepath.Join(t.TempDir(), "storage")
	if err := os.WriteFile(down, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	h := distributedHandler(t, clock, "sb", secretZone(), d, down)
	z := h.zones[0]
	provisional := headerHash(z)
	if provisional == cluster {
		t.Fatal("a zone that never read the cluster's secret hashes with it")
	}
	req := func() *http.Request {
		r := weightedRequest("/")
		r.Header.Set("X-API-Key", "203.0.113.7")
		return r
	}
	for range 3 {
		if _, err := serve(h, req()); err != nil {
			t.Fatalf("while the storage is down: %v", err)
		}
	}
	if _, err := serve(h, req()); status(err) != http.StatusTooManyRequests {
		t.Fatalf("while the storage is down, the 4th of 3: %v, want 429 (it limits on its own)", err)
	}
	if c := z.dist.cluster.PeekHash(provisional, 1, clock.Now()); c.Allowed {
		t.Fatalf("the cluster state did not count the key meanwhile: %+v", c)
	}

	// The storage answers: its syncer joins.
	if err := os.Remove(down); err != nil {
		t.Fatal(err)
	}
	if err := os.CopyFS(down, os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	if err := z.join(newHashSecretOf(t, down), zap.NewNop())(context.Background(), &certmagic.FileStorage{Path: down}); err != nil {
		t.Fatal(err)
	}
	if got := headerHash(z); got != cluster {
		t.Fatalf("after joining, the zone hashes the value to %x, the cluster to %x", got, cluster)
	}
	if c := z.dist.cluster.PeekHash(provisional, 1, clock.Now()); !c.Allowed || c.Remaining < 2 {
		t.Fatalf("after joining, the cells of the provisional hash still count what it counted: %+v", c)
	}
}

// newHashSecretOf is the hashSecret of the file storage at dir in this
// process.
func newHashSecretOf(t *testing.T, dir string) *hashSecret {
	t.Helper()
	s, err := hashSecretOf(storageID(nil, &certmagic.FileStorage{Path: dir}))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// An instance that started while the storage had lost the secret (a Redis
// restarted empty, before the running instances stored it again) makes a
// new one; the running instances follow it at their next write
// (Syncer.rejoin), forgetting their own counts, so the cluster hashes alike
// again instead of staying split until every old instance restarts.
func TestInstancesFollowASecretStoredWhileTheStorageHadLostTheirs(t *testing.T) {
	clock := testclock.New(time.Now())
	d := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second)}
	dir := t.TempDir()
	newProcess(t)
	old := distributedHandler(t, clock, "sc", secretZone(), d, dir).zones[0]
	if err := os.Remove(filepath.Join(dir, filepath.FromSlash(storage.SecretKey))); err != nil {
		t.Fatal(err)
	}
	newProcess(t)
	newer := distributedHandler(t, clock, "sc", secretZone(), d, dir).zones[0]
	if headerHash(old) == headerHash(newer) {
		t.Fatal("the new instance made the secret the old one had")
	}
	if err := old.join(newHashSecretOf(t, dir), zap.NewNop())(context.Background(), &certmagic.FileStorage{Path: dir}); err != nil {
		t.Fatal(err)
	}
	if a, b := headerHash(old), headerHash(newer); a != b {
		t.Fatalf("after its next write, the running instance hashes the value to %x, the new one to %x", a, b)
	}
}
