package floodgate

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// parseZoneText parses a rate_limit directive holding one zone named z.
func parseZoneText(t *testing.T, body string) (*Handler, error) {
	t.Helper()
	rl := new(Handler)
	err := rl.unmarshalCaddyfile(caddyfile.NewTestDispenser("rate_limit {\n"+body+"\n}"), nil, map[string]inlineDef{})
	return rl, err
}

func TestBadWeightQuotaAndActionValuesFailAtLoad(t *testing.T) {
	zone := func(lines string) string { return "zone z {\nevents 5\nwindow 1m\n" + lines + "\n}" }
	for _, tt := range []struct {
		name, body, want string
	}{
		{"weight 0", zone("weight 0"), `zone "z": weight 0: must be at least 1`},
		{"weight -2", zone("weight -2"), `zone "z": weight -2: must be at least 1`},
		{"weight 6 with events 5", zone("weight 6"), `zone "z": weight 6: above 5, the most the zone can grant`},
		{"weight above a quota", zone("quota 3 1h\nweight 4"), `zone "z": weight 4: above 3`},
		{"weight 1.5", zone("weight 1.5"), `zone "z": weight "1.5": must be a whole number`},
		{"weight without a value", zone("weight"), "wrong argument count"},
		{"weight with two values", zone("weight 2 3"), "wrong argument count"},
		{"response_header without a field", zone("weight response_header"), "response_header needs a value"},
		{"both response weights", zone("weight response_header X-Cost\nweight response_bytes"), `zone "z": weight response_header and weight response_bytes: a zone charges one cost its response reports, not both`},
		{"status and time", zone("weight response_status 401\nweight response_time"), `zone "z": weight response_status and weight response_time: a zone charges one cost`},
		{"response_status without a status", zone("weight response_status"), `zone "z": weight response_status: needs at least one status code or class, e.g. 401 403 or 4xx`},
		{"response_status 4xxx", zone("weight response_status 401 4xxx"), `zone "z": weight response_status: "4xxx": not a status code (401) or class (4xx)`},
		{"response_status 1xx", zone("weight response_status 1xx"), `zone "z": weight response_status: "1xx": a class is 2xx, 3xx, 4xx or 5xx`},
		{"response_status 101", zone("weight response_status 101"), `zone "z": weight response_status: "101": a final status is from 200 to 599`},
		{"response_status 600", zone("weight response_status 600"), `zone "z": weight response_status: "600": a final status is from 200 to 599`},
		{"response_status twice", zone("weight response_status 401\nweight response_status 403"), `zone "z": weight response_status is set twice`},
		{"response_time with a value", zone("weight response_time 300ms"), `zone "z": weight response_time takes no value, not "300ms"`},
		{"response_time and a weight rule", zone("weight 2 {\nmethod POST\n}\nweight response_time"), `zone "z": weight response_time: a zone that charges the response's time has no other weight rule`},
		{"handler weight 0", "weight 0\n" + zone(""), "weight 0: must be at least 1"},
		{"handler weight -2", "weight -2\n" + zone(""), "weight -2: must be at least 1"},
		{"quota 0 1h", zone("quota 0 1h"), `zone "z": quota "0": the count must be a whole number of at least 1`},
		{"quota 10 without a duration", zone("quota 10"), `zone "z": quota [10]: needs a count and a duration`},
		{"quota with a bad duration", zone("quota 10 soon"), `zone "z": quota 10 "soon": the window must be a positive duration`},
		{"quota -1s", zone("quota 10 -1s"), `zone "z": quota 10 "-1s": the window must be a positive duration`},
		{"quota above the sketch", zone("quota 4294967296 1h"), `zone "z": quota 4294967296 1h0m0s: the count must be between 1 and 4294967295`},
		{"two quotas on one window", zone("quota 10 1h\nquota 20 1h"), `zone "z": quota 20 1h0m0s: the zone already has a quota over 1h0m0s`},
		{"three quotas", zone("quota 10 1h\nquota 10 2h\nquota 10 3h"), `zone "z": quota: at most 2 quotas per zone, got 3`},
		{"action explode", zone("action explode"), `zone "z": action "explode": must be deny, log or delay <max>`},
		{"action delay -1s", zone("action delay -1s"), `zone "z": action delay "-1s": the longest delay must be a positive duration`},
		{"action delay 0s", zone("action delay 0s"), `zone "z": action delay "0s": the longest delay must be a positive duration`},
		{"action delay without max", zone("action delay"), `zone "z": action delay: needs the longest delay`},
		{"action log with an argument", zone("action log 2s"), "wrong argument count"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseZoneText(t, tt.body)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestBadValuesInJSONFailAtValidation(t *testing.T) {
	base := func() *Zone { return &Zone{Limit: zoneconf.Limit{MaxEvents: 5, Window: caddy.Duration(time.Minute)}} }
	for _, tt := range []struct {
		name string
		edit func(*Zone)
		want string
	}{
		{"weight 6 with events 5", func(z *Zone) { z.Weights = []*weight.Rule{{Weight: weight.Static(6)}} }, `zone "z": weight 6: above 5`},
		{"a rule without a weight", func(z *Zone) { z.Weights = []*weight.Rule{{}} }, `zone "z": weights[0]: a weight is required`},
		{"quota 0", func(z *Zone) { z.Quotas = []Quota{{MaxEvents: 0, Window: caddy.Duration(time.Hour)}} }, `zone "z": quota 0 1h0m0s: the count must be between 1 and`},
		{"quota without a window", func(z *Zone) { z.Quotas = []Quota{{MaxEvents: 10}} }, `zone "z": quota 10 0s: the window must be at least 1ms`},
		{"action explode", func(z *Zone) { z.Action = "explode" }, `zone "z": action "explode": must be deny, log or delay`},
		{"action delay -1s", func(z *Zone) { z.Action, z.MaxDelay = "delay", caddy.Duration(-time.Second) }, `zone "z": action delay -1s: the longest delay must be positive`},
		{"max_delay without delay", func(z *Zone) { z.MaxDelay = caddy.Duration(time.Second) }, `zone "z": max_delay 1s: only with action delay`},
		{"weight_response_status 4x", func(z *Zone) { z.WeightResponseStatus = []string{"4x"} }, `zone "z": weight response_status: "4x": not a status code (401) or class (4xx)`},
		{"weight_response_status empty", func(z *Zone) { z.WeightResponseStatus = []string{} }, `zone "z": weight response_status: needs at least one status code or class`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			z := base()
			tt.edit(z)
			if err := z.Validate("z"); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestWeightSubdirectivesParse(t *testing.T) {
	rl, err := parseZoneText(t, `weight {header.X-Route-Cost}
	zone z {
		events 100
		window 1m
		weight 10 {
			path /search*
		}
		weight {header.X-Cost}
		weight response_header X-Upstream-Cost
		quota 50 1h
		quota 500 24h
		action delay 2s
	}
	zone logins {
		events 5
		window 10m
		weight response_status 401 403 5xx
	}
	zone backend {
		events 60000
		window 1m
		weight response_time
	}`)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(rl)
	for _, want := range []string{
		`"weight":"{http.request.header.X-Route-Cost}"`,
		`"weights":[{"weight":10,"match":[{"path":["/search*"]}]},{"weight":"{http.request.header.X-Cost}"}]`,
		`"weight_response_header":"X-Upstream-Cost"`,
		`"quotas":[{"max_events":50,"window":3600000000000},{"max_events":500,"window":86400000000000}]`,
		`"action":"delay","max_delay":2000000000`,
		`"weight_response_status":["401","403","5xx"]`,
		`"weight_response_time":true`,
	} {
		if !strings.Contains(string(got), want) {
			t.Errorf("JSON %s\nlacks %s", got, want)
		}
	}
}

// weightedRequest is a GET of path with the given header (name: value).
func weightedRequest(path string, headers ...string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, path, nil)
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ": ")
		r.Header.Set(name, value)
	}
	return r
}

func TestPlaceholderWeightsNeverPassForFree(t *testing.T) {
	cost, _ := weight.Parse("{http.request.header.X-Cost}")
	h := newTestHandler(t, nil, map[string]*Zone{
		"placeholder_weight": {Limit: zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Hour), Burst: 10}, Weights: []*weight.Rule{{Weight: cost}}},
	})
	for _, bad := range []string{"", "0", "-1", "2.5", "abc", "11", "99999999999999999999"} {
		if _, err := serve(h, weightedRequest("/", "X-Cost: "+bad)); status(err) != http.StatusBadRequest {
			t.Errorf("X-Cost %q: status %d, want 400", bad, status(err))
		}
	}
	w, err := serve(h, weightedRequest("/", "X-Cost: 4"))
	if err != nil || w.Header().Get("RateLimit") != `"placeholder_weight";r=6;t=1440` {
		t.Fatalf("X-Cost 4 after the bad ones: %v, RateLimit %q, want 6 left: bad weights charge nothing", err, w.Header().Get("RateLimit"))
	}
	if _, err := serve(h, weightedRequest("/", "X-Cost: 7")); status(err) != http.StatusTooManyRequests {
		t.Errorf("X-Cost 7 with 6 left: %v, want 429", err)
	}
}

func TestZoneRuleWinsOverHandlerWeight(t *testing.T) {
	zones := func(prefix string) map[string]*Zone {
		return map[string]*Zone{
			prefix + "_rule":    {Limit: zoneconf.Limit{MaxEvents: 20, Window: caddy.Duration(time.Hour), Burst: 20}, Weights: []*weight.Rule{{Weight: weight.Static(5)}}},
			prefix + "_no_rule": {Limit: zoneconf.Limit{MaxEvents: 20, Window: caddy.Duration(time.Hour), Burst: 20}},
		}
	}
	weighted := newTestHandler(t, nil, zones("weighted"))
	weighted.Weight = weight.Static(3)
	plain := newTestHandler(t, nil, zones("plain"))
	for _, tt := range []struct {
		h    *Handler
		want string
	}{
		{weighted, `"weighted_no_rule";r=17;t=540, "weighted_rule";r=15;t=900`},
		{plain, `"plain_no_rule";r=19;t=180, "plain_rule";r=15;t=900`},
	} {
		w, err := serveAt(tt.h, weightedRequest("/"), time.Now())
		if err != nil {
			t.Fatal(err)
		}
		// t is rounded up from just under the refill time of what was
		// charged (180 s a token).
		if got := w.Header().Get("RateLimit"); got != tt.want {
			t.Errorf("RateLimit %q, want %q", got, tt.want)
		}
	}
}

func TestQuotaDenialChargesNeitherRateNorQuota(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{
		"rate_and_quota": {Limit: zoneconf.Limit{MaxEvents: 100, Window: caddy.Duration(time.Hour), Memory: 4096}, Quotas: []Quota{{MaxEvents: 2, Window: caddy.Duration(time.Hour)}}},
	})
	for range 2 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		w, err := serve(h, weightedRequest("/"))
		if status(err) != http.StatusTooManyRequests {
			t.Fatalf("third request: %v, want 429", err)
		}
		if got := w.Header().Get("RateLimit"); !strings.HasPrefix(got, `"rate_and_quota";r=98;`) || !strings.Contains(got, `"rate_and_quota/1h";r=0;`) {
			t.Errorf("RateLimit %q: the quota's denials must leave the rate at 98", got)
		}
		if got := w.Header().Get("RateLimit-Policy"); got != `"rate_and_quota";q=100;w=3600, "rate_and_quota/1h";q=2;w=3600` {
			t.Errorf("RateLimit-Policy %q", got)
		}
	}
}

