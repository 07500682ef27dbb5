package caddytest

import (
	"fmt"
	"testing"
	"time"
)

// sweepConfig is a config whose zone sweep_raise allows events per window
// for the key in the X-Key header (a token bucket: burst is explicit).
func sweepConfig(events, window, tag string) string {
	return config("", `
	rate_limit {
		zone sweep_raise {
			key {http.request.header.X-Key}
			events `+events+`
			window `+window+`
			burst `+events+`
		}
	}
	respond "`+tag+`"`)
}

// TestRaisingALimitByReloadNeverLocksIdleKeysOut is issue 16's first
// scenario, over HTTP: a zone reloaded from 10 a minute to a million a
// second (a byte rate is exactly this), keys charged before and after the
// reload, then left idle. At a million a second a counter's 32-bit time
// wraps in 4.3 s, so the table must be swept every second or so; before
// the fix the sweep loop kept the timer of the old limit (days) and every
// idle key was denied after about 4.5 s, with Retry-After 3.
//
// The sweep runs in real time in the background, so the test must wait in
// real time: 5.5 s of idleness, past the 4.3 s wrap and the 4.5–5.7 s at
// which the old code denied. It is the only wait, and it is bounded.
func TestRaisingALimitByReloadNeverLocksIdleKeysOut(t *testing.T) {
	tc := newTester(t)
	tc.InitServer(sweepConfig("10", "1m", "slow"), "caddyfile")
	var keys []string
	for i := range 3 {
		key := fmt.Sprintf("before-%d", i)
		if code, _, _ := get(t, tc, "/", "X-Key: "+key); code != 200 {
			t.Fatalf("%s at 10 a minute: %d, want 200", key, code)
		}
		keys = append(keys, key)
	}
	tc.InitServer(sweepConfig("1000000", "1s", "fast"), "caddyfile")
	for i := range 3 {
		key := fmt.Sprintf("after-%d", i)
		if code, body, _ := get(t, tc, "/", "X-Key: "+key); code != 200 || body != "fast" {
			t.Fatalf("%s at a million a second: %d %q, want 200 from the new config", key, code, body)
		}
		keys = append(keys, key)
	}
	time.Sleep(5500 * time.Millisecond)
	for _, key := range keys {
		if code, _, resp := get(t, tc, "/", "X-Key: "+key); code != 200 {
			t.Errorf("%s after 5.5 s idle at a million a second: %d (Retry-After %q), want 200", key, code, resp.Header.Get("Retry-After"))
		}
	}
}
