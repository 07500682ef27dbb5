#!/bin/bash
# From the repository's root: BenchmarkAllow's floodgate (token buckets) and
# floodgate_window (a window zone) against their floors in ROUNDS (default
# 8) back-to-back runs, and the ratio within each run.
#
# A shared VM's speed drifts by ±20% over minutes, more than the gap being
# measured, so sub-benchmarks run minutes apart (as in one -count 5 run of
# BenchmarkAllow) compare different machines. Each round here runs the
# sub-benchmarks within about twenty seconds; the ratios of a round are
# comparable, and their median over the rounds is the figure to quote.
#
# BASE=<revision> also builds that revision's limiter (with this tree's
# bench_test.go, so both run the same sub-benchmarks) and runs it in every
# round beside this tree's, the order swapped from round to round: each
# version's ratios, and this tree's ns/op over the base's in the same round.
set -euo pipefail
command -v python3 >/dev/null || { echo "python3 is needed: apt-get install -y python3" >&2; exit 1; }
ROUNDS=${ROUNDS:-8}
BASE=${BASE:-}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
go test -c -o "$dir/new.test" ./limiter
bins=(new)
if [ -n "$BASE" ]; then
	mkdir "$dir/base"
	git archive "$BASE" | tar -x -C "$dir/base"
	cp limiter/bench_test.go "$dir/base/limiter/"
	(cd "$dir/base" && go test -c -o "$dir/base.test" ./limiter)
	bins=(base new)
fi
subs='floodgate|floodgate_window|floor_rmw_clock|floor_rmw_k_clock|floor_rmw_clock_window|floor_rmw_k_clock_window'
for i in $(seq 1 "$ROUNDS"); do
	order=("${bins[@]}")
	if [ $((i % 2)) = 0 ] && [ ${#bins[@]} = 2 ]; then
		order=(new base)
	fi
	for v in "${order[@]}"; do
		"$dir/$v.test" -test.run XXX -test.bench "BenchmarkAllow/($subs)(_parallel)?\$" -test.count 1 |
			awk -v v="$v" '/^BenchmarkAllow/ { sub(/-[0-9]+$/, "", $1); sub(/^BenchmarkAllow\//, "", $1); print v, $1, $3 }'
	done
	echo
done | python3 -c '
import statistics, sys
rounds = []
for r in sys.stdin.read().strip().split("\n\n"):
    d = {}
    for l in r.splitlines():
        v, name, ns = l.split()
        d.setdefault(v, {})[name] = float(ns)
    rounds.append(d)
versions = [v for v in ("base", "new") if v in rounds[0]]
def line(label, xs, fmt):
    print(f"{label}: median {fmt(statistics.median(xs))}, range {fmt(min(xs))}-{fmt(max(xs))} over {len(xs)} rounds")
ratio = lambda x: f"{x:.2f}"
ns = lambda x: f"{x:.1f}"
for v in versions:
    tag = v + " " if len(versions) > 1 else ""
    for mode, sfx in (("serial", ""), ("parallel", "_parallel")):
        # floor_rmw_clock_window and floor_rmw_k_clock_window against
        # floor_rmw_clock: what the window table costs any design before
        # it decides anything.
        for name, floor in (("floodgate", "floor_rmw_clock"), ("floodgate", "floor_rmw_k_clock"),
                            ("floodgate_window", "floor_rmw_clock"), ("floodgate_window", "floor_rmw_clock_window"),
                            ("floodgate_window", "floor_rmw_k_clock_window"), ("floodgate_window", "floodgate"),
                            ("floor_rmw_clock_window", "floor_rmw_clock"), ("floor_rmw_k_clock_window", "floor_rmw_clock")):
            line(f"{tag}{mode:8} {name:24} / {floor:24}", [r[v][name + sfx] / r[v][floor + sfx] for r in rounds], ratio)
        for name in ("floodgate", "floodgate_window", "floor_rmw_clock", "floor_rmw_k_clock", "floor_rmw_clock_window", "floor_rmw_k_clock_window"):
            line(f"{tag}{mode:8} {name:24} ns/op", [r[v][name + sfx] for r in rounds], ns)
if len(versions) > 1:
    for mode, sfx in (("serial", ""), ("parallel", "_parallel")):
        for name in ("floodgate", "floodgate_window"):
            line(f"new/base {mode:8} {name:24}", [r["new"][name + sfx] / r["base"][name + sfx] for r in rounds], ratio)
'