func TestLogActionPassesAndChargesNothing(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{
		"dry_run": {Limit: zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(time.Hour), Burst: 2}, Action: "log"},
	})
	for _, h := range h.zones {
		h.action = parseAction("log")
	}
	var last *httptest.ResponseRecorder
	for i := range 4 {
		w, err := serve(h, weightedRequest("/"))
		if err != nil {
			t.Fatalf("request %d: %v, want it to pass", i+1, err)
		}
		last = w
	}
	// A dry run changes nothing clients see.
	for _, f := range []string{"RateLimit", "RateLimit-Policy", "Retry-After"} {
		if got := last.Header().Values(f); len(got) > 0 {
			t.Errorf("%s %q on a dry run, want none", f, got)
		}
	}
	// Charging nothing: the zone holds what enforcing would have left,
	// zero tokens, not minus two.
	if d := h.zones[0].buckets.PeekHash(keyOf(h.zones[0], "192.0.2.1:1", "", nil), 1, time.Now()); d.RetryAfter > 30*time.Minute {
		t.Errorf("logged requests were charged: wait %v, want at most one token's 30m", d.RetryAfter)
	}
}

// heldClock stands in for the timer of a held request: it records the wait
// and either returns at once (time passes by clock.advance) or, if block is
// set, says so on entered and waits for the request's context, as a
// disconnecting client makes it.
type heldClock struct {
	clock   *testclock.Clock
	mu      sync.Mutex
	waits   []time.Duration
	block   bool
	entered chan struct{} // one value per request that starts waiting, with block
	// meanwhile, if set, runs at the end of each wait that returns at
	// once, with the clock's time: what other clients did meanwhile.
	meanwhile func(time.Time)
}

