package floodgate

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	pathpkg "path"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// FuzzAdminAPI sends the admin API arbitrary methods, paths and query
// strings. It answers every one with JSON: 200, or an error of 400, 404 or
// 405, never a panic nor another status; an answer stays small; and a GET
// of a key charges nothing.
func FuzzAdminAPI(f *testing.F) {
	for _, s := range [][3]string{
		{"GET", "/rate_limit/zones", ""},
		{"GET", "/rate_limit/zones/fuzz_admin", ""},
		{"GET", "/rate_limit/zones/fuzz_admin/top", "n=3"},
		{"GET", "/rate_limit/zones/fuzz_admin/top", "n=-1"},
		{"GET", "/rate_limit/zones/fuzz_admin/top", "n=99999999999999999999"},
		{"GET", "/rate_limit/zones/fuzz_admin/keys/192.0.2.7", ""},
		{"DELETE", "/rate_limit/zones/fuzz_admin/keys/2001:db8::1", ""},
		{"GET", "/rate_limit/zones/fuzz_admin/keys/a/b/c%2F%00", ""},
		{"POST", "/rate_limit/zones/fuzz_admin/keys/k", ""},
		{"GET", "/rate_limit/zones/nope/keys/k", ""},
		{"PUT", "/rate_limit/zones", "x=%zz"},
		{"GET", "/rate_limit/zones/fuzz%20admin/top", "n=1&n=2"},
	} {
		f.Add(s[0], s[1], s[2])
	}
	h := newTestHandler(f, nil, map[string]*Zone{"fuzz_admin": {
		Key:   "{http.request.header.X-Key}",
		Limit: zoneconf.Limit{MaxEvents: 10, Window: caddy.Duration(time.Minute), Burst: 10, Memory: 4096},
	}})
	for i := range 20 {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Key", strings.Repeat("k", i%3))
		_, _ = serve(h, r)
	}
	app := &App{logger: zap.NewNop(), live: h.zones}
	goLive(app)
	f.Cleanup(func() { retire(app) })
	mux := http.NewServeMux()
	for _, rt := range (adminAPI{}).Routes() {
		mux.Handle(rt.Pattern, adminRoute{rt.Handler})
	}
	f.Fuzz(func(t *testing.T, method, path, query string) {
		if !validMethod(method) || !strings.HasPrefix(path, "/") || pathpkg.Clean(path) != path {
			return // net/http answers these before any handler (a bad request, a redirect)
		}
		status, body := adminRequest(mux, method, path, query)
		switch status {
		case http.StatusOK, http.StatusBadRequest, http.StatusNotFound, http.StatusMethodNotAllowed:
		default:
			t.Fatalf("%s %q ?%q: status %d: %s", method, path, query, status, body)
		}
		if len(body) > 64<<10 {
			t.Fatalf("%s %q: %d bytes", method, path, len(body))
		}
		if status == http.StatusOK && !json.Valid(body) {
			t.Fatalf("%s %q: not JSON: %s", method, path, body)
		}
		if status == http.StatusOK && method == http.MethodGet && strings.Contains(path, "/keys/") {
			// Times move on between the two; what the key holds does not.
			_, again := adminRequest(mux, method, path, query)
			var k1, k2 KeyInfo
			if json.Unmarshal(body, &k1) != nil || json.Unmarshal(again, &k2) != nil || len(k1.Policies) != len(k2.Policies) || k1.Policies[0].Remaining != k2.Policies[0].Remaining {
				t.Fatalf("GET %q twice: %s then %s", path, body, again)
			}
		}
	})
}

// adminRequest serves one admin request as Caddy's admin server does: an
// APIError's status and message, or what the handler wrote.
func adminRequest(mux *http.ServeMux, method, path, query string) (int, []byte) {
	r := &http.Request{Method: method, URL: &url.URL{Path: path, RawQuery: query}, Header: http.Header{}, Host: "localhost"}
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, r)
	if e := w.Header().Get(adminErrHeader); e != "" {
		w.Header().Del(adminErrHeader)
		var status int
		_, _ = fmt.Sscan(e, &status)
		return status, w.Body.Bytes()
	}
	return w.Code, w.Body.Bytes()
}

// adminErrHeader carries an admin handler's error status out of the mux.
const adminErrHeader = "X-Test-Admin-Error"

// adminRoute runs an admin handler under a ServeMux (which sets the path
// values), turning its error into a status as Caddy's admin server does.
type adminRoute struct{ h caddy.AdminHandler }

func (a adminRoute) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	err := a.h.ServeHTTP(w, r)
	var apiErr caddy.APIError
	switch {
	case errors.As(err, &apiErr):
		w.Header().Set(adminErrHeader, fmt.Sprint(apiErr.HTTPStatus))
		_, _ = w.Write([]byte(apiErr.Error()))
	case err != nil:
		w.Header().Set(adminErrHeader, "500")
		_, _ = w.Write([]byte(err.Error()))
	}
}

func validMethod(m string) bool {
	return m != "" && strings.IndexFunc(m, func(r rune) bool { return r <= ' ' || r >= 0x7f || strings.ContainsRune("()<>@,;:\\\"/[]?={}", r) }) < 0
}
