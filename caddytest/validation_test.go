package caddytest

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// validate adapts (for a Caddyfile) and provisions a config (its ports named
// as withPorts reads them) without starting it, as `caddy validate` does, and
// returns the first error.
func validate(t *testing.T, cfg, adapter string) error {
	t.Helper()
	raw := []byte(withPorts(cfg))
	if adapter == "caddyfile" {
		out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(raw, map[string]any{"filename": "Caddyfile"})
		if err != nil {
			return err
		}
		raw = out
	}
	var c caddy.Config
	if err := json.Unmarshal(raw, &c); err != nil {
		return err
	}
	return caddy.Validate(&c)
}

// handlerCaddyfile is a config whose only site has the rate_limit block body.
func handlerCaddyfile(body string) string {
	return "http://localhost:HTTP_PORT {\n\trate_limit {\n" + body + "\n\t}\n\trespond ok\n}\n"
}

// zoneCaddyfile is a config with one zone named z whose block holds the
// given lines plus events and window unless the lines set them.
func zoneCaddyfile(lines string) string {
	if !strings.Contains(lines, "events") {
		lines += "\nevents 5"
	}
	if !strings.Contains(lines, "window") {
		lines += "\nwindow 1m"
	}
	return handlerCaddyfile("zone z {\n" + lines + "\n}")
}

// handlerJSON is a config whose only route runs the given rate_limit handler
// JSON, with the rate_limit app's JSON if app is not empty.
func handlerJSON(handler, app string) string {
	apps := `"http": {"servers": {"srv0": {"listen": ["localhost:HTTP_PORT"], "routes": [{"handle": [` + handler + `]}]}}}`
	if app != "" {
		apps = `"rate_limit": ` + app + `, ` + apps
	}
	return `{"admin": {"disabled": true}, "apps": {` + apps + `}}`
}

