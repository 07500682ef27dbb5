package floodgate

import (
	"net/http"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// probeFromCleanup counts the provisions of cleanupProbe, an HTTP handler,
// made from the rate_limit app's Cleanup.
var probeFromCleanup atomic.Int32

type cleanupProbe struct{}

func (cleanupProbe) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.cleanup_probe", New: func() caddy.Module { return new(cleanupProbe) }}
}
func (cleanupProbe) Provision(caddy.Context) error {
	if strings.Contains(string(debug.Stack()), "floodgate.(*App).Cleanup") {
		probeFromCleanup.Add(1)
	}
	return nil
}
func (cleanupProbe) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	return next.ServeHTTP(w, r)
}

func init() { caddy.RegisterModule(cleanupProbe{}) }

// A rate_limit app that fails to provision must not provision the http app
// from its Cleanup (App.warn -> placeholdersSet -> AppIfConfigured would):
// Caddy cleans up a failed config too, not only a validated one.
func TestAFailedProvisionLoadsNoOtherAppFromCleanup(t *testing.T) {
	cfg := `{"apps":{
	  "rate_limit":{"zones":{"bad":{"max_events":0,"window":"1m"}}},
	  "http":{"servers":{"s":{"listen":[":0"],"routes":[{"handle":[{"handler":"cleanup_probe"}]}]}}}}}`
	for range 20 {
		_ = caddy.Validate(mustCfg(t, cfg))
	}
	if n := probeFromCleanup.Load(); n > 0 {
		t.Fatalf("the http app was provisioned %d times from rate_limit's Cleanup", n)
	}
}

func mustCfg(t *testing.T, s string) *caddy.Config {
	var c caddy.Config
	if err := caddy.StrictUnmarshalJSON([]byte(s), &c); err != nil {
		t.Fatal(err)
	}
	return &c
}
