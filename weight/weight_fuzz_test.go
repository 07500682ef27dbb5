package weight

import (
	"encoding/json"
	"math"
	"math/big"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzParse reads arbitrary text as a configured weight: never a panic, a
// number is at least 1, and what parses is written back (String; JSON, for
// UTF-8 text) as text that parses to the same weight.
func FuzzParse(f *testing.F) {
	for _, s := range []string{"1", "10000", "0", "-2", "1.5", "", " 3", "{http.request.header.X-Cost}", "{", "9223372036854775807", "9223372036854775808", "+4", "0x10", `"5"`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := Parse(s)
		if err != nil {
			if !v.IsZero() {
				t.Fatalf("Parse(%q) failed (%v) but set %v", s, err, v)
			}
			return
		}
		if v.template == "" && v.n < 1 {
			t.Fatalf("Parse(%q) = %d", s, v.n)
		}
		if again, err := Parse(v.String()); err != nil || again != v {
			t.Fatalf("Parse(%q).String() = %q parses to %v, %v", s, v.String(), again, err)
		}
		if !utf8.ValidString(s) {
			return // JSON holds only UTF-8: it would carry U+FFFD instead
		}
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		var back Value
		if err := json.Unmarshal(b, &back); err != nil || back != v {
			t.Fatalf("%v marshals to %s, which unmarshals to %v, %v", v, b, back, err)
		}
	})
}

// FuzzResolve expands a template weight to arbitrary text, as a header or
// a response_header value may hold: the result is a whole number from 1 to
// the limit exactly when the text (trimmed of spaces) is one, by an exact
// reference, and an error quotes at most maxQuoted bytes of the value.
func FuzzResolve(f *testing.F) {
	for _, s := range []string{"1", "7", "0", "-1", "2.5", "abc", "11", "99999999999999999999", " 4 ", "\t5\n", "+3", "٣", "1e3", "0x7", "00010", strings.Repeat("9", 5000)} {
		f.Add(s, int64(10))
	}
	f.Add("5", int64(math.MaxInt64))
	v, err := Parse("{x}")
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, s string, limit int64) {
		n, err := v.Resolve(func(string) string { return s }, limit)
		want, ok := referenceCount(s)
		if ok && want > limit {
			ok = false
		}
		if ok != (err == nil) || ok && n != want {
			t.Fatalf("weight %q, limit %d: %d, %v; want %d, %v", s, limit, n, err, want, ok)
		}
		// Quoted, a byte takes at most 4 characters (\xc9).
		if err != nil && len(err.Error()) > 100+4*maxQuoted {
			t.Fatalf("error of %d bytes for a value of %d", len(err.Error()), len(s))
		}
	})
}

// referenceCount is Count by definition: optional ASCII spaces around an
// optional sign and decimal digits, worth 1 to MaxInt64.
func referenceCount(s string) (int64, bool) {
	s = strings.TrimSpace(s)
	digits := strings.TrimPrefix(strings.TrimPrefix(s, "+"), "-")
	if digits == "" || len(s)-len(digits) > 1 || strings.Trim(digits, "0123456789") != "" {
		return 0, false
	}
	n, _ := new(big.Int).SetString(s, 10)
	if n.Sign() < 1 || !n.IsInt64() {
		return 0, false
	}
	return n.Int64(), true
}
