package caddytest

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// okUpstream is an upstream that answers 200 "upstream", for the recipes
// that reverse_proxy to localhost:8080.
func okUpstream(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("upstream"))
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// remaining returns the r= of zone's item in a RateLimit header.
func remaining(t *testing.T, resp *http.Response, zone string) int {
	t.Helper()
	for item := range strings.SplitSeq(resp.Header.Get("RateLimit"), ", ") {
		if z, r, _ := parseRateLimitItem(item); z == zone {
			n, err := strconv.Atoi(r)
			if err != nil {
				t.Fatalf("RateLimit %q: r=%q", resp.Header.Get("RateLimit"), r)
			}
			return n
		}
	}
	t.Fatalf("RateLimit %q has no item for %q", resp.Header.Get("RateLimit"), zone)
	return 0
}

func TestRecipeBehindAProxy(t *testing.T) {
	tc := newTester(t)
	// The test's clients are the proxy, on loopback.
	tc.InitServer(readmeConfig(t, "## Behind a CDN or a proxy", 0, "", "10.0.0.0/8", "127.0.0.0/8", "localhost:8080", okUpstream(t)), "caddyfile")
	// A proxy appends the address it saw to whatever the client wrote.
	forged := func(i int) string { return "X-Forwarded-For: 198.51.100." + strconv.Itoa(i) + ", 203.0.113.5" }
	var left []int
	for i := range 3 {
		code, _, resp := get(t, tc, "/", forged(i))
		if code != 200 {
			t.Fatalf("request %d: %d", i, code)
		}
		left = append(left, remaining(t, resp, "per_client"))
	}
	if left[0] != 99 || left[1] != 98 || left[2] != 97 {
		t.Errorf("a client forging a new X-Forwarded-For each time: r = %v, want 99 98 97 (one bucket)", left)
	}
	_, _, resp := get(t, tc, "/", "X-Forwarded-For: 203.0.113.6")
	if r := remaining(t, resp, "per_client"); r != 99 {
		t.Errorf("another client behind the same proxy: r=%d, want a bucket of its own (99)", r)
	}
}

func TestRecipeAPIKeysRolledUpToTheirOrganisation(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "## API keys rolled up to their organisation", 0, ""), "caddyfile")
	if got := codes(t, tc, 4, "/", "X-API-Key: key-alice"); got != "200 200 200 429" {
		t.Errorf("alice: %s, want her key's 3", got)
	}
	if got := codes(t, tc, 3, "/", "X-API-Key: key-bob"); got != "200 200 429" {
		t.Errorf("bob after alice: %s, want acme's last 2 (alice's denial charged nothing)", got)
	}
	if got := codes(t, tc, 4, "/", "X-API-Key: key-carol"); got != "200 200 200 429" {
		t.Errorf("carol in initech: %s, want her key's 3", got)
	}
	// Unknown keys have no organisation: each is limited on its own in
	// per_api_key, and they share per_org under the client's address.
	if got := codes(t, tc, 3, "/", "X-API-Key: key-mallory"); got != "200 200 200" {
		t.Errorf("an unknown key: %s", got)
	}
	if got := codes(t, tc, 3, "/", "X-API-Key: key-trudy"); got != "200 200 429" {
		t.Errorf("a second unknown key from the same address: %s, want that address's last 2 in per_org", got)
	}
}

func TestRecipeLoginEndpoint(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "## A login endpoint", 0, "", "localhost:8080", okUpstream(t)), "caddyfile")
	c := clientFrom("127.0.0.41")
	if got := seq(t, c, 5, "POST", "/login"); got != "200 200 200 200 200" {
		t.Fatalf("five attempts: %s", got)
	}
	req, err := http.NewRequest("POST", baseURL+"/login", nil)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	code, body, resp := do(t, c, req)
	elapsed := time.Since(start)
	if code != 429 || !strings.HasPrefix(body, "Too many login attempts: retry in ") {
		t.Errorf("sixth attempt: %d %q, want 429 with the message", code, body)
	}
	// One attempt returns every 10m / 5 = 2 minutes.
	checkSeconds(t, "Retry-After", resp.Header.Get("Retry-After"), 2*time.Minute, elapsed)
	if got := seq(t, c, 3, "GET", "/login"); got != "200 200 200" {
		t.Errorf("GET /login: %s, want it not limited", got)
	}
}