func TestEveryBadValueFailsAtLoadNamingIt(t *testing.T) {
	for _, tt := range []struct {
		name, adapter, cfg string
		want               []string // every substring must be in the error
	}{
		{"events zero", "caddyfile", zoneCaddyfile("events 0"), []string{`events "0"`, "at least 1"}},
		{"max_concurrent zero", "caddyfile", zoneCaddyfile("max_concurrent 0"), []string{`max_concurrent "0"`, "from 1 to 1048576"}},
		{"max_concurrent too large", "caddyfile", handlerCaddyfile("zone z {\nmax_concurrent 2000000\n}"), []string{`max_concurrent "2000000"`}},
		{"max_concurrent not a number", "caddyfile", handlerCaddyfile("zone z {\nmax_concurrent many\n}"), []string{`max_concurrent "many"`}},
		{"max_concurrent misspelt", "caddyfile", handlerCaddyfile("zone z {\nmax_concurent 3\n}"), []string{"max_concurent", "max_concurrent"}},
		{"max_concurrent with window alone", "caddyfile", handlerCaddyfile("zone z {\nmax_concurrent 3\nwindow 1m\n}"), []string{"events is required"}},
		{"max_concurrent with burst alone", "caddyfile", handlerCaddyfile("zone z {\nmax_concurrent 3\nburst 5\n}"), []string{"burst 5", "needs max_events and window"}},
		{"max_concurrent negative in JSON", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_concurrent": -1}}}`, ""), []string{"max_concurrent -1", "between 1 and 1048576"}},
		{"max_concurrent with events alone in JSON", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_concurrent": 2, "max_events": 5}}}`, ""), []string{"max_events 5 needs a window"}},
		{"events negative", "caddyfile", zoneCaddyfile("events -3"), []string{`events "-3"`}},
		{"events not a number", "caddyfile", zoneCaddyfile("events lots"), []string{`events "lots"`}},
		{"events missing", "caddyfile", handlerCaddyfile("zone z {\nwindow 1m\n}"), []string{"events is required"}},
		{"window missing", "caddyfile", handlerCaddyfile("zone z {\nevents 1\n}"), []string{"window is required"}},
		{"window zero", "caddyfile", zoneCaddyfile("window 0"), []string{`window "0"`, "must be positive"}},
		{"window negative", "caddyfile", zoneCaddyfile("window -5s"), []string{`window "-5s"`, "must be positive"}},
		{"window not a duration", "caddyfile", zoneCaddyfile("window soon"), []string{`window "soon"`}},
		{"burst zero", "caddyfile", zoneCaddyfile("burst 0"), []string{`burst "0"`}},
		{"ipv4_prefix too long", "caddyfile", zoneCaddyfile("ipv4_prefix 33"), []string{"ipv4_prefix 33", "between 0 and 32"}},
		{"ipv4_prefix negative", "caddyfile", zoneCaddyfile("ipv4_prefix -1"), []string{"ipv4_prefix -1"}},
		{"ipv6_prefix too long", "caddyfile", zoneCaddyfile("ipv6_prefix 129"), []string{"ipv6_prefix 129", "between 0 and 128"}},
		{"ipv6_prefix not a number", "caddyfile", zoneCaddyfile("ipv6_prefix wide"), []string{`ipv6_prefix "wide"`}},
		{"memory too small", "caddyfile", zoneCaddyfile("memory 12"), []string{`memory "12"`, "between 64 B and 16 GiB"}},
		{"memory too large", "caddyfile", zoneCaddyfile("memory 1TiB"), []string{`memory "1TiB"`, "between 64 B and 16 GiB"}},
		{"memory 100GiB as written", "caddyfile", zoneCaddyfile("memory 100GiB"), []string{`zone "z": memory "100GiB": must be between 64 B and 16 GiB`}},
		{"memory not a size", "caddyfile", zoneCaddyfile("memory plenty"), []string{`memory "plenty"`}},
		{"memory and sources", "caddyfile", zoneCaddyfile("memory 1MiB\nsources 10"), []string{"memory 1048576", "not both"}},
		{"sources zero", "caddyfile", zoneCaddyfile("sources 0"), []string{`sources "0"`}},
		{"false_deny one", "caddyfile", zoneCaddyfile("false_deny 1"), []string{`false_deny "1"`}},
		{"false_deny zero", "caddyfile", zoneCaddyfile("false_deny 0"), []string{`false_deny "0"`}},
		{"unknown zone subdirective", "caddyfile", zoneCaddyfile("max_burst 3"), []string{`unrecognized subdirective "max_burst" (it takes key, match, weight, quota, action, events, window, burst`}},
		{"a typo of events", "caddyfile", handlerCaddyfile("zone z {\nevnets 5\nwindow 1m\n}"), []string{`zone "z": unrecognized subdirective "evnets"; did you mean events?`}},
		{"a typo of window", "caddyfile", zoneCaddyfile("windw 1m"), []string{`unrecognized subdirective "windw"; did you mean window?`}},
		{"a typo in the handler", "caddyfile", handlerCaddyfile("zone z {\nevents 1\nwindow 1m\n}\njiter 0.1"), []string{`unrecognized rate_limit subdirective "jiter"; did you mean jitter?`}},
		{"a zone setting outside a zone", "caddyfile", handlerCaddyfile("events 5\nwindow 1m"), []string{`"events" is a zone's setting: it goes inside a zone block`}},
		{"words after events", "caddyfile", handlerCaddyfile("zone z {\nevents 10 (means 5 attempts)\nwindow 1m\n}"), []string{`zone "z": events needs exactly one value, not "10 (means 5 attempts)": comments start with #, e.g. events 10 # (means 5 attempts)`}},
		{"a window in words", "caddyfile", zoneCaddyfile("window 1 minute"), []string{`zone "z": window needs exactly one value, not "1 minute": a duration is one word; write window 1m`}},
		{"a window of 10 seconds in words", "caddyfile", zoneCaddyfile("window 10 seconds"), []string{`write window 10s`}},
		{"a typo of the global option", "caddyfile", "{\n\trate_limit {\n\t\tzoen x {\n\t\t}\n\t}\n}\n" + handlerCaddyfile(""), []string{`unrecognized rate_limit global option "zoen"; did you mean zone?`}},
		{"unknown handler subdirective", "caddyfile", handlerCaddyfile("zone z {\nevents 1\nwindow 1m\n}\nsweep 1m"), []string{`unrecognized rate_limit subdirective "sweep"`}},
		{"unknown distributed subdirective", "caddyfile", handlerCaddyfile("distributed {\nread_every 1s\n}"), []string{`unrecognized subdirective "read_every"`}},
		{"unknown global option", "caddyfile", "{\n\trate_limit {\n\t\tzones x\n\t}\n}\n" + handlerCaddyfile(""), []string{`unrecognized rate_limit global option "zones"`}},
		{"negative jitter", "caddyfile", handlerCaddyfile("jitter -0.5"), []string{`jitter "-0.5"`}},
		{"jitter not a number", "caddyfile", handlerCaddyfile("jitter some"), []string{`jitter "some"`}},
		{"jitter as a percentage", "caddyfile", handlerCaddyfile("jitter 20"), []string{`jitter "20": must be a fraction of the wait from 0 to 1 (0.2 adds up to 20%); 20 would make Retry-After up to 21 times the wait`}},
		{"JSON jitter as a percentage", "json", handlerJSON(`{"handler": "rate_limit", "jitter": 20}`, ""), []string{"jitter 20: must be a fraction of the wait from 0 to 1"}},
		{"action twice", "caddyfile", zoneCaddyfile("action deny\naction log"), []string{`zone "z": action is set twice (first at Caddyfile:4): keep one`}},
		{"weight response_header twice", "caddyfile", zoneCaddyfile("weight response_header X-Cost\nweight response_header X-Units"), []string{`zone "z": weight response_header is set twice (first at Caddyfile:4): keep one`}},
		{"weight response_bytes twice", "caddyfile", zoneCaddyfile("weight response_bytes\nweight response_bytes"), []string{`zone "z": weight response_bytes is set twice (first at Caddyfile:4)`}},
		{"weight twice", "caddyfile", zoneCaddyfile("weight 2\nweight 3"), []string{`zone "z": weight 3 never applies: the weight rule at Caddyfile:4 has no matcher block, so it prices every request`}},
		{"weight rule after one for every request", "caddyfile", zoneCaddyfile("weight 2\nweight 3 {\nmethod POST\n}"), []string{`zone "z": weight 3 never applies`}},
		{"JSON weight rule after one for every request", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 5, "window": "1m", "weights": [{"weight": 2}, {"weight": 3}]}}}`, ""), []string{`zone "z": weights[1] never applies: weights[0] has no matchers, so it prices every request`}},
		{"handler weight twice", "caddyfile", handlerCaddyfile("zone z {\nevents 5\nwindow 1m\n}\nweight 2\nweight 3"), []string{`weight is set twice (first at Caddyfile:7): keep one`}},
		{"jitter twice", "caddyfile", handlerCaddyfile("jitter 0.1\njitter 0.2"), []string{`jitter is set twice`}},
		{"weight above a capped burst", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1500000, "window": "1m", "burst": 1048576, "weights": [{"weight": 1100000}]}}}`, ""), []string{`zone "z": weight 1100000: above 1048576, the most the zone can grant`}},
		{"negative sweep_interval", "caddyfile", handlerCaddyfile("sweep_interval -1m"), []string{`sweep_interval "-1m"`, "negative"}},
		{"negative read_interval", "caddyfile", handlerCaddyfile("distributed {\nread_interval -1s\n}"), []string{`read_interval "-1s"`}},
		{"negative write_interval", "caddyfile", handlerCaddyfile("distributed {\nwrite_interval -2s\n}"), []string{`write_interval "-2s"`}},
		{"negative purge_age", "caddyfile", handlerCaddyfile("distributed {\npurge_age -3s\n}"), []string{`purge_age "-3s"`}},
		{"headers neither on nor off", "caddyfile", handlerCaddyfile("headers maybe"), []string{`headers "maybe"`}},
		{"duplicate zone in a handler", "caddyfile", handlerCaddyfile("zone z {\nevents 1\nwindow 1m\n}\nzone z {\nevents 2\nwindow 1m\n}"), []string{`zone "z" at Caddyfile:7 is defined twice in one rate_limit directive`}},
		{"conflicting zone in the global option", "caddyfile", "{\n\trate_limit {\n\t\tzone g {\n\t\t\tevents 1\n\t\t\twindow 1m\n\t\t}\n\t\tzone g {\n\t\t\tevents 2\n\t\t\twindow 1m\n\t\t}\n\t}\n}\n" + handlerCaddyfile("zone g"), []string{`zone "g" at Caddyfile:7 is already defined differently in the rate_limit global option`}},
		{"inline zone defined unlike the global zone", "caddyfile", "{\n\trate_limit {\n\t\tzone g {\n\t\t\tevents 1\n\t\t\twindow 1m\n\t\t}\n\t}\n}\n" + handlerCaddyfile("zone g {\nevents 2\nwindow 1m\n}"), []string{`zone "g" at Caddyfile:11 is defined differently in the rate_limit global option`, "define it once in the rate_limit global option (rate_limit { zone g { … } }) and use it by name (rate_limit g)"}},
		{"conflicting zones across handlers", "caddyfile", "http://localhost:HTTP_PORT {\n\trate_limit /a {\n\t\tzone d {\n\t\t\tevents 1\n\t\t\twindow 1m\n\t\t}\n\t}\n\trate_limit /b {\n\t\tzone d {\n\t\t\tevents 2\n\t\t\twindow 1m\n\t\t}\n\t}\n\trespond ok\n}\n", []string{`zone "d" is defined differently at Caddyfile:3 and at Caddyfile:9`, "define it once in the rate_limit global option"}},
		{"events twice", "caddyfile", zoneCaddyfile("events 5\nevents 50"), []string{`zone "z": events is set twice (first at Caddyfile:4)`}},
		{"key twice", "caddyfile", zoneCaddyfile("key {client_ip}\nkey {remote_host}"), []string{`zone "z": key is set twice (first at Caddyfile:4)`, "on one line"}},
		{"key without a placeholder", "caddyfile", zoneCaddyfile("key"), []string{`zone "z": key needs at least one placeholder`}},
		{"zone without a name", "caddyfile", handlerCaddyfile("zone"), []string{"zone needs a name", "Caddyfile:3"}},
		{"global zone without a name", "caddyfile", "{\n\trate_limit {\n\t\tzone\n\t}\n}\n" + handlerCaddyfile(""), []string{"zone needs a name", "Caddyfile:3"}},
		{"zone name in single quotes", "caddyfile", handlerCaddyfile("zone 'api' {\nevents 1\nwindow 1m\n}"), []string{`zone name "'api'"`, "needs no quotes"}},
		{"events above the largest rate", "caddyfile", zoneCaddyfile("events 99999999999"), []string{`zone "z": 99999999999 events per 1m0s is 1.667e+09 per second, above the maximum of 1000000 per second`}},
		{"window 1ns", "caddyfile", zoneCaddyfile("window 1ns"), []string{`window "1ns": must be at least 1ms`}},
		{"window 1us", "caddyfile", zoneCaddyfile("events 10\nwindow 1us"), []string{`window "1us": must be at least 1ms`}},
		{"rate above the maximum over 1ms", "caddyfile", zoneCaddyfile("events 10000\nwindow 1ms\nburst 10000"), []string{"10000 events per 1ms is 1e+07 per second, above the maximum of 1000000 per second"}},
		{"window above a year", "caddyfile", zoneCaddyfile("window 36500d"), []string{`zone "z": window "36500d": must be at most 365d`}},
		{"burst above the maximum", "caddyfile", zoneCaddyfile("burst 99999999999"), []string{`zone "z": burst "99999999999": must be at most 1048576`}},
		{"a window above the maximum", "caddyfile", handlerCaddyfile("zone z {\n\t\tevents 1500000\n\t\twindow 1m\n\t}"), []string{`zone "z": max_events 1500000: at most 1048576 in a window; for more, set burst`}},
		{"false_deny too small", "caddyfile", zoneCaddyfile("false_deny 0.000000001"), []string{`zone "z": false_deny 0.000000001 and sources 100000 (the default) need a table larger than the maximum of 16 GiB`}},
		{"undefined global zone", "caddyfile", handlerCaddyfile("zone nowhere"), []string{`zone "nowhere" is not defined`}},
		{"undefined global zone as argument", "caddyfile", "http://localhost:HTTP_PORT {\n\trate_limit nowhere\n\trespond ok\n}\n", []string{`zone "nowhere" is not defined`}},
		{"zone name with a space", "caddyfile", handlerCaddyfile("zone \"a b\" {\nevents 1\nwindow 1m\n}"), []string{`zone name "a b"`}},

		{"JSON max_events zero", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 0, "window": "1m"}}}`, ""), []string{`zone "z": max_events is required`}},
		{"JSON window missing", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1}}}`, ""), []string{`zone "z": window is required`}},
		{"JSON rate above the maximum", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 5000, "window": 1000000, "burst": 10000}}}`, ""), []string{`zone "z": 5000 events per 1ms is 5e+06 per second`}},
		{"JSON window in seconds", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1, "window": 3600}}}`, ""), []string{`zone "z": window 3.6µs: must be at least 1ms (a number in JSON is nanoseconds: write a duration such as "1h", or 3600000000000 for an hour)`}},
		{"JSON zone name in single quotes", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"'z'": {"max_events": 1, "window": "1m"}}}`, ""), []string{`zone name "'z'"`}},
		{"JSON conflicting zones across handlers", "json", `{"admin": {"disabled": true}, "apps": {"http": {"servers": {"srv0": {"listen": ["localhost:HTTP_PORT"], "routes": [{"handle": [{"handler": "rate_limit", "rate_limits": {"z": {"key": "{http.vars.client_ip}", "max_events": 1, "window": "1m"}}}, {"handler": "rate_limit", "rate_limits": {"z": {"max_events": 2, "window": "1m"}}}]}]}}}}}`, []string{`zone "z" is defined twice, differently (key "{http.vars.client_ip}" and unset, max_events 1 and 2)`, "define it once in the rate_limit app"}},
		{"JSON max_events not a number", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": "ten", "window": "1m"}}}`, ""), []string{"max_events"}},
		{"JSON window negative", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1, "window": "-1m"}}}`, ""), []string{"window -1m0s"}},
		{"JSON burst negative", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1, "window": "1m", "burst": -2}}}`, ""), []string{"burst -2"}},
		{"JSON ipv6_prefix", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1, "window": "1m", "ipv6_prefix": 200}}}`, ""), []string{"ipv6_prefix 200"}},
		{"JSON false_deny", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1, "window": "1m", "false_deny": 2}}}`, ""), []string{"false_deny 2"}},
		{"JSON sources negative", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1, "window": "1m", "sources": -5}}}`, ""), []string{"sources -5"}},
		{"JSON jitter negative", "json", handlerJSON(`{"handler": "rate_limit", "jitter": -1}`, ""), []string{"jitter -1"}},
		{"JSON sweep_interval negative", "json", handlerJSON(`{"handler": "rate_limit", "sweep_interval": "-1s"}`, ""), []string{"sweep_interval -1s"}},
		{"JSON purge_age negative", "json", handlerJSON(`{"handler": "rate_limit", "distributed": {"purge_age": "-1s"}}`, ""), []string{"purge_age -1s"}},
		{"JSON undefined global zone", "json", handlerJSON(`{"handler": "rate_limit", "zones": ["nope"]}`, `{"zones": {"yes": {"max_events": 1, "window": "1m"}}}`), []string{`zone "nope" is not defined`}},
		{"JSON zone listed twice", "json", handlerJSON(`{"handler": "rate_limit", "zones": ["yes", "yes"]}`, `{"zones": {"yes": {"max_events": 1, "window": "1m"}}}`), []string{`zone "yes" is listed twice`}},
		{"JSON inline zone unlike the global", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"yes": {"max_events": 2, "window": "1m"}}}`, `{"zones": {"yes": {"max_events": 1, "window": "1m"}}}`), []string{`zone "yes" is defined twice, differently (max_events 1 and 2)`}},
		{"JSON global zone window missing", "json", handlerJSON(`{"handler": "rate_limit"}`, `{"zones": {"g": {"max_events": 1}}}`), []string{`zone "g": window is required`}},
		{"JSON unknown field", "json", handlerJSON(`{"handler": "rate_limit", "rate_limits": {"z": {"max_events": 1, "window": "1m", "evnets": 2}}}`, ""), []string{"evnets"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := validate(t, tt.cfg, tt.adapter)
			if err == nil {
				t.Fatalf("config loaded; want an error containing %q", tt.want)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			// A message names what the operator wrote: no burst, sources
			// or byte count they did not write.
			for _, wrong := range []string{"burst 9", "raise burst", "sources 0", "107374182400", "window 0s", "wrong argument count"} {
				if strings.Contains(err.Error(), wrong) {
					t.Errorf("error %q names %q, which the config does not say", err, wrong)
				}
			}
		})
	}
}

