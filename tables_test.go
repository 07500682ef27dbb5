package floodgate

import (
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
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
