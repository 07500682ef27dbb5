package caddytest

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// readmeExample returns the n-th (from 0) caddyfile code block of the
// section with the given heading ("### Weights": its level is ignored) in
// README.md or one of the pages of docs/, where the README's examples moved.
func readmeExample(t *testing.T, heading string, n int) string {
	t.Helper()
	title := strings.TrimLeft(heading, "# ")
	line := regexp.MustCompile(`(?m)^#+ ` + regexp.QuoteMeta(title) + `$`)
	for _, page := range docPages(t) {
		raw, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		loc := line.FindIndex(raw)
		if loc == nil {
			continue
		}
		section := string(raw[loc[1]:])
		if end := strings.Index(section, "\n#"); end >= 0 {
			section = section[:end]
		}
		blocks := strings.Split(section, "```caddyfile\n")
		if len(blocks) <= n+1 {
			t.Fatalf("%s: section %q has %d caddyfile blocks, want at least %d", page, title, len(blocks)-1, n+1)
		}
		block, _, _ := strings.Cut(blocks[n+1], "```")
		return block
	}
	t.Fatalf("no section %q in README.md or docs/", title)
	return ""
}

// readmeConfig is a README example as a config of the test Caddy: its
// global options (if any) merged with the tests' (and extra), and its site
// example.com served as the test site. replace lists old, new pairs for the
// example's other addresses (an upstream, a proxy's range). Nothing else is changed.
func readmeConfig(t *testing.T, heading string, n int, extra string, replace ...string) string {
	t.Helper()
	block := strings.NewReplacer(replace...).Replace(readmeExample(t, heading, n))
	if strings.HasPrefix(block, "{\n") {
		end := strings.Index(block, "\n}\n")
		extra += "\n" + block[2:end]
		block = block[end+3:]
	}
	if !strings.Contains(block, "example.com {") {
		t.Fatalf("README example %q %d has no site example.com", heading, n)
	}
	block = strings.Replace(block, "example.com {", fmt.Sprintf("http://localhost:%d {", httpPort), 1)
	return globals(extra) + block
}

// trustXFF makes {client_ip} the X-Forwarded-For of requests from loopback,
// so that tests can be clients from any address.
const trustXFF = `servers {
		trusted_proxies static private_ranges
		client_ip_headers X-Forwarded-For
	}`

// getFrom sends a request with method to path from a client of its own
// connection and returns the status and response.
func request(t *testing.T, c *http.Client, method, path string, headers ...string) (int, *http.Response) {
	t.Helper()
	code, _, resp := do(t, c, testcaddy.Request(t, method, baseURL+path, headers...))
	return code, resp
}

// seq sends the same request n times and returns the status codes.
func seq(t *testing.T, c *http.Client, n int, method, path string, headers ...string) string {
	t.Helper()
	return testcaddy.Codes(t, c, n, method, baseURL+path, headers...)
}

func TestReadmeWeightsExample(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "### Weights", 0, ""), "caddyfile")
	c := clientFrom("127.0.0.11")
	if got := seq(t, c, 5, "GET", "/"); got != "200 200 200 200 200" {
		t.Fatalf("five pages: %s", got)
	}
	code, resp := request(t, c, "GET", "/search")
	if code != 200 || !strings.HasPrefix(resp.Header.Get("RateLimit"), `"pages";r=5;`) {
		t.Fatalf("first search: %d %q, want 200 with 5 left", code, resp.Header.Get("RateLimit"))
	}
	if got := seq(t, c, 1, "GET", "/search"); got != "429" {
		t.Fatalf("second search: %s, want 429", got)
	}
	if got := seq(t, c, 6, "GET", "/"); got != "200 200 200 200 200 429" {
		t.Errorf("pages after the denied search (which must charge nothing): %s", got)
	}
	// A zone rule wins over the handler's weight: a POST costs 5 anywhere.
	post := clientFrom("127.0.0.12")
	if got := seq(t, post, 5, "POST", "/search"); got != "200 200 200 200 429" {
		t.Errorf("POSTs to /search at 5 each: %s", got)
	}
}