func TestGoodConfigsValidate(t *testing.T) {
	for _, tt := range []struct{ name, cfg string }{
		{"every subdirective", handlerCaddyfile(`zone all {
			key {client_ip} {remote_host} {http.request.header.X-Key}
			events 100
			window 1m
			burst 20
			ipv4_prefix 24
			ipv6_prefix 48
			match {
				method GET
				path /api/*
			}
			memory 1MiB
		}
		zone sized {
			events 1
			window 1s
			sources 1000
			false_deny 0.01
		}
		distributed {
			read_interval 1s
			write_interval 2s
			purge_age 1m
		}
		storage file_system /tmp/floodgate-unused
		jitter 0.2
		log_key
		sweep_interval 1m
		disable_metrics
		headers off`)},
		{"prefix zero", zoneCaddyfile("ipv4_prefix 0\nipv6_prefix 0")},
		{"max_concurrent alone, as caddy-ratelimit's PR #98 writes it", handlerCaddyfile("zone z {\nkey {remote_host}\nmax_concurrent 5\n}")},
		{"max_concurrent beside a rate, a quota, a weight and fallback keys", handlerCaddyfile("zone z {\nkey {header.X-Key} {client_ip}\nevents 10\nwindow 1s\nburst 20\nquota 1000 1h\nweight 2\nmax_concurrent 5\n}")},
		{"max_concurrent alone and beside a rate in a distributed handler", handlerCaddyfile("zone conc_only {\nkey {client_ip}\nmax_concurrent 5\n}\nzone conc_rate {\nkey {client_ip}\nevents 5\nwindow 1m\nmax_concurrent 5\n}\ndistributed {\nread_interval 1s\nwrite_interval 1s\n}\nstorage file_system /tmp/floodgate-unused")},
		{"max_concurrent alone with action log and memory", handlerCaddyfile("zone z {\nkey {client_ip}\nmax_concurrent 5\naction log\nmemory 1MiB\n}")},
		{"high rate as a token bucket", zoneCaddyfile("events 1500000\nwindow 1m\nburst 1048576")},
		{"the fastest rate", zoneCaddyfile("events 1000000\nwindow 1s")},
		{"the slowest rate", zoneCaddyfile("events 1\nwindow 365d")},
		{"same zone in two handlers", "http://localhost:HTTP_PORT {\n\trate_limit /a {\n\t\tzone d {\n\t\t\tevents 1\n\t\t\twindow 1m\n\t\t}\n\t}\n\trate_limit /b {\n\t\tzone d {\n\t\t\tevents 1\n\t\t\twindow 1m\n\t\t}\n\t}\n\trespond ok\n}\n"},
		{"inline zone as the global zone", "{\n\trate_limit {\n\t\tzone g {\n\t\t\tevents 1\n\t\t\twindow 1m\n\t\t}\n\t}\n}\n" + handlerCaddyfile("zone g {\nevents 1\nwindow 1m\n}")},
		{"distributed without block", handlerCaddyfile("distributed")},
		{"jitter one", handlerCaddyfile("jitter 1")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if err := validate(t, tt.cfg, "caddyfile"); err != nil {
				t.Fatal(err)
			}
		})
	}
}
