package storage

import (
	"bytes"
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	redisstorage "github.com/pberkel/caddy-storage-redis"
	"github.com/redis/go-redis/v9"

	"github.com/floodgate-rl/floodgate/limiter"
)

// getCounter counts the GETs a go-redis client sends, per key.
type getCounter struct {
	mu   sync.Mutex
	gets map[string]int
}

func (*getCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *getCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if a := cmd.Args(); len(a) == 2 && strings.EqualFold(cmd.Name(), "get") {
			g.mu.Lock()
			g.gets[a[1].(string)]++
			g.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (*getCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// Over Redis a read fetches each entry once: caddy-storage-redis's Stat
// GETs the whole value, so asking it for the size before the Load would
// move every snapshot twice. An entry larger than any snapshot is still
// refused (skipped and counted), once fetched.
func TestRedisReadFetchesEachEntryOnce(t *testing.T) {
	r, why := startRedis(t)
	if r == nil {
		t.Skipf("%s (.ci/run installs redis-server)", why)
	}
	nodes := newNodes(t, r.storage, 3)
	now := t0.Add(time.Second)
	for _, n := range nodes {
		n.take("k", 3, now)
		n.s.Write(bg, now)
	}
	big := bytes.Repeat([]byte{'x'}, int(maxSnapshotSize(nodes[1].c.shape))+1)
	if err := r.storage.Store(bg, Key("z/1", "big"), big); err != nil {
		t.Fatal(err)
	}
	g := &getCounter{gets: map[string]int{}}
	r.storage.GetClient().(redis.UniversalClient).AddHook(g)
	b := nodes[1]
	b.s.Read(bg, now)
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, name := range []string{"a", "c", "big"} {
		if n := g.gets[r.prefix+"/"+Key("z/1", name)]; n != 1 {
			t.Errorf("the read fetched %s %d times, want once (all GETs: %v)", name, n, g.gets)
		}
	}
	for key, n := range g.gets {
		if n > 1 {
			t.Errorf("the read fetched %s %d times", key, n)
		}
	}
	if got := b.c.Skipped(); got != 1 {
		t.Errorf("skipped %d entries, want the one too large", got)
	}
	// 9 granted of 10: the peers' 6 read, its own 3.
	if d := b.c.PeekHash(hk, 1, now); !d.Allowed || d.Remaining != 1 {
		t.Errorf("b after the read: %+v, want 1 remaining (the peers' counts read)", d)
	}
}

// What CheckStorage guards against: caddy-storage-redis with compression
// on stores a value of over 4 MiB and then refuses to load it. A zone that
// could write one is refused; a small zone, the same storage without
// compression, and the file system are not.
func TestCheckStorageRefusesWhatCompressedRedisCannotLoad(t *testing.T) {
	r, why := startRedis(t)
	if r == nil {
		t.Skipf("%s (.ci/run installs redis-server)", why)
	}
	rs := redisstorage.New()
	rs.Port = []string{strconv.Itoa(r.server.Port)}
	rs.Compression = redisstorage.CompressionFlate
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := rs.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	big := make([]byte, maxDecompressed+1)
	if err := rs.Store(bg, "big", big); err != nil {
		t.Fatal(err)
	}
	if _, err := rs.Load(bg, "big"); err == nil {
		t.Fatal("compressed Redis loaded a value over 4 MiB: the check guards nothing")
	}

	large := Shape{Zone: "z", Window: time.Minute, Width: limiter.MaxSketchWidth}
	small := Shape{Zone: "z", Window: time.Minute, Width: 256}
	if err := CheckStorage(rs, large); err == nil || !strings.Contains(err.Error(), "turn compression off") {
		t.Errorf("a zone of %.0f MiB entries on compressed Redis: %v", float64(maxAggregateSize(large))/(1<<20), err)
	}
	if err := CheckStorage(rs, small); err != nil {
		t.Errorf("a zone of %d-byte entries on compressed Redis: %v", maxAggregateSize(small), err)
	}
	if err := CheckStorage(r.storage, large); err != nil {
		t.Errorf("uncompressed Redis: %v", err)
	}
	fs, _ := fileStorage(t)
	if err := CheckStorage(fs, large); err != nil {
		t.Errorf("the file system: %v", err)
	}
}
