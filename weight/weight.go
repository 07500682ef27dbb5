// Package weight is what a request costs in a zone's units: a fixed number
// (a search costs 10 page views), or a number the request carries in a
// placeholder (`{http.request.header.X-Cost}`), or one the response reports
// after the fact (an upstream's header, the body's size).
//
// Start at Value, the weight a Caddyfile or JSON config writes. Resolve
// turns a Value into a request's weight, and refuses anything that could let
// a request through for free: a value that is not a whole number of at least
// 1, an empty one, or one beyond what the zone can ever grant. Count reads
// the weight a response reports in a header, and refuses the same values
// but the too large, which the caller charges as a debt.
//
// Rule is a weight rule as a config writes it (a Value and caddyhttp request
// matchers); Validate checks a zone's rules and Provision loads them into
// Rules, whose Of is what a request costs. ResponseWriter watches a response
// for the weights it declares (a header field, the body's bytes) and reports
// each to a Reporter as soon as it is known.
//
// The package knows Caddy's HTTP types but no zone: the most a zone can
// grant is passed in, and the tables a weight is charged to stay in the root
// package (weights.go), which settles what a ResponseWriter reports. So the
// dependencies point one way: the root imports weight, never the reverse.
package weight

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// A Value is a weight as configured: a whole number of at least 1, or a
// template holding placeholders that is expanded for each request. The zero
// Value is unset; callers use their default (1) for it.
type Value struct {
	n        int64
	template string
}

// Static returns the fixed weight n (at least 1).
func Static(n int64) Value { return Value{n: n} }

// Parse reads a weight as written in a config: a whole number of at least 1,
// or text with a placeholder (anything holding `{`). Errors name the value.
func Parse(s string) (Value, error) {
	if strings.Contains(s, "{") {
		return Value{template: s}, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return Value{}, fmt.Errorf("weight %q: must be a whole number of at least 1 or a placeholder", s)
	}
	if n < 1 {
		return Value{}, fmt.Errorf("weight %d: must be at least 1", n)
	}
	return Value{n: n}, nil
}

// IsZero reports whether v is unset.
func (v Value) IsZero() bool { return v.n == 0 && v.template == "" }

// IsTemplate reports whether v is read from each request (a placeholder),
// rather than fixed.
func (v Value) IsTemplate() bool { return v.template != "" }

// String is v as a config writes it.
func (v Value) String() string {
	if v.template != "" {
		return v.template
	}
	return strconv.FormatInt(v.n, 10)
}

// CheckFixed reports an error if v is a number above limit, the most that
// who (e.g. "the zone") can grant: a request of that weight could never
// pass. Templates are checked for each request, by Resolve.
func (v Value) CheckFixed(limit int64, who string) error {
	if v.n > limit {
		return fmt.Errorf("weight %d: above %d, the most %s can grant: such a request could never pass", v.n, limit, who)
	}
	return nil
}

// Resolve returns the weight of one request: v itself if it is a number,
// else its template expanded by expand and read as a whole number. An
// expansion that is empty, not a whole number of at least 1, or above limit
// (the most the zone can ever grant) is an error naming the value: such a
// request must not pass for free, nor wait for a grant that never comes.
func (v Value) Resolve(expand func(string) string, limit int64) (int64, error) {
	if v.template == "" {
		return v.n, nil
	}
	s := expand(v.template)
	n, ok := Count(s)
	if !ok && strings.TrimSpace(s) == "" {
		return 0, fmt.Errorf("weight %s is empty: the request must give a whole number of at least 1", v.template)
	}
	if !ok {
		return 0, fmt.Errorf("weight %s = %q: must be a whole number of at least 1", v.template, truncate(s))
	}
	if n > limit {
		return 0, fmt.Errorf("weight %s = %d: above %d, the most the zone can grant", v.template, n, limit)
	}
	return n, nil
}

// Count reads s as a whole number of at least 1 (surrounding spaces
// allowed, as in a header). It reports false for anything else: empty,
// zero, negative, fractional, or beyond int64.
func Count(s string) (int64, bool) {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n < 1 {
		return 0, false
	}
	return n, true
}

// maxQuoted is how much of a bad value an error quotes: a header can be
// megabytes long, an error message should not be.
const maxQuoted = 64

func truncate(s string) string {
	if len(s) <= maxQuoted {
		return s
	}
	return s[:maxQuoted] + "…"
}

// MarshalJSON writes a number as a JSON number and a template as a string.
func (v Value) MarshalJSON() ([]byte, error) {
	if v.template != "" {
		return json.Marshal(v.template)
	}
	return []byte(strconv.FormatInt(v.n, 10)), nil
}

// UnmarshalJSON reads a JSON number (a whole number of at least 1) or a
// string (a number or a template, as Parse).
func (v *Value) UnmarshalJSON(b []byte) error {
	var s string
	if len(b) > 0 && b[0] == '"' {
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
	} else {
		s = string(b)
	}
	p, err := Parse(s)
	if err != nil {
		return err
	}
	*v = p
	return nil
}
