package limiter

import (
	"math/big"
	"testing"
	"time"
	"unsafe"

	"github.com/floodgate-rl/floodgate/internal/schedtest"
)

// A stepper runs goroutines one atomic step at a time. Each goroutine runs
// only when released, up to its next pause (the point before its next atomic
// load, CAS or swap of a word, or load or store of a table's parameters) or
// its end, so a schedule (which goroutine takes each step) fixes the
// interleaving of every memory operation.
type stepper struct {
	release []chan struct{}
	back    chan int // what the released goroutine did: paused, waiting or finished
	cur     int
}

const (
	stepPaused = iota
	stepWaiting
	stepFinished
)

// runSchedule starts fs, follows prefix (goroutine ids, one per step), then
// lets the lowest runnable goroutine take each further step. Only
// operations on the addresses watch accepts are steps; others run through.
// A goroutine that waits for SetLimit (table.moved) is not runnable
// until what it waits for has happened, so a schedule never spins. It
// returns the path taken: the goroutine of each step and the runnable
// goroutines at it; stuck is true if every goroutine left was waiting.
func runSchedule(watch func(g int, addr unsafe.Pointer) bool, fs []func(), prefix []int) (path []int, runnable [][]int, stuck bool) {
	s := &stepper{back: make(chan int)}
	for range fs {
		s.release = append(s.release, make(chan struct{}))
	}
	ready := make([]func() bool, len(fs))
	testPause = func(addr unsafe.Pointer) {
		id := s.cur
		if !watch(id, addr) {
			return
		}
		s.back <- stepPaused
		<-s.release[id]
	}
	testWait = func(cond func() bool) {
		id := s.cur
		ready[id] = cond
		s.back <- stepWaiting
		<-s.release[id]
	}
	defer func() { testPause, testWait = nil, nil }()
	for i, f := range fs {
		go func() {
			<-s.release[i]
			f()
			s.back <- stepFinished
		}()
	}
	live := make([]bool, len(fs))
	for i := range live {
		live[i] = true
	}
	for step := 0; ; step++ {
		var ids []int
		alive := false
		for i, ok := range live {
			alive = alive || ok
			if ok && (ready[i] == nil || ready[i]()) {
				ids = append(ids, i)
			}
		}
		if !alive {
			return path, runnable, false
		}
		if len(ids) == 0 {
			return path, runnable, true
		}
		g := ids[0]
		if step < len(prefix) {
			g = prefix[step]
		}
		path, runnable = append(path, g), append(runnable, ids)
		s.cur, ready[g] = g, nil
		s.release[g] <- struct{}{}
		if <-s.back == stepFinished {
			live[g] = false
		}
	}
}

// watchLines accepts the words of the given lines.
func watchLines(ls ...*line) func(int, unsafe.Pointer) bool {
	return func(_ int, a unsafe.Pointer) bool {
		for _, l := range ls {
			if uintptr(a)-uintptr(unsafe.Pointer(l)) < 64 {
				return true
			}
		}
		return false
	}
}

// everySchedule calls setup for a fresh world, runs its goroutines through
// every interleaving of their steps, and calls check after each, with the
// schedule taken. It returns the number of schedules.
func everySchedule(t *testing.T, setup func() (watch func(int, unsafe.Pointer) bool, fs []func(), check func(schedule string))) int {
	t.Helper()
	var prefix []int
	n := 0
	for {
		watch, fs, check := setup()
		path, runnable, stuck := runSchedule(watch, fs, prefix)
		n++
		if stuck {
			t.Fatalf("schedule %s: every goroutine left waits for a SetLimit that never comes", schedtest.String(path))
		}
		check(schedtest.String(path))
		if t.Failed() {
			return n
		}
		var more bool
		if prefix, more = schedtest.Next(path, runnable); !more {
			return n
		}
	}
}

// A race is two or three requests of one key run through every
// interleaving of their atomic steps on a table of one line, after the key
// was drained at t=0, and followed by draining the key again at end. A token
// bucket drained at 0 and never full since holds burst + ⌊rate·end⌋ − (what
// was granted after 0) at end, so every schedule must grant exactly
// burst + ⌊rate·end⌋ in all: more is a grant the bucket did not hold, fewer
// is a token lost. end is chosen away from a token's arrival, so the
// table's rounding (under a tick) does not show.
type race struct {
	name  string
	limit Limit
	k     int
	reqs  []raceReq
	end   time.Duration
	// exactly is how many of reqs' tokens must be granted in every
	// schedule (-1: any number).
	exactly int64
}

