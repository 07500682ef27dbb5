package limiter

import (
	"encoding/binary"
	"math"
	"testing"
	"time"
)

// simResult is what floodSim measured once the heavy sources had drained
// their counters.
type simResult struct {
	light float64 // share of the light sources' requests denied
	fresh float64 // share of never-seen keys a Peek found denied
	live  float64 // the table's own estimate (Stats) at the same moments
}

// tableKind is a kind of table, and its false-deny formula.
type tableKind struct {
	name     string
	new      func(BucketsConfig) (Table, error)
	estimate func(sources, lines, k int) float64
}

var tableKinds = []tableKind{
	{"buckets", func(cfg BucketsConfig) (Table, error) { return newBuckets(cfg, clockEpoch) }, EstimateFalseDeny},
	{"windows", func(cfg BucketsConfig) (Table, error) { return newWindows(cfg, clockEpoch) }, EstimateWindowFalseDeny},
}

// floodSim runs heavy sources flooding at three times the limit and light
// sources at half of it, on a table of kind sized by BucketsConfig.
func floodSim(t *testing.T, kind tableKind, cfg BucketsConfig, heavy, light int) (simResult, Table) {
	t.Helper()
	clk := newFakeClock()
	cfg.Limit = Limit{Events: 10, Window: time.Second}
	b, err := kind.new(cfg)
	if err != nil {
		t.Fatal(err)
	}
	key := func(i int) uint64 {
		var k [8]byte
		binary.LittleEndian.PutUint64(k[:], uint64(i)*0x9e3779b97f4a7c15)
		return Hash(k[:])
	}
	const step = 100 * time.Millisecond
	var asked, denied, probed, freshDenied int
	var live float64
	for s := range 40 {
		for i := range heavy {
			b.TakeHash(key(i), 3, clk.Now()) // 30/s: three times the limit
		}
		if s%2 == 0 { // 5/s: half the limit
			if s >= 20 {
				live += b.Stats(clk.Now()).FalseDeny / 10
				for i := range 20_000 {
					probed++
					if !b.PeekHash(key(-1-i-s*20_000), 1, clk.Now()).Allowed {
						freshDenied++
					}
				}
			}
			for i := heavy; i < heavy+light; i++ {
				d, _ := b.TakeHash(key(i), 1, clk.Now())
				if s >= 20 {
					asked++
					if !d.Allowed {
						denied++
					}
				}
			}
		}
		clk.Advance(step)
	}
	return simResult{
		light: float64(denied) / float64(asked),
		fresh: float64(freshDenied) / float64(probed),
		live:  live,
	}, b
}

// TestFalseDenyMatchesEstimate checks the sizing formula against measurement:
// the light sources' false-deny rate must be within a factor of two of
// EstimateFalseDeny (EstimateWindowFalseDeny for windows) at several loads.
func TestFalseDenyMatchesEstimate(t *testing.T) {
	heavy := 20_000
	if raceEnabled {
		heavy = 5_000
	}
	for _, kind := range tableKinds {
		for _, perLine := range []float64{0.25, 0.5, 1, 2} {
			lines := int(float64(heavy) / perLine)
			r, _ := floodSim(t, kind, BucketsConfig{Bytes: lines * 64}, heavy, heavy/2)
			est := kind.estimate(heavy, lines, DefaultK)
			t.Logf("%s, %.2f flooding sources per line: light sources denied %.3f%% (formula %.3f%%); fresh keys denied %.3f%% (live estimate %.3f%%)",
				kind.name, perLine, r.light*100, est*100, r.fresh*100, r.live*100)
			if r.light > 2*est || r.light < est/2 {
				t.Errorf("%s, %.2f sources per line: measured %.4f, outside 2× of the estimate %.4f", kind.name, perLine, r.light, est)
			}
			// The live estimate is an exact expectation over the table's
			// lines; sampling 200,000 fresh keys must agree with it.
			if math.Abs(r.fresh-r.live) > 0.3*r.live+0.0002 {
				t.Errorf("%s, %.2f sources per line: fresh keys denied %.4f, live estimate %.4f", kind.name, perLine, r.fresh, r.live)
			}
		}
	}
}

// TestDefaultSizingKeepsFalseDenyUnderOnePercent floods a table of the
// default size with as many sources as it is sized for, for both kinds.
func TestDefaultSizingKeepsFalseDenyUnderOnePercent(t *testing.T) {
	for _, kind := range tableKinds {
		cfg := BucketsConfig{}
		heavy := DefaultSources
		if raceEnabled {
			// Same load per line on a smaller table.
			heavy = DefaultSources / 10
			cfg.Sources = heavy
		}
		r, b := floodSim(t, kind, cfg, heavy, 10_000)
		measured := r.light
		est := kind.estimate(heavy, b.Lines(), DefaultK)
		t.Logf("%s: %d flooding sources on the default %d-byte table: measured false-deny %.3f%%, estimate %.3f%%",
			kind.name, heavy, b.Bytes(), measured*100, est*100)
		if measured >= 0.01 {
			t.Fatalf("%s: false-deny %.3f%% at the default sizing, want below 1%%", kind.name, measured*100)
		}
		if measured > 2*est || measured < est/2 {
			t.Errorf("%s: measured %.4f is not within 2× of the estimate %.4f", kind.name, measured, est)
		}
	}
}

func TestLinesForMeetsTarget(t *testing.T) {
	for _, tc := range []struct {
		sources int
		fd      float64
	}{{100_000, 0.005}, {1000, 0.001}, {1, 0.5}, {10_000_000, 0.01}} {
		n := LinesFor(tc.sources, tc.fd, DefaultK)
		if EstimateFalseDeny(tc.sources, n, DefaultK) > tc.fd {
			t.Errorf("%d sources: %d lines exceed the target %g", tc.sources, n, tc.fd)
		}
		if n > 1 && EstimateFalseDeny(tc.sources, n-1, DefaultK) <= tc.fd {
			t.Errorf("%d sources: %d lines is not the smallest", tc.sources, n)
		}
	}
}

func TestEstimateFalseDenyKnownValues(t *testing.T) {
	// One flooding key on a fresh key's line covers all 4 of its
	// counters only if it drew the same 4 of 16: 1/1820. At a load of
	// λ ≪ 1 that is the only way to be denied: λ/1820.
	lines := 1_000_000
	got := EstimateFalseDeny(1, lines, 4)
	if want := 1e-6 / 1820; math.Abs(got-want) > want*1e-4 {
		t.Errorf("one source on a million lines: %g, want %g", got, want)
	}
	if EstimateFalseDeny(0, lines, 4) != 0 || EstimateFalseDeny(1e9, 1, 4) != 1 {
		t.Error("edge values wrong")
	}
}
