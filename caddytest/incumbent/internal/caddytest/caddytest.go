// Package caddytest stands in, for the ported caddy-ratelimit tests of
// package incumbent, for github.com/caddyserver/caddy/v2/caddytest: the same
// Tester and the same assertions (it embeds the real one), with what the
// port needs to run beside floodgate's other test packages and without the
// incumbent's private fake clock:
//
//   - The incumbent's configs name fixed ports (admin localhost:2999, HTTP
//     8080); configs and URLs are rewritten to the free ports Ports picked
//     at run time.
//   - Each InitServer first loads a config without servers, so the zones the
//     previous test used are released: caddy-ratelimit's tests reuse zone
//     names, and floodgate (like caddy-ratelimit itself) keeps a zone's
//     state across config loads by name.
//   - The clock: InitTime and AdvanceTime drive real time (see AdvanceTime).
package caddytest

import (
	"bytes"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	real "github.com/caddyserver/caddy/v2/caddytest"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// The free ports, and the fixed ones of the incumbent's tests they stand for.
var (
	AdminPort, HTTPPort, HTTPSPort int
	rewrite                        *strings.Replacer
)

// Ports records the ports picked for this process (testcaddy.MustFreePorts).
func Ports(admin, httpPort, httpsPort int) {
	AdminPort, HTTPPort, HTTPSPort = admin, httpPort, httpsPort
	rewrite = strings.NewReplacer("2999", strconv.Itoa(admin), "8080", strconv.Itoa(httpPort))
}

// Tester is caddytest.Tester on the free ports.
type Tester struct {
	*real.Tester
	t testing.TB
}

// NewTester returns a Tester whose client opens a connection per request:
// one kept from before a config load would reach the server it replaced.
func NewTester(t testing.TB) *Tester {
	tc := real.NewTester(t).WithDefaultOverrides(real.Config{AdminPort: AdminPort})
	tc.Client.Transport.(*http.Transport).DisableKeepAlives = true
	return &Tester{Tester: tc, t: t}
}

// InitServer loads a config without servers (releasing every zone), then
// rawConfig with its ports rewritten, and fails the test if Caddy refuses
// either. It waits until the new config alone listens (testcaddy.Load).
func (tc *Tester) InitServer(rawConfig string, configType string) {
	tc.t.Helper()
	empty := fmt.Sprintf(`{"admin": {"listen": "localhost:%d", "config": {"persist": false}}}`, AdminPort)
	if err := testcaddy.Load(tc.t, AdminPort, empty, "json", AdminPort, HTTPPort, HTTPSPort); err != nil {
		tc.t.Fatalf("loading the empty config: %v", err)
	}
	if err := testcaddy.Load(tc.t, AdminPort, rewrite.Replace(rawConfig), configType, AdminPort, HTTPPort, HTTPSPort); err != nil {
		tc.t.Fatalf("loading the config: %v", err)
	}
}

func (tc *Tester) AssertGetResponse(requestURI string, expectedStatusCode int, expectedBody string) (*http.Response, string) {
	tc.t.Helper()
	clock.sent()
	return tc.Tester.AssertGetResponse(rewrite.Replace(requestURI), expectedStatusCode, expectedBody)
}

func (tc *Tester) AssertDeleteResponse(requestURI string, expectedStatusCode int, expectedBody string) (*http.Response, string) {
	tc.t.Helper()
	clock.sent()
	return tc.Tester.AssertDeleteResponse(rewrite.Replace(requestURI), expectedStatusCode, expectedBody)
}

func (tc *Tester) AssertPostResponseBody(requestURI string, requestHeaders []string, requestBody *bytes.Buffer, expectedStatusCode int, expectedBody string) (*http.Response, string) {
	tc.t.Helper()
	clock.sent()
	return tc.Tester.AssertPostResponseBody(rewrite.Replace(requestURI), requestHeaders, requestBody, expectedStatusCode, expectedBody)
}

// clock is the reference time of the incumbent's fake clock, in real time:
// the moment the first request after InitTime was sent, which is when the
// window it opens starts (to within the time it takes to arrive).
var clock refClock

type refClock struct {
	sync.Mutex
	armed bool
	start time.Time
}

func (c *refClock) sent() {
	c.Lock()
	defer c.Unlock()
	if c.armed {
		c.armed, c.start = false, time.Now()
	}
}

// InitTime is the incumbent's initTime: the clock's reference is the next
// request.
func InitTime() {
	clock.Lock()
	defer clock.Unlock()
	clock.armed, clock.start = true, time.Time{}
}

// margin is how long after "reference + seconds" AdvanceTime returns: more
// than a request takes to reach Caddy (so a window of that many seconds is
// over), less than a second minus one (so Retry-After, rounded up to whole
// seconds, reads the same as on the incumbent's fake clock).
const margin = 250 * time.Millisecond

// AdvanceTime is the incumbent's advanceTime(seconds), which sets its fake
// clock to reference + seconds: here it sleeps until then, plus margin. The
// incumbent's clock is private to its package (a `now` variable its tests
// replace), so a port to another limiter can only drive real time.
func AdvanceTime(seconds int) {
	clock.Lock()
	start := clock.start
	clock.Unlock()
	time.Sleep(time.Until(start.Add(time.Duration(seconds)*time.Second + margin)))
}
