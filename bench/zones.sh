#!/usr/bin/env bash
# What several zones on one route cost an allowed request, on loopback:
# plain Caddy (`respond`), and one Caddy with floodgate serving /one (a
# zone keyed by the X-Key header, `events 100000 window 10s` and
# `quota 10000000 1h`) and /four (four such zones, all keyed by X-Key), all
# allowing everything. wrk sends a random X-Key of a million per request
# (the same Lua script for every server), so that the tables and sketches
# are read from memory, as under real traffic, not from one hot line. The
# targets are measured in alternating rounds (the machine is shared and
# noisy: only ratios measured in the same round mean anything); each
# round's ratio to plain Caddy is printed, then their median and range.
#
# BEFORE=<a caddy with floodgate> adds that binary's /one and /four to every
# round (an older commit's build: before and after in the same run).
#
# Needs: Go, wrk, python3. Ports are picked free at run time.
# Knobs: ROUNDS (5), DURATION (5s), CONNS (32), OUT (a temp dir), BEFORE.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-5s}
CONNS=${CONNS:-32}
. bench/caddies.sh

zone() { # name
	cat <<ZONE
		zone $1 {
			key {http.request.header.X-Key}
			events 100000
			window 10s
			quota 10000000 1h
		}
ZONE
}
body() { # server name: what it serves
	local body='	respond "ok"'
	if [ "$1" != caddy-plain ]; then
		body="	handle /one {
		rate_limit {
$(zone one)
		}
		respond \"ok\"
	}
	handle /four {
		rate_limit {
$(zone a)
$(zone b)
$(zone c)
$(zone d)
		}
		respond \"ok\"
	}"
	fi
	echo "$body"
}
cat >"$OUT/keys.lua" <<'LUA'
local threads = 0
function setup(thread)
	threads = threads + 1
	thread:set("id", threads)
end
function init(args)
	math.randomseed(os.time() * 16 + id)
end
request = function()
	return wrk.format(nil, nil, { ["X-Key"] = "user-" .. math.random(1, 1000000) })
end
LUA

servers=(caddy-plain caddy-floodgate)
if [ -n "${BEFORE:-}" ]; then
	cp "$BEFORE" "$OUT/caddy-before"
	servers+=(caddy-before)
fi
trap stop_servers EXIT
for s in "${servers[@]}"; do serve "$s" zones "$(body "$s")"; done
targets=("caddy-plain /")
for s in "${servers[@]:1}"; do targets+=("$s /one" "$s /four"); done
for s in "${servers[@]}"; do
	path=/one
	[ "$s" = caddy-plain ] && path=/
	for _ in $(seq 300); do curl -fs "http://127.0.0.1:${PORT[$s]}$path" >/dev/null && break; sleep 0.1; done
done
# The zones must really be in the path: their headers show them.
for s in "${servers[@]:1}"; do
	for path in /one /four; do
		want=$([ $path = /one ] && echo 2 || echo 8)
		got=$(curl -fsi -H 'X-Key: probe' "http://127.0.0.1:${PORT[$s]}$path" | grep -i '^RateLimit:' | tr ',' '\n' | grep -c ';r=' || true)
		[ "$got" = "$want" ] || { echo "$s $path answers with $got RateLimit items, not $want:" >&2; cat "$OUT/$s.zones.log" >&2; exit 1; }
	done
done

echo "== throughput: $ROUNDS rounds of $DURATION, $CONNS connections, targets alternating"
for r in $(seq "$ROUNDS"); do
	for t in "${targets[@]}"; do
		read -r s path <<<"$t"
		out=$(wrk -t2 -c"$CONNS" -d"$DURATION" -s "$OUT/keys.lua" "http://127.0.0.1:${PORT[$s]}$path")
		rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
		if grep -q 'Non-2xx' <<<"$out"; then
			echo "$t answered something else than 200:" >&2
			echo "$out" >&2
			exit 1
		fi
		printf 'round %d %-24s %10.0f req/s\n' "$r" "$t" "$rps"
	done
done | tee "$OUT/zones.txt"
python3 - "$OUT/zones.txt" <<'PY'
import statistics, sys, collections
rps = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    f = line.split()
    rps[int(f[1])][" ".join(f[2:-2])] = float(f[-2])
names = list(rps[1])
for n in names:
    ratios = [r[n] / r["caddy-plain /"] for r in rps.values()]
    means = [r[n] for r in rps.values()]
    print(f"{n:24} {statistics.median(means):8.0f} req/s (median)  ratio to plain Caddy: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
if "caddy-before /four" in names:
    for p in ("/one", "/four"):
        ratios = [r["caddy-floodgate " + p] / r["caddy-before " + p] for r in rps.values()]
        print(f"this build {p} / before {p}: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
PY
