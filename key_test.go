package floodgate

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

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

// keyOf returns the hash the zone computes for a request from remote with
// the given client IP var (if not empty) and headers.
func keyOf(z *zone, remote, clientIPVar string, headers map[string]string) uint64 {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = remote
	for k, v := range headers {
		r.Header.Set(k, v)
	}
	if clientIPVar != "" {
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: clientIPVar}))
	}
	return z.key(&request{r: r, repl: caddyhttp.NewTestReplacer(r)}).hash
}

func TestKeyExtraction(t *testing.T) {
	v4, v6 := 24, 48
	mk := func(keys ...string) *zone {
		z := &zone{v4: v4, v6: v6}
		for _, k := range keys {
			z.keys = append(z.keys, parseKeySpec(k))
		}
		return z
	}
	client := mk("{http.vars.client_ip}")
	remote := mk("{remote_host}")
	header := mk("{http.request.header.X-Key}", "{http.request.header.X-Other}")
	none := mk()
	hashOf := func(s string) uint64 { return limiter.Hash([]byte(s)) }
	netOf := func(ip string) uint64 {
		k := limiter.NetworkKey(mustAddr(t, ip), v4, v6)
		return limiter.Hash(k.Bytes())
	}
	huge := strings.Repeat("k", 1<<20)

	for _, tt := range []struct {
		name                   string
		z                      *zone
		remote, clientVar, hdr string
		other                  string
		want                   uint64
	}{
		{"client IP from vars, masked", client, "198.51.100.1:5", "192.0.2.200", "", "", netOf("192.0.2.1")},
		{"client IP falls back to the peer", client, "192.0.2.9:5", "", "", "", netOf("192.0.2.1")},
		{"IPv4-mapped client IP is IPv4", client, "", "::ffff:192.0.2.7", "", "", netOf("192.0.2.1")},
		{"IPv6 client grouped by /48", client, "", "2001:db8:1:ffff::1", "", "", netOf("2001:db8:1::")},
		{"remote host ignores vars", remote, "192.0.2.9:5", "203.0.113.1", "", "", netOf("192.0.2.0")},
		{"remote IPv6 with brackets", remote, "[2001:db8:1:2::3]:443", "", "", "", netOf("2001:db8:1::")},
		{"header holding an IP is masked", header, "", "", "10.1.2.3", "", header.keys[0].salted(netOf("10.1.2.99"))},
		{"header holding a name is hashed", header, "", "", "alice", "", header.keys[0].salted(hashOf("alice"))},
		{"empty first key falls back", header, "", "", "", "bob", header.keys[1].salted(hashOf("bob"))},
		{"no key at all is the empty key", header, "192.0.2.1:5", "", "", "", limiter.Hash(nil)},
		{"a zone without keys is one bucket", none, "192.0.2.1:5", "", "", "", limiter.Hash(nil)},
		{"a huge key is hashed by its first 8 KiB", header, "", "", huge, "", header.keys[0].salted(hashOf(huge[:8<<10]))},
	} {
		t.Run(tt.name, func(t *testing.T) {
			hdrs := map[string]string{}
			if tt.hdr != "" {
				hdrs["X-Key"] = tt.hdr
			}
			if tt.other != "" {
				hdrs["X-Other"] = tt.other
			}
			remoteAddr := tt.remote
			if remoteAddr == "" {
				remoteAddr = "127.0.0.1:1"
			}
			if got := keyOf(tt.z, remoteAddr, tt.clientVar, hdrs); got != tt.want {
				t.Errorf("hash %x, want %x", got, tt.want)
			}
		})
	}
}

// expandedKeyHash is how a key template was charged before keys were
// compiled: the replacer's full expansion, an IP address masked to its
// network, anything else hashed (now up to maxKeyHashed bytes).
func expandedKeyHash(z *zone, tmpl string, r *http.Request, repl *caddy.Replacer) uint64 {
	s := repl.ReplaceAll(tmpl, "")
	if s == "" {
		return limiter.Hash(nil)
	}
	// An address is at most maxIPText bytes, zone included: a longer
	// text is a key like any other, though netip would parse it (a zone
	// may be of any length).
	if a, err := netip.ParseAddr(s); err == nil && len(s) <= maxIPText {
		nk := limiter.NetworkKey(a.WithZone(""), z.v4, z.v6)
		return z.keys[0].salted(limiter.Hash(nk.Bytes()))
	}
	return z.keys[0].salted(limiter.HashString(s[:min(len(s), maxKeyHashed)]))
}

