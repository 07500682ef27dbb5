package caddytest

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

var update = flag.Bool("update", false, "rewrite the .golden files of TestCaddyfileAdaptsToGoldenJSON")

// TestCaddyfileAdaptsToGoldenJSON adapts every testdata Caddyfile to JSON and
// compares it with its .golden file; run with -update to accept changes.
func TestCaddyfileAdaptsToGoldenJSON(t *testing.T) {
	files, err := filepath.Glob("../testdata/adapt/*.caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no Caddyfiles found: %v", err)
	}
	files = append(files, "../testdata/Caddyfile")
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			in, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			out, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt(in, map[string]any{"filename": file})
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range warnings {
				// caddy-ratelimit's README example is kept verbatim,
				// unformatted.
				if !strings.Contains(file, "caddy_ratelimit_readme") || !strings.Contains(w.Message, "not formatted") {
					t.Errorf("warning: %s", w)
				}
			}
			var pretty bytes.Buffer
			if err := json.Indent(&pretty, out, "", "\t"); err != nil {
				t.Fatal(err)
			}
			pretty.WriteByte('\n')
			golden := strings.TrimSuffix(file, ".caddyfile") + ".golden"
			if *update {
				if err := os.WriteFile(golden, pretty.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test ./caddytest -run Golden -update)", err)
			}
			if !bytes.Equal(pretty.Bytes(), want) {
				t.Errorf("%s adapts to\n%s\nwant (%s)\n%s", file, pretty.Bytes(), golden, want)
			}
		})
	}
}

// TestCaddyRatelimitExamplesLoadUnchanged checks that the Caddyfile and JSON
// examples of mholt/caddy-ratelimit v0.1.0's README load as they are.
func TestCaddyRatelimitExamplesLoadUnchanged(t *testing.T) {
	cf, err := os.ReadFile("../testdata/adapt/caddy_ratelimit_readme.caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	if err := validate(t, string(cf), "caddyfile"); err != nil {
		t.Errorf("Caddyfile example: %v", err)
	}
	if err := validate(t, caddyRatelimitJSONExample, "json"); err != nil {
		t.Errorf("JSON example: %v", err)
	}
}

// caddyRatelimitJSONExample is the "JSON example" of caddy-ratelimit v0.1.0's
// README, verbatim.
const caddyRatelimitJSONExample = `{
	"apps": {
		"http": {
			"servers": {
				"demo": {
					"listen": [":80"],
					"routes": [
						{
							"handle": [
								{
									"handler": "rate_limit",
									"rate_limits": {
										"static_example": {
											"match": [
												{"method": ["GET"]}
											],
											"key": "static",
											"window": "1m",
											"max_events": 100
										},
										"dynamic_example": {
											"key": "{http.request.remote.host}",
											"window": "5s",
											"max_events": 2
										}
									},
									"distributed": {},
									"log_key": true
								},
								{
									"handler": "static_response",
									"body": "I'm behind the rate limiter!"
								}
							]
						}
					]
				}
			}
		}
	}
}`
