package zoneconf

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// Errors that say how to write what the operator most likely meant: the
// nearest subdirective for a typo, `1m` for `1 minute`, `#` for words after
// a value that read as a comment (published how-tos write
// `events 10 (means 5 attempts)`).

// Arg returns the one argument of the subdirective the dispenser is on, or
// an error that starts with where, names the subdirective and says how to
// write it.
func Arg(d *caddyfile.Dispenser, where string) (string, error) {
	field := d.Val()
	if !d.NextArg() {
		return "", d.Errf("%s%s needs a value", where, field)
	}
	v := d.Val()
	if rest := d.RemainingArgs(); len(rest) > 0 {
		return "", d.Errf("%s%s", where, extraArgs(field, v, rest))
	}
	return v, nil
}

// OneArg is Arg without a where.
func OneArg(d *caddyfile.Dispenser) (string, error) { return Arg(d, "") }

// extraArgs says why `field v rest…` is not one value, and how to write it.
func extraArgs(field, v string, rest []string) string {
	msg := fmt.Sprintf("%s needs exactly one value, not %q", field, strings.Join(append([]string{v}, rest...), " "))
	if _, err := strconv.ParseFloat(v, 64); err == nil {
		switch {
		case len(rest) == 1 && durationFields[field] && durationUnits[strings.ToLower(rest[0])] != "":
			return fmt.Sprintf("%s: a duration is one word; write %s %s%s", msg, field, v, durationUnits[strings.ToLower(rest[0])])
		case len(rest) == 1 && field == "memory" && isSizeUnit(rest[0]):
			return fmt.Sprintf("%s: a size is one word; write %s %s%s", msg, field, v, rest[0])
		case thousands(rest):
			return fmt.Sprintf("%s: a number is one word, without spaces; write %s %s%s", msg, field, v, strings.Join(rest, ""))
		}
	}
	for _, w := range rest {
		if slices.Contains(Options, w) || slices.Contains([]string{"key", "zone", "name", "match", "weight", "quota", "action"}, w) {
			return fmt.Sprintf("%s: each setting goes on a line of its own (%s %s, then %s …)", msg, field, v, w)
		}
	}
	return fmt.Sprintf("%s: comments start with #, e.g. %s %s # %s", msg, field, v, strings.Join(rest, " "))
}

// durationFields are the subdirectives whose value is a duration.
var durationFields = map[string]bool{"window": true, "read_interval": true, "write_interval": true, "purge_age": true, "sweep_interval": true}

// isSizeUnit reports whether s is a unit of a size (KB, MiB, …).
func isSizeUnit(s string) bool {
	switch strings.ToLower(s) {
	case "b", "kb", "kib", "mb", "mib", "gb", "gib", "k", "m", "g":
		return true
	}
	return false
}

// thousands reports whether ws are groups of three digits: the rest of a
// number written in groups (100 000).
func thousands(ws []string) bool {
	for _, w := range ws {
		if len(w) != 3 || strings.Trim(w, "0123456789") != "" {
			return false
		}
	}
	return true
}

// durationUnits maps the words people write after a number to the unit
// Caddy's durations take.
var durationUnits = map[string]string{
	"ms": "ms", "millisecond": "ms", "milliseconds": "ms",
	"s": "s", "sec": "s", "secs": "s", "second": "s", "seconds": "s",
	"m": "m", "min": "m", "mins": "m", "minute": "m", "minutes": "m",
	"h": "h", "hr": "h", "hrs": "h", "hour": "h", "hours": "h",
	"d": "d", "day": "d", "days": "d",
}

// Unknown is the error for a subdirective word that is none of known:
// where, the word, and the nearest of known if a typo can explain it.
func Unknown(d *caddyfile.Dispenser, where, what, word string, known []string) error {
	if near := Nearest(word, known); near != "" {
		return d.Errf("%sunrecognized %s %q; did you mean %s?", where, what, word, near)
	}
	return d.Errf("%sunrecognized %s %q (it takes %s)", where, what, word, strings.Join(known, ", "))
}

// Nearest returns the word of known that word is a typo of: at most one
// edit away (two for words of five letters or more), an edit being a
// letter inserted, deleted, changed or two neighbours swapped, case
// ignored; "" if none is, or two are equally near.
func Nearest(word string, known []string) string {
	word = strings.ToLower(word)
	limit := 1
	if len(word) >= 5 {
		limit = 2
	}
	best, bestDist, tie := "", limit+1, false
	for _, k := range known {
		switch dist := editDistance(word, strings.ToLower(k)); {
		case dist < bestDist:
			best, bestDist, tie = k, dist, false
		case dist == bestDist:
			tie = true
		}
	}
	if tie || bestDist > limit {
		return ""
	}
	return best
}

// editDistance is the optimal string alignment distance between a and b:
// insertions, deletions, substitutions and transpositions of neighbours.
func editDistance(a, b string) int {
	prev2 := make([]int, len(b)+1)
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}
