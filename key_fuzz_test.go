package floodgate

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/floodgate-rl/floodgate/limiter"
)

// FuzzRequestKey charges requests with arbitrary key templates, header values
// of any bytes and length (one or several), query strings and prefix
// lengths. The compiled key must hash exactly what Caddy's replacer expands
// the template to (an address masked to the zone's prefixes, anything else
// hashed up to maxKeyHashed bytes), and the key shown in logs must be at
// most maxShownKey bytes, cut at a character boundary.
func FuzzRequestKey(f *testing.F) {
	f.Add("{http.request.header.X-Key}", []byte("alice"), []byte(nil), "a=1", 24, 48)
	f.Add("{http.request.header.X-Key}", []byte("10.1.2.3"), []byte(nil), "", 0, 0)
	f.Add("{http.request.header.X-Key}", []byte("2001:db8::1%eth0"), []byte(nil), "", 33, 129)
	f.Add("{http.request.header.X-Key}", []byte("one"), []byte("two"), "", 24, 48)
	f.Add("{http.request.header.X-Key}-{http.request.method}", []byte("\xff\xfe\x00é"), []byte(nil), "", -1, 200)
	f.Add("{http.request.uri.query.ip}", []byte(nil), []byte(nil), "ip=::ffff:192.0.2.7", 16, 32)
	f.Add("{http.request.uri.query.a}.{http.request.uri.query.b}", []byte(nil), []byte(nil), "a=10.1&b=2.3", 8, 8)
	f.Add(`a\{b}{http.request.method}`, []byte(nil), []byte(nil), "", 32, 64)
	f.Add("{unclosed {http.request.header.X-Key}", []byte(strings.Repeat("é", 5000)), []byte(nil), "", 24, 48)
	f.Add("{header.X-Key}", []byte("x"), []byte(nil), "", 24, 48)
	f.Add("{http.request.remote.host}", []byte(nil), []byte(nil), "", 24, 48)
	f.Add("a\x00{http.request.method}\x00\x01{http.request.header.X-Key}", []byte("k"), []byte(nil), "", 24, 48)
	f.Fuzz(func(t *testing.T, tmpl string, v1, v2 []byte, query string, v4, v6 int) {
		if len(tmpl) > 256 {
			return
		}
		z := &zone{v4: v4, v6: v6, keys: []keySpec{parseKeySpec(tmpl)}}
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = "192.0.2.1:5"
		r.URL.RawQuery = query
		if v1 != nil {
			r.Header["X-Key"] = []string{string(v1)}
			if v2 != nil {
				r.Header["X-Key"] = append(r.Header["X-Key"], string(v2))
			}
		}
		repl := caddyhttp.NewTestReplacer(r)
		q := &request{r: r, repl: repl}
		c := z.key(q)
		if want := expandedKeyHash(z, tmpl, r, repl); c.hash != want {
			t.Fatalf("hash %x, want %x (of %.60q)", c.hash, want, repl.ReplaceAll(tmpl, ""))
		}
		shown := z.keyText(q, c)
		if len(shown) > maxShownKey || strings.HasSuffix(shown, "…") && utf8.ValidString(repl.ReplaceAll(tmpl, "")) && !utf8.ValidString(shown) {
			t.Fatalf("shown key of %d bytes: %.60q", len(shown), shown)
		}
		_ = z.source(c)
	})
}

// FuzzNetworkKey masks any address to any prefix length: the key holds
// exactly the network netip computes (lengths clamped to the family's
// range), IPv4-mapped addresses are IPv4, and Prefix names that network.
func FuzzNetworkKey(f *testing.F) {
	f.Add([]byte{192, 0, 2, 200}, 24, 48)
	f.Add([]byte{0x20, 1, 0xd, 0xb8, 0, 1, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 1}, 24, 48)
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 7}, 31, 127)
	f.Add([]byte{255, 255, 255, 255}, -5, 500)
	f.Add([]byte{1, 2, 3}, 8, 8)
	f.Fuzz(func(t *testing.T, ip []byte, v4, v6 int) {
		a, _ := netip.AddrFromSlice(ip)
		k := limiter.NetworkKey(a, v4, v6)
		if !a.IsValid() {
			if k.Bytes() != nil {
				t.Fatalf("invalid address keyed as %x", k.Bytes())
			}
			return
		}
		u := a.Unmap()
		bits := max(0, min(v6, 128))
		family := byte(6)
		if u.Is4() {
			bits, family = max(0, min(v4, 32)), 4
		}
		want, err := u.Prefix(bits)
		if err != nil {
			t.Fatal(err)
		}
		if got := k.Bytes(); got[0] != family || !bytes.Equal(got[1:], want.Addr().AsSlice()) {
			t.Fatalf("%v /%d,/%d keyed as %x, want family %d and %v", a, v4, v6, got, family, want)
		}
		if p := k.Prefix(v4, v6); p != want {
			t.Fatalf("%v /%d,/%d: Prefix %v, want %v", a, v4, v6, p, want)
		}
	})
}
