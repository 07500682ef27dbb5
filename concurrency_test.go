package floodgate

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

func concZone(n int64) *Zone {
	return &Zone{Key: "{http.request.header.X-Key}", Limit: zoneconf.Limit{MaxConcurrent: n, Memory: 1 << 16}}
}

func keyed(key string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Key", key)
	return r
}

func TestAPanicInALaterHandlerGivesThePlaceBack(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"conc_panic": concZone(1)})
	z := h.zones[0]
	panics := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { panic("a later handler") })
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the later handler's panic did not reach the caller")
			}
		}()
		_, _ = serveNextAt(h, keyed("a"), panics, time.Now())
	}()
	if n := z.conc.InUse(); n != 0 {
		t.Fatalf("%d places in use after a panic, want 0", n)
	}
	if _, err := serve(h, keyed("a")); err != nil {
		t.Fatalf("the key after the panic: %v", err)
	}
}

// A request denied by another zone's rate takes no place, and one denied a
// place charges no rate: each is checked from inside a request in flight.
func TestADeniedRequestTakesNoPlaceAndNoToken(t *testing.T) {
	rate := func() *Zone {
		return &Zone{Key: "{http.request.header.X-Key}", Limit: zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(time.Hour), Burst: 2, Memory: 1 << 16}}
	}
	h := newTestHandler(t, nil, map[string]*Zone{"a_rate": rate(), "b_conc": concZone(1)})
	conc := h.zones[1].conc
	var inner error
	nested := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		// The outer request holds b_conc's one place: this one is
		// denied a place, and must give a_rate its token back.
		_, inner = serve(h, keyed("a"))
		return nil
	})
	if _, err := serveNextAt(h, keyed("a"), nested, time.Now()); err != nil {
		t.Fatal(err)
	}
	if status(inner) != http.StatusTooManyRequests {
		t.Fatalf("the nested request: %v, want 429", inner)
	}
	// a_rate granted 1 of its 2: the denied request took nothing.
	if _, err := serve(h, keyed("a")); err != nil {
		t.Fatalf("the second token: %v (the request denied a place was charged)", err)
	}
	if n := conc.InUse(); n != 0 {
		t.Fatalf("%d places in use at rest, want 0", n)
	}
	// Now a_rate denies: the request must take no place in b_conc.
	nested = caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		t.Fatal("a request over a_rate was served")
		return nil
	})
	if _, err := serveNextAt(h, keyed("a"), nested, time.Now()); status(err) != http.StatusTooManyRequests {
		t.Fatalf("over a_rate: %v, want 429", err)
	}
	if n := conc.InUse(); n != 0 {
		t.Fatalf("a request a_rate denied holds %d places, want 0", n)
	}
}

// A dry run (action log) admits and counts places as enforcing would, lets
// the request it would refuse pass, and counts it as logged.
func TestADryRunCountsTheRequestsItWouldRefuse(t *testing.T) {
	zc := concZone(1)
	zc.Action = "log"
	h := newTestHandler(t, nil, map[string]*Zone{"conc_log": zc})
	z := h.zones[0]
	var inner error
	var innerCalled bool
	nested := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		_, inner = serveNextAt(h, keyed("a"), caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
			innerCalled = true
			return nil
		}), time.Now())
		return nil
	})
	if _, err := serveNextAt(h, keyed("a"), nested, time.Now()); err != nil {
		t.Fatal(err)
	}
	if inner != nil || !innerCalled {
		t.Fatalf("the request a dry run would refuse: %v (served %v), want it served", inner, innerCalled)
	}
	if got := z.counts.requests[outcomeLogged].Load(); got != 1 {
		t.Fatalf("%d requests counted as logged, want 1", got)
	}
	if n := z.conc.InUse(); n != 0 {
		t.Fatalf("%d places in use at rest", n)
	}
}
