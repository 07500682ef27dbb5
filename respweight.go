package floodgate

import (
	"io"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/weight"
)

// afterCharge is a charge a response still owes a zone: the request paid its
// request-time weight at arrival; the response may report more.
type afterCharge struct {
	z    *zone
	hash uint64
	paid int64
}

// settle charges what a response reported beyond what its request paid, at
// now, the time the response reported it. Not at the request's arrival: a
// response may take longer than the key takes to refill, and a charge dated
// then would be refilled away before it was made (or, on a counter that has
// moved past that time, read as a debt that far ahead), and a quota would
// count it in a window that may already weigh nothing. The key may go into
// debt: at most one burst below empty in the rate, and one quota in each
// quota, so a wild report cannot lock a key out for longer than a full
// refill (see limiter.Buckets.Charge).
func (c afterCharge) settle(reported int64, now time.Time) {
	extra := reported - c.paid
	if extra <= 0 {
		return
	}
	c.z.buckets.Charge(c.hash, extra, now)
	for _, s := range c.z.quotas {
		s.Add(c.hash, min(extra, s.Quota()), now)
	}
}

// costWriter watches a response for the costs zones charge after it: the
// value of a header when the header is written (weight response_header),
// and the body's size once the handler returns (weight response_bytes),
// each charged at the time it is known, read from clock. Only requests that
// meet such a zone get one.
type costWriter struct {
	caddyhttp.ResponseWriterWrapper
	clock   func() time.Time
	pending []afterCharge
	inline  [2]afterCharge
	wrote   bool
	bytes   int64
}

// serveCharged passes the request on; for zones whose cost the response
// reports, through a costWriter that charges it.
func (h *Handler) serveCharged(w http.ResponseWriter, r *http.Request, verdicts []verdict, next caddyhttp.Handler) error {
	var cw *costWriter
	for i := range verdicts {
		v := &verdicts[i]
		if v.z.afterHeader == "" && !v.z.afterBytes || v.logged {
			continue
		}
		if cw == nil {
			cw = &costWriter{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, clock: h.now}
			cw.pending = cw.inline[:0]
		}
		cw.pending = append(cw.pending, afterCharge{z: v.z, hash: v.c.hash, paid: v.weight})
	}
	if cw == nil {
		return next.ServeHTTP(w, r)
	}
	err := next.ServeHTTP(cw, r)
	for _, c := range cw.pending {
		if c.z.afterBytes {
			c.settle(cw.bytes, cw.clock())
		}
	}
	return err
}

// WriteHeader charges the zones that read a response header, once, at the
// final (non-1xx) status. A missing or bad value charges nothing more than
// the request-time weight already paid.
func (cw *costWriter) WriteHeader(code int) {
	if code >= 200 && !cw.wrote {
		cw.wrote = true
		for _, c := range cw.pending {
			if c.z.afterHeader != "" {
				if n, ok := weight.Count(cw.Header().Get(c.z.afterHeader)); ok {
					c.settle(n, cw.clock())
				}
			}
		}
	}
	cw.ResponseWriterWrapper.WriteHeader(code)
}

func (cw *costWriter) Write(p []byte) (int, error) {
	if !cw.wrote {
		cw.WriteHeader(http.StatusOK)
	}
	n, err := cw.ResponseWriterWrapper.Write(p)
	cw.bytes += int64(n)
	return n, err
}

// ReadFrom keeps the underlying writer's sendfile path (a file server's
// body) while counting its bytes.
func (cw *costWriter) ReadFrom(r io.Reader) (int64, error) {
	if !cw.wrote {
		cw.WriteHeader(http.StatusOK)
	}
	n, err := cw.ResponseWriterWrapper.ReadFrom(r)
	cw.bytes += n
	return n, err
}

var _ http.ResponseWriter = (*costWriter)(nil)