func TestPlaceholderWeightFromTheRequest(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone header_cost {
			events 10
			window 1h
		}
		weight {header.X-Cost}
	}
	respond "ok"
	handle_errors 400 {
		respond "bad cost: {err.message}" 400
	}`), "caddyfile")
	for _, bad := range []string{"0", "-2", "abc", "11", "1.5"} {
		code, body, _ := get(t, tc, "/", "X-Cost: "+bad)
		if code != 400 || !strings.Contains(body, "header_cost") {
			t.Errorf("X-Cost %q: %d %q, want 400 naming the zone", bad, code, body)
		}
	}
	if code, _, _ := get(t, tc, "/"); code != 400 {
		t.Errorf("no X-Cost: %d, want 400", code)
	}
	_, _, resp := get(t, tc, "/", "X-Cost: 6")
	if got := resp.Header.Get("RateLimit"); !strings.HasPrefix(got, `"header_cost";r=4;`) {
		t.Errorf("X-Cost 6 after the bad ones: RateLimit %q, want 4 left (bad weights charge nothing)", got)
	}
	if got := codes(t, tc, 2, "/", "X-Cost: 4"); got != "200 429" {
		t.Errorf("X-Cost 4 twice with 4 left: %s", got)
	}
}

// costUpstream is an upstream that reports the cost given in its request's
// cost query parameter in X-Query-Cost, and sends size bytes of body.
func costUpstream(t *testing.T) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if c := r.URL.Query().Get("cost"); c != "" {
			w.Header().Set("X-Query-Cost", c)
		}
		size, _ := strconv.Atoi(r.URL.Query().Get("size"))
		w.Header().Set("Content-Length", strconv.Itoa(size))
		_, _ = io.CopyN(w, zeros{}, int64(size))
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

func TestResponseHeaderWeightDrivesBoundedDebt(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone reported_cost {
			key {header.X-Key}
			events 20
			window 1h
			weight response_header X-Query-Cost
		}
	}
	reverse_proxy `+costUpstream(t)), "caddyfile")
	// 20 → 13 → 6 → −1: three admitted, then the debt denies.
	if got := codes(t, tc, 4, "/?cost=7", "X-Key: seven"); got != "200 200 200 429" {
		t.Errorf("reported cost 7 on a zone of 20: %s, want 200 200 200 429", got)
	}
	// A missing or bad report charges the request-time weight, 1.
	for _, cost := range []string{"", "abc", "0", "-3"} {
		key := "X-Key: bad" + cost
		if got := codes(t, tc, 21, "/?cost="+cost, key); !strings.HasSuffix(got, " 200 429") || strings.Count(got, "200") != 20 {
			t.Errorf("reported cost %q: %s, want 20 passes at 1 each, then 429", cost, got)
		}
	}
	// A report that large is still one burst of debt at most: the key is
	// denied, not locked out for ever (Retry-After at most two bursts' refill).
	_, _, _ = get(t, tc, "/?cost=999999999", "X-Key: huge")
	code, _, resp := get(t, tc, "/", "X-Key: huge")
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if code != 429 || ra < 3600 || ra > 2*3600+1 {
		t.Errorf("after a huge report: %d, Retry-After %d s, want 429 for between one and two hours", code, ra)
	}
}

func TestReadmeResponseWeightExample(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "### Costs reported by the response", 0, "", "localhost:4000", costUpstream(t)), "caddyfile")
	c := clientFrom("127.0.0.21")
	if got := seq(t, c, 5, "GET", "/?cost=300", "X-API-Key: k1"); got != "200 200 200 200 429" {
		t.Errorf("query cost 300 of 1000: %s, want four, then 429", got)
	}
	bytes := clientFrom("127.0.0.22")
	code, resp := request(t, bytes, "GET", "/?size=400000")
	if code != 200 || !strings.Contains(resp.Header.Get("RateLimit-Policy"), `"egress";q=1000000;w=60;qu="content-bytes"`) {
		t.Fatalf("%d, RateLimit-Policy %q, want the egress item in content-bytes", code, resp.Header.Get("RateLimit-Policy"))
	}
	// 1 MB → 600 kB → 200 kB → −200 kB: the third download is admitted,
	// the fourth not (a second's refill is 17 kB).
	if got := seq(t, bytes, 3, "GET", "/?size=400000"); got != "200 200 429" {
		t.Errorf("400 kB downloads on 1 MB a minute: 200 %s, want 200 200 200 429", got)
	}
}