type raceReq struct {
	at time.Duration
	w  int64
	// rollback makes the request a Txn that a second policy denies after
	// this table granted it: its charge is refunded.
	rollback bool
}

// racers returns a function for each of reqs, taking from b (as a Txn that
// denier denies, for a rollback), and what they were granted once run.
func racers(b Policy, denier *Buckets, h uint64, reqs []raceReq) (fs []func(), granted func() (got []int64, sum int64)) {
	got := make([]int64, len(reqs))
	for i, r := range reqs {
		fs = append(fs, func() {
			if r.rollback {
				var txn Txn
				txn.Take(b, h, r.w, tm(r.at))
				txn.Take(denier, h, 1, tm(r.at))
				return
			}
			if d, _ := b.TakeHash(h, r.w, tm(r.at)); d.Allowed {
				got[i] = r.w
			}
		})
	}
	return fs, func() ([]int64, int64) {
		var sum int64
		for _, g := range got {
			sum += g
		}
		return got, sum
	}
}

func (rc race) run(t *testing.T) {
	tb := newTextbook(rc.limit)
	want := rc.limit.EffectiveBurst() + floorRat(new(big.Rat).Mul(tb.rate, big.NewRat(int64(rc.end), 1)))
	const h = 0x1234_5678_9abc_def0
	schedules := everySchedule(t, func() (func(int, unsafe.Pointer) bool, []func(), func(string)) {
		b, err := newBuckets(BucketsConfig{Limit: rc.limit, Bytes: 64, K: rc.k}, clockEpoch)
		if err != nil {
			t.Fatal(err)
		}
		denier := newTable(t, Limit{Events: 1, Window: time.Hour}, 64)
		denier.Charge(h, 2, tm(0)) // denies everything
		setup := int64(drain(b, h, tm(0)))
		fs, granted := racers(b, denier, h, rc.reqs)
		return watchLines(&b.p.Load().lines[0]), fs, func(schedule string) {
			got, reqs := granted()
			total := setup + reqs + int64(drain(b, h, tm(rc.end)))
			if total != want {
				t.Errorf("%s, schedule %s: %d granted (%d by the racing requests: %v), want %d", rc.name, schedule, total, reqs, got, want)
			}
			if rc.exactly >= 0 && reqs != rc.exactly {
				t.Errorf("%s, schedule %s: racing requests got %v, want %d tokens in all", rc.name, schedule, got, rc.exactly)
			}
		}
	})
	t.Logf("%s: %d schedules", rc.name, schedules)
}

func TestEveryInterleavingIsExact(t *testing.T) {
	ms := time.Millisecond
	two := Limit{Events: 2, Window: time.Second}
	for _, rc := range []race{
		{"two take the last token", two, 3, []raceReq{{750 * ms, 1, false}, {750 * ms, 1, false}}, 1250 * ms, 1},
		{"two take the last token, one counter", two, 1, []raceReq{{750 * ms, 1, false}, {750 * ms, 1, false}}, 1250 * ms, 1},
		{"across a token's arrival", two, 3, []raceReq{{490 * ms, 1, false}, {510 * ms, 1, false}}, 1250 * ms, 1},
		{"three across a token's arrival", two, 1, []raceReq{{490 * ms, 1, false}, {510 * ms, 1, false}, {510 * ms, 1, false}}, 1250 * ms, 1},
		{"weights", Limit{Events: 4, Window: time.Second}, 3, []raceReq{{625 * ms, 2, false}, {625 * ms, 1, false}}, 1200 * ms, -1},
		{"a stalled request sees a refill", Limit{Events: 10, Window: time.Second}, 3, []raceReq{{990 * ms, 1, false}, {1050 * ms, 1, false}}, 1070 * ms, 2},
		{"a rollback races a take", two, 1, []raceReq{{750 * ms, 1, true}, {750 * ms, 1, false}}, 1250 * ms, -1},
		{"three with a rollback", two, 1, []raceReq{{750 * ms, 1, true}, {750 * ms, 1, false}, {760 * ms, 1, false}}, 1250 * ms, -1},
	} {
		rc.run(t)
	}
}
