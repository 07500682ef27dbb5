#!/usr/bin/env bash
# The denied path under a flood, on loopback: requests per second that Caddy
# answers with 429 to one client over its limit, and the log each server
# writes meanwhile. Four servers, each built with xcaddy at Caddy v2.11.9:
#
#   respond-429      plain Caddy, `respond 429` (a static response)
#   error-429        plain Caddy, `error 429`: Caddy's error path, which a
#                    rate limiter's denial takes so that handle_errors works
#   floodgate        floodgate, a per-client zone of 1 request per hour
#   caddy-ratelimit  mholt/caddy-ratelimit v0.1.0, the same zone
#
# The client (wrk, 32 connections, all from 127.0.0.1) is over its limit
# from the first request on, so every response measured is a 429 (checked).
# Servers run in alternating rounds (the machine is shared and noisy: only
# ratios from one run mean anything). Each server logs at INFO to its own
# file; the script prints the bytes each wrote during the rounds.
#
# Needs: Go, wrk (apt-get install -y wrk). Uses ports 9721-9734 on 127.0.0.1
# and measures under /tmp/floodgate-bench.lock, so that benchmarks do not
# overlap (set FLOODGATE_BENCH_LOCKED=1 if the caller holds it already).
# Knobs: ROUNDS (3), DURATION (10s), CONNS (32), OUT (a temp dir; binaries
# already in OUT are reused).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
CONNS=${CONNS:-32}
. bench/caddies.sh
# Build first, then wait for other benchmarks to finish: the lock is held
# from here until the script exits.
if [ -z "${FLOODGATE_BENCH_LOCKED:-}" ]; then
	exec 9>/tmp/floodgate-bench.lock
	flock 9
fi

servers=(respond-429 error-429 floodgate caddy-ratelimit)
declare -A BIN=([respond-429]=caddy-plain [error-429]=caddy-plain [floodgate]=caddy-floodgate [caddy-ratelimit]=caddy-ratelimit)
declare -A PORT=([respond-429]=9721 [error-429]=9722 [floodgate]=9723 [caddy-ratelimit]=9724)

config() { # server port admin-port
	local order="" handle
	case $1 in
	respond-429) handle='respond 429' ;;
	error-429) handle='error 429' ;;
	*)
		[ "$1" = caddy-ratelimit ] && order="order rate_limit before basic_auth"
		handle='rate_limit {
		zone per_client {
			key {remote_host}
			events 1
			window 1h
		}
	}
	respond "ok"' ;;
	esac
	cat >"$OUT/$1.Caddyfile" <<CADDY
{
	admin 127.0.0.1:$3
	auto_https off
	persist_config off
	$order
	log default {
		output file $OUT/$1.log
		level INFO
	}
}
http://127.0.0.1:$2 {
	$handle
}
CADDY
}

declare -A PID
cleanup() { for s in "${servers[@]}"; do [ -n "${PID[$s]:-}" ] && kill "${PID[$s]}" 2>/dev/null || true; done; }
trap cleanup EXIT
for s in "${servers[@]}"; do
	port=${PORT[$s]}
	config "$s" "$port" $((port + 10))
	: >"$OUT/$s.log"
	XDG_DATA_HOME="$OUT/$s.data" XDG_CONFIG_HOME="$OUT/$s.config" \
		"$OUT/${BIN[$s]}" run --config "$OUT/$s.Caddyfile" --adapter caddyfile >"$OUT/$s.out" 2>&1 &
	PID[$s]=$!
done
for s in "${servers[@]}"; do
	url="http://127.0.0.1:${PORT[$s]}/"
	for _ in $(seq 100); do curl -s -o /dev/null "$url" && break; sleep 0.1; done
	# The rate limiters' first request is allowed; every later one must be
	# a 429, as it is for the plain servers.
	curl -s -o /dev/null "$url"
	code=$(curl -s -o /dev/null -w '%{http_code}' "$url")
	[ "$code" = 429 ] || { echo "$s answers $code, want 429:" >&2; cat "$OUT/$s.out" >&2; exit 1; }
done

size() { stat -c %s "$OUT/$1.log"; }

echo "== denied requests: $ROUNDS rounds of $DURATION, $CONNS connections, one client over its limit"
declare -A SUM LOG REQS
for r in $(seq "$ROUNDS"); do
	for s in "${servers[@]}"; do
		before=$(size "$s")
		wrk -t2 -c"$CONNS" -d"$DURATION" "http://127.0.0.1:${PORT[$s]}/" >"$OUT/$s.wrk.$r.txt"
		after=$(size "$s")
		rps=$(awk '/Requests\/sec/ {print $2}' "$OUT/$s.wrk.$r.txt")
		sent=$(awk '/requests in/ {print $1}' "$OUT/$s.wrk.$r.txt")
		non2xx=$(awk '/Non-2xx/ {print $NF}' "$OUT/$s.wrk.$r.txt")
		[ "${non2xx:-0}" = "$sent" ] || { echo "$s: $sent requests but ${non2xx:-0} non-2xx responses" >&2; exit 1; }
		SUM[$s]=$(awk -v a="${SUM[$s]:-0}" -v b="$rps" 'BEGIN {print a + b}')
		LOG[$s]=$((${LOG[$s]:-0} + after - before))
		REQS[$s]=$((${REQS[$s]:-0} + sent))
		printf 'round %d  %-16s %10.0f req/s  %10d log bytes\n' "$r" "$s" "$rps" $((after - before))
	done
done
mean() { awk -v a="${SUM[$1]}" -v n="$ROUNDS" 'BEGIN {print a / n}'; }
respond=$(mean respond-429)
errpath=$(mean error-429)
printf '%-16s %10s  %9s  %9s  %12s  %s\n' server 'req/s' 'vs error' 'vs respond' 'log bytes' 'per 1000 denials'
for s in "${servers[@]}"; do
	m=$(mean "$s")
	awk -v m="$m" -v e="$errpath" -v r="$respond" -v s="$s" -v l="${LOG[$s]}" -v n="${REQS[$s]}" \
		'BEGIN {printf "%-16s %10.0f  %9.3f  %9.3f  %12d  %.1f\n", s, m, m / e, m / r, l, 1000 * l / n}'
done
echo "binaries, configs, logs and wrk output in $OUT"
