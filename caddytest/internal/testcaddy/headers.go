package testcaddy

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// An Item is one item of the RateLimit-Policy and RateLimit fields: its
// name, q and w from the policy, r and t from the limit (w and t -1 when
// the item has none, as max_concurrent's).
type Item struct {
	Name       string
	Q, W, R, T int64
}

// Items parses the RateLimit-Policy and RateLimit fields of hdr (the
// draft's structured-field lists, as floodgate writes them) into items,
// in the policy's order. A field that does not parse fails the test.
func Items(t testing.TB, hdr http.Header) []Item {
	t.Helper()
	policy, limit := params(t, hdr.Get("RateLimit-Policy")), params(t, hdr.Get("RateLimit"))
	if len(policy) != len(limit) {
		t.Fatalf("RateLimit-Policy %q and RateLimit %q have different items", hdr.Get("RateLimit-Policy"), hdr.Get("RateLimit"))
	}
	items := make([]Item, len(policy))
	for i, p := range policy {
		l := limit[i]
		if p["name"] != l["name"] {
			t.Fatalf("item %d is %s in RateLimit-Policy, %s in RateLimit", i, p["name"], l["name"])
		}
		items[i] = Item{Name: p["name"], Q: num(t, p, "q"), W: optional(t, p, "w"), R: num(t, l, "r"), T: optional(t, l, "t")}
	}
	return items
}

func params(t testing.TB, field string) []map[string]string {
	t.Helper()
	var out []map[string]string
	for item := range strings.SplitSeq(field, ", ") {
		parts := strings.Split(item, ";")
		name, ok := strings.CutPrefix(parts[0], `"`)
		name, ok2 := strings.CutSuffix(name, `"`)
		if !ok || !ok2 {
			t.Fatalf("item %q of %q has no quoted name", item, field)
		}
		m := map[string]string{"name": name}
		for _, p := range parts[1:] {
			k, v, _ := strings.Cut(p, "=")
			m[k] = v
		}
		out = append(out, m)
	}
	return out
}

// optional is num for a parameter an item may leave out (a max_concurrent
// item has no window): -1 if it does.
func optional(t testing.TB, m map[string]string, k string) int64 {
	t.Helper()
	if _, ok := m[k]; !ok {
		return -1
	}
	return num(t, m, k)
}

func num(t testing.TB, m map[string]string, k string) int64 {
	t.Helper()
	if k == "q" && m["qu"] != "" && m[k] == "" {
		return 0
	}
	n, err := strconv.ParseInt(m[k], 10, 64)
	if err != nil {
		t.Fatalf("item %s: %s=%q: %v", m["name"], k, m[k], err)
	}
	return n
}

// CheckHonest checks what a response says of its limits, as a client reads
// it: every item's t is at most its w (the draft's effective window); a
// denial's Retry-After is at least 1, at most the longest w of the items
// that deny (r=0), and at most the longest t among them, so that a client
// reading either waits no longer than the limit asks and the two agree.
// It returns the items and Retry-After (0 for a response that is not a
// 429).
func CheckHonest(t testing.TB, label string, resp *http.Response) ([]Item, int64) {
	t.Helper()
	items := Items(t, resp.Header)
	for _, it := range items {
		if it.W < 0 {
			continue // a place in flight has no window
		}
		if it.T > it.W || it.T < 0 {
			t.Errorf("%s: item %s says t=%d, outside its window w=%d", label, it.Name, it.T, it.W)
		}
	}
	if resp.StatusCode != http.StatusTooManyRequests {
		return items, 0
	}
	ra, err := strconv.ParseInt(resp.Header.Get("Retry-After"), 10, 64)
	if err != nil || ra < 1 {
		t.Fatalf("%s: Retry-After %q", label, resp.Header.Get("Retry-After"))
	}
	var w, tt int64
	for _, it := range items {
		if it.R == 0 && it.W < 0 {
			w, tt = max(w, 1), max(tt, 1) // max_concurrent's Retry-After is 1 s
		}
		if it.R == 0 && it.W >= 0 {
			w, tt = max(w, it.W), max(tt, it.T)
		}
	}
	if w == 0 {
		t.Errorf("%s: a 429 whose items all have some left: %q", label, resp.Header.Get("RateLimit"))
	}
	if ra > w {
		t.Errorf("%s: Retry-After %d exceeds the longest window of the items that deny (w=%d)", label, ra, w)
	}
	if ra > tt {
		t.Errorf("%s: Retry-After %d beside t=%d of the items that deny: the two disagree", label, ra, tt)
	}
	return items, ra
}
