package floodgate

import (
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// TestReleasedTableStopsSweeping: a table's background sweeps end when the
// last config holding it lets it go.
func TestReleasedTableStopsSweeping(t *testing.T) {
	key := tableKey{zone: "sweeps", lines: 1, k: limiter.DefaultK}
	tbl, err := acquireTable(key, func() (limiter.Table, *xdpTable, error) {
		b, err := limiter.NewBuckets(limiter.BucketsConfig{Limit: limiter.Limit{Events: 1, Window: time.Second}, Bytes: 64})
		return b, nil, err
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-tbl.stop:
		t.Fatal("sweeps stopped while the table is held")
	default:
	}
	releaseTable(key)
	select {
	case <-tbl.stop:
	default:
		t.Fatal("sweeps still running after the table was released")
	}
}

func TestLimitsChangeOnlyWhenAConfigGoesLive(t *testing.T) {
	h := newTestHandler(t, nil, map[string]*Zone{"goes_live": {Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Memory: 4096}}})
	running := h.zones[0]
	events := func() int64 { return running.buckets.Limit().Events }
	oldApp := &App{logger: zap.NewNop(), live: []*zone{running}}
	if err := oldApp.Start(); err != nil {
		t.Fatal(err)
	}

	z, err := provisionZone(caddy.Context{}, "goes_live", &Zone{Limit: zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Hour), Memory: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	defer z.release()
	if z.buckets != running.buckets {
		t.Fatal("same zone and shape got a different table")
	}
	if events() != 3 {
		t.Fatalf("after provisioning events 10: %d in force, want 3 until the config starts", events())
	}

	// A config that starts, then is stopped because another of its apps
	// failed to start, gives the limit back.
	failed := &App{logger: zap.NewNop(), live: []*zone{z}}
	if err := failed.Start(); err != nil {
		t.Fatal(err)
	}
	if events() != 10 {
		t.Fatalf("after Start: events %d, want 10", events())
	}
	if err := failed.Stop(); err != nil {
		t.Fatal(err)
	}
	if events() != 3 {
		t.Fatalf("after the failed config stopped: events %d, want 3 again", events())
	}

	// A config that goes live keeps its limit when the config it replaced
	// is stopped.
	live := &App{logger: zap.NewNop(), live: []*zone{z}}
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	if err := oldApp.Stop(); err != nil {
		t.Fatal(err)
	}
	if events() != 10 {
		t.Errorf("after the replaced config stopped: events %d, want 10", events())
	}

	other, err := provisionZone(caddy.Context{}, "goes_live", &Zone{Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Memory: 8192}})
	if err != nil {
		t.Fatal(err)
	}
	defer other.release()
	if other.buckets == running.buckets {
		t.Error("a zone whose memory changed kept the old table")
	}
}
