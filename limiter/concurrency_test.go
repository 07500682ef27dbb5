package limiter

import (
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"
)

func newConcurrency(t testing.TB, n int64, bytes, k int) *Concurrency {
	t.Helper()
	c, err := NewConcurrency(ConcurrencyConfig{Max: n, Bytes: bytes, K: k})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestAKeyHoldsAtMostMaxPlaces(t *testing.T) {
	c := newConcurrency(t, 3, 1<<20, 0)
	a, b := HashString("a"), HashString("b")
	var places [4]Place
	for i := range 3 {
		d := c.AdmitHash(a, &places[i])
		if !d.Allowed || d.Limit != 3 || d.Remaining != int64(2-i) {
			t.Fatalf("admission %d of a: %+v, want allowed with %d left", i+1, d, 2-i)
		}
	}
	if d := c.AdmitHash(a, &places[3]); d.Allowed || d.Remaining != 0 || places[3].Held() {
		t.Fatalf("fourth admission of a: %+v (held %v), want denied holding nothing", d, places[3].Held())
	}
	var other Place
	if d := c.AdmitHash(b, &other); !d.Allowed {
		t.Fatalf("b is denied while a is full: %+v", d)
	}
	if got := c.InFlight(a); got != 3 {
		t.Fatalf("a in flight: %d, want 3", got)
	}
	if !places[1].Release() {
		t.Fatal("releasing a held place reported false")
	}
	if d := c.AdmitHash(a, &places[3]); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("a after a release: %+v, want allowed with 0 left", d)
	}
	if got := c.InUse(); got != 4 {
		t.Fatalf("places in use: %d, want 4", got)
	}
}

func TestAPlaceIsReleasedExactlyOnce(t *testing.T) {
	c := newConcurrency(t, 1, 64, 3)
	h := HashString("k")
	var p Place
	if !c.AdmitHash(h, &p).Allowed {
		t.Fatal("first admission denied")
	}
	// Many goroutines race to release it (a handler's return and a
	// hijacked connection's close): one gives it back.
	var wg sync.WaitGroup
	var won atomic.Int32
	for range 8 {
		wg.Go(func() {
			if p.Release() {
				won.Add(1)
			}
		})
	}
	wg.Wait()
	if won.Load() != 1 {
		t.Fatalf("%d releases reported giving the place back, want 1", won.Load())
	}
	if p.Release() || p.Held() {
		t.Fatal("a released place released again")
	}
	// Released twice would have taken a count from nothing: the key is
	// back to exactly 0, and one more admission fills it.
	if got := c.InUse(); got != 0 {
		t.Fatalf("places in use after the release: %d, want 0", got)
	}
	if !c.AdmitHash(h, &p).Allowed || c.AdmitHash(h, new(Place)).Allowed {
		t.Fatal("after the release the key must hold exactly one place again")
	}
}

func TestAdmittingIntoAHeldPlaceReleasesItFirst(t *testing.T) {
	c := newConcurrency(t, 2, 64, 3)
	var p Place
	c.AdmitHash(HashString("a"), &p)
	c.AdmitHash(HashString("b"), &p)
	if got := c.InUse(); got != 1 {
		t.Fatalf("places in use: %d, want 1 (a's was released when p was reused)", got)
	}
}

func TestSetMaxKeepsThePlacesInUse(t *testing.T) {
	c := newConcurrency(t, 3, 1<<16, 0)
	h := HashString("k")
	var ps [3]Place
	for i := range ps {
		c.AdmitHash(h, &ps[i])
	}
	if err := c.SetMax(2); err != nil {
		t.Fatal(err)
	}
	if c.AdmitHash(h, new(Place)).Allowed {
		t.Fatal("a key holding 3 places admitted under a limit of 2")
	}
	ps[0].Release()
	if c.AdmitHash(h, new(Place)).Allowed {
		t.Fatal("a key holding 2 places admitted under a limit of 2")
	}
	ps[1].Release()
	if !c.AdmitHash(h, new(Place)).Allowed {
		t.Fatal("a key holding 1 place denied under a limit of 2")
	}
	for _, n := range []int64{0, -1, MaxConcurrent + 1} {
		if err := c.SetMax(n); err == nil {
			t.Errorf("SetMax(%d) accepted", n)
		}
		if _, err := NewConcurrency(ConcurrencyConfig{Max: n}); err == nil {
			t.Errorf("NewConcurrency with max %d accepted", n)
		}
	}
}

