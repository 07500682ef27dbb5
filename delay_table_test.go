package floodgate

import (
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// A delay zone's table is made at the zone's limit, Debt included: made
// without it, the config's first Start would convert the whole fresh table
// (SetLimit freezes every word), faulting in every page of it and, for an
// xdp zone, swapping its program for nothing.
func TestDelayZoneTableIsMadeAtItsLimit(t *testing.T) {
	zc := &Zone{Limit: zoneconf.Limit{MaxEvents: 1, Window: caddy.Duration(time.Second), Burst: 1, Memory: 1 << 26},
		Action: "delay", MaxDelay: caddy.Duration(10 * time.Second)}
	z, err := provisionZone(caddy.Context{}, "delay_table", zc)
	if err != nil {
		t.Fatal(err)
	}
	defer z.release()
	if got := z.table.buckets.Limit(); got != z.limit {
		t.Fatalf("table made with %+v, zone's limit %+v: Start will SetLimit the whole %d-byte table", got, z.limit, zc.Memory)
	}
}