func TestCompiledKeysHashWhatTheReplacerExpands(t *testing.T) {
	long := strings.Repeat("0123456789", 2000)
	for _, tmpl := range []string{
		"{http.request.header.X-Key}",
		"{http.request.header.x-key}",
		"{http.request.header.X-Multi}",
		"{http.request.header.X-Long}",
		"{http.request.header.X-Absent}",
		"{header.X-Key}", // a Caddyfile shorthand, unknown in JSON
		"{http.request.method}-{http.request.uri.path}",
		"{http.request.uri.query.ip}",
		"{http.request.uri.query.a}.{http.request.uri.query.b}",
		"{http.request.header.X-Long}{http.request.header.X-Long}",
		`a\{b}{http.request.method}`,
		"{unclosed {http.request.method}",
		"literal",
		"{http.request.header.X-Multi}:{http.request.method}",
	} {
		t.Run(tmpl, func(t *testing.T) {
			z := &zone{v4: 24, v6: 48, keys: []keySpec{parseKeySpec(tmpl)}}
			r := httptest.NewRequest(http.MethodGet, "/p/q?ip=2001:db8::1&a=10.1&b=2.3", nil)
			r.Header.Set("X-Key", "alice")
			r.Header.Add("X-Multi", "one")
			r.Header.Add("X-Multi", "two")
			r.Header.Set("X-Long", long)
			repl := caddyhttp.NewTestReplacer(r)
			got := z.key(&request{r: r, repl: repl})
			if want := expandedKeyHash(z, tmpl, r, repl); got.hash != want {
				t.Errorf("hash %x, want %x (of %.40q)", got.hash, want, repl.ReplaceAll(tmpl, ""))
			}
		})
	}
}

// A key template reads a client's header without copying it: a 1 MB header
// costs no more memory per request than a short one.
func TestHugeKeysAreNotCopied(t *testing.T) {
	for _, tmpl := range []string{"{http.request.header.X-Key}", "{http.request.header.X-Key}-{http.request.method}"} {
		h := newTestHandler(t, nil, map[string]*Zone{
			"huge_" + strconv.Itoa(len(tmpl)): {Key: tmpl, Limit: zoneconf.Limit{MaxEvents: zoneconf.MaxPerSecond, Window: caddy.Duration(time.Second), Memory: 4096}},
		})
		h.DisableHeaders = true
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Key", strings.Repeat("k", 1<<20))
		caddyhttp.NewTestReplacer(r)
		w := httptest.NewRecorder()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		const n = 20
		for range n {
			if err := h.serveAt(w, r, okHandler, time.Now()); err != nil {
				t.Fatal(err)
			}
		}
		runtime.ReadMemStats(&after)
		if perRequest := (after.TotalAlloc - before.TotalAlloc) / n; perRequest > 4<<10 {
			t.Errorf("%s: %d bytes allocated per request with a 1 MB header, want under 4 KiB", tmpl, perRequest)
		}
	}
}

func TestShownKeysAreCut(t *testing.T) {
	if got := shownKey("short"); got != "short" {
		t.Errorf("shownKey(short) = %q", got)
	}
	for _, s := range []string{strings.Repeat("k", 900<<10), strings.Repeat("é", 200)} {
		got := shownKey(s)
		if len(got) > maxShownKey || !strings.HasSuffix(got, "…") || !utf8.ValidString(got) || !strings.HasPrefix(s, strings.TrimSuffix(got, "…")) {
			t.Errorf("shownKey of %d bytes = %d bytes %.20q…, want a valid prefix of at most %d bytes ending in …", len(s), len(got), got, maxShownKey)
		}
	}
}

func TestSourceNamesWhatWasCharged(t *testing.T) {
	z := &zone{v4: 24, v6: 48}
	for _, tt := range []struct {
		c    charge
		want string
	}{
		{charge{addr: mustAddr(t, "203.0.113.77")}, "203.0.113.0/24"},
		{charge{addr: mustAddr(t, "2001:db8:1:2::3")}, "2001:db8:1::/48"},
		{charge{hash: 0xab, key: 0}, "key:00000000000000ab"},
		{charge{key: -1}, "none"},
	} {
		if got := z.source(tt.c); got != tt.want {
			t.Errorf("source(%+v) = %q, want %q", tt.c, got, tt.want)
		}
	}
}

// Only text that can be an address is given to netip.ParseAddr (whose error
// allocates); every address still is.
func TestIPLike(t *testing.T) {
	for _, s := range []string{"192.0.2.1", "::1", "2001:db8::1", "::ffff:192.0.2.7", "fe80::1%eth0"} {
		if !ipLike(s) || !parseIP(s).IsValid() {
			t.Errorf("%q: not taken for an address", s)
		}
	}
	for _, s := range []string{"", "alice", "deadbeef", "GET-/", "%eth0", "1.2.3.4.example", strings.Repeat("1.", 40)} {
		if ipLike(s) || parseIP(s).IsValid() {
			t.Errorf("%q taken for an address", s)
		}
	}
	if a := parseIP("fe80::1%eth0"); a.Zone() != "" {
		t.Errorf("zone kept: %v", a)
	}
}