// TestCollisionsOnlyOverCount drives a table of one line (every key
// collides) and an exact reference with the same random admissions and
// releases: the table never admits a key that holds n places, and its
// count of places in use is exact.
func TestCollisionsOnlyOverCount(t *testing.T) {
	for _, k := range []int{1, 2, 3, 8} {
		const n, keys = 3, 40
		c := newConcurrency(t, n, 64, k)
		r := rand.New(rand.NewPCG(uint64(k), 1))
		held := make([][]*Place, keys)
		falseDenies := 0
		for step := range 20_000 {
			key := r.IntN(keys)
			h := HashString(string(rune('A' + key)))
			if len(held[key]) > 0 && r.IntN(2) == 0 {
				i := r.IntN(len(held[key]))
				held[key][i].Release()
				held[key] = append(held[key][:i], held[key][i+1:]...)
			} else {
				p := new(Place)
				d := c.AdmitHash(h, p)
				switch {
				case d.Allowed && len(held[key]) >= n:
					t.Fatalf("k=%d step %d: key %d admitted holding %d places", k, step, key, len(held[key]))
				case d.Allowed:
					held[key] = append(held[key], p)
				case len(held[key]) < n:
					falseDenies++
				}
			}
			total := 0
			for _, ps := range held {
				total += len(ps)
			}
			if got := c.InUse(); got != int64(total) {
				t.Fatalf("k=%d step %d: %d places in use, want %d", k, step, got, total)
			}
		}
		t.Logf("k=%d: %d false denies in 20000 steps of 40 keys on one line", k, falseDenies)
	}
}

// concurrencyRace runs admits requests of one key, and releases places the
// key held beforehand (of held), through every interleaving of their atomic
// steps on a table of one line. In every schedule the key must never hold
// more than n, and, when nothing is released, exactly n must be admitted of
// the n+m racing, whatever the order: no racer may be denied by another's
// passing count. At the end, releasing everything leaves the table at 0.
func concurrencyRace(t *testing.T, name string, n int64, k, held, admits, releases int) {
	t.Helper()
	const h = 0x1234_5678_9abc_def0
	schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		c := newConcurrency(t, n, 64, k)
		before := make([]Place, held)
		for i := range before {
			if !c.AdmitHash(h, &before[i]).Allowed {
				t.Fatalf("%s: setup admission %d denied", name, i)
			}
		}
		places := make([]Place, admits)
		var fs []func()
		for i := range admits {
			fs = append(fs, func() { c.AdmitHash(h, &places[i]) })
		}
		for i := range releases {
			fs = append(fs, func() { before[i].Release() })
		}
		return watchLines(&c.lines[0]), fs, func(schedule string) {
			got := 0
			for i := range places {
				if places[i].Held() {
					got++
				}
			}
			if int64(held-releases+got) > n {
				t.Errorf("%s, schedule %s: %d admitted beside %d still held, over %d", name, schedule, got, held-releases, n)
			}
			if releases == 0 && int64(held+got) != min(n, int64(held+admits)) {
				t.Errorf("%s, schedule %s: %d admitted of %d racing with %d held, want %d", name, schedule, got, admits, held, min(n, int64(held+admits))-int64(held))
			}
			for i := range places {
				places[i].Release()
			}
			for i := range before {
				before[i].Release()
			}
			if u := c.InUse(); u != 0 {
				t.Errorf("%s, schedule %s: %d places in use once all are released", name, schedule, u)
			}
		}
	})
	t.Logf("%s: %d schedules", name, schedules)
}

func TestEveryConcurrencyInterleavingIsExact(t *testing.T) {
	// The schedules multiply with the steps (a load and a CAS per word a
	// key's counters occupy): three racers run on one counter (k=1), two
	// on the words of k=2 and k=3.
	concurrencyRace(t, "two race for the last place, k=2", 1, 2, 0, 2, 0)
	concurrencyRace(t, "two race for the last place, k=1", 1, 1, 0, 2, 0)
	concurrencyRace(t, "two race for the last of two places, k=2", 2, 2, 1, 2, 0)
	concurrencyRace(t, "three race for two places, k=1", 2, 1, 0, 3, 0)
	concurrencyRace(t, "three race for the last of three places, k=1", 3, 1, 2, 3, 0)
	concurrencyRace(t, "a release races an admission, k=3", 1, 3, 1, 1, 1)
	concurrencyRace(t, "a release races two admissions, k=1", 1, 1, 1, 2, 1)
	concurrencyRace(t, "two releases race an admission, k=1", 2, 1, 2, 1, 2)
}

