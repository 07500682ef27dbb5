package floodgate

import (
	"net/http"
	"strconv"
	"strings"
)

// The header fields in canonical form (textproto.CanonicalMIMEHeaderKey), so
// that setting them does not canonicalise on every request.
const (
	policyField = "Ratelimit-Policy"
	limitField  = "Ratelimit"
)

// setHeaders writes the RateLimit-Policy and RateLimit fields of
// draft-ietf-httpapi-ratelimit-headers-10, one list item per zone that
// applied to the request:
//
//	RateLimit-Policy: "api";q=100;w=60
//	RateLimit: "api";r=42;t=18
//
// q is the zone's burst and w its window in seconds; r is what the key may
// still take now and t the seconds until its bucket is full again, both
// rounded up. Each quota of a zone is an item of its own, named after the
// zone and its window (quotaName). Zone names are restricted (validZoneName) so that they need no
// escaping in a quoted string.
func setHeaders(hdr http.Header, verdicts []verdict) {
	if len(verdicts) == 1 && len(verdicts[0].q) == 0 {
		hdr[policyField] = []string{verdicts[0].z.policy}
	} else {
		var p strings.Builder
		for i, v := range verdicts {
			if i > 0 {
				p.WriteString(", ")
			}
			p.WriteString(v.z.policy)
			for _, q := range v.z.quotaPolicies {
				p.WriteString(", ")
				p.WriteString(q)
			}
		}
		hdr[policyField] = []string{p.String()}
	}
	var buf [96]byte
	b := buf[:0]
	for i, v := range verdicts {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = appendLimitItem(b, v.z.name, v.rate.Remaining, ceilSeconds(v.rate.Reset))
		for j, q := range v.q {
			b = append(b, ", "...)
			b = appendLimitItem(b, v.z.quotaNames[j], q.Remaining, ceilSeconds(q.Reset))
		}
	}
	hdr[limitField] = []string{string(b)}
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
