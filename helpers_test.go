package floodgate

import (
	"maps"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/floodgate-rl/floodgate/internal/testclock"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// testClocks holds the clock of each handler made by newTestHandler with one;
// serve passes its time to the handler.
var testClocks sync.Map // *Handler → *testclock.Clock

// newTestHandler provisions a handler with the given inline zones (without
// matchers, which need a Caddy context) whose requests, run by serve, happen
// at clock's time (or the real time if clock is nil). Its zones' tables are
// released when the test ends.
func newTestHandler(t testing.TB, clock *testclock.Clock, zones map[string]*Zone) *Handler {
	t.Helper()
	h := &Handler{RateLimits: zones, logger: zap.NewNop(), sleep: sleep, now: time.Now}
	h.meter = &timeMeter{clock: time.Now}
	if clock != nil {
		h.now = clock.Now
		h.meter.clock = clock.Now
		testClocks.Store(h, clock)
		t.Cleanup(func() { testClocks.Delete(h) })
	}
	for _, name := range slices.Sorted(maps.Keys(zones)) {
		z, err := provisionZone(caddy.Context{}, name, zones[name])
		if err != nil {
			t.Fatal(err)
		}
		h.owned = append(h.owned, z)
		h.zones = append(h.zones, z)
	}
	h.setZones(h.zones)
	t.Cleanup(func() { _ = h.Cleanup() })
	return h
}

var okHandler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
})

// serve runs one request through h, at the time of its test clock if it
// has one, and returns the recorder and the error.
func serve(h *Handler, r *http.Request) (*httptest.ResponseRecorder, error) {
	now := time.Now()
	if c, ok := testClocks.Load(h); ok {
		now = c.(*testclock.Clock).Now()
	}
	return serveAt(h, r, now)
}

// serveAt runs one request through h at time now, with a fresh replacer.
func serveAt(h *Handler, r *http.Request, now time.Time) (*httptest.ResponseRecorder, error) {
	return serveNextAt(h, r, okHandler, now)
}

// serveNextAt runs one request through h and on to next at time now, with a
// fresh replacer, and returns the recorder and the error.
func serveNextAt(h *Handler, r *http.Request, next caddyhttp.Handler, now time.Time) (*httptest.ResponseRecorder, error) {
	w := httptest.NewRecorder()
	caddyhttp.NewTestReplacer(r)
	return w, h.serveAt(w, r, next, now)
}

func status(err error) int {
	if err == nil {
		return http.StatusOK
	}
	if he, ok := err.(caddyhttp.HandlerError); ok {
		return he.StatusCode
	}
	return -1
}

// withRemote sets r's peer address.
func withRemote(r *http.Request, addr string) *http.Request {
	r.RemoteAddr = addr
	return r
}

func mustAddr(t *testing.T, s string) netip.Addr {
	t.Helper()
	a, err := netip.ParseAddr(s)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func requestFrom(remote string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = remote
	return r
}

// deniedHandler returns a handler whose zone denies every request after a
// client's first, logging to an observer at level.
func deniedHandler(t *testing.T, name, key string, level zapcore.Level) (*Handler, *observer.ObservedLogs) {
	return limitedHandler(t, name, key, 1, level)
}

// limitedHandler returns a handler with one zone allowing events per hour,
// grouping IPv4 clients by /24, logging to an observer at level.
func limitedHandler(t *testing.T, name, key string, events int64, level zapcore.Level) (*Handler, *observer.ObservedLogs) {
	core, logs := observer.New(level)
	v4 := 24
	h := newTestHandler(t, nil, map[string]*Zone{
		name: {Key: key, Limit: zoneconf.Limit{MaxEvents: events, Window: caddy.Duration(time.Hour), IPv4Prefix: &v4}},
	})
	h.logger = zap.New(core)
	return h, logs
}

// recordingEmitter stands for Caddy's events app.
type recordingEmitter struct {
	listening bool
	events    []map[string]any
}

func (e *recordingEmitter) ShouldEmit(string) bool { return e.listening }

func (e *recordingEmitter) Emit(_ caddy.Context, name string, data map[string]any) caddy.Event {
	e.events = append(e.events, data)
	return caddy.Event{}
}
