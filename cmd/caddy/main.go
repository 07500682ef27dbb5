// Command caddy is Caddy with the standard modules, floodgate and the Redis
// storage module (caddy.storage.redis, for clusters), for the quick start and
// for tests: `go run ./cmd/caddy run --config testdata/Caddyfile`.
// For production builds use xcaddy (see the README).
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/pberkel/caddy-storage-redis"

	_ "github.com/floodgate-rl/floodgate"
)

func main() {
	caddycmd.Main()
}
