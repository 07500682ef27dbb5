package storage

// Tests written by a hostile review of the cluster's hash secret.

import (
	"context"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	redisstorage "github.com/pberkel/caddy-storage-redis"
)

// Instances that start together on a real Redis, each with its own client
// (as separate processes have), agree on one secret: caddy-storage-redis's
// Lock is a real lock, and its Load says fs.ErrNotExist for a missing key,
// which Secret's first look depends on. Three rounds of eight. The lock is
// polled every second (lockPollInterval): queued for it one after the
// other, eight took 6 to 7 s, more than a zone's load waits (restoreTimeout,
// 5 s); waiters now look for the stored secret meanwhile, so a round takes
// about one poll.
func TestInstancesOnRedisAgreeOnOneSecret(t *testing.T) {
	r, why := startRedis(t)
	if r == nil {
		t.Skipf("%s (.ci/run installs redis-server)", why)
	}
	const instances = 8
	clients := make([]*redisstorage.RedisStorage, instances)
	for i := range clients {
		rs := redisstorage.New()
		rs.Port = []string{strconv.Itoa(r.server.Port)}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		t.Cleanup(cancel)
		if err := rs.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		clients[i] = rs
	}
	for round := range 3 {
		began := time.Now()
		if _, err := r.server.Do("FLUSHALL"); err != nil {
			t.Fatal(err)
		}
		var got [instances]uint64
		var errs [instances]error
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range clients {
			wg.Go(func() {
				<-start
				got[i], errs[i] = Secret(bg, clients[i], uint64(1000*round+i+1))
			})
		}
		close(start)
		wg.Wait()
		for i := range got {
			if errs[i] != nil {
				t.Fatalf("round %d, instance %d: %v", round, i, errs[i])
			}
			if got[i] != got[0] {
				t.Fatalf("round %d: instances hash with %x and %x", round, got[0], got[i])
			}
		}
		t.Logf("round %d: %d instances agreed on %x in %v", round, instances, got[0], time.Since(began))
	}
}

// An oversized entry at SecretKey is refused unread, as a snapshot is
// (loadBounded): a 32 MiB entry read whole would cost 32 MiB per syncer per
// retry, every 1 to 10 s while it stays.
func TestAnOversizedSecretIsNotReadWhole(t *testing.T) {
	st := &certmagic.FileStorage{Path: t.TempDir()}
	big := make([]byte, 32<<20)
	copy(big, secretHeader+"1\n")
	if err := st.Store(bg, SecretKey, big); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := Secret(bg, st, 5)
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("a 32 MiB entry was taken for a secret")
	}
	if n := after.TotalAlloc - before.TotalAlloc; n > 1<<20 {
		t.Errorf("refusing a 32 MiB entry allocated %d bytes: it was read whole (%v)", n, err)
	}
}
