package testcaddy

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

// RateLimit runs `caddy rate-limit args...` as Caddy's command line would,
// against the admin endpoint on localhost:adminPort unless args name
// another address or a config, and returns what it printed.
func RateLimit(t testing.TB, adminPort int, args ...string) (string, error) {
	t.Helper()
	cmd, ok := caddycmd.Commands()["rate-limit"]
	if !ok {
		t.Fatal("no rate-limit command registered")
	}
	c := &cobra.Command{Use: cmd.Name}
	cmd.CobraFunc(c)
	var out bytes.Buffer
	c.SetOut(&out)
	c.SetErr(&out)
	if a := strings.Join(args, " "); !strings.Contains(a, "--address") && !strings.Contains(a, "--config") {
		args = append(args, "--address", fmt.Sprintf("localhost:%d", adminPort))
	}
	c.SetArgs(args)
	err := c.Execute()
	return out.String(), err
}