func TestWhyABare400(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "### Why a bare 400?", 0, ""), "caddyfile")
	code, body, _ := get(t, tc, "/", "X-Cost: abc")
	if code != 400 || !strings.Contains(body, "must be a whole number of at least 1") {
		t.Errorf("a bad weight with handle_errors 400: %d %q, want 400 saying why", code, body)
	}
	if code, _, _ := get(t, tc, "/", "X-Cost: 2"); code != 200 {
		t.Errorf("a good weight: %d", code)
	}
}

// loginUpstream is a login form: 200 for the password "right" (in the
// X-Password header), 401 for any other; it counts the attempts that reach
// it.
func loginUpstream(t *testing.T) (addr string, hits *atomic.Int64) {
	t.Helper()
	hits = new(atomic.Int64)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if r.Header.Get("X-Password") != "right" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		_, _ = w.Write([]byte("welcome"))
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), hits
}

func TestRecipeFailedLoginsOnly(t *testing.T) {
	tc := newTester(t)
	addr, hits := loginUpstream(t)
	tc.InitServer(readmeConfig(t, "## Failed logins only", 0, "", "localhost:8080", addr), "caddyfile")
	c := clientFrom("127.0.0.42")
	if got := seq(t, c, 10, "POST", "/login", "X-Password: right"); got != strings.TrimSpace(strings.Repeat("200 ", 10)) {
		t.Fatalf("ten successful logins: %s", got)
	}
	if got := seq(t, c, 5, "POST", "/login", "X-Password: guess"); got != "401 401 401 401 401" {
		t.Fatalf("five failed logins after ten successful ones: %s, want each to reach the form", got)
	}
	before := hits.Load()
	code, body, resp := do(t, c, testcaddy.Request(t, "POST", baseURL+"/login", "X-Password: guess"))
	if code != 429 || !strings.HasPrefix(body, "Too many failed logins: try again later") {
		t.Errorf("sixth failed login: %d %q, want 429 with the message", code, body)
	}
	if n := hits.Load() - before; n != 0 {
		t.Errorf("the sixth failed login reached the upstream (%d hits), want it refused before", n)
	}
	// A failure returns every 10m / 5 = 2 minutes.
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 1 || ra > 120 {
		t.Errorf("Retry-After %q, want 1 to 120 s", resp.Header.Get("Retry-After"))
	}
	if got := seq(t, clientFrom("127.0.0.43"), 1, "POST", "/login", "X-Password: guess"); got != "401" {
		t.Errorf("another client's failed login: %s, want it to reach the form", got)
	}
}

func TestRecipeAShareOfTheBackendsTime(t *testing.T) {
	tc := newTester(t)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(300 * time.Millisecond) // the backend's time is what is measured
		_, _ = w.Write([]byte("result"))
	}))
	t.Cleanup(srv.Close)
	tc.InitServer(readmeConfig(t, "## A share of the backend's time", 0, "", "localhost:8080", strings.TrimPrefix(srv.URL, "http://"), "events 60000", "events 1000"), "caddyfile")
	c := clientFrom("127.0.0.44")
	var got []string
	for range 8 {
		code, _, resp := do(t, c, testcaddy.Request(t, "GET", baseURL+"/search", "X-API-Key: alice"))
		got = append(got, strconv.Itoa(code))
		if code == 429 {
			if p := resp.Header.Get("RateLimit-Policy"); !strings.Contains(p, `qu="ms"`) {
				t.Errorf("RateLimit-Policy %q, want the millisecond as the unit", p)
			}
			break
		}
	}
	if s := strings.Join(got, " "); s != "200 200 200 429" && s != "200 200 200 200 429" {
		t.Errorf("a key's 300 ms requests on 1000 ms a minute: %s, want 3 or 4 served, then 429", s)
	}
	code, _, resp := do(t, c, testcaddy.Request(t, "GET", baseURL+"/search", "X-API-Key: bob"))
	if code != 200 {
		t.Errorf("another key: %d, want it served", code)
	}
	if r := remaining(t, resp, "backend_time"); r < 1000-400 || r > 1000 {
		t.Errorf("another key's first request: r=%d ms left, want what is left before its own time is charged", r)
	}
}
