// Package incumbent runs caddy-ratelimit's own black-box tests
// (caddyfile_test.go and handler_test.go, ported with their assertions
// unchanged) against floodgate in a real, in-process Caddy: a
// caddy-ratelimit Caddyfile or JSON config keeps its meaning. The ports
// are picked free at run time.
package incumbent

import (
	"os"
	"testing"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/floodgate-rl/floodgate"

	"github.com/floodgate-rl/floodgate/caddytest/incumbent/internal/caddytest"
	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

func TestMain(m *testing.M) {
	ports := testcaddy.MustFreePorts(3)
	caddytest.Ports(ports[0], ports[1], ports[2])
	os.Exit(testcaddy.Main(m, "incumbent", ports[0]))
}
