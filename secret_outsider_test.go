package floodgate

// Tests written by a hostile review of the cluster's hash secret and of the
// caps on t and Retry-After: each failed on the code it reviewed.

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// unmix inverts mix(h, 0): murmur3's finaliser is a bijection, and its
// inverse is public (the multiplicative inverses of its two constants).
// mix is murmur3's finaliser of h ^ salt, as keys were once salted.
func mix(h, salt uint64) uint64 {
	h ^= salt
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}

func unmix(h uint64) uint64 {
	h ^= h >> 33
	h *= 0x9cb4b2f8129337db // inverse of 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	h *= 0x4f74430c22a54005 // inverse of 0xff51afd7ed558ccd
	h ^= h >> 33
	return h
}

// clusterSecret makes the cluster's secret in the file storage at dir, as
// a first instance would, and returns it.
func clusterSecret(t *testing.T, dir string) uint64 {
	t.Helper()
	v, err := storage.Secret(context.Background(), &certmagic.FileStorage{Path: dir}, 0xc1a55e)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// downStorage returns a path whose file storage fails every call (its
// directory is a file), and up, which puts dir's content there: the
// storage answering again.
func downStorage(t *testing.T, dir string) (down string, up func()) {
	t.Helper()
	down = filepath.Join(t.TempDir(), "storage")
	if err := os.WriteFile(down, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return down, func() {
		t.Helper()
		if err := os.Remove(down); err != nil {
			t.Fatal(err)
		}
		if err := os.CopyFS(down, os.DirFS(dir)); err != nil {
			t.Fatal(err)
		}
	}
}

// The deny log's source, top and the admin key view show a key's hash. A
// reviewer recovered the cluster's secret from one such hash of a key whose
// value he knew (his own API key), in O(1): the hash was murmur3's
// finaliser, which runs backwards, applied twice. Keys are now hashed with
// SipHash under the secret, a pseudorandom function: the inversion that
// worked then gives nothing, and another value's hash cannot be predicted.
func TestAShownHashRevealsNothingOfTheSecret(t *testing.T) {
	clock := testclock.New(time.Now())
	d := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second)}
	dir := t.TempDir()
	newProcess(t)
	secret := clusterSecret(t, dir)
	z := distributedHandler(t, clock, "rv_leak", secretZone(), d, dir).zones[0]

	// What the attacker sees: the source of a denial of its own key.
	const own = "attackers-own-api-key"
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-API-Key", own)
	src := z.source(z.key(&request{r: r, repl: caddyhttp.NewTestReplacer(r)}))
	logged, err := strconv.ParseUint(strings.TrimPrefix(src, "key:"), 16, 64)
	if err != nil {
		t.Fatalf("source %q: %v", src, err)
	}
	// What the attacker computes, from public code only.
	salt := unmix(logged) ^ limiter.HashString(own)
	recovered := unmix(salt) ^ keySalt(z.keys[0].text)
	if recovered == secret {
		t.Errorf("the deny-log source %s of the attacker's own key gives the cluster's hash secret %x: every value's counters are computable again", src, recovered)
	}
	// And with it, any other value's counters, offline.
	r.Header.Set("X-API-Key", "someone-else")
	if got, guess := z.key(&request{r: r, repl: caddyhttp.NewTestReplacer(r)}).hash, mix(limiter.HashString("someone-else"), salt); got == guess {
		t.Errorf("from one logged source, another value's hash %x is predicted exactly", got)
	}
}

// A reload while a zone is provisional, once the storage answers again,
// seals the new config's zone with the cluster's secret at load; its
// cluster state is the old config's, which counted under the provisional
// secret. It forgets those counts before anything publishes them
// (storage.Cluster.HashedUnder), though no syncer of the new config had to
// adopt anything.
func TestAReloadThatLearnsTheSecretForgetsTheProvisionalCounts(t *testing.T) {
	clock := testclock.New(time.Now())
	d := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second)}
	dir := t.TempDir()
	clusterSecret(t, dir)
	newProcess(t)
	down, up := downStorage(t, dir)
	old := distributedHandler(t, clock, "rv_reload", secretZone(), d, down)
	provisional := headerHash(old.zones[0])
	req := func() *http.Request {
		r := weightedRequest("/")
		r.Header.Set("X-API-Key", "203.0.113.7")
		return r
	}
	for range 3 {
		if _, err := serve(old, req()); err != nil {
			t.Fatal(err)
		}
	}
	up()
	// The reload: the new config distributes the zone while the old one
	// still holds its cluster state.
	h := distributedHandler(t, clock, "rv_reload", secretZone(), d, down)
	z := h.zones[0]
	if err := z.join(newHashSecretOf(t, down), zap.NewNop())(context.Background(), &certmagic.FileStorage{Path: down}); err != nil {
		t.Fatal(err)
	}
	if c := z.dist.cluster.PeekHash(provisional, 1, clock.Now()); !c.Allowed || c.Remaining < 2 {
		t.Errorf("after the reload and its syncer's join, the cluster state still holds the 3 counted under the provisional secret (remaining %d of 3): its next write publishes them to every peer", c.Remaining)
	}
}

