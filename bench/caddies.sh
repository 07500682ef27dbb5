# Sourced by the benchmark scripts, from the repository's root: builds into
# $OUT (default: a new temp dir) the three Caddy binaries they compare, each
# with xcaddy at Caddy v2.11.9, unless OUT already holds them:
# caddy-plain, caddy-floodgate (this checkout) and caddy-ratelimit
# (mholt/caddy-ratelimit v0.1.0). Checks that wrk is installed.
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install -y wrk" >&2; exit 1; }

export CADDY_VERSION=v2.11.9
build() { # name, extra xcaddy args...
	local name=$1; shift
	[ -x "$OUT/$name" ] && return
	echo "building $name" >&2
	go tool xcaddy build v2.11.9 --output "$OUT/$name" "$@" >"$OUT/$name.build.log" 2>&1 ||
		{ cat "$OUT/$name.build.log" >&2; exit 1; }
}
build caddy-plain
build caddy-floodgate --with "github.com/floodgate-rl/floodgate@v0.0.0-00010101000000-000000000000=$PWD"
build caddy-ratelimit --with github.com/mholt/caddy-ratelimit@v0.1.0
