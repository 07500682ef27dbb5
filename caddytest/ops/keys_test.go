package ops

import (
	"fmt"
	"net/http"
	"net/url"
	"testing"

	"github.com/floodgate-rl/floodgate"
)

// TestAHeaderHoldingAnAddressDrawsOnItsOwnCounters: with the README's
// `key {header.X-API-Key} {client_ip}`, a client that sends another
// client's address as its API key is charged under that API key, never
// under the address: the client at that address (and its whole /24) keeps
// its limit, and the admin API tells the two apart.
func TestAHeaderHoldingAnAddressDrawsOnItsOwnCounters(t *testing.T) {
	mustLoad(t, caddyfile("", `	rate_limit {
		zone forged {
			key {header.X-API-Key} {client_ip}
			events 3
			window 1h
			ipv4_prefix 24
		}
	}
	respond "ok"`))
	// The attacker at 127.0.21.1 names the victim's address as its key:
	// it gets that key's 3, no more.
	if got := codes(t, "127.0.21.1", 4, "X-API-Key: 127.0.22.7"); got != "200 200 200 429" {
		t.Fatalf("forged key: %s, want 200 200 200 429", got)
	}
	// The victim's network has all of its 3 left.
	if got := codes(t, "127.0.22.9", 4); got != "200 200 200 429" {
		t.Errorf("the client whose address was forged: %s, want 200 200 200 429", got)
	}
	// The attacker's own address was never charged.
	if got := codes(t, "127.0.21.1", 1); got != "200" {
		t.Errorf("the attacker without the header: %s, want 200", got)
	}

	// /top names the forged key apart from the address, and each name
	// reaches back to its own counters.
	var top floodgate.TopInfo
	adminJSON(t, http.MethodGet, "/rate_limit/zones/forged/top", &top)
	forged := "{http.request.header.X-Api-Key}=127.0.22.0/24"
	want := fmt.Sprint([]floodgate.TopSource{{Source: forged, Denied: 1}, {Source: "127.0.22.0/24", Denied: 1}})
	if got := fmt.Sprint(top.Sources); got != want {
		t.Errorf("top: %s, want %s", got, want)
	}
	var victim, key floodgate.KeyInfo
	adminJSON(t, http.MethodGet, "/rate_limit/zones/forged/keys/127.0.22.9", &victim)
	if victim.Source != "127.0.22.0/24" || victim.Allowed {
		t.Errorf("the victim's address: %+v, want 127.0.22.0/24, drained", victim)
	}
	adminJSON(t, http.MethodDelete, "/rate_limit/zones/forged/keys/"+url.PathEscape(forged), &key)
	if key.Source != forged || !key.Allowed {
		t.Errorf("reset of the forged key: %+v, want %s allowed", key, forged)
	}
	// The key as configured names it too.
	adminJSON(t, http.MethodGet, "/rate_limit/zones/forged/keys/"+url.PathEscape("{header.X-API-Key}=127.0.22.7"), &key)
	if key.Source != forged || !key.Allowed || key.Policies[0].Remaining != 3 {
		t.Errorf("the forged key by its configured name: %+v, want %s with 3 left", key, forged)
	}
	if got := codes(t, "127.0.21.1", 1, "X-API-Key: 127.0.22.7"); got != "200" {
		t.Errorf("forged key after its reset: %s, want 200", got)
	}
	if got := codes(t, "127.0.22.9", 1); got != "429" {
		t.Errorf("the victim after the forged key's reset: %s, want 429 (its own reset is its own)", got)
	}
}
