package storage

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// The first instance to find no secret stores its candidate; every later
// one reads it, whatever its own candidate.
func TestSecretIsMadeOnceThenRead(t *testing.T) {
	st := &certmagic.FileStorage{Path: t.TempDir()}
	first, err := Secret(bg, st, 0x1234)
	if err != nil || first != 0x1234 {
		t.Fatalf("the first instance got %x, %v; want its candidate 1234", first, err)
	}
	for _, candidate := range []uint64{0x9999, 0} {
		if got, err := Secret(bg, st, candidate); err != nil || got != first {
			t.Fatalf("an instance with candidate %x got %x, %v; want the stored %x", candidate, got, err, first)
		}
	}
	data, err := st.Load(bg, SecretKey)
	if err != nil || string(data) != "floodgate hash secret v1 1234\n" {
		t.Fatalf("stored %q, %v", data, err)
	}
}

// A candidate of 0 is never stored: 0 would leave the salts public.
func TestSecretIsNeverZero(t *testing.T) {
	st := &certmagic.FileStorage{Path: t.TempDir()}
	if got, err := Secret(bg, st, 0); err != nil || got == 0 {
		t.Fatalf("got %x, %v", got, err)
	}
	if err := st.Store(bg, SecretKey, []byte("floodgate hash secret v1 0\n")); err != nil {
		t.Fatal(err)
	}
	if got, err := Secret(bg, st, 7); err == nil {
		t.Fatalf("a stored zero secret was used: %x", got)
	}
}

// raceLoader lets two callers of Secret both find no secret before either
// takes the lock: the interleaving in which two instances that start
// together would each store their own.
type raceLoader struct {
	*certmagic.FileStorage
	loads   atomic.Int32
	bothIn  chan struct{}
	arrived sync.WaitGroup
}

// Stat is what Secret asks first (loadBounded).
func (r *raceLoader) Stat(ctx context.Context, key string) (certmagic.KeyInfo, error) {
	data, err := r.FileStorage.Stat(ctx, key)
	if r.loads.Add(1) <= 2 {
		r.arrived.Done()
		select {
		case <-r.bothIn:
		case <-time.After(10 * time.Second): // a bound, should the other never come
			return data, errors.New("the other caller never loaded")
		}
	}
	return data, err
}

// Two instances that start together, both finding no secret, agree on one:
// the store is made under the storage's lock, after a second look.
func TestInstancesStartingTogetherAgreeOnOneSecret(t *testing.T) {
	r := &raceLoader{FileStorage: &certmagic.FileStorage{Path: t.TempDir()}, bothIn: make(chan struct{})}
	r.arrived.Add(2)
	go func() { r.arrived.Wait(); close(r.bothIn) }()
	var got [2]uint64
	var errs [2]error
	var wg sync.WaitGroup
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = Secret(bg, r, uint64(100+i))
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("instance %d: %v", i, err)
		}
	}
	if got[0] != got[1] {
		t.Fatalf("the two instances hash with different secrets: %x and %x", got[0], got[1])
	}
	if n := r.loads.Load(); n < 3 {
		t.Fatalf("%d loads: the interleaving was not forced", n)
	}
}

// A stored entry that is not a secret is an error that names it, and is
// left as it is: running instances may hash with what it held.
func TestAnEntryThatIsNotASecretIsAnError(t *testing.T) {
	for name, data := range map[string]string{
		"junk":      "hello",
		"empty":     "",
		"not hex":   "floodgate hash secret v1 xyz\n",
		"too large": "floodgate hash secret v1 12" + strings.Repeat(" ", 100),
		"too long":  "floodgate hash secret v1 123456789abcdef01\n",
	} {
		t.Run(name, func(t *testing.T) {
			st := &certmagic.FileStorage{Path: t.TempDir()}
			if err := st.Store(bg, SecretKey, []byte(data)); err != nil {
				t.Fatal(err)
			}
			got, err := Secret(bg, st, 5)
			if err == nil || !strings.Contains(err.Error(), SecretKey) {
				t.Fatalf("got %x, %v; want an error naming %q", got, err, SecretKey)
			}
			if after, _ := st.Load(bg, SecretKey); string(after) != data {
				t.Fatalf("the entry was changed to %q", after)
			}
		})
	}
}

// No zone's snapshots can be stored where the secret is.
func TestNoZoneDirectoryIsTheSecret(t *testing.T) {
	for _, zone := range []string{"hash secret", "hash%20secret", "hash", "hash secret/x"} {
		if d := Dir(zone); d == SecretKey || strings.HasPrefix(SecretKey, d+"/") {
			t.Errorf("zone %q is stored at %q", zone, d)
		}
	}
}

// A Syncer with a join reads and publishes nothing until join has
// succeeded, trying it again with the open's back-off; a Syncer stopped
// before that publishes nothing either.
func TestASyncerPublishesNothingBeforeItJoins(t *testing.T) {
	for _, stopEarly := range []bool{false, true} {
		t.Run(fmt.Sprintf("stopped_before_joining=%v", stopEarly), func(t *testing.T) {
			st := newMemStorage()
			c, err := newCluster(Shape{Zone: "z/1", Window: testWindow, Width: 256}, 10)
			if err != nil {
				t.Fatal(err)
			}
			c.TakeHash(42, 1, time.Now())
			s := NewSyncer(c, st, "a", testIntervals, zap.NewNop())
			s.proc = newProcess()
			var tries atomic.Int32
			s.Joining(func(context.Context, certmagic.Storage) error {
				if tries.Add(1) < 3 {
					return errors.New("not yet")
				}
				return nil
			})
			// entries and loads are what the storage holds and was asked.
			entries := func() (n int, loads int64) {
				st.mu.Lock()
				defer st.mu.Unlock()
				return len(st.data), st.loads
			}
			waits, fire := make(chan time.Duration), make(chan time.Time)
			s.after = func(d time.Duration) <-chan time.Time {
				waits <- d
				return fire
			}
			s.Start()
			for i, want := range []time.Duration{time.Second, 2 * time.Second} {
				select {
				case got := <-waits:
					if got != want {
						t.Errorf("wait %d: %v, want %v", i+1, got, want)
					}
				case <-time.After(10 * time.Second): // a bound, should the loop hang
					t.Fatalf("no wait %d within 10s", i+1)
				}
				if n, loads := entries(); n != 0 || loads != 0 {
					t.Fatalf("before joining: %d entries stored, %d loads", n, loads)
				}
				if stopEarly {
					s.Stop()
					if n, _ := entries(); n != 0 {
						t.Fatalf("stopped before joining, it published %d entries", n)
					}
					return
				}
				fire <- time.Now()
			}
			s.Stop()
			if tries.Load() != 3 {
				t.Fatalf("join was tried %d times, want 3", tries.Load())
			}
			if n, _ := entries(); n == 0 {
				t.Fatal("joined, it never published")
			}
		})
	}
}
