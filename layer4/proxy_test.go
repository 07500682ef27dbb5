package layer4

import (
	"encoding/json"
	"testing"
)

func TestProxyAfterLimit(t *testing.T) {
	const (
		limit = `{"match":[{"rate_limit":{"zone":"z"}}],"handle":[{"handler":"close"}]}`
		pp    = `{"handle":[{"handler":"proxy_protocol"}]}`
		ppIf  = `{"match":[{"proxy_protocol":{}}],"handle":[{"handler":"proxy_protocol"}]}`
		echo  = `{"handle":[{"handler":"echo"}]}`
	)
	server := func(routes ...string) string {
		s := `{"servers":{"s":{"listen":[":1"],"routes":[`
		for i, r := range routes {
			if i > 0 {
				s += ","
			}
			s += r
		}
		return s + `]}}}`
	}
	for _, tc := range []struct {
		name, cfg string
		want      bool
	}{
		{"proxy_protocol route first", server(pp, limit, echo), false},
		{"@pp proxy_protocol route first", server(ppIf, limit, echo), false},
		{"no PROXY protocol", server(limit, echo), false},
		{"limit, then proxy_protocol", server(limit, pp, echo), true},
		{"limit, then @pp proxy_protocol", server(limit, ppIf, echo), true},
		{"limit and proxy_protocol in one route", server(`{"match":[{"rate_limit":{}}],"handle":[{"handler":"proxy_protocol"}]}`), false},
		{"limit in a subroute before proxy_protocol",
			server(`{"handle":[{"handler":"subroute","routes":[`+limit+`]}]}`, pp), true},
		{"proxy_protocol then limit in a subroute",
			server(`{"handle":[{"handler":"subroute","routes":[` + pp + `,` + limit + `]}]}`), false},
		{"wrappers: proxy_protocol, layer4, tls",
			`{"servers":{"h":{"listener_wrappers":[{"wrapper":"proxy_protocol"},{"wrapper":"layer4","routes":[` + limit + `]},{"wrapper":"tls"}]}}}`, false},
		{"wrappers: layer4, proxy_protocol, tls",
			`{"servers":{"h":{"listener_wrappers":[{"wrapper":"layer4","routes":[` + limit + `]},{"wrapper":"proxy_protocol"},{"wrapper":"tls"}]}}}`, true},
		{"another server's proxy_protocol",
			`{"servers":{"a":{"routes":[` + limit + `]},"b":{"routes":[` + pp + `]}}}`, false},
	} {
		var cfg any
		if err := json.Unmarshal([]byte(tc.cfg), &cfg); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := proxyAfterLimit(cfg); got != tc.want {
			t.Errorf("%s: proxyAfterLimit = %v, want %v", tc.name, got, tc.want)
		}
	}
}
