package layer4

import (
	"fmt"
	"testing"
)

// keylessCaddyfile shares a global zone without a key between the listener
// wrapper and the site's HTTP handler, as the listener-wrapper example
// (docs/layer4.md#in-front-of-https-the-listener-wrapper) once did.
func keylessCaddyfile() string {
	return httpsCaddyfile(`rate_limit {
		zone keyless {
			events 4
			window 1h
			ipv4_prefix 24
		}
	}`, `layer4 {
				@flood rate_limit zone keyless
				route @flood {
					close
				}
			}`, "rate_limit keyless")
}

// TestKeylessZoneSharedWithLayer4KeysHTTPByClient checks that such a zone
// charges each HTTP request to the client's network, the bucket the matcher
// charges its connections to: a network that used its limit is cut off, and
// a new network is not denied for what other networks did (with one bucket
// for every HTTP request, it was). The wrapper runs in a caddy process, as
// in wrapper_test.go: caddy-l4's listener wrapper races with the HTTP server
// under the race detector.
func TestKeylessZoneSharedWithLayer4KeysHTTPByClient(t *testing.T) {
	startCaddy(t, keylessCaddyfile())
	// Each request is a new connection (one token) and a request (one
	// more): 127.0.9.0/24 is drained after two.
	var got []string
	for _, src := range []string{"127.0.9.1", "127.0.9.2", "127.0.9.3"} {
		code, err := httpsGet(src)
		if err != nil {
			got = append(got, "closed")
		} else {
			got = append(got, fmt.Sprint(code))
		}
	}
	if fmt.Sprint(got) != "[200 200 closed]" {
		t.Errorf("127.0.9.0/24: %v, want [200 200 closed]", got)
	}
	if code, err := httpsGet("127.0.10.1"); err != nil || code != 200 {
		t.Errorf("a new network's first request: %d, %v", code, err)
	}
}
