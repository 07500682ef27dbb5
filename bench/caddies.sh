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

# For the scripts that measure with wrk: free_port prints a port free on
# 127.0.0.1 now; serve NAME RUN BODY writes $OUT/NAME.RUN.Caddyfile, which
# serves BODY on a free port (PORT[NAME]) with its admin API on another and
# its logs discarded, and starts $OUT/NAME with it (PID[NAME]; its output in
# $OUT/NAME.RUN.log); stop_servers stops every server serve started.
declare -A PORT PID
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
serve() { # name, run, body
	PORT[$1]=$(free_port)
	cat >"$OUT/$1.$2.Caddyfile" <<CADDY
{
	admin 127.0.0.1:$(free_port)
	auto_https off
	persist_config off
	log default {
		output discard
	}
}
http://127.0.0.1:${PORT[$1]} {
$3
}
CADDY
	XDG_DATA_HOME="$OUT/$1.data" XDG_CONFIG_HOME="$OUT/$1.config" \
		"$OUT/$1" run --config "$OUT/$1.$2.Caddyfile" --adapter caddyfile >"$OUT/$1.$2.log" 2>&1 &
	PID[$1]=$!
}
stop_servers() { for s in "${!PID[@]}"; do kill "${PID[$s]}" 2>/dev/null || true; done; }
