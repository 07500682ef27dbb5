package layer4

import (
	"bytes"
	"encoding/json"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// A connection from a load balancer that speaks PROXY protocol carries the
// client's address in a header before its first byte; caddy-l4's
// proxy_protocol handler (or Caddy's proxy_protocol listener wrapper) reads
// it and gives the connection the client's address. The matcher limits the
// client only if that happens before it charges the connection: in an
// earlier route, or an earlier listener wrapper. Match waits for a header
// whose first bytes it sees (see proxyHeader), and Provision warns about a
// config that reads the header only after a rate_limit matcher
// (proxyAfterLimit).

// PROXY protocol header signatures: version 1 is text, version 2 binary
// (haproxy's proxy-protocol.txt, sections 2.1 and 2.2).
var (
	proxyV1 = []byte("PROXY ")
	proxyV2 = []byte("\r\n\r\n\x00\r\nQUIT\n")
)

// What proxyHeader found at the start of a connection's bytes.
const (
	proxyHeaderNone   = iota // no PROXY header, or no byte read yet
	proxyHeaderBegun         // a signature's first bytes, not all of it
	proxyHeaderUnread        // a whole signature
)

// proxyHeader tells whether b, the bytes read so far from a connection,
// begins with a PROXY protocol header. No byte read yet is no header: the
// matcher does not read to find out, so that it decides before a byte is
// read.
func proxyHeader(b []byte) int {
	if len(b) == 0 {
		return proxyHeaderNone
	}
	for _, sig := range [][]byte{proxyV1, proxyV2} {
		switch {
		case bytes.HasPrefix(b, sig):
			return proxyHeaderUnread
		case len(b) < len(sig) && bytes.HasPrefix(sig, b):
			return proxyHeaderBegun
		}
	}
	return proxyHeaderNone
}

// warnProxyOrder logs a warning if the app being provisioned (the layer4
// app, or the HTTP app whose listener wrappers hold the matcher) reads PROXY
// protocol headers only after a rate_limit matcher: such a matcher limits
// the load balancer, every client at once.
//
// Caddy provisions routes and listener wrappers in order and drops each
// one's JSON once it is provisioned, so what the app still holds as JSON is
// the matcher's own route or wrapper and everything after it: a
// proxy_protocol handler or wrapper there comes after a rate_limit matcher.
func (m *Matcher) warnProxyOrder(ctx caddy.Context) {
	mods := ctx.Modules()
	if len(mods) == 0 {
		return
	}
	raw, err := json.Marshal(mods[0])
	if err != nil {
		return
	}
	var cfg any
	if json.Unmarshal(raw, &cfg) != nil || !proxyAfterLimit(cfg) {
		return
	}
	m.logger.Warn("a proxy_protocol handler or listener wrapper comes after a rate_limit matcher: the matcher limits the load balancer, not its clients; read PROXY protocol first (an unconditional `route { proxy_protocol }` or a `@pp proxy_protocol` route before the rate_limit route, or the proxy_protocol listener wrapper before layer4)",
		zap.String("zone", m.zone.Name))
}

// proxyAfterLimit reports whether cfg, a config as JSON values, holds a
// list (of routes, or of listener wrappers) in which an element that uses a
// rate_limit matcher comes before one that reads PROXY protocol headers.
func proxyAfterLimit(cfg any) bool {
	switch v := cfg.(type) {
	case []any:
		limited := false
		for _, e := range v {
			if limited && readsProxy(e) || proxyAfterLimit(e) {
				return true
			}
			limited = limited || usesLimit(e)
		}
	case map[string]any:
		for _, e := range v {
			if proxyAfterLimit(e) {
				return true
			}
		}
	}
	return false
}

// usesLimit reports whether cfg holds a matcher set with a rate_limit
// matcher: an object in the list of a route's "match".
func usesLimit(cfg any) bool {
	return anyObject(cfg, func(o map[string]any) bool {
		sets, _ := o["match"].([]any)
		for _, set := range sets {
			if s, ok := set.(map[string]any); ok && s["rate_limit"] != nil {
				return true
			}
		}
		return false
	})
}

// readsProxy reports whether cfg holds caddy-l4's proxy_protocol handler or
// Caddy's proxy_protocol listener wrapper.
func readsProxy(cfg any) bool {
	return anyObject(cfg, func(o map[string]any) bool {
		return o["handler"] == "proxy_protocol" || o["wrapper"] == "proxy_protocol"
	})
}

// anyObject reports whether f holds for an object in cfg, at any depth.
func anyObject(cfg any, f func(map[string]any) bool) bool {
	switch v := cfg.(type) {
	case []any:
		for _, e := range v {
			if anyObject(e, f) {
				return true
			}
		}
	case map[string]any:
		if f(v) {
			return true
		}
		for _, e := range v {
			if anyObject(e, f) {
				return true
			}
		}
	}
	return false
}
