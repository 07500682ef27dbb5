#!/usr/bin/env bash
# Load comparison on loopback: plain Caddy, Caddy with floodgate, and Caddy
# with mholt/caddy-ratelimit v0.1.0, each built with xcaddy from the module
# proxy at Caddy v2.11.9.
#
#   1. Throughput: a per-client zone that allows everything, measured with
#      wrk against each server in alternating rounds (the machine is shared
#      and noisy: only ratios measured in the same run mean anything).
#      Prints requests/s and the ratio to plain Caddy.
#   2. Memory: resident memory of each rate limiter before and after a flood
#      of KEYS distinct keys (a header per request) at 100 events per 10 s.
#
# Needs: Go, wrk (apt-get install -y wrk). Uses ports 9701-9713 on 127.0.0.1.
# Knobs: ROUNDS (3), DURATION (10s), CONNS (64), KEYS (200000), OUT (a temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
CONNS=${CONNS:-64}
KEYS=${KEYS:-200000}
. bench/caddies.sh

# Each server: / is limited per client (by remote address) with a limit no
# benchmark reaches; /flood is limited per X-Key header at 100 per 10s.
config() { # name port admin-port
	local zones="" order=""
	[ "$1" = caddy-ratelimit ] && order="order rate_limit before basic_auth"
	case $1 in
	caddy-plain) ;;
	*) zones='
	@flood path /flood
	rate_limit @flood {
		zone per_key {
			key {http.request.header.X-Key}
			events 100
			window 10s
		}
	}
	@rest not path /flood
	rate_limit @rest {
		zone per_client {
			key {remote_host}
			events 1000000
			window 1s
		}
	}' ;;
	esac
	cat >"$OUT/$1.Caddyfile" <<CADDY
{
	admin 127.0.0.1:$3
	auto_https off
	persist_config off
	$order
	log default {
		output discard
	}
}
http://127.0.0.1:$2 {$zones
	respond "ok"
}
CADDY
}

declare -A PORT=([caddy-plain]=9701 [caddy-floodgate]=9702 [caddy-ratelimit]=9703)
declare -A PID
servers=(caddy-plain caddy-floodgate caddy-ratelimit)
cleanup() { for s in "${servers[@]}"; do [ -n "${PID[$s]:-}" ] && kill "${PID[$s]}" 2>/dev/null || true; done; }
trap cleanup EXIT
for s in "${servers[@]}"; do
	port=${PORT[$s]}
	config "$s" "$port" $((port + 10))
	XDG_DATA_HOME="$OUT/$s.data" XDG_CONFIG_HOME="$OUT/$s.config" \
		"$OUT/$s" run --config "$OUT/$s.Caddyfile" --adapter caddyfile >"$OUT/$s.log" 2>&1 &
	PID[$s]=$!
done
for s in "${servers[@]}"; do
	for _ in $(seq 100); do curl -fs "http://127.0.0.1:${PORT[$s]}/" >/dev/null && break; sleep 0.1; done
	curl -fs "http://127.0.0.1:${PORT[$s]}/" >/dev/null || { echo "$s did not start:" >&2; cat "$OUT/$s.log" >&2; exit 1; }
done

# The floodgate zone must really be in the path: its headers show it.
curl -fsi "http://127.0.0.1:${PORT[caddy-floodgate]}/" | grep -qi '^RateLimit-Policy: "per_client"' ||
	{ echo "floodgate's per_client zone is not answering with its headers" >&2; exit 1; }

rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; } # KiB

echo "== throughput: $ROUNDS rounds of $DURATION, $CONNS connections, servers alternating"
declare -A SUM
for r in $(seq "$ROUNDS"); do
	for s in "${servers[@]}"; do
		rps=$(wrk -t2 -c"$CONNS" -d"$DURATION" "http://127.0.0.1:${PORT[$s]}/" | awk '/Requests\/sec/ {print $2}')
		SUM[$s]=$(awk -v a="${SUM[$s]:-0}" -v b="$rps" 'BEGIN {print a + b}')
		printf 'round %d  %-16s %10.0f req/s\n' "$r" "$s" "$rps"
	done
done
plain=$(awk -v a="${SUM[caddy-plain]}" -v n="$ROUNDS" 'BEGIN {print a / n}')
for s in "${servers[@]}"; do
	awk -v a="${SUM[$s]}" -v n="$ROUNDS" -v p="$plain" -v s="$s" \
		'BEGIN {printf "mean %-16s %10.0f req/s  ratio to plain Caddy %.3f\n", s, a / n, a / n / p}'
done

echo "== memory: a flood of $KEYS distinct keys at 100 events per 10s"
cat >"$OUT/flood.lua" <<'LUA'
local counter, base = 0, 0
local threads = {}
function setup(thread)
	thread:set("id", #threads)
	table.insert(threads, thread)
end
function init(args)
	base = tonumber(id) * tonumber(os.getenv("KEYS_PER_THREAD"))
end
function request()
	counter = counter + 1
	return wrk.format("GET", "/flood", { ["X-Key"] = "k" .. (base + counter % tonumber(os.getenv("KEYS_PER_THREAD"))) })
end
LUA
for s in caddy-floodgate caddy-ratelimit; do
	pid=${PID[$s]}
	before=$(rss "$pid")
	# Enough requests for every key at least once: keep going until the
	# flood has sent KEYS requests (two threads, each its own half).
	KEYS_PER_THREAD=$((KEYS / 2)) wrk -t2 -c"$CONNS" -d"${FLOOD_DURATION:-30s}" -s "$OUT/flood.lua" \
		"http://127.0.0.1:${PORT[$s]}/" >"$OUT/$s.flood.txt"
	sent=$(awk '/requests in/ {print $1}' "$OUT/$s.flood.txt")
	after=$(rss "$pid")
	printf '%-16s %8d requests sent; RSS %6.1f MiB -> %6.1f MiB (+%.1f MiB)\n' "$s" "$sent" \
		"$(awk -v k="$before" 'BEGIN {print k / 1024}')" "$(awk -v k="$after" 'BEGIN {print k / 1024}')" \
		"$(awk -v a="$after" -v b="$before" 'BEGIN {print (a - b) / 1024}')"
done
echo "binaries and logs in $OUT"