// With jitter, a 429's Retry-After is longer than the wait; the t of the
// item that denies says as much (at most its w), so the two agree.
func TestJitterKeepsRetryAfterAndTInAgreement(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour))
	h := newTestHandler(t, clock, map[string]*Zone{"rv_jitter": {Limit: zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(20 * time.Second)}}})
	h.Jitter = 0.5
	req := func() *http.Request { return withRemote(httptest.NewRequest(http.MethodGet, "/", nil), "192.0.2.1:1") }
	if _, err := serve(h, req()); err != nil {
		t.Fatal(err)
	}
	clock.Advance(10 * time.Second)
	if _, err := serve(h, req()); err != nil {
		t.Fatal(err)
	}
	tOf := regexp.MustCompile(`;t=(\d+)`)
	for i := range 32 {
		w, err := serve(h, req())
		if status(err) != http.StatusTooManyRequests {
			t.Fatalf("denial %d: %v", i, err)
		}
		ra, _ := strconv.Atoi(w.Header().Get("Retry-After"))
		m := tOf.FindStringSubmatch(w.Header().Get("RateLimit"))
		if m == nil {
			t.Fatalf("RateLimit %q", w.Header().Get("RateLimit"))
		}
		if tt, _ := strconv.Atoi(m[1]); ra > tt {
			t.Fatalf("denial %d: Retry-After %d beside RateLimit %q: the two disagree", i, ra, w.Header().Get("RateLimit"))
		}
	}
}

// A key reset through the admin API while its zone is provisional (its
// storage not yet answering) is recorded under a hash no other instance
// uses: the answer says it is this instance's alone, and joining drops it
// with the counts made under that hash. A reset made once the zone is on
// the cluster's secret reaches the peers.
func TestAResetWhileProvisionalSaysItIsLocal(t *testing.T) {
	clock := testclock.New(time.Now().Add(time.Hour))
	d := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second), Bursts: BurstsFree}
	dir := t.TempDir()
	clusterSecret(t, dir)
	newProcess(t)
	bob := map[string]string{"X-API-Key": "bob"}
	bobHash := keyOf(distributedHandler(t, clock, "rv_reset_known", secretZone(), d, dir).zones[0], "10.9.9.9:5", "", bob)

	newProcess(t)
	down, up := downStorage(t, dir)
	h := distributedHandler(t, clock, "rv_reset", secretZone(), d, down)
	z := h.zones[0]
	shape, _ := countsOf(z, 0)
	now := clock.Now()
	// The operator resets bob here (handleKey's DELETE).
	c, err := z.sourceCharge("bob")
	if err != nil {
		t.Fatal(err)
	}
	z.buckets.Fill(c.hash)
	z.dist.cluster.Reset(c.hash, now)
	if text := z.dist.clusterResetText(now); !strings.Contains(text, "NOT published") || !strings.Contains(text, "alone") {
		t.Errorf("a reset while provisional says %q: it promises the cluster what it cannot", text)
	}

	up()
	// A peer that had counted bob's 3 of 3 before the reset.
	p := newClusterPeer(t, down, shape, 3, d.intervals(time.Hour), "peer")
	for range 3 {
		p.c.TakeHash(bobHash, 1, now.Add(-time.Second))
	}
	if err := z.join(newHashSecretOf(t, down), zap.NewNop())(context.Background(), &certmagic.FileStorage{Path: down}); err != nil {
		t.Fatal(err)
	}
	if got := keyOf(z, "10.9.9.9:5", "", bob); got != bobHash {
		t.Fatalf("joined, bob hashes to %x, the cluster to %x", got, bobHash)
	}
	// This instance publishes; the peer reads it.
	deliver := func(at time.Time) {
		t.Helper()
		z.dist.synced[0].syncer.Write(context.Background(), at)
		inst, err := caddy.InstanceID()
		if err != nil {
			t.Fatal(err)
		}
		from := filepath.Join(down, filepath.FromSlash(storage.Key(shape.Zone, inst.String())))
		to := filepath.Join(down, filepath.FromSlash(storage.Key(p.own, inst.String())))
		data, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(to), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(to, data, 0o600); err != nil {
			t.Fatal(err)
		}
		p.s.Read(context.Background(), at)
	}
	deliver(now.Add(time.Millisecond))
	if dec := p.c.PeekHash(bobHash, 1, now.Add(time.Millisecond)); dec.Allowed {
		t.Errorf("the peer lets bob through after this instance joined: the provisional reset reached it? (%+v)", dec)
	}
	if text := z.dist.clusterResetText(now); strings.Contains(text, "NOT published") {
		t.Errorf("joined, a reset still says %q", text)
	}
	// The same reset, once joined, reaches the peer.
	z.dist.cluster.Reset(bobHash, now.Add(2*time.Millisecond))
	deliver(now.Add(3 * time.Millisecond))
	if dec := p.c.PeekHash(bobHash, 1, now.Add(3*time.Millisecond)); !dec.Allowed {
		t.Fatalf("a reset made after joining did not reach the peer either: the test does not show what it says (%+v)", dec)
	}
}

// A zone keyed only by the client's address hashes nothing under a
// secret: it joins its cluster whatever the storage holds at the secret's
// key (an entry another tool left there), and never forgets its counts.
func TestAnAddressZoneJoinsWithoutASecret(t *testing.T) {
	clock := testclock.New(time.Now())
	d := &Distributed{ReadInterval: caddy.Duration(time.Second), WriteInterval: caddy.Duration(time.Second)}
	dir := t.TempDir()
	st := &certmagic.FileStorage{Path: dir}
	if err := st.Store(context.Background(), storage.SecretKey, []byte("left by another tool\n")); err != nil {
		t.Fatal(err)
	}
	newProcess(t)
	h := distributedHandler(t, clock, "rv_addr", &Zone{
		Key:   "{http.request.remote.host}",
		Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Memory: 4096},
	}, d, dir)
	z := h.zones[0]
	if z.hasSalts() {
		t.Fatal("a zone keyed by the client's address has salts")
	}
	if err := z.join(newHashSecretOf(t, dir), zap.NewNop())(context.Background(), st); err != nil {
		t.Errorf("a zone keyed only by the client's address cannot join its cluster: %v", err)
	}
}