// held returns the waits so far.
func (c *heldClock) held() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.waits)
}

func (c *heldClock) sleep(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	c.waits = append(c.waits, d)
	c.mu.Unlock()
	if c.block {
		select {
		case c.entered <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
		<-ctx.Done()
		return ctx.Err()
	}
	c.clock.Advance(d)
	if c.meanwhile != nil {
		c.meanwhile(c.clock.Now())
	}
	return nil
}

// delayHandler is a handler with one zone of 10 requests per second and the
// given burst, with action delay up to maxDelay, on a clock of its own.
func delayHandler(t *testing.T, name string, burst int64, maxDelay time.Duration) (*Handler, *heldClock) {
	clock := testclock.New(time.Now().Add(time.Hour)) // after the tables are made: their clocks start then
	h := newTestHandler(t, clock, map[string]*Zone{
		name: {Limit: zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Second), Burst: burst}, Action: "delay", MaxDelay: caddy.Duration(maxDelay)},
	})
	held := &heldClock{clock: clock, entered: make(chan struct{}, 8)}
	h.sleep = held.sleep
	return h, held
}

func TestDelayHoldsUntilTheTokensReturn(t *testing.T) {
	h, held := delayHandler(t, "delay_holds", 1, 250*time.Millisecond)
	for i := range 3 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
	}
	// One token every 100ms, burst 1: the first passes, the next ones wait
	// for the next token (at most 100ms: the clock need not start on a
	// refill), then 100ms (the clock moved by the first wait).
	if w := held.held(); len(w) != 2 || w[0] <= 0 || w[0] > 100*time.Millisecond || w[1] != 100*time.Millisecond {
		t.Errorf("waits %v, want [(0, 100ms] 100ms]", w)
	}
	if h.zones[0].counts.held.Load() != 0 {
		t.Errorf("%d still held", h.zones[0].counts.held.Load())
	}
}

