package floodgate

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/limiter"
)

// A concQueue holds the requests that wait for a place in a zone with
// max_concurrent and action delay, first come first served per key: a
// request finds a place only if no earlier request of its key waits, and a
// released place wakes the first waiting request of its key. At most
// maxHeld requests wait in a zone (they are counted with the ones delay
// holds); beyond, a request is denied at once, so a flood of waiting
// requests costs bounded memory. It lives with the zone's table, so the
// requests of an old config wake those of the new one.
type concQueue struct {
	mu      sync.Mutex
	waiting map[uint64][]chan struct{} // by key hash, oldest first
	n       int
}

// admit takes a place for the key with hash h in c, waiting up to maxDelay
// for one if the key has none left. It returns the decision (RetryAfter set
// for a denial), how long it waited, and an error if ctx ended meanwhile
// (the client went away), having taken nothing.
func (q *concQueue) admit(ctx context.Context, c *limiter.Concurrency, h uint64, p *limiter.Place, maxDelay time.Duration) (limiter.Decision, time.Duration, error) {
	start := time.Now()
	timer := time.NewTimer(maxDelay)
	defer timer.Stop()
	var ch chan struct{}
	for {
		q.mu.Lock()
		// Behind the key's earlier requests unless this one is the
		// first of them.
		first := len(q.waiting[h]) == 0 || q.waiting[h][0] == ch
		if first {
			if d := c.AdmitHash(h, p); d.Allowed {
				if ch != nil {
					q.remove(h, ch)
				}
				q.wakeLocked(h) // the next may find a place too
				q.mu.Unlock()
				return d, time.Since(start), nil
			}
		}
		if ch == nil {
			if q.n >= maxHeld {
				q.mu.Unlock()
				return q.denied(c), 0, nil
			}
			ch = make(chan struct{}, 1)
			q.waiting[h] = append(q.waiting[h], ch)
			q.n++
		}
		q.mu.Unlock()
		select {
		case <-ch:
		case <-timer.C:
			q.leave(h, ch)
			return q.denied(c), 0, nil
		case <-ctx.Done():
			q.leave(h, ch)
			return limiter.Decision{}, 0, caddyhttp.Error(499, fmt.Errorf("client went away while waiting for a place: %w", ctx.Err()))
		}
	}
}

// len is how many requests wait; 0 for no queue.
func (q *concQueue) len() int {
	if q == nil {
		return 0
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n
}

func (q *concQueue) denied(c *limiter.Concurrency) limiter.Decision {
	return limiter.Decision{Limit: c.Max(), RetryAfter: concRetryAfter}
}

// wake tells the first waiting request of the key with hash h that a place
// may be free.
func (q *concQueue) wake(h uint64) {
	q.mu.Lock()
	q.wakeLocked(h)
	q.mu.Unlock()
}

func (q *concQueue) wakeLocked(h uint64) {
	if w := q.waiting[h]; len(w) > 0 {
		select {
		case w[0] <- struct{}{}:
		default: // already woken
		}
	}
}

// leave takes a request that gives up off the queue, and passes a wake-up
// it may have had on to the next.
func (q *concQueue) leave(h uint64, ch chan struct{}) {
	q.mu.Lock()
	q.remove(h, ch)
	q.wakeLocked(h)
	q.mu.Unlock()
}

// remove takes ch off the key's queue.
func (q *concQueue) remove(h uint64, ch chan struct{}) {
	w := q.waiting[h]
	for i, c := range w {
		if c == ch {
			w = append(w[:i], w[i+1:]...)
			q.n--
			break
		}
	}
	if len(w) == 0 {
		delete(q.waiting, h)
	} else {
		q.waiting[h] = w
	}
}
