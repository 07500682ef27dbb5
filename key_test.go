package floodgate

import (
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// TestAKeysValueMeetsOnlyItsOwnKeysValues: which key of a zone produced a
// value is part of what is hashed, so that the same text under two keys
// draws on unrelated counters (a header holding a client's address does not
// drain that client), while the source address keeps the hash that layer4
// matchers and the XDP program compute for a connection, and a key keeps
// its counters however the config writes it or orders the list.
func TestAKeysValueMeetsOnlyItsOwnKeysValues(t *testing.T) {
	mk := func(keys ...string) *zone {
		z := &zone{v4: 24, v6: 48}
		for _, k := range keys {
			z.keys = append(z.keys, parseKeySpec(expandShorthands(k)))
		}
		return z
	}
	z := mk("{header.X-API-Key}", "{client_ip}")
	forged := keyOf(z, "10.9.9.9:5", "", map[string]string{"X-API-Key": "203.0.113.7"})
	client := keyOf(z, "203.0.113.7:5", "", nil)
	network := limiter.NetworkKey(mustAddr(t, "203.0.113.99"), 24, 48)
	if want := limiter.Hash(network.Bytes()); client != want {
		t.Errorf("the client address hashes to %x, want %x: what a layer4 matcher and the XDP program charge for its connections", client, want)
	}
	if forged == client {
		t.Errorf("X-API-Key: 203.0.113.7 and the client 203.0.113.7 share the hash %x", forged)
	}
	if got := keyOf(z, "10.9.9.9:5", "", map[string]string{"X-API-Key": "203.0.113.200"}); got != forged {
		t.Errorf("a header holding an address is still grouped by network: %x and %x", got, forged)
	}

	// The same text under two keys that are not addresses.
	two := mk("{header.X-User}", "{header.X-Org}")
	user := keyOf(two, "10.9.9.9:5", "", map[string]string{"X-User": "acme"})
	org := keyOf(two, "10.9.9.9:5", "", map[string]string{"X-Org": "acme"})
	if user == org {
		t.Errorf("X-User: acme and X-Org: acme share the hash %x", user)
	}

	// The same key however it is written, wherever it stands in the list.
	for _, other := range []*zone{
		mk("{http.request.header.x-api-key}", "{client_ip}"),
		mk("{header.X-Absent}", "{http.request.header.X-Api-Key}"),
	} {
		got := keyOf(other, "10.9.9.9:5", "", map[string]string{"X-API-Key": "203.0.113.7"})
		if got != forged {
			t.Errorf("keys %v: the header's value hashes to %x, want %x as in %v", other.keys, got, forged, z.keys)
		}
	}
	if got := keyOf(mk("{remote_host}"), "203.0.113.7:5", "", nil); got != client {
		t.Errorf("{remote_host} hashes an address to %x, {client_ip} to %x: both are the source address", got, client)
	}
}

// TestSaltingKeepsAKeysValuesApart: salting is a bijection of the value's
// hash for each key, so that it never merges two values of one key.
func TestSaltingKeepsAKeysValuesApart(t *testing.T) {
	k := parseKeySpec("{http.request.header.X-Key}")
	seen := map[uint64]uint64{}
	for h := range uint64(1 << 16) {
		for _, v := range []uint64{h, h << 48, ^h} {
			s := k.salted(v)
			if prev, ok := seen[s]; ok && prev != v {
				t.Fatalf("%x and %x both salt to %x", prev, v, s)
			}
			seen[s] = v
		}
	}
}

// TestAZonesSaltsHoldItsTablesSecret: with a public salt alone, anyone can
// search offline for a header value whose counters are a given client's
// (the table's size is the default, or guessed). The salt of a zone's keys
// holds a random secret of its table: another zone's table (another
// process's, another zone name) hashes the same value elsewhere, while the
// same zone after a reload, which keeps its table, hashes it where it did.
// A distributed zone's instances must agree: they share a secret through
// their storage (TestDistributedZonesShareASecretHashNoOneElseKnows).
func TestAZonesSaltsHoldItsTablesSecret(t *testing.T) {
	zc := func() *Zone {
		return &Zone{Key: "{http.request.header.X-API-Key}", Limit: zoneconf.Limit{MaxEvents: 3, Window: caddy.Duration(time.Hour), Memory: 4096}}
	}
	hashIn := func(h *Handler) uint64 {
		return keyOf(h.zones[0], "10.9.9.9:5", "", map[string]string{"X-API-Key": "203.0.113.7"})
	}
	first := newTestHandler(t, nil, map[string]*Zone{"secret_a": zc()})
	reloaded := newTestHandler(t, nil, map[string]*Zone{"secret_a": zc()})
	other := newTestHandler(t, nil, map[string]*Zone{"secret_b": zc()})
	if first.zones[0].table != reloaded.zones[0].table {
		t.Fatal("the zone's table did not survive the reload")
	}
	if a, b := hashIn(first), hashIn(reloaded); a != b {
		t.Errorf("the same zone after a reload hashes the value to %x, before to %x", b, a)
	}
	if a, b := hashIn(first), hashIn(other); a == b {
		t.Errorf("two zones' tables hash the value alike (%x): their secrets are the same", a)
	}
	public := parseKeySpec("{http.request.header.X-API-Key}")
	value := limiter.NetworkKey(mustAddr(t, "203.0.113.7"), 32, 64)
	if got, guess := hashIn(first), public.salted(limiter.Hash(value.Bytes())); got == guess {
		t.Errorf("the hash %x is the public salt's: computable without the table's secret", got)
	}
}
