package floodgate

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// The README's xcaddy command builds what the test suite tests: the Caddy
// version and every module it pins are the ones go.mod requires, and
// xcaddy is go.mod's tool. A pin left behind by a go.mod upgrade would
// build operators a Caddy, or a Redis storage, that no test has run.
func TestREADMEBuildCommandMatchesGoMod(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	required := map[string]string{}
	tool, inTools := false, false
	for line := range strings.Lines(string(gomod)) {
		s := strings.TrimSpace(line)
		f := strings.Fields(strings.TrimPrefix(s, "require "))
		if len(f) >= 2 && strings.Contains(f[0], ".") && strings.HasPrefix(f[1], "v") {
			required[f[0]] = f[1]
		}
		// A tool line alone, or in a tool ( … ) block (go.mod has bpf2go too).
		inTools = s == "tool (" || inTools && s != ")"
		tool = tool || s == "tool github.com/caddyserver/xcaddy/cmd/xcaddy" || inTools && s == "github.com/caddyserver/xcaddy/cmd/xcaddy"
	}
	if !tool {
		t.Error("go.mod has no tool line for xcaddy, which the README's `go tool xcaddy` runs")
	}
	cmd := regexp.MustCompile(`(?s)go tool xcaddy build (\S+) .*?\n` + "```").FindStringSubmatch(string(readme))
	if cmd == nil {
		t.Fatal("the README has no `go tool xcaddy build <version>` command")
	}
	if want := required["github.com/caddyserver/caddy/v2"]; cmd[1] != want {
		t.Errorf("the README builds Caddy %s, go.mod requires %s", cmd[1], want)
	}
	withs := regexp.MustCompile(`--with (\S+?)@(\S+?)(=\S+)?\s`).FindAllStringSubmatch(cmd[0], -1)
	redis := false
	for _, w := range withs {
		mod, version, replaced := w[1], w[2], w[3] != ""
		switch {
		case mod == "github.com/floodgate-rl/floodgate":
			if !replaced {
				t.Errorf("the README builds floodgate from %s, not from the checkout (=.)", version)
			}
		case required[mod] == "":
			t.Errorf("the README builds in %s, which go.mod does not require", mod)
		case required[mod] != version:
			t.Errorf("the README builds %s %s, go.mod requires %s", mod, version, required[mod])
		}
		redis = redis || mod == "github.com/pberkel/caddy-storage-redis"
	}
	if len(withs) < 2 || !redis {
		t.Errorf("the README's build has %d modules %v, want floodgate and the Redis storage", len(withs), withs)
	}
}
