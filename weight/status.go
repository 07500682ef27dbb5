package weight

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Statuses is a set of final HTTP statuses (100 to 599), written as codes
// (401) and classes (4xx): the responses a zone with weight
// response_status charges.
type Statuses struct {
	bits [10]uint64 // bit s-100 for status s
}

// ParseStatuses reads codes and classes such as "401", "403", "4xx". Each
// is refused with why if it is not a status from 200 to 599 or a class 2xx
// to 5xx: a 1xx response is never final, so it can never be charged.
func ParseStatuses(words []string) (Statuses, error) {
	var s Statuses
	if len(words) == 0 {
		return s, errors.New("needs at least one status code or class, e.g. 401 403 or 4xx")
	}
	for _, w := range words {
		if len(w) == 3 && (w[1] == 'x' || w[1] == 'X') && (w[2] == 'x' || w[2] == 'X') {
			c := w[0]
			if c < '2' || c > '5' {
				return Statuses{}, fmt.Errorf("%q: a class is 2xx, 3xx, 4xx or 5xx", w)
			}
			base := int(c-'0') * 100
			for code := base; code < base+100; code++ {
				s.add(code)
			}
			continue
		}
		code, err := strconv.Atoi(w)
		if err != nil || len(w) != 3 {
			return Statuses{}, fmt.Errorf("%q: not a status code (401) or class (4xx)", w)
		}
		if code < 200 || code > 599 {
			return Statuses{}, fmt.Errorf("%q: a final status is from 200 to 599", w)
		}
		s.add(code)
	}
	return s, nil
}

func (s *Statuses) add(code int) { s.bits[(code-100)/64] |= 1 << ((code - 100) % 64) }

// Has reports whether code is in s.
func (s *Statuses) Has(code int) bool {
	if code < 100 || code > 599 {
		return false
	}
	return s.bits[(code-100)/64]&(1<<((code-100)%64)) != 0
}

// IsZero reports whether s holds no status.
func (s *Statuses) IsZero() bool { return s.bits == [10]uint64{} }

// ErrorStatus is the status Caddy answers a handler's error with, as its
// access log records it: a caddyhttp.HandlerError's status code (basic_auth's
// 401, reverse_proxy's 502), else 500.
func ErrorStatus(err error) int {
	if he, ok := errors.AsType[caddyhttp.HandlerError](err); ok && he.StatusCode != 0 {
		return he.StatusCode
	}
	return http.StatusInternalServerError
}