// heldRequests starts n requests through h that stay held (held.block), and
// waits until each is; cancel releases them.
func heldRequests(t *testing.T, h *Handler, held *heldClock, n int) (cancel func(), errs chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errs = make(chan error, n)
	for i := range n {
		go func() {
			_, err := serve(h, weightedRequest("/").WithContext(ctx))
			errs <- err
		}()
		select {
		case <-held.entered:
		case err := <-errs:
			cancel()
			t.Fatalf("request %d was answered instead of held: %v", i+1, err)
		case <-time.After(10 * time.Second):
			cancel()
			t.Fatalf("request %d was not held within 10s", i+1)
		}
	}
	return cancel, errs
}

// serveOrGiveUp serves a request that must not be held: if it is (a bug),
// it gives up after a while, as a client would, instead of hanging the test.
func serveOrGiveUp(h *Handler) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := serve(h, weightedRequest("/").WithContext(ctx))
	return err
}

func TestDelayReservesSoHeldRequestsNeverOverAdmit(t *testing.T) {
	h, held := delayHandler(t, "delay_queue", 3, 250*time.Millisecond)
	held.block = true
	for i := range 3 {
		if _, err := serve(h, weightedRequest("/")); err != nil {
			t.Fatalf("burst request %d: %v", i+1, err)
		}
	}
	cancel, errs := heldRequests(t, h, held, 2)
	defer cancel()
	// Each held request reserved its token at arrival, so the second waits
	// behind the first.
	if w := held.held(); len(w) != 2 || w[0] <= 0 || w[0] > 100*time.Millisecond || w[1]-w[0] != 100*time.Millisecond {
		t.Errorf("waits %v, want the second 100ms after the first", w)
	}
	// A third would wait 300ms, beyond max_delay: denied at once.
	if err := serveOrGiveUp(h); status(err) != http.StatusTooManyRequests {
		t.Errorf("beyond max_delay: %v, want 429 at once", err)
	}
	cancel()
	for range 2 {
		<-errs
	}
}