func TestReadmeQuotaExample(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "### Quotas", 0, ""), "caddyfile")
	if got := codes(t, tc, 5, "/", "X-API-Key: trial-key"); got != "200 200 200 200 200" {
		t.Fatalf("five requests: %s", got)
	}
	code, _, resp := get(t, tc, "/", "X-API-Key: trial-key")
	if code != 429 {
		t.Fatalf("sixth request: %d, want 429", code)
	}
	// The hour's quota is full until the estimate of the previous hour's
	// five decays to four: between 12 minutes and 72 minutes from now.
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if ra < 12*60 || ra > 72*60+1 {
		t.Errorf("Retry-After %q, want minutes (12 to 72), not the rate's second", resp.Header.Get("Retry-After"))
	}
	if got, want := resp.Header.Get("RateLimit-Policy"), `"trial";q=100;w=1, "trial/1h";q=5;w=3600, "trial/24h";q=50;w=86400`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	// The rate regains a token every 10 ms, so it shows 95 or more; the
	// day's quota shows exactly the five: the denial charged neither.
	got := resp.Header.Get("RateLimit")
	rate, _, _ := strings.Cut(strings.TrimPrefix(got, `"trial";r=`), ";")
	if r, err := strconv.Atoi(rate); err != nil || r < 95 || !strings.Contains(got, `"trial/1h";r=0;t=`) || !strings.Contains(got, `"trial/24h";r=45;t=`) {
		t.Errorf("RateLimit %q: the quota's denial must charge nothing (rate at 95 or more, day at 45)", got)
	}
	t.Logf("RateLimit: %s; Retry-After: %s", resp.Header.Get("RateLimit"), resp.Header.Get("Retry-After"))
}

func TestReadmeRollupUsersAndOrganisation(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "### Roll-up keys", 0, ""), "caddyfile")
	user := func(name, org string) []string { return []string{"X-User: " + name, "X-Org: " + org} }
	if got := codes(t, tc, 4, "/", user("alice", "acme")...); got != "200 200 200 429" {
		t.Errorf("alice: %s, want her 3", got)
	}
	// Alice's denial charged nothing in acme: 2 left for bob.
	if got := codes(t, tc, 3, "/", user("bob", "acme")...); got != "200 200 429" {
		t.Errorf("bob after alice: %s, want acme's last 2", got)
	}
	// Acme's denials charged nothing in carol's own zone: she has her 3 in
	// another organisation.
	if got := codes(t, tc, 2, "/", user("carol", "acme")...); got != "429 429" {
		t.Errorf("carol in acme: %s, want acme's limit", got)
	}
	if got := codes(t, tc, 4, "/", user("carol", "initech")...); got != "200 200 200 429" {
		t.Errorf("carol in initech: %s, want her own 3 untouched", got)
	}
}

func TestReadmeRollupIPv6Networks(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "### Roll-up keys", 1, trustXFF), "caddyfile")
	from := func(ip string) string { return "X-Forwarded-For: " + ip }
	if got := codes(t, tc, 3, "/", from("2001:db8:1:1::1")); got != "200 200 200" {
		t.Fatalf("first /64: %s", got)
	}
	if got := codes(t, tc, 1, "/", from("2001:db8:1:1::2")); got != "429" {
		t.Errorf("another address of the same /64: %s, want 429", got)
	}
	if got := codes(t, tc, 2, "/", from("2001:db8:1:2::1")); got != "200 200" {
		t.Errorf("a second /64 of the /48: %s, want the /48's last 2 (the /64's denial charged nothing)", got)
	}
	code, _, resp := get(t, tc, "/", from("2001:db8:1:2::1"))
	if rl := resp.Header.Get("RateLimit"); code != 429 || !strings.Contains(rl, `"per_64";r=1;`) || !strings.Contains(rl, `"per_48";r=0;`) {
		t.Errorf("the /48 full: %d %q, want 429 with the /64's last token not charged", code, rl)
	}
	if got := codes(t, tc, 1, "/", from("2001:db8:2::1")); got != "200" {
		t.Errorf("another /48: %s", got)
	}
}

