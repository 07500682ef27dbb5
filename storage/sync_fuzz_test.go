package storage

import (
	"encoding/binary"
	"path"
	"runtime"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
)

// FuzzSyncerRead runs a whole Read over storage holding what a broken or
// hostile peer could write: a snapshot (with a valid checksum, so the
// fuzzer reaches past it) of any instance name, write time, sketch bytes,
// blocks and resets, stored under its own name or another, beside raw bytes
// under a peer's name; and, as the zone's aggregate, the same fields (with
// dup) or the raw bytes. Read must not panic, must allocate within a bound
// set by what it read, and must impose nothing a valid peer could not: no
// key is blocked beyond a window from now (a valid peer's block lasts at
// most a window from its write, and a write dated ahead counts from now),
// none waits on the counts longer than two windows, and a peer that stops
// writing stops counting within two windows.
func FuzzSyncerRead(f *testing.F) {
	seed, err := newCluster(Shape{Zone: "z/1", Window: testWindow, Width: 256}, 10)
	if err != nil {
		f.Fatal(err)
	}
	now := t0.Add(10 * time.Second)
	for range 7 {
		seed.TakeHash(limiter.HashString("k"), 1, now)
	}
	sk, _ := seed.sketch.AppendSnapshot(nil, now)
	k := binary.LittleEndian.AppendUint64(nil, limiter.HashString("k"))
	blocks := binary.AppendVarint(k, now.Add(testWindow).UnixNano())
	resets := binary.AppendVarint(binary.LittleEndian.AppendUint64(nil, limiter.HashString("r")), now.UnixNano())
	f.Add("a", int64(0), sk, blocks, resets, []byte(nil), false)
	f.Add("a", int64(-1), sk, []byte(nil), []byte(nil), []byte("junk"), true)
	f.Add("b", int64(1<<62), sk, binary.AppendVarint(k, 1<<62), []byte(nil), appendSnapshot(nil, "raw", now, sk, nil, nil), false)
	f.Add("c", int64(-1<<62), sk[:len(sk)/2], blocks, blocks, []byte(nil), false)
	f.Add("", int64(time.Hour), []byte(nil), []byte(nil), []byte(nil), []byte(nil), true)

	probes := []uint64{limiter.HashString("k"), limiter.HashString("r"), 0, 1}
	for i := range 28 {
		probes = append(probes, limiter.HashString(string(rune('A'+i))))
	}
	f.Fuzz(func(t *testing.T, instance string, written int64, sketch, blockBytes, resetBytes, raw []byte, dup bool) {
		if len(instance) > 64 || len(sketch)+len(blockBytes)+len(resetBytes)+len(raw) > 1<<16 {
			return
		}
		st, _ := fileStorage(t)
		var bl []block
		eachPair(blockBytes, func(h uint64, until int64) { bl = append(bl, block{hash: h, until: until}) })
		var rs []reset
		eachPair(resetBytes, func(h uint64, at int64) { rs = append(rs, reset{hash: h, at: at}) })
		data := appendSnapshot(nil, instance, now.Add(time.Duration(written)), sketch, bl, rs)
		stored := len(data) + len(raw)
		for _, name := range []string{instance, "dup"} {
			if name == "dup" && !dup || name == "" || name == "n" {
				continue
			}
			if path.Dir(path.Clean(Key("z/1", name))) != Dir("z/1") {
				// Not a file of the zone's directory (".", "..", "a/b"):
				// no instance id is (they are UUIDs), and storing there
				// would replace the directory or miss it.
				continue
			}
			if err := st.Store(bg, Key("z/1", name), data); err != nil {
				return // a name the file system refuses
			}
			stored += len(data)
		}
		if err := st.Store(bg, Key("z/1", "raw"), raw); err != nil {
			t.Fatal(err)
		}
		// The same fields as an aggregate, which the node reads instead of
		// the snapshots while it is fresh; or the raw bytes as one.
		agg := raw
		if dup {
			agg = appendAggregate(nil, &aggregate{
				snapshot: snapshot{instance: instance, written: now.Add(time.Duration(written)), sketch: sketch, blocks: bl, resets: rs},
				members:  []member{{name: instance, w: writtenOf(now, data)}, {name: "dup", w: writtenOf(now, data)}},
			})
		}
		if err := st.Store(bg, AggregateKey("z/1"), agg); err != nil {
			t.Fatal(err)
		}
		stored += len(agg)
		c, err := newCluster(Shape{Zone: "z/1", Window: testWindow, Width: 256}, 10)
		if err != nil {
			t.Fatal(err)
		}
		s := NewSyncer(c, st, "n", testIntervals, zap.NewNop())
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		s.Read(bg, now)
		runtime.ReadMemStats(&after)
		// The sum of the peers' sketches (2 windows × 4 rows × 256), the
		// files as read, and what the file system and decoder add.
		if got, bound := after.TotalAlloc-before.TotalAlloc, uint64(256<<10+8*stored); got > bound {
			t.Fatalf("Read of %d stored bytes allocated %d, bound %d", stored, got, bound)
		}
		for _, b := range bl {
			if until, ok := c.blocks.blocked(b.hash, now.UnixNano()); ok && until > now.Add(testWindow).UnixNano() {
				t.Fatalf("key %x blocked for %v after one read, more than a window", b.hash, time.Duration(until-now.UnixNano()))
			}
		}
		for _, h := range probes {
			if d := c.PeekHash(h, 1, now); d.RetryAfter > 2*testWindow {
				t.Fatalf("key %x waits %v after one read, more than two windows", h, d.RetryAfter)
			}
		}
		later := now.Add(2*testWindow + time.Second)
		s.Read(bg, later)
		for _, h := range probes {
			if d := c.PeekHash(h, 1, later); !d.Allowed {
				t.Fatalf("key %x denied two windows after its peers last wrote (retry after %v)", h, d.RetryAfter)
			}
		}
	})
}

// eachPair reads b as the fuzzer's blocks or resets: a little-endian key
// hash and a varint time, repeated.
func eachPair(b []byte, f func(h uint64, t int64)) {
	for len(b) >= 9 {
		t, n := binary.Varint(b[8:])
		if n <= 0 {
			return
		}
		f(binary.LittleEndian.Uint64(b), t)
		b = b[8+n:]
	}
}
