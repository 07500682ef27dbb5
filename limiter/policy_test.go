package limiter

import (
	"testing"
	"time"
)

// TestTxnDeniedRequestChargesNoPolicy combines a token bucket (burst 5) with
// a rolling quota (3 per minute): the quota's denial must leave the bucket
// as it was.
func TestTxnDeniedRequestChargesNoPolicy(t *testing.T) {
	clk := newFakeClock()
	bucket := roomy(t, Limit{Events: 5, Window: time.Minute}, clk)
	quota, err := NewSketch(SketchConfig{Quota: 3, Window: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	h := Hash([]byte("client"))
	for i := range 3 {
		var txn Txn
		txn.Take(bucket, h, 1, clk.Now())
		txn.Take(quota, h, 1, clk.Now())
		if txn.Denied() {
			t.Fatalf("request %d denied", i+1)
		}
	}
	for range 10 {
		var txn Txn
		b := txn.Take(bucket, h, 1, clk.Now())
		q := txn.Take(quota, h, 1, clk.Now())
		if !txn.Denied() || !b.Allowed || q.Allowed {
			t.Fatalf("4th+ request: bucket %+v quota %+v, want the quota to deny", b, q)
		}
	}
	if d := bucket.PeekHash(h, 1, clk.Now()); d.Remaining != 2 {
		t.Fatalf("bucket has %d left after 3 granted and 10 denied requests, want 2", d.Remaining)
	}
}

// TestTxnAfterDenialOnlyPeeks: once a policy denies, later policies are
// asked without charging, so the caller still learns their state.
func TestTxnAfterDenialOnlyPeeks(t *testing.T) {
	clk := newFakeClock()
	first := roomy(t, Limit{Events: 1, Window: time.Hour}, clk)
	second := roomy(t, Limit{Events: 9, Window: time.Hour}, clk)
	h := Hash([]byte("k"))
	first.TakeHash(h, 1, clk.Now())
	var txn Txn
	txn.Take(first, h, 1, clk.Now())
	d := txn.Take(second, h, 1, clk.Now())
	if !d.Allowed || d.Remaining != 9 {
		t.Fatalf("second policy after a denial: %+v, want a peek (allowed, 9 left)", d)
	}
	if got := second.PeekHash(h, 1, clk.Now()).Remaining; got != 9 {
		t.Fatalf("second policy was charged: %d left", got)
	}
}

func TestTxnRollbackRefundsMoreThanInline(t *testing.T) {
	clk := newFakeClock()
	h := Hash([]byte("k"))
	var ps []*Buckets
	var txn Txn
	for range MaxInlinePolicies + 3 {
		b := roomy(t, Limit{Events: 4, Window: time.Hour}, clk)
		ps = append(ps, b)
		txn.Take(b, h, 3, clk.Now())
	}
	txn.RollbackAt(clk.Now())
	// A charge to a full counter counts from the next tick (line.go; here
	// 0.22 s), so the refunded counters are full from then on.
	clk.Advance(time.Second)
	for i, b := range ps {
		if got := b.PeekHash(h, 1, clk.Now()).Remaining; got != 4 {
			t.Fatalf("policy %d: %d left after rollback, want 4", i, got)
		}
	}
}

func TestTxnAllocatesNothing(t *testing.T) {
	clk := newFakeClock()
	a := roomy(t, Limit{Events: MaxRate, Window: time.Second, Burst: MaxBurst}, clk)
	s, _ := NewSketch(SketchConfig{Quota: 1 << 30, Window: time.Hour})
	h := Hash([]byte("k"))
	allocs := testing.AllocsPerRun(1000, func() {
		var txn Txn
		txn.Take(a, h, 1, clk.Now())
		txn.Take(s, h, 1, clk.Now())
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per two-policy decision", allocs)
	}
}

// TestTxnCheckChargesNothingAndDeniesWhenSpent: a Check grants what the key
// could pay without charging it, and a key with nothing left denies the Txn
// and gives back what an earlier Take charged.
func TestTxnCheckChargesNothingAndDeniesWhenSpent(t *testing.T) {
	clk := newFakeClock()
	other := roomy(t, Limit{Events: 5, Window: time.Hour}, clk)
	checked := roomy(t, Limit{Events: 1, Window: time.Hour}, clk)
	h := Hash([]byte("k"))
	for i := range 3 {
		var txn Txn
		txn.Take(other, h, 1, clk.Now())
		if d := txn.Check(checked, h, 1, clk.Now()); !d.Allowed || txn.Denied() {
			t.Fatalf("check %d: %+v, want it allowed: nothing was charged", i+1, d)
		}
	}
	if got := checked.PeekHash(h, 1, clk.Now()).Remaining; got != 1 {
		t.Fatalf("checked policy holds %d, want 1: a Check charges nothing", got)
	}
	checked.TakeHash(h, 1, clk.Now())
	var txn Txn
	txn.Take(other, h, 1, clk.Now())
	if d := txn.Check(checked, h, 1, clk.Now()); d.Allowed || !txn.Denied() {
		t.Fatalf("check of a spent key: %+v denied=%v, want a denial", d, txn.Denied())
	}
	if got := other.PeekHash(h, 1, clk.Now()).Remaining; got != 2 {
		t.Fatalf("other policy holds %d after the denial, want 2 (its charge given back)", got)
	}
}

// Touch decides and changes nothing: every policy answers as it would have
// without it, for a key it has charged and one it has not, and a policy of
// an unknown kind is left alone.
func TestTouchChangesNothing(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	lim := Limit{Events: 3, Window: time.Minute}
	b, err := newBuckets(BucketsConfig{Limit: Limit{Events: 3, Window: time.Minute, Burst: 3}, Bytes: 1 << 12}, now)
	if err != nil {
		t.Fatal(err)
	}
	w, err := newWindows(BucketsConfig{Limit: lim, Bytes: 1 << 12}, now)
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSketch(SketchConfig{Quota: 3, Window: time.Minute, Width: 64})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []Policy{b, w, s, nil} {
		if p == nil {
			Touch(nil, 1) // no kind it knows: nothing happens
			continue
		}
		for _, h := range []uint64{0x1234_5678_9abc_def0, 42} {
			if h == 42 {
				p.TakeHash(h, 2, now)
			}
			before := p.PeekHash(h, 1, now)
			Touch(p, h)
			if after := p.PeekHash(h, 1, now); after != before {
				t.Errorf("%T, key %x: %+v after Touch, %+v before", p, h, after, before)
			}
		}
	}
}
