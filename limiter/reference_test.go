package limiter

import (
	"math/rand/v2"
	"testing"
	"time"
)

// refBuckets is the obvious version of Buckets: every line is brought up to
// date on every touch, under no concurrency, in plain integers. The real
// table's lazy refill (pending amounts, generations, lifted charges,
// rebasing once per refill period, sweeps) must decide exactly as it does.
type refBuckets struct {
	b     *Buckets // for placement and parameters only
	ticks []int64
	defs  [][countersPerLine]int64
}

func newRefBuckets(b *Buckets) *refBuckets {
	n := b.Lines()
	return &refBuckets{b: b, ticks: make([]int64, n), defs: make([][countersPerLine]int64, n)}
}

func (r *refBuckets) take(h uint64, weight int64, nowNs int64, commit bool) Decision {
	p := r.b.p.Load()
	nowTick := nowNs / int64(p.t.tick)
	_, counters, at := r.b.place(p.t, h)
	i := at >> 16
	if e := nowTick - r.ticks[i]; e > 0 {
		for c := range r.defs[i] {
			r.defs[i][c] = max(0, r.defs[i][c]-e*p.refill)
		}
		r.ticks[i] = nowTick
	}
	capUnits, cost := p.capUnits, weight*UnitsPerToken
	d := Decision{Limit: p.limit.burst()}
	best, f := int64(1<<62), 0
	for j, c := range counters {
		if r.defs[i][c] < best {
			best, f = r.defs[i][c], j
		}
	}
	wait := func(def, target int64) time.Duration {
		if def <= target {
			return 0
		}
		ticks := (def - target + p.refill - 1) / p.refill
		return time.Duration((nowTick+ticks)*int64(p.t.tick) - nowNs)
	}
	if cost > capUnits {
		d.RetryAfter = Never
		commit = false
	}
	if best+cost > capUnits || !commit {
		d.Allowed = d.RetryAfter != Never && best+cost <= capUnits
		d.Remaining = (capUnits - min(best, capUnits)) / UnitsPerToken
		d.Reset = wait(best, 0)
		if !d.Allowed && d.RetryAfter != Never {
			d.RetryAfter = wait(best, capUnits-cost)
		}
		return d
	}
	for j, c := range counters {
		if j != f {
			r.defs[i][c] += min(cost, 2*capUnits-min(r.defs[i][c], 2*capUnits))
		}
	}
	r.defs[i][counters[f]] += cost
	after := r.defs[i][counters[f]]
	d.Allowed = true
	d.Remaining = (capUnits - min(after, capUnits)) / UnitsPerToken
	d.Reset = wait(after, 0)
	return d
}

// TestBucketsMatchReference drives both with random keys on a tiny table
// (so keys collide), random weights and random time steps from a fraction
// of a tick to several refill periods.
func TestBucketsMatchReference(t *testing.T) {
	for _, l := range []Limit{
		{Events: 5, Window: 10 * time.Second},
		{Events: 100, Window: time.Second, Burst: 20},
		{Events: 3, Window: time.Hour},
	} {
		t.Run(l.String(), func(t *testing.T) {
			clk := newFakeClock()
			b, err := newBuckets(BucketsConfig{Limit: l, Bytes: 4 * 64}, clockEpoch)
			if err != nil {
				t.Fatal(err)
			}
			ref := newRefBuckets(b)
			r := rand.New(rand.NewPCG(9, 10))
			tick := b.p.Load().t.tick
			fill := time.Duration(float64(l.burst()) / l.PerSecond() * float64(time.Second))
			for i := range 200_000 {
				switch r.IntN(10) {
				case 0:
					clk.Advance(fill * time.Duration(1+r.IntN(3)))
				case 1, 2, 3:
					clk.Advance(tick * time.Duration(r.IntN(20)))
				case 4:
					clk.Advance(time.Duration(r.Int64N(int64(tick))))
				}
				h := Hash([]byte{byte(r.IntN(40))})
				w := int64(1 + r.IntN(int(l.burst())+1))
				if r.IntN(4) != 0 {
					w = 1
				}
				peek := r.IntN(5) == 0
				nowNs := b.nowNanos(clk.Now())
				var got Decision
				if peek {
					got = b.PeekHash(h, w, clk.Now())
				} else {
					got, _ = b.TakeHash(h, w, clk.Now())
				}
				want := ref.take(h, w, nowNs, !peek)
				if got != want {
					t.Fatalf("op %d (key hash %x, weight %d, peek %v, t=%v): got %+v, reference %+v",
						i, h, w, peek, time.Duration(nowNs), got, want)
				}
			}
		})
	}
}
