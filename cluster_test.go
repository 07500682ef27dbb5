package floodgate

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/filestorage"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
)

func TestDistributedValidate(t *testing.T) {
	d := func(r, w, p time.Duration) *Distributed {
		return &Distributed{ReadInterval: caddy.Duration(r), WriteInterval: caddy.Duration(w), PurgeAge: caddy.Duration(p)}
	}
	for _, tc := range []struct {
		d    *Distributed
		want string
	}{
		{d(time.Millisecond, 0, 0), "distributed: read_interval 1ms: must be at least 10ms"},
		{d(0, -time.Second, 0), "distributed: write_interval -1s: must be at least 10ms"},
		{d(0, 0, -time.Second), "distributed: purge_age -1s: must not be negative"},
		{d(0, 0, 9*time.Second), "distributed: purge_age 9s: must be at least twice write_interval (5s)"},
		{d(0, time.Second, time.Second), "purge_age 1s: must be at least twice write_interval (1s)"},
	} {
		if err := tc.d.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.d, err, tc.want)
		}
	}
	for _, ok := range []*Distributed{d(0, 0, 0), d(10*time.Millisecond, 10*time.Millisecond, 20*time.Millisecond)} {
		if err := ok.Validate(); err != nil {
			t.Errorf("%+v: %v", ok, err)
		}
	}
}

func TestDistributedDefaults(t *testing.T) {
	iv := new(Distributed).intervals(time.Minute)
	if iv != (storage.Intervals{Read: 5 * time.Second, Write: 5 * time.Second, PurgeAge: 2 * time.Minute}) {
		t.Fatalf("defaults for a 1m window: %+v", iv)
	}
	if iv := new(Distributed).intervals(time.Second); iv.PurgeAge != time.Minute {
		t.Fatalf("purge_age for a 1s window: %v, want 1m", iv.PurgeAge)
	}
	d := &Distributed{WriteInterval: caddy.Duration(time.Hour)}
	if iv := d.intervals(time.Second); iv.PurgeAge != 2*time.Hour || iv.Read != 5*time.Second {
		t.Fatalf("with write_interval 1h: %+v", iv)
	}
}

// The rate_limit global option distributes its zones with its own
// distributed and storage.
func TestGlobalOptionDistributed(t *testing.T) {
	d := caddyfile.NewTestDispenser(`rate_limit {
		zone g {
			events 5
			window 1m
		}
		distributed {
			read_interval 1s
			write_interval 2s
		}
		storage file_system /tmp/x
	}`)
	v, err := parseGlobal(d, nil)
	if err != nil {
		t.Fatal(err)
	}
	var app App
	if err := json.Unmarshal(v.(httpcaddyfile.App).Value, &app); err != nil {
		t.Fatal(err)
	}
	if app.Distributed == nil || app.Distributed.ReadInterval != caddy.Duration(time.Second) || app.Distributed.WriteInterval != caddy.Duration(2*time.Second) {
		t.Fatalf("distributed: %+v", app.Distributed)
	}
	if !strings.Contains(string(app.StorageRaw), `"module":"file_system"`) {
		t.Fatalf("storage: %s", app.StorageRaw)
	}
	if _, err := parseGlobal(caddyfile.NewTestDispenser(`rate_limit {
		distributed {
			read_interval 1ms
		}
	}`), nil); err == nil || !strings.Contains(err.Error(), "read_interval 1ms: must be at least 10ms") {
		t.Fatalf("bad interval in the global option: %v", err)
	}
}

// bursts takes split or free; anything else fails naming the field.
func TestDistributedBursts(t *testing.T) {
	for _, c := range []struct {
		in, want, err string
	}{
		{"bursts free", BurstsFree, ""},
		{"bursts split", BurstsSplit, ""},
		{"", "", ""},
		{"bursts sometimes", "", `distributed: bursts "sometimes": must be split or free`},
		{"bursts", "", "wrong argument count"},
	} {
		v, err := parseGlobal(caddyfile.NewTestDispenser("rate_limit {\n\tdistributed {\n\t\t"+c.in+"\n\t}\n}"), nil)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q: error %v, want %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%q: %v", c.in, err)
		}
		var app App
		if err := json.Unmarshal(v.(httpcaddyfile.App).Value, &app); err != nil {
			t.Fatal(err)
		}
		if app.Distributed.Bursts != c.want {
			t.Errorf("%q: bursts %q, want %q", c.in, app.Distributed.Bursts, c.want)
		}
	}
}

// A distributed zone's decision is its bucket's, made stricter by the
// cluster's.
func TestStricter(t *testing.T) {
	bucket := limiter.Decision{Allowed: true, Limit: 10, Remaining: 7, Reset: time.Second}
	cl := limiter.Decision{Limit: 20, RetryAfter: 3 * time.Second, Reset: 4 * time.Second}
	got := stricter(bucket, cl)
	want := limiter.Decision{Allowed: false, Limit: 10, Remaining: 0, RetryAfter: 3 * time.Second, Reset: 4 * time.Second}
	if got != want {
		t.Fatalf("stricter = %+v, want %+v", got, want)
	}
	cl = limiter.Decision{Allowed: true, Limit: 20, Remaining: 12}
	if got := stricter(bucket, cl); got != bucket {
		t.Fatalf("a laxer cluster changed the decision: %+v", got)
	}
}
