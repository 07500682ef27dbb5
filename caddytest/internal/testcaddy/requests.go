package testcaddy

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
)

// Request returns a request for method and url with the given headers, each
// written "Name: value"; it fails the test if the request cannot be made.
func Request(t testing.TB, method, url string, headers ...string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ": ")
		req.Header.Set(name, value)
	}
	return req
}

// Codes sends n requests for method and url with c, each with the given
// headers ("Name: value"), and returns their status codes, e.g.
// "200 200 429"; it fails the test if one gets no answer.
func Codes(t testing.TB, c *http.Client, n int, method, url string, headers ...string) string {
	t.Helper()
	out := make([]string, 0, n)
	for range n {
		code, _, _ := Do(t, c, Request(t, method, url, headers...))
		out = append(out, fmt.Sprint(code))
	}
	return strings.Join(out, " ")
}

// ClientFrom returns an HTTP client whose connections go to addr
// ("host:port"), whatever a request's URL says, from the local address ip
// (any address in 127.0.0.0/8 is this host on Linux). It opens a new
// connection per request, so none outlives a config load.
func ClientFrom(ip, addr string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, addr)
		},
		DisableKeepAlives: true,
	}}
}

// Site returns a Caddyfile for an in-process Caddy on the given ports: the
// global options with extra (Globals), then one http://localhost site on the
// HTTP port with body.
func Site(adminPort, httpPort, httpsPort int, extra, body string) string {
	return Globals(adminPort, httpPort, httpsPort, extra) + fmt.Sprintf("http://localhost:%d {\n%s\n}\n", httpPort, body)
}

// JSON sends req with c, fails the test unless the answer is 200 OK, and
// decodes its body, one JSON value, into v.
func JSON(t testing.TB, c *http.Client, req *http.Request, v any) {
	t.Helper()
	code, body, _ := Do(t, c, req)
	if code != http.StatusOK {
		t.Fatalf("%s %s: %d %s", req.Method, req.URL, code, body)
	}
	if err := json.Unmarshal([]byte(body), v); err != nil {
		t.Fatalf("%s %s: %v in %s", req.Method, req.URL, err, body)
	}
}
