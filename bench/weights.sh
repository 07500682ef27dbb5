#!/usr/bin/env bash
# What weight response_status and weight response_time cost an allowed
# request, on loopback: plain Caddy, and one Caddy with floodgate serving
# /none (no rate_limit), /zone (a per-client zone that allows everything),
# /status (the same zone with weight response_status 401 403) and /time
# (the same with weight response_time), measured with wrk in alternating
# rounds (the machine is shared and noisy: only ratios measured in the same
# run mean anything). Prints requests/s and the ratio to plain Caddy.
#
# Needs: Go, wrk, python3. Ports are picked free at run time.
# Knobs: ROUNDS (3), DURATION (5s), CONNS (32), OUT (a temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5s}
CONNS=${CONNS:-32}
. bench/caddies.sh

zone() { # name, extra setting
	cat <<ZONE
	rate_limit {
		zone $1 {
			key {remote_host}
			events 1000000
			window 1s
			burst 1000000
			$2
		}
	}
ZONE
}
body() { # server name: what it serves
	local body='	respond "ok"'
	if [ "$1" = caddy-floodgate ]; then
		body="	handle /none {
		respond \"ok\"
	}
	handle /zone {
$(zone plain "")
		respond \"ok\"
	}
	handle /status {
$(zone failed "weight response_status 401 403")
		respond \"ok\"
	}
	handle /time {
$(zone timed "weight response_time")
		respond \"ok\"
	}"
	fi
	echo "$body"
}

servers=(caddy-plain caddy-floodgate)
trap stop_servers EXIT
for s in "${servers[@]}"; do serve "$s" weights "$(body "$s")"; done
targets=("caddy-plain /" "caddy-floodgate /none" "caddy-floodgate /zone" "caddy-floodgate /status" "caddy-floodgate /time")
for s in "${servers[@]}"; do
	for _ in $(seq 100); do curl -fs "http://127.0.0.1:${PORT[$s]}/none" >/dev/null && break; sleep 0.1; done
done
for t in "${targets[@]}"; do
	read -r s path <<<"$t"
	curl -fs "http://127.0.0.1:${PORT[$s]}$path" >/dev/null || { echo "$s $path does not answer:" >&2; cat "$OUT/$s.weights.log" >&2; exit 1; }
done
# The zones must really be in the path: their headers show them.
for z in plain failed timed; do
	path=$(case $z in plain) echo /zone ;; failed) echo /status ;; timed) echo /time ;; esac)
	curl -fsi "http://127.0.0.1:${PORT[caddy-floodgate]}$path" | grep -qi "^RateLimit-Policy: \"$z\"" ||
		{ echo "zone $z is not answering with its headers" >&2; exit 1; }
done

echo "== throughput: $ROUNDS rounds of $DURATION, $CONNS connections, targets alternating"
declare -A SUM
for r in $(seq "$ROUNDS"); do
	for t in "${targets[@]}"; do
		read -r s path <<<"$t"
		rps=$(wrk -t2 -c"$CONNS" -d"$DURATION" "http://127.0.0.1:${PORT[$s]}$path" | awk '/Requests\/sec/ {print $2}')
		SUM[$t]=$(awk -v a="${SUM[$t]:-0}" -v b="$rps" 'BEGIN {print a + b}')
		printf 'round %d  %-24s %10.0f req/s\n' "$r" "$t" "$rps"
	done
done
plain=$(awk -v a="${SUM[caddy-plain /]}" -v n="$ROUNDS" 'BEGIN {print a / n}')
for t in "${targets[@]}"; do
	awk -v a="${SUM[$t]}" -v n="$ROUNDS" -v p="$plain" -v t="$t" \
		'BEGIN {printf "mean %-24s %10.0f req/s  ratio to plain Caddy %.3f\n", t, a / n, a / n / p}'
done
