package weight

import (
	"io"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Watch is a weight a response reports: the value of the header field
// Header (weight response_header); with Bytes, the body's size in bytes
// (weight response_bytes); with Status, Cost if the final status is one
// of Status (weight response_status), else nothing.
type Watch struct {
	Header string
	Bytes  bool
	Status *Statuses
	Cost   int64
}

// A Reporter is told the weights a response reports.
type Reporter interface {
	// Reported says that the weight the response reports for the i-th
	// Watch has grown from `from` to `to`, at now.
	Reported(i int, from, to int64, now time.Time)
}

// ResponseWriter reports to a Reporter the weights a response declares, as
// soon as each is known and before the client can have it, so that the
// client's next request is decided on a key that has paid for this one: a
// header's value, or a status's cost, when the header is written, once, at
// the final (non-1xx) status; the body's bytes as they are written. A
// missing or bad header value (see Count) reports nothing. Set it up with
// Init and Watch, and tell it with Done what the handler returned.
type ResponseWriter struct {
	caddyhttp.ResponseWriterWrapper
	report  Reporter
	clock   func() time.Time
	watches []Watch
	inline  [2]Watch
	wrote   bool
	// countBytes: a Watch counts the body's bytes; bytes is how many have
	// been reported.
	countBytes bool
	bytes      int64
}

// Init sets w up to pass the response on to rw and report to report, at
// the times read from clock, with no Watch yet.
func (w *ResponseWriter) Init(rw http.ResponseWriter, report Reporter, clock func() time.Time) {
	w.ResponseWriterWrapper = caddyhttp.ResponseWriterWrapper{ResponseWriter: rw}
	w.report, w.clock = report, clock
	w.watches = w.inline[:0]
}

// Watch adds a weight for w to report, as the next index (from 0).
func (w *ResponseWriter) Watch(x Watch) {
	w.watches = append(w.watches, x)
	w.countBytes = w.countBytes || x.Bytes
}

// WriteHeader reports the header fields and statuses watched, once, at the
// final status. 101 Switching Protocols is final too: the connection is
// then handed over (a WebSocket) and no other status follows, so Done must
// not take the handler's nil for a 200; no status set holds 101 (see
// ParseStatuses), so it charges nothing, as the access log's 101 says.
func (w *ResponseWriter) WriteHeader(code int) {
	if (code >= 200 || code == http.StatusSwitchingProtocols) && !w.wrote {
		w.final(code, true)
	}
	w.ResponseWriterWrapper.WriteHeader(code)
}

// final reports what the final status code says, and the header fields
// watched if headers (the response's headers are the handler's).
func (w *ResponseWriter) final(code int, headers bool) {
	w.wrote = true
	for i, x := range w.watches {
		switch {
		case x.Header != "" && headers:
			if n, ok := Count(w.Header().Get(x.Header)); ok {
				w.report.Reported(i, 0, n, w.clock())
			}
		case x.Status != nil && x.Status.Has(code):
			w.report.Reported(i, 0, x.Cost, w.clock())
		}
	}
}

// Done tells w that the handler returned err. A handler that wrote no
// status leaves it to Caddy, which answers an error with its status (see
// ErrorStatus: basic_auth's 401 is such an error) and nil with 200, as its
// access log records: Done reports the statuses watched for that one. (A
// handle_errors route may then write another status; the error's is the
// one charged.)
func (w *ResponseWriter) Done(err error) {
	if w.wrote {
		return
	}
	if err != nil {
		w.final(ErrorStatus(err), false)
	} else {
		w.final(http.StatusOK, true)
	}
}

// Write reports p's bytes before it passes them on. Bytes the connection
// then fails to take (a client gone) are reported all the same.
func (w *ResponseWriter) Write(p []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	w.reportBytes(int64(len(p)))
	return w.ResponseWriterWrapper.Write(p)
}

// reportBytes reports n more body bytes to the watches that count them.
func (w *ResponseWriter) reportBytes(n int64) {
	if !w.countBytes || n <= 0 {
		return
	}
	from := w.bytes
	w.bytes += n
	now := w.clock()
	for i, x := range w.watches {
		if x.Bytes {
			w.report.Reported(i, from, w.bytes, now)
		}
	}
}

// ReadFrom keeps the underlying writer's sendfile path (a file server's
// body) when no Watch counts the body's bytes. When one does, the bytes go
// through Write, to be reported before they are sent: the price of counting
// them is the copy that sendfile saves.
func (w *ResponseWriter) ReadFrom(r io.Reader) (int64, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	if w.countBytes {
		return io.Copy(writerOnly{w}, r)
	}
	return w.ResponseWriterWrapper.ReadFrom(r)
}

// writerOnly hides every method of a writer but Write, so that io.Copy
// uses Write.
type writerOnly struct{ io.Writer }

var _ http.ResponseWriter = (*ResponseWriter)(nil)
