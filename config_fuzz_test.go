package floodgate

import (
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/floodgate-rl/floodgate/layer4"
)

// Configs a fuzzer may build must never reach the network or the disk beyond
// the default storage: the seeds name no module that does (redis, a log
// file), so mutations rarely can.

// FuzzCaddyfile adapts arbitrary Caddyfiles built around every floodgate
// directive and global option. Adapting and loading never panic, and a config
// that loads adapts to JSON whose floodgate modules survive a round trip
// through their Go types: the JSON they marshal to loads again, into the
// same zones.
func FuzzCaddyfile(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/adapt/*.caddyfile")
	for _, s := range append(seeds, "testdata/Caddyfile") {
		b, err := os.ReadFile(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(string(b))
	}
	for _, s := range fuzzCaddyfiles {
		f.Add(s)
	}
	adapter := caddyconfig.GetAdapter("caddyfile")
	f.Fuzz(func(t *testing.T, text string) {
		if len(text) > 4<<10 {
			return
		}
		// Loading starts no admin endpoint and no server; a Redis storage
		// would dial out, so none is used.
		text = strings.ReplaceAll(text, "redis", "file_system")
		out, _, err := adapter.Adapt([]byte(text), map[string]any{"filename": "Caddyfile"})
		if err != nil {
			if os.Getenv("FUZZ_DEBUG") != "" {
				t.Logf("does not adapt: %v", err)
			}
			return
		}
		checkLoadsAndRoundTrips(t, out)
	})
}

// FuzzJSONConfig loads arbitrary JSON as the rate_limit app, a rate_limit
// handler and a layer4 rate_limit matcher of one config: never a panic, and
// what loads round-trips as FuzzCaddyfile requires.
func FuzzJSONConfig(f *testing.F) {
	for _, s := range fuzzJSONSeeds {
		f.Add(s[0], s[1], s[2])
	}
	f.Fuzz(func(t *testing.T, app, handler, matcher string) {
		if len(app)+len(handler)+len(matcher) > 4<<10 {
			return
		}
		for _, s := range []string{app, handler, matcher} {
			if !json.Valid([]byte(s)) {
				return
			}
		}
		cfg := `{"apps":{"rate_limit":` + app + `,` +
			`"http":{"servers":{"s":{"listen":["127.0.0.1:0"],"routes":[{"handle":[` + handler + `]}]}}},` +
			`"layer4":{"servers":{"l":{"listen":["127.0.0.1:0"],"routes":[{"match":[{"rate_limit":` + matcher + `}],"handle":[{"handler":"close"}]}]}}}}}`
		checkLoadsAndRoundTrips(t, []byte(cfg))
	})
}

// checkLoadsAndRoundTrips loads cfg (provisions and validates it, starting
// nothing); if it loads, every floodgate module in it is decoded into its Go
// type and encoded again, and that config must load too, with the same zone
// definitions.
func checkLoadsAndRoundTrips(t *testing.T, cfg []byte) {
	t.Helper()
	if err := loadErr(cfg); err != nil {
		if os.Getenv("FUZZ_DEBUG") != "" {
			t.Logf("does not load: %v", err)
		}
		return
	}
	var doc any
	if err := json.Unmarshal(cfg, &doc); err != nil {
		t.Fatalf("a config that loads is not JSON: %v", err)
	}
	zones := map[string]string{}
	again, err := json.Marshal(roundTrip(t, doc, "", zones))
	if err != nil {
		t.Fatal(err)
	}
	if err := loadErr(again); err != nil {
		t.Fatalf("config loads, but not after its floodgate modules round-trip: %v\nbefore: %s\nafter:  %s", err, cfg, again)
	}
	var doc2 any
	if err := json.Unmarshal(again, &doc2); err != nil {
		t.Fatal(err)
	}
	zones2 := map[string]string{}
	roundTrip(t, doc2, "", zones2)
	if !maps.Equal(zones, zones2) {
		t.Fatalf("zones change in a round trip:\n%v\n%v", zones, zones2)
	}
}

// loadErr provisions and validates cfg without starting it, as `caddy
// validate` does.
func loadErr(cfg []byte) error {
	var c caddy.Config
	if err := json.Unmarshal(cfg, &c); err != nil {
		return err
	}
	// Loading logs a few lines at INFO; a fuzzer loads thousands.
	c.Logging = &caddy.Logging{Logs: map[string]*caddy.CustomLog{"default": {BaseLog: caddy.BaseLog{Level: "ERROR"}}}}
	return caddy.Validate(&c)
}

// roundTrip replaces every floodgate module in a decoded JSON document by
// the JSON its Go type encodes it to, recording each zone's definition by
// name (and where it is defined) in zones. parent is the key v is under.
func roundTrip(t *testing.T, v any, parent string, zones map[string]string) any {
	switch v := v.(type) {
	case []any:
		for i := range v {
			v[i] = roundTrip(t, v[i], parent, zones)
		}
		return v
	case map[string]any:
		for _, k := range slices.Sorted(maps.Keys(v)) {
			switch {
			case k == "rate_limit" && parent == "apps":
				v[k] = reencode(t, v[k], new(App), func(a *App) {
					for name, z := range a.Zones {
						zones["app "+name] = z.definition()
					}
				})
			case k == "rate_limit" && parent == "match" && isObject(v[k]):
				// A layer4 matcher set (HTTP has no rate_limit matcher).
				v[k] = reencode(t, v[k], new(layer4.Matcher), func(*layer4.Matcher) {})
			default:
				v[k] = roundTrip(t, v[k], k, zones)
			}
		}
		if v["handler"] == "rate_limit" {
			return reencode(t, v, new(Handler), func(h *Handler) {
				for name, z := range h.RateLimits {
					zones["handler "+name] = z.definition()
				}
			})
		}
		return v
	}
	return v
}

func isObject(v any) bool { _, ok := v.(map[string]any); return ok }

// reencode decodes v into m, lets note see it, and returns m encoded again
// (with the handler's module name, for a handler) as a decoded document.
func reencode[M any](t *testing.T, v any, m *M, note func(*M)) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, m); err != nil {
		t.Fatalf("JSON that loads does not decode into %T: %v\n%s", m, err, b)
	}
	note(m)
	var out any
	if err := json.Unmarshal(caddyconfig.JSON(m, nil), &out); err != nil {
		t.Fatal(err)
	}
	if o, ok := out.(map[string]any); ok && reflect.TypeOf(m) == reflect.TypeOf(new(Handler)) {
		o["handler"] = "rate_limit"
	}
	return out
}

// fuzzCaddyfiles use every directive and global option floodgate adds, each
// setting at least once, on loopback with automatic HTTPS off.
var fuzzCaddyfiles = []string{
	`{
	auto_https off
	rate_limit {
		zone shared {
			key {client_ip}
			events 100
			window 1m
			burst 20
			ipv4_prefix 24
			ipv6_prefix 48
			quota 1000 1h
			action log
			memory 1MiB
		}
		distributed {
			read_interval 1s
			write_interval 1s
			purge_age 1m
		}
	}
	layer4 {
		127.0.0.1:0 {
			@flood rate_limit {
				events 10
				window 1s
				burst 20
				ipv4_prefix 24
				ipv6_prefix 48
				sources 1000
				false_deny 0.01
			}
			route @flood {
				close
			}
		}
		127.0.0.1:0 {
			@z rate_limit zone shared
			route @z {
				close
			}
		}
	}
}

http://127.0.0.1:0 {
	rate_limit /api/* shared {
		zone z {
			key {header.X-Key} {client_ip}
			events 5
			window 10s
			burst 5
			weight {header.X-Cost}
			weight 2 {
				method POST
			}
			weight response_header X-Cost
			quota 50 1h
			quota 500 24h
			action delay 2s
			match {
				path /api/*
			}
			sources 1000
			false_deny 0.01
		}
		weight 1
		jitter 0.1
		log_key
		sweep_interval 1m
		disable_metrics
		headers off
		distributed {
			read_interval 1s
		}
		storage file_system /tmp/floodgate-fuzz
	}
	respond "ok"
}`,
	`http://127.0.0.1:0 {
	rate_limit {
		zone bytes {
			events 1000000
			window 1s
			burst 1048576
			weight response_bytes
			memory 64KiB
		}
		headers on
	}
	respond "x"
}`,
}

// fuzzJSONSeeds are (app, handler, layer4 matcher) triples.
var fuzzJSONSeeds = [][3]string{
	{`{}`, `{"handler":"rate_limit","rate_limits":{"z":{"max_events":5,"window":"1m","burst":5}}}`, `{"max_events":10,"window":"1s"}`},
	{`{"zones":{"g":{"key":"{http.request.remote.host}","max_events":100,"window":"1m","burst":20,"ipv4_prefix":24,"ipv6_prefix":48,"quotas":[{"max_events":1000,"window":"1h"}],"action":"log","memory":1048576}},"distributed":{"read_interval":"1s","write_interval":"1s"}}`,
		`{"handler":"rate_limit","zones":["g"],"rate_limits":{"w":{"key":"{http.request.header.X-Key}","fallback_keys":["{http.request.remote.host}"],"max_events":5,"window":"10s","weights":[{"weight":"{http.request.header.X-Cost}"},{"weight":2,"match":[{"method":["POST"]}]}],"weight_response_header":"X-Cost","action":"delay","max_delay":"2s","sources":1000,"false_deny":0.01}},"weight":1,"jitter":0.1,"log_key":true,"disable_headers":true}`,
		`{"zone":"g"}`},
	{`{}`, `{"handler":"rate_limit","rate_limits":{"b":{"max_events":1000000,"window":"1s","burst":1048576,"weight_response_bytes":true,"memory":65536}}}`, `{"name":"n","max_events":1,"window":"24h","burst":3,"memory":65536}`},
}