func TestFallbackKeySaysWhichKeyWasUsed(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone key_name_zone {
			key {header.X-API-Key} {client_ip}
			events 10
			window 1h
		}
	}
	respond "{http.rate_limit.key_name}"`), "caddyfile")
	if _, body, _ := get(t, tc, "/", "X-API-Key: k"); body != "{http.request.header.X-API-Key}" {
		t.Errorf("with an API key: %q", body)
	}
	if _, body, _ := get(t, tc, "/"); body != "{http.vars.client_ip}" {
		t.Errorf("without: %q", body)
	}
}

// metric returns the value of a caddy_rate_limit_requests_total series.
func metric(t *testing.T, zone, outcome string) int {
	t.Helper()
	return int(testcaddy.MetricSum(testcaddy.Metrics(t, adminPort), fmt.Sprintf(`caddy_rate_limit_requests_total{outcome=%q,zone=%q}`, outcome, zone)))
}

func TestReadmeActionsExample(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(readmeConfig(t, "### Actions", 0, ""), "caddyfile")
	c := clientFrom("127.0.0.31")
	start := time.Now()
	var last *http.Response
	for i := range 4 {
		code, resp := request(t, c, "GET", "/")
		if code != 200 {
			t.Fatalf("request %d: %d, want every one to pass (delayed, or only logged)", i+1, code)
		}
		last = resp
	}
	// smooth spaces requests 200 ms apart: three waits. A loose bound: the
	// point is that requests were held, not how precisely.
	if elapsed := time.Since(start); elapsed < 450*time.Millisecond || elapsed > 5*time.Second {
		t.Errorf("four requests took %v, want about 600ms of holding", elapsed)
	}
	// A dry run changes nothing clients see: smooth's headers only.
	if rl, ra := last.Header.Get("RateLimit"), last.Header.Get("Retry-After"); strings.Contains(rl, "trial_limit") ||
		strings.Contains(last.Header.Get("RateLimit-Policy"), "trial_limit") || ra != "" || !strings.HasPrefix(rl, `"smooth";`) {
		t.Errorf("a logged request: RateLimit %q, Retry-After %q, want smooth's RateLimit only", rl, ra)
	}
	if n := metric(t, "trial_limit", "logged"); n != 2 {
		t.Errorf("trial_limit logged %d, want 2 (the 3rd and 4th requests)", n)
	}
	// Each request is sent when the one before is answered, just as its
	// token is spent: held for about 200ms, unless the machine took that
	// long to send it (then its token is back and it passes at once; a
	// loaded CI machine did). The elapsed time above holds either way.
	if n := metric(t, "smooth", "delayed"); n < 1 || n > 3 {
		t.Errorf("smooth delayed %d, want 1 to 3 of the 3 requests after the first", n)
	}

	// Five at once, as the text promises: one passes, four are held, each
	// reserving the next token, 200 ms apart. (A sixth would be held for
	// the whole second of max delay, measured from its own arrival: one
	// that read the clock a moment before the first is refused, rightly.)
	var mu sync.Mutex
	var got []string
	var wg sync.WaitGroup
	burst := clientFrom("127.0.0.32")
	for range 5 {
		wg.Go(func() {
			code, _ := request(t, burst, "GET", "/")
			mu.Lock()
			got = append(got, strconv.Itoa(code))
			mu.Unlock()
		})
	}
	wg.Wait()
	slices.Sort(got)
	if s := strings.Join(got, " "); s != "200 200 200 200 200" {
		t.Errorf("five at once: %s, want one passed and four held", s)
	}
}

func TestLoggedRequestSetsTheExceededPlaceholder(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(config("", `
	rate_limit {
		zone logged_zone {
			events 1
			window 1h
			action log
		}
	}
	respond "exceeded={http.rate_limit.exceeded.name}"`), "caddyfile")
	if code, _, _ := get(t, tc, "/"); code != 200 {
		t.Errorf("first: %d", code)
	}
	if code, body, _ := get(t, tc, "/"); code != 200 || body != "exceeded=logged_zone" {
		t.Errorf("second: %d %q, want 200 naming the zone", code, body)
	}
}

func TestBadWeightValuesFailTheLoad(t *testing.T) {
	for _, tt := range []struct{ zone, want string }{
		{"weight 6", `zone \"bad_w\": weight 6: above 5`},
		{"action explode", `zone \"bad_w\": action \"explode\"`},
		{"quota 10", `zone \"bad_w\": quota [10]: needs a count and a duration`},
	} {
		err := load(t, config("", `
	rate_limit {
		zone bad_w {
			events 5
			window 1m
			`+tt.zone+`
		}
	}
	respond "ok"`), "caddyfile")
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want an error containing %s", tt.zone, err, tt.want)
		}
	}
}