// A delay zone holds what returns within max_delay and no more: at 10 a
// second, burst 1, max_delay 250ms, one request passes, two are held (their
// tokens return after 100 and 200ms) and the next, whose token returns
// after 300ms, is denied at once.
func TestDelayHoldsWhatReturnsWithinMaxDelay(t *testing.T) {
	h, held := delayHandler(t, "delay_burst", 1, 250*time.Millisecond)
	held.block = true
	if _, err := serve(h, weightedRequest("/")); err != nil {
		t.Fatal(err)
	}
	cancel, errs := heldRequests(t, h, held, 2)
	defer cancel()
	if err := serveOrGiveUp(h); status(err) != http.StatusTooManyRequests {
		t.Errorf("with 200ms of tokens held: %v, want 429", err)
	}
	cancel()
	<-errs
	<-errs
}

func TestDelayedClientThatLeavesGetsItsTokensBack(t *testing.T) {
	h, held := delayHandler(t, "delay_leaves", 1, time.Second)
	held.block = true
	_, _ = serve(h, weightedRequest("/"))
	z := h.zones[0]
	hash := keyOf(z, "192.0.2.1:1", "", nil)
	before := z.buckets.PeekHash(hash, 1, held.clock.Now()).RetryAfter
	cancel, errs := heldRequests(t, h, held, 1)
	cancel()
	if err := <-errs; status(err) != 499 {
		t.Errorf("client gone: %v, want 499", err)
	}
	if after := z.buckets.PeekHash(hash, 1, held.clock.Now()).RetryAfter; after != before {
		t.Errorf("after the held client left: wait %v, want %v as before it came", after, before)
	}
	if n := z.counts.held.Load(); n != 0 {
		t.Errorf("%d requests still counted as held", n)
	}
}

func TestDelayHoldsAtMostMaxHeld(t *testing.T) {
	h, _ := delayHandler(t, "delay_bound", 5, time.Hour)
	for range 4 {
		_, _ = serve(h, weightedRequest("/"))
	}
	z := h.zones[0]
	_, _ = serve(h, weightedRequest("/"))
	z.counts.held.Store(maxHeld)
	if _, err := serve(h, weightedRequest("/")); status(err) != http.StatusTooManyRequests {
		t.Errorf("with %d held: %v, want 429", maxHeld, err)
	}
	if n := z.counts.held.Load(); n != maxHeld {
		t.Errorf("held %d after a refused hold, want %d", n, maxHeld)
	}
}

var _ caddyhttp.Handler = okHandler