// TestConcurrencyMemoryIsFlat floods a table with a million distinct keys,
// each holding a place and then releasing it: the heap does not grow with
// the keys (nothing is stored per key), and the table is empty afterwards.
func TestConcurrencyMemoryIsFlat(t *testing.T) {
	if testing.Short() {
		t.Skip("a million admissions")
	}
	c, err := NewConcurrency(ConcurrencyConfig{Max: 1})
	if err != nil {
		t.Fatal(err)
	}
	keys := benchKeys()
	var p Place
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	admitted := 0
	for _, a := range keys {
		k := NetworkKey(a, 32, 128)
		if c.AdmitHash(Hash(k.Bytes()), &p).Allowed {
			admitted++
		}
		p.Release()
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 64<<10 {
		t.Errorf("the heap grew by %d bytes over a million keys", grew)
	}
	if after.Mallocs-before.Mallocs > 1000 {
		t.Errorf("%d allocations for a million admissions", after.Mallocs-before.Mallocs)
	}
	if admitted != len(keys) {
		t.Errorf("%d of %d keys admitted, each with its first place", admitted, len(keys))
	}
	if u := c.InUse(); u != 0 {
		t.Errorf("%d places in use after every one was released", u)
	}
	t.Logf("table %d bytes, heap %d -> %d", c.Bytes(), before.HeapAlloc, after.HeapAlloc)
}

// A table that replaces another (a reload that resized the zone) counts
// the places still in use there as the key's: a key holding n there gets
// none here until they are given back, one for each given back, and
// Unfollow lets go of the old table only once it holds none.
func TestAFollowingTableCountsThePlacesLeftInTheOld(t *testing.T) {
	const h = 0x1234_5678_9abc_def0
	old, c := newConcurrency(t, 2, 64, 2), newConcurrency(t, 2, 128, 2)
	var before [2]Place
	for i := range before {
		if !old.AdmitHash(h, &before[i]).Allowed {
			t.Fatalf("admission %d into the old table denied", i)
		}
	}
	c.Follow(old)
	c.Follow(c) // a table never follows itself
	var p [2]Place
	if d := c.AdmitHash(h, &p[0]); d.Allowed || c.InFlight(h) != 2 || c.InUse() != 2 {
		t.Fatalf("the key holds 2 of 2 in the old table: %+v, in flight %d, in use %d; want denied, 2, 2", d, c.InFlight(h), c.InUse())
	}
	if c.Unfollow() {
		t.Fatal("Unfollow let go of a table with 2 places in use")
	}
	before[0].Release()
	if d := c.AdmitHash(h, &p[0]); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("one place given back to the old table: %+v, want admitted with 0 left", d)
	}
	if d := c.AdmitHash(h, &p[1]); d.Allowed {
		t.Fatalf("one place held in each table: %+v, want denied", d)
	}
	before[1].Release()
	if !c.Unfollow() {
		t.Fatal("Unfollow kept a table with no place in use")
	}
	if d := c.AdmitHash(h, &p[1]); !d.Allowed || c.InUse() != 2 {
		t.Fatalf("the old table let go: %+v, %d in use; want admitted, 2", d, c.InUse())
	}
}

// A release in the table followed races admissions into the one that
// follows it, in every order of their loads and CASes: never more than n
// held between the two tables.
func TestEveryFollowingInterleavingIsExact(t *testing.T) {
	const h = 0x1234_5678_9abc_def0
	for _, c := range []struct {
		name                   string
		n                      int64
		k, held, admits, frees int
	}{
		{"a release in the old table races two admissions, k=1", 2, 1, 2, 2, 1},
		{"a release in the old table races an admission, k=2", 1, 2, 1, 1, 1},
		{"two releases in the old table race two admissions, k=1", 2, 1, 2, 2, 2},
	} {
		schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
			old, nt := newConcurrency(t, c.n, 64, c.k), newConcurrency(t, c.n, 64, c.k)
			before := make([]Place, c.held)
			for i := range before {
				if !old.AdmitHash(h, &before[i]).Allowed {
					t.Fatalf("%s: setup admission %d denied", c.name, i)
				}
			}
			nt.Follow(old)
			places := make([]Place, c.admits)
			var fs []func()
			for i := range c.admits {
				fs = append(fs, func() { nt.AdmitHash(h, &places[i]) })
			}
			for i := range c.frees {
				fs = append(fs, func() { before[i].Release() })
			}
			return watchLines(&old.lines[0], &nt.lines[0]), fs, func(schedule string) {
				got := 0
				for i := range places {
					if places[i].Held() {
						got++
					}
				}
				if left := c.held - c.frees; int64(left+got) > c.n {
					t.Errorf("%s, schedule %s: %d admitted beside %d still held in the old table, over %d", c.name, schedule, got, left, c.n)
				}
				for i := range places {
					places[i].Release()
				}
				for i := range before {
					before[i].Release()
				}
				if u := nt.InUse(); u != 0 {
					t.Errorf("%s, schedule %s: %d places in use once all are released", c.name, schedule, u)
				}
			}
		})
		t.Logf("%s: %d schedules", c.name, schedules)
	}
}
