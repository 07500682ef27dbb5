#!/bin/bash
# From the repository's root: BenchmarkAllow's floodgate (token buckets) and
# floodgate_window (a window zone) against their floors in ROUNDS (default
# 8) back-to-back runs, and the ratio within each run.
#
# A shared VM's speed drifts by ±20% over minutes, more than the gap being
# measured, so sub-benchmarks run minutes apart (as in one -count 5 run of
# BenchmarkAllow) compare different machines. Each round here runs the
# three sub-benchmarks within about ten seconds; the ratios of a round are
# comparable, and their median over the rounds is the figure to quote.
set -euo pipefail
command -v python3 >/dev/null || { echo "python3 is needed: apt-get install -y python3" >&2; exit 1; }
ROUNDS=${ROUNDS:-8}
bin=$(mktemp -d)/limiter.test
go test -c -o "$bin" ./limiter
for i in $(seq 1 "$ROUNDS"); do
	"$bin" -test.run XXX -test.bench 'BenchmarkAllow/(floodgate|floodgate_window|floor_rmw_clock|floor_rmw_k_clock|floor_rmw_clock_window)(_parallel)?$' -test.count 1 |
		awk '/^BenchmarkAllow/ { sub(/-[0-9]+$/, "", $1); sub(/^BenchmarkAllow\//, "", $1); print $1, $3 }'
	echo
done | python3 -c '
import statistics, sys
rounds = [dict((l.split()[0], float(l.split()[1])) for l in r.splitlines()) for r in sys.stdin.read().strip().split("\n\n")]
for mode, sfx in (("serial", ""), ("parallel", "_parallel")):
    for name, floor in (("floodgate", "floor_rmw_clock"), ("floodgate", "floor_rmw_k_clock"),
                        ("floodgate_window", "floor_rmw_clock"), ("floodgate_window", "floor_rmw_clock_window"),
                        ("floodgate_window", "floodgate")):
        rs = [r[name + sfx] / r[floor + sfx] for r in rounds]
        print(f"{mode:8} {name:16} / {floor:22}: median {statistics.median(rs):.2f}, range {min(rs):.2f}-{max(rs):.2f} over {len(rs)} rounds")
    for name in ("floodgate", "floodgate_window", "floor_rmw_clock", "floor_rmw_k_clock", "floor_rmw_clock_window"):
        ns = [r[name + sfx] for r in rounds]
        print(f"{mode:8} {name:22} ns/op: median {statistics.median(ns):.1f}, range {min(ns):.1f}-{max(ns):.1f}")
'
