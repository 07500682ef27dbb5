package integration

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
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
