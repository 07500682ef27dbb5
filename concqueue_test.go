package floodgate

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// A flood of requests waiting for a place costs bounded memory: beyond
// maxHeld waiting, a request is denied at once, and requests whose clients
// go away leave the queue empty.
func TestTheQueueForAPlaceIsBounded(t *testing.T) {
	c, err := limiter.NewConcurrency(limiter.ConcurrencyConfig{Max: 1, Bytes: 1 << 12})
	if err != nil {
		t.Fatal(err)
	}
	q := &concQueue{waiting: make(map[uint64][]chan struct{})}
	const h = 42
	var holder limiter.Place
	if d, _, err := q.admit(context.Background(), c, h, &holder, time.Hour); err != nil || !d.Allowed {
		t.Fatalf("the first request: %+v %v", d, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make(chan error, maxHeld)
	for range maxHeld {
		wg.Go(func() {
			var p limiter.Place
			_, _, err := q.admit(ctx, c, h, &p, time.Hour)
			errs <- err
		})
	}
	deadline := time.Now().Add(10 * time.Second)
	for q.len() < maxHeld {
		if time.Now().After(deadline) {
			t.Fatalf("only %d of %d requests waiting", q.len(), maxHeld)
		}
		time.Sleep(time.Millisecond)
	}
	start := time.Now()
	var p limiter.Place
	d, _, err := q.admit(context.Background(), c, h, &p, 2*time.Second)
	if err != nil || d.Allowed || d.RetryAfter != concRetryAfter {
		t.Fatalf("a request beyond %d waiting: %+v %v, want denied at once", maxHeld, d, err)
	}
	if waited := time.Since(start); waited > time.Second {
		t.Errorf("the request beyond the bound waited %v", waited)
	}
	cancel()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err == nil {
			t.Fatal("a waiting request whose client went away was admitted")
		}
	}
	if q.len() != 0 || len(q.waiting) != 0 {
		t.Fatalf("%d waiting (%d keys) after every client went away, want 0", q.len(), len(q.waiting))
	}
	if n := c.InUse(); n != 1 {
		t.Fatalf("%d places in use, want the first request's 1", n)
	}
}
