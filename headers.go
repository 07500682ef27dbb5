package floodgate

import (
	"net/http"
	"strconv"
	"time"
	"unsafe"
)

// The header fields in canonical form (textproto.CanonicalMIMEHeaderKey), so
// that setting them does not canonicalise on every request.
const (
	policyField     = "Ratelimit-Policy"
	limitField      = "Ratelimit"
	retryAfterField = "Retry-After"
)

// responseHeaders holds the values of the rate-limit header fields of one
// response, and is their only allocation: the []string each field needs and
// the bytes of the values live in it. Each value gets its own slice, because
// handlers after this one may change a field's values in place (Caddy's
// `header` directive does); strings are never changed.
type responseHeaders struct {
	policy, limit, retryAfter [1]string
	// buf holds the text of the values made per request; a longer text
	// spills to the heap. Its size makes the struct 256 bytes, one of Go's
	// size classes: room for the RateLimit items of four zones with a
	// quota each and short names (the policy of a handler's zones is made
	// once, Handler.policyOf).
	buf [200]byte
	n   int
}

// setRateLimit writes the RateLimit-Policy and RateLimit fields of
// draft-ietf-httpapi-ratelimit-headers-10, one list item per zone that
// applied to the request:
//
//	RateLimit-Policy: "api";q=100;w=60
//	RateLimit: "api";r=42;t=18
//
// q and w are the zone's burst and the seconds its bucket takes to refill
// (see policyItem); r is what the key may still take now, rounded down, and
// t the seconds until its bucket is full again, rounded up. A window zone's
// t is the seconds until its grants no longer count, and for a request it
// denies, until a request of that weight would pass (its Retry-After).
// Each quota of a zone is an item of its own, named after the zone and its
// window (quotaName), with q its count and w its window. Every item's t is at
// most its w (zone.told, zone.quotaTold), as is a Retry-After it causes. Zone
// names are restricted (validZoneName) so that they need no escaping in a
// quoted string.
//
// A zone with action log (a dry run) has no item: a dry run must not change
// what clients see, so a response is what it would be without that zone. If
// every zone is a dry run, neither field is set.
//
// told is the wait the response's Retry-After says (0 if none): the t of
// an item that denies is at least that, at most its w, so that jitter
// (Handler.Jitter), which lengthens Retry-After, lengthens the t of the
// items it speaks for alike, and the two agree.
//
// policy is the RateLimit-Policy value if the caller has it made already
// (Handler.policyOf), else empty, and it is made here.
func (rh *responseHeaders) setRateLimit(hdr http.Header, verdicts []verdict, told time.Duration, policy string) {
	n := 0
	for _, v := range verdicts {
		if v.z.action.enforces() {
			n++
		}
	}
	if n == 0 {
		return
	}
	switch {
	case policy != "":
		rh.policy[0] = policy
	case n == 1:
		for _, v := range verdicts {
			if v.z.action.enforces() {
				rh.policy[0] = v.z.policy
			}
		}
	default:
		b := rh.start()
		for _, v := range verdicts {
			b = appendPolicy(b, v.z)
		}
		rh.policy[0] = rh.text(b)
	}
	b := rh.start()
	for _, v := range verdicts {
		if !v.z.action.enforces() {
			continue
		}
		// The rate, each quota and max_concurrent have an item each (a
		// zone with max_concurrent alone has no rate). d is the zone's
		// answer; with quotas or max_concurrent, that combines the
		// rate's and theirs.
		rate := v.d
		if len(v.z.quotas) > 0 || v.z.conc != nil {
			rate = v.rate
		}
		if _, none := v.z.buckets.(noRate); !none {
			t := v.z.reset(rate)
			if !rate.Allowed {
				t = max(t, told)
			}
			b = appendSeparator(b)
			b = appendLimitItem(b, v.z.name, rate.Remaining, ceilSeconds(v.z.told(t)))
		}
		for j, q := range v.quotas() {
			t := q.Reset
			if !q.Allowed {
				t = max(t, told)
			}
			b = appendSeparator(b)
			b = appendLimitItem(b, v.z.quotaNames[j], q.Remaining, ceilSeconds(v.z.quotaTold(j, t)))
		}
		if v.z.conc != nil {
			// A place has no window: r alone (t is optional).
			b = appendSeparator(b)
			b = append(b, '"')
			b = append(b, concName(v.z.name)...)
			b = append(b, `";r=`...)
			b = strconv.AppendInt(b, max(v.conc.Remaining, 0), 10)
		}
	}
	rh.limit[0] = rh.text(b)
	hdr[policyField] = rh.policy[:]
	hdr[limitField] = rh.limit[:]
}

// setRetryAfter writes the Retry-After field: secs, a number of seconds.
func (rh *responseHeaders) setRetryAfter(hdr http.Header, secs int64) {
	rh.retryAfter[0] = rh.text(strconv.AppendInt(rh.start(), secs, 10))
	hdr[retryAfterField] = rh.retryAfter[:]
}

// start returns where the next value is to be appended: the unused end of
// buf, with no length.
func (rh *responseHeaders) start() []byte { return rh.buf[rh.n:rh.n] }

// appendPolicy appends z's RateLimit-Policy items to b, after a
// separator if b has items, if z enforces (a dry run has none).
func appendPolicy(b []byte, z *zone) []byte {
	if !z.action.enforces() {
		return b
	}
	return append(appendSeparator(b), z.policy...)
}

// text returns b, a value appended to start(), as a string without copying
// it. The bytes are never written again: later values are appended after
// them, and a value that outgrows buf moves to a new array.
func (rh *responseHeaders) text(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	if rh.n < len(rh.buf) && unsafe.SliceData(b) == &rh.buf[rh.n] {
		rh.n += len(b) // it stayed in buf
	}
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// appendSeparator appends the comma between two list items, if b has one.
func appendSeparator(b []byte) []byte {
	if len(b) > 0 {
		b = append(b, ", "...)
	}
	return b
}

// appendLimitItem appends one RateLimit list item: `"name";r=<remaining>;t=<seconds>`.
func appendLimitItem(b []byte, name string, remaining, reset int64) []byte {
	b = append(b, '"')
	b = append(b, name...)
	b = append(b, `";r=`...)
	b = strconv.AppendInt(b, max(remaining, 0), 10)
	b = append(b, ";t="...)
	return strconv.AppendInt(b, reset, 10)
}
