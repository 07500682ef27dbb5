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

// settle charges the zone for a response whose reported cost has grown from
// `from` to `to`, at now, the time it grew: whatever of that growth is
// beyond what the request paid. Not at the request's arrival: a response
// may take longer than the key takes to refill, and a charge dated then
// would be refilled away before it was made (or, on a counter that has moved
// past that time, read as a debt that far ahead), and a quota would count it
// in a window that may already weigh nothing. The key may go into debt: at
// most one burst below empty in the rate (see limiter.Buckets.Charge), and
// one quota in each quota however many times a response is settled, so a
// wild report cannot lock a key out for longer than a full refill.
func (c afterCharge) settle(from, to int64, now time.Time) {
	before, after := max(from-c.paid, 0), max(to-c.paid, 0)
	if after <= before {
		return
	}
	c.z.buckets.Charge(c.hash, after-before, now)
	for _, s := range c.z.quotas {
		q := s.Quota()
		s.Add(c.hash, min(after, q)-min(before, q), now)
	}
}

// costWriter watches a response for the costs zones charge after it, and
// charges each when it is known, at the time read from clock: the value of
// a header when the header is written (weight response_header), and the
// body's bytes as they are written (weight response_bytes), each before
// the client can have them, so that its next request is decided on a key
// that has paid for this one. Only requests that meet such a zone get one.
type costWriter struct {
	caddyhttp.ResponseWriterWrapper
	clock   func() time.Time
	pending []afterCharge
	inline  [2]afterCharge
	wrote   bool
	// countBytes: a pending zone charges the body's bytes; bytes is how
	// many have been charged.
	countBytes bool
	bytes      int64
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
		cw.countBytes = cw.countBytes || v.z.afterBytes
	}
	if cw == nil {
		return next.ServeHTTP(w, r)
	}
	return next.ServeHTTP(cw, r)
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
					c.settle(0, n, cw.clock())
				}
			}
		}
	}
	cw.ResponseWriterWrapper.WriteHeader(code)
}

// Write charges p's bytes before it passes them on. Bytes the connection
// then fails to take (a client gone) are charged all the same.
func (cw *costWriter) Write(p []byte) (int, error) {
	if !cw.wrote {
		cw.WriteHeader(http.StatusOK)
	}
	cw.chargeBytes(int64(len(p)))
	return cw.ResponseWriterWrapper.Write(p)
}

// chargeBytes charges n more body bytes to the zones that count them.
func (cw *costWriter) chargeBytes(n int64) {
	if !cw.countBytes || n <= 0 {
		return
	}
	from := cw.bytes
	cw.bytes += n
	now := cw.clock()
	for _, c := range cw.pending {
		if c.z.afterBytes {
			c.settle(from, cw.bytes, now)
		}
	}
}

// ReadFrom keeps the underlying writer's sendfile path (a file server's
// body) when no zone counts the body's bytes. When one does, the bytes go
// through Write, to be charged before they are sent: the price of counting
// them is the copy that sendfile saves.
func (cw *costWriter) ReadFrom(r io.Reader) (int64, error) {
	if !cw.wrote {
		cw.WriteHeader(http.StatusOK)
	}
	if cw.countBytes {
		return io.Copy(writerOnly{cw}, r)
	}
	return cw.ResponseWriterWrapper.ReadFrom(r)
}

// writerOnly hides every method of a writer but Write, so that io.Copy
// uses Write.
type writerOnly struct{ io.Writer }

var _ http.ResponseWriter = (*costWriter)(nil)
