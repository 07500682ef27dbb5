package weight

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestRuleJSON: a rule reads and writes the JSON a zone's weights hold, so
// configs written before the rules moved here load unchanged.
func TestRuleJSON(t *testing.T) {
	const in = `[{"weight":5,"match":[{"path":["/search"]}]},{"weight":"{http.request.header.X-Cost}"}]`
	var rules []*Rule
	if err := json.Unmarshal([]byte(in), &rules); err != nil {
		t.Fatal(err)
	}
	if len(rules) != 2 || rules[0].Weight != Static(5) || len(rules[0].MatcherSetsRaw) != 1 || rules[1].Weight.String() != "{http.request.header.X-Cost}" || rules[1].MatcherSetsRaw != nil {
		t.Fatalf("read %s as %+v %+v", in, rules[0], rules[1])
	}
	out, err := json.Marshal(rules)
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != in {
		t.Errorf("wrote %s, want %s", out, in)
	}
}

func TestValidate(t *testing.T) {
	path := caddyhttp.RawMatcherSets{{"path": json.RawMessage(`["/a"]`)}}
	for _, tt := range []struct {
		name  string
		rules []*Rule
		want  string
	}{
		{"none", nil, ""},
		{"a fixed weight the zone can grant", []*Rule{{Weight: Static(5)}}, ""},
		{"a nil rule", []*Rule{nil}, "weights[0]: a weight is required"},
		{"a rule without a weight", []*Rule{{Weight: Static(1), MatcherSetsRaw: path}, {}}, "weights[1]: a weight is required"},
		{"a rule after one for every request", []*Rule{{Weight: Static(1)}, {Weight: Static(2), MatcherSetsRaw: path}}, "weights[1] never applies: weights[0] has no matchers, so it prices every request (rules are tried in order)"},
		{"a fixed weight above the limit", []*Rule{{Weight: Static(6)}}, "weight 6: above 5, the most the zone can grant: such a request could never pass"},
		{"a placeholder is checked per request", []*Rule{{Weight: Value{template: "{x}"}}}, ""},
	} {
		err := Validate(tt.rules, 5)
		if got := errString(err); got != tt.want {
			t.Errorf("%s: Validate = %q, want %q", tt.name, got, tt.want)
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestRulesOf: the first rule that matches gives the weight, else the
// handler's, else 1; a weight that must not pass is a 400 naming whose
// rules refused it, and a fixed handler weight above the limit fails
// CheckHandler unless a rule prices every request.
func TestRulesOf(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	search := caddyhttp.RawMatcherSets{{"path": json.RawMessage(`["/search"]`)}}
	cost := Value{template: "{http.request.header.X-Cost}"}
	rs, err := Provision(ctx, []*Rule{{Weight: Static(3), MatcherSetsRaw: search}, {Weight: cost}}, `zone "api"`)
	if err != nil {
		t.Fatal(err)
	}
	matched, err := Provision(ctx, []*Rule{{Weight: Static(3), MatcherSetsRaw: search}}, `zone "api"`)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name     string
		rules    Rules
		path, x  string
		hw       Value
		want     int64
		status   int
		wantText string
	}{
		{"no rules, no handler weight", Rules{}, "/", "", Value{}, 1, 0, ""},
		{"no rules: the handler's weight", Rules{}, "/", "", Static(4), 4, 0, ""},
		{"the first rule that matches", rs, "/search", "7", Static(4), 3, 0, ""},
		{"the next rule, from the header", rs, "/", "7", Static(4), 7, 0, ""},
		{"no rule matches: the handler's weight", matched, "/", "", Static(4), 4, 0, ""},
		{"an empty weight", rs, "/", "", Value{}, 0, 400, `zone "api": weight {http.request.header.X-Cost} is empty: the request must give a whole number of at least 1`},
		{"a weight above the limit", rs, "/", "11", Value{}, 0, 400, `zone "api": weight {http.request.header.X-Cost} = 11: above 10, the most the zone can grant`},
	} {
		r := httptest.NewRequest(http.MethodGet, tt.path, nil)
		if tt.x != "" {
			r.Header.Set("X-Cost", tt.x)
		}
		repl := caddyhttp.NewTestReplacer(r)
		n, err := tt.rules.Of(r, repl, tt.hw, 10)
		var he caddyhttp.HandlerError
		switch {
		case tt.status == 0 && (err != nil || n != tt.want):
			t.Errorf("%s: Of = %d, %v; want %d", tt.name, n, err, tt.want)
		case tt.status != 0 && (!errors.As(err, &he) || he.StatusCode != tt.status || he.Err.Error() != tt.wantText):
			t.Errorf("%s: Of = %d, %v; want a %d %q", tt.name, n, err, tt.status, tt.wantText)
		}
	}
	if err := matched.CheckHandler(Static(11), 10); errString(err) != `weight 11: above 10, the most zone "api" can grant: such a request could never pass` {
		t.Errorf("CheckHandler(11) with a rule that may not match: %v", err)
	}
	if err := rs.CheckHandler(Static(11), 10); err != nil {
		t.Errorf("CheckHandler(11) with a rule for every request: %v, want nil (the handler's weight is never used)", err)
	}
}

// TestProvisionBadMatcher: a matcher that fails to load names whose rule
// it is and which rule.
func TestProvisionBadMatcher(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	bad := caddyhttp.RawMatcherSets{{"no_such_matcher": json.RawMessage(`{}`)}}
	_, err := Provision(ctx, []*Rule{{Weight: Static(1), MatcherSetsRaw: bad}}, `zone "api"`)
	const want = `zone "api": weights[0]: loading matchers: `
	if err == nil || len(err.Error()) < len(want) || err.Error()[:len(want)] != want {
		t.Errorf("Provision with an unknown matcher: %v, want an error starting %q", err, want)
	}
}
