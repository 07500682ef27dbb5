package floodgate

import (
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/weight"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// A dry run (action log) changes nothing clients see (Zone.Action's doc):
// a weight the zone could not grant (above its burst, not a number, absent)
// is logged as one that would be refused, and the request passes.
func TestADryRunZoneRefusesNoWeight(t *testing.T) {
	cost, _ := weight.Parse("{http.request.header.X-Cost}")
	h := newTestHandler(t, nil, map[string]*Zone{
		"dry": {Limit: zoneconf.Limit{MaxEvents: 2, Window: caddy.Duration(time.Hour), Burst: 2}, Action: "log",
			Weights: []*weight.Rule{{Weight: cost}}},
	})
	for _, hdr := range []string{"X-Cost: 5", "X-Cost: abc", ""} {
		var hs []string
		if hdr != "" {
			hs = append(hs, hdr)
		}
		if _, err := serve(h, weightedRequest("/", hs...)); err != nil {
			t.Errorf("%q through a dry-run zone: %v, want it to pass", hdr, err)
		}
	}
}
