#!/usr/bin/env bash
# Regenerates docs/performance.md, its plots (docs/perf-*.png) and its data
# (docs/perf/*.csv) from one run, from the repository's root:
#
#   bench/perf.sh
#
# It builds plain Caddy, Caddy with this checkout of floodgate and Caddy
# with mholt/caddy-ratelimit v0.1.0 (bench/caddies.sh, xcaddy at v2.11.9),
# runs bench/perf's measurements (memory against distinct keys, allowed and
# denied requests/s with wrk, an attack timeline, false denials as a table
# fills), the fleet benchmark (storage's BenchmarkFleet: 2 to 128 instances
# of one distributed zone over an in-memory storage and a redis-server, sync
# every 1 s and 5 s) and the soak (bench/soak: three instances on one redis-server,
# floods, reloads, SIGKILLs; SOAK=10m by default, SOAK=0 keeps the committed
# soak data), then plots with gnuplot and writes the page.
#
# Needs: Go, wrk, gnuplot (apt-get install -y wrk gnuplot-nox), redis-server
# for the soak. Servers listen on free loopback ports. Knobs: ROUNDS (3),
# DURATION (5s per wrk run), KEYS (200000), FLEET (5x, the fleet
# benchmark's -benchtime), SOAK (10m), OUT (binaries);
# PAGE=1 only plots and writes the page from the data already in docs/perf;
# SOAK_ONLY=1 runs only the soak (recording its own date and commit in
# docs/perf/soak-run.txt), FLEET_ONLY=1 only the fleet benchmark (in
# docs/perf/fleet-run.txt), then plots and writes the page.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5s}
KEYS=${KEYS:-200000}
FLEET=${FLEET:-5x}
SOAK=${SOAK:-10m}
command -v gnuplot >/dev/null || { echo "gnuplot is needed: apt-get install -y gnuplot-nox" >&2; exit 1; }
data=docs/perf
mkdir -p "$data"

if [ -n "${SOAK_ONLY:-}" ]; then
	OUT=${OUT:-$(mktemp -d)}
	go build -o "$OUT/caddy-cmd" ./cmd/caddy
	printf 'date=%s\ncommit=%s\n' "$(date -u +%Y-%m-%d)" "$(git rev-parse --short HEAD)" >"$data/soak-run.txt"
	(cd bench/soak && go run . -caddy "$OUT/caddy-cmd" -duration "$SOAK" -out "../../$data/soak.csv") |
		tee "$data/soak.txt" || true
elif [ -n "${FLEET_ONLY:-}" ]; then
	printf 'date=%s\ncommit=%s\n' "$(date -u +%Y-%m-%d)" "$(git rev-parse --short HEAD)" >"$data/fleet-run.txt"
	go test -run - -bench 'Fleet$' -benchtime "$FLEET" ./storage | tee "$data/fleet.txt"
elif [ -z "${PAGE:-}" ]; then
	. bench/caddies.sh
	# One benchmark at a time on the machine (see bench/deny.sh).
	exec 9>/tmp/floodgate-bench.lock
	flock 9
	(cd bench/perf && go build -o "$OUT/perf" .)
	printf 'date=%s\ncommit=%s\ncores=%s\narch=%s\n' "$(date -u +%Y-%m-%d)" "$(git rev-parse --short HEAD)" "$(nproc)" "$(uname -m)" >"$data/run.txt"
	"$OUT/perf" -bins "$OUT" -out "$data" -rounds "$ROUNDS" -duration "$DURATION" -keys "$KEYS" \
		falsedeny memory throughput timeline | tee "$data/perf.log"
	cp "$data/run.txt" "$data/fleet-run.txt"
	go test -run - -bench 'Fleet$' -benchtime "$FLEET" ./storage | tee "$data/fleet.txt"
	if [ "$SOAK" != 0 ]; then
		go build -o "$OUT/caddy-cmd" ./cmd/caddy
		cp "$data/run.txt" "$data/soak-run.txt"
		(cd bench/soak && go run . -caddy "$OUT/caddy-cmd" -duration "$SOAK" -out "../../$data/soak.csv") |
			tee "$data/soak.txt" || true
	fi
fi

# Plots.
plot() { # name, gnuplot commands
	gnuplot -e "set terminal pngcairo size 800,450 font 'sans,10'; set output 'docs/perf-$1.png'; set datafile separator ','; set key top left; set grid; $2"
}
plot memory "set title 'Resident memory against distinct keys (per-key zone, 100 events / 10 s)';
	set xlabel 'distinct keys sent'; set ylabel 'RSS (MiB)';
	plot '$data/memory.csv' every ::1 using 1:2 with linespoints lw 2 title 'floodgate',
	     '' every ::1 using 1:3 with linespoints lw 2 title 'caddy-ratelimit v0.1.0'"
# Each round's ratio to its baseline in the same round; the bars are the
# means, the whiskers the least and greatest round.
awk '/^throughput: round/ {
		r = $3; name = $4; for (i = 5; i < NF - 1; i++) name = name " " $i
		rps[r, name] = $(NF - 1); rounds[r] = 1
	}
	END {
		n = split("plain respond|floodgate allowed|caddy-ratelimit allowed|plain error 429|plain respond 429|floodgate denied|caddy-ratelimit denied", names, "|")
		for (i = 1; i <= n; i++) {
			base = (i <= 3) ? "plain respond" : "plain error 429"
			sum = 0; lo = 1e9; hi = 0; k = 0
			for (r in rounds) {
				x = rps[r, names[i]] / rps[r, base]; sum += x; k++
				if (x < lo) lo = x; if (x > hi) hi = x
			}
			label = (i <= 3 ? "allowed: " : "denied: ") names[i]
			sub(/ (allowed|denied)$/, "", label)
			printf "\"%s\",%.3f,%.3f,%.3f\n", label, sum / k, lo, hi
		}
	}' "$data/perf.log" >"$data/throughput-ratios.csv"
plot throughput "set title 'Requests/s as a ratio to plain Caddy in the same round (allowed: to respond; denied: to error 429)';
	set style fill solid 0.6; set boxwidth 0.6; set yrange [0:*]; set offsets 0, 0, graph 0.1, 0; set xtics rotate by -20; unset key;
	plot '$data/throughput-ratios.csv' using 0:2:xtic(1) with boxes, '' using 0:2:3:4 with yerrorbars pt 0 lc black,
	     '' using 0:(0.05):(sprintf('%.2f', \$2)) with labels"
plot timeline "set terminal pngcairo size 800,500 font 'sans,10'; set output 'docs/perf-timeline.png'; set title 'An attack on floodgate: 64 sources over their limit from 15 s to 45 s';
	set xlabel 'time (s)'; set ylabel 'requests/s'; set logscale y; set yrange [10:100000];
	set y2label 'fair clients served (%) / RSS (MiB)'; set y2tics; set ytics nomirror; set y2range [0:120];
	set key below horizontal;
	plot '$data/timeline.csv' every ::1 using 1:3 with lines lw 2 title 'flood sent/s',
	     '' every ::1 using 1:4 with lines lw 2 title 'flood allowed/s',
	     '' every ::1 using 1:(\$2*100) axes x1y2 with lines lw 2 title 'fair served (%)',
	     '' every ::1 using 1:5 axes x1y2 with lines lw 2 title 'RSS (MiB)'"
plot falsedeny "set title 'False denials as a 1 MiB table fills with flooding sources (K = 3)';
	set xlabel 'flooding sources per line'; set ylabel 'fresh keys denied'; set logscale y; set format y '%g';
	plot '$data/falsedeny.csv' every ::1 using 1:2 with points pt 7 ps 1.2 title 'measured',
	     '' every ::1 using 1:3 with lines lw 2 title 'estimated (EstimateFalseDeny)'"
# The fleet benchmark's metrics, by unit (go test prints them in any order),
# one line per storage, sync interval and fleet size.
if [ -s "$data/fleet.txt" ]; then
	awk 'BEGIN { print "storage,interval_s,instances,spread_allowed_per_limit,burst_allowed_per_limit,read_B_per_inst_interval,max_read_B_per_inst_interval,written_B_per_inst_interval,ns_per_inst_sync,retained_B_per_inst,reset_intervals,spread_noise_per_limit,failover_s,failover_granted,cpu_ns_per_inst_sync,aggregator_read_ns,max_sync_alloc_B" }
		/^BenchmarkFleet\/N=/ {
			split($1, p, "/"); n = p[2]; iv = p[3]; st = p[4]
			sub(/^N=/, "", n); sub(/^interval=/, "", iv); sub(/s$/, "", iv); sub(/^storage=/, "", st); sub(/-[0-9]+$/, "", st)
			delete m; for (i = 3; i < NF; i += 2) m[$(i + 1)] = $i
			printf "%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s\n", st, iv, n, m["spread-allowed/limit"], m["burst-allowed/limit"],
				m["read-B/inst/interval"], m["max-read-B/inst/interval"], m["written-B/inst/interval"], m["ns/inst/sync"],
				m["retained-B/inst"], m["reset-intervals"], m["spread-noise/limit"], m["failover-s"], m["failover-granted"],
				m["cpu-ns/inst/sync"], m["aggregator-read-ns"], m["max-sync-alloc-B"]
		}' "$data/fleet.txt" >"$data/fleet.csv"
	# Plot (e): over-admission against instances, one line per sync
	# interval (in-memory storage), and the storage traffic per instance.
	plot fleet "set terminal pngcairo size 1000,450 font 'sans,10'; set output 'docs/perf-fleet.png'; set multiplot layout 1,2;
		set datafile separator ','; set logscale x 2; set xrange [1.5:170]; set xlabel 'instances'; set key bottom left;
		set title 'Granted ÷ limit for one key (events 100 per hour)'; set ylabel 'allowed ÷ limit'; set yrange [0:1.3];
		plot '$data/fleet.csv' every ::1 using (strcol(1) eq 'memory' && \$2 == 1 ? \$3 : 1/0):4 with linespoints lw 2 pt 7 title 'spread, sync 1 s',
		     '' every ::1 using (strcol(1) eq 'memory' && \$2 == 5 ? \$3 : 1/0):4 with linespoints lw 2 pt 6 title 'spread, sync 5 s',
		     '' every ::1 using (strcol(1) eq 'memory' && \$2 == 1 ? \$3 : 1/0):5 with linespoints lw 2 pt 5 title 'burst, sync 1 s',
		     '' every ::1 using (strcol(1) eq 'memory' && \$2 == 5 ? \$3 : 1/0):5 with linespoints lw 2 pt 4 title 'burst, sync 5 s',
		     1 with lines dt 2 lc black title 'the limit';
		set title 'Storage traffic per instance per sync interval (sync 1 s)'; set ylabel 'bytes'; set logscale y; set yrange [1000:*]; set format y '%.0s %cB'; set key top left;
		plot '$data/fleet.csv' every ::1 using (strcol(1) eq 'memory' && \$2 == 1 ? \$3 : 1/0):6 with linespoints lw 2 pt 7 title 'read (mean)',
		     '' every ::1 using (strcol(1) eq 'memory' && \$2 == 1 ? \$3 : 1/0):7 with linespoints lw 2 pt 6 title 'read by the aggregator',
		     '' every ::1 using (strcol(1) eq 'memory' && \$2 == 1 ? \$3 : 1/0):8 with linespoints lw 2 pt 5 title 'written';
		unset multiplot"
fi
if [ -s "$data/soak.csv" ]; then
	plot soak "set title 'Soak: three instances, floods, reloads every 2-5 s, instance 2 SIGKILLed every minute';
		set xlabel 'time (s)'; set ylabel 'RSS (MiB)'; set y2label 'goroutines, descriptors'; set y2tics; set ytics nomirror;
		set yrange [0:*]; set y2range [0:*]; set key bottom right;
		plot '$data/soak.csv' every ::1 using 1:(\$2/1048576) with lines lw 2 title 'RSS instance 0',
		     '' every ::1 using 1:(\$3/1048576) with lines lw 2 title 'RSS instance 1',
		     '' every ::1 using 1:5 axes x1y2 with lines title 'goroutines 0',
		     '' every ::1 using 1:8 axes x1y2 with lines title 'descriptors 0'"
fi

# The page.
run() { sed -n "s/^$1=//p" "$data/run.txt"; }
col() { awk -F, -v k="$2" -v c="$3" 'NR > 1 { gsub(/"/, "", $1); if ($1 == k) print $c }' "$data/$1.csv"; }
ratio() { awk -F, -v k="$1" '{ gsub(/"/, "", $1); if ($1 == k) printf "%.2f (rounds %.2f–%.2f)", $2, $3, $4 }' "$data/throughput-ratios.csv"; }
mem_fg=$(awk -F, 'NR == 2 { a = $2 } END { printf "%.1f → %.1f", a, $2 }' "$data/memory.csv")
mem_rl=$(awk -F, 'NR == 2 { a = $3 } END { printf "%.1f → %.1f", a, $3 }' "$data/memory.csv")
fleet_max=$(awk -F, 'NR > 1 { for (i = 4; i <= 5; i++) if ($i > m) m = $i } END { printf "%.2f", m }' "$data/fleet.csv" 2>/dev/null || true)
fair_attack=$(awk -F, 'NR > 1 && $1 >= 15 && $1 < 45 { s += $2; n++ } END { printf "%.2f%%", 100 * s / n }' "$data/timeline.csv")
flood=$(awk -F, 'NR > 1 && $1 >= 16 && $1 < 45 { a += $4; s += $3; n++ } END { printf "%.0f of %.0f", a / n, s / n }' "$data/timeline.csv")
{
	cat <<EOF
# Performance

Generated by \`bench/perf.sh\` from one run on $(run date) at commit $(run commit), on $(run cores) cores
($(run arch)) shared with other work: absolute numbers move with the neighbours' load, so read ratios
measured in the same run. Data: [docs/perf](perf/).

## Memory against distinct keys

![RSS against distinct keys](perf-memory.png)

A zone keyed by a header, 100 events per 10 s, sent $KEYS distinct keys (16 connections). floodgate:
$mem_fg MiB; caddy-ratelimit v0.1.0: $mem_rl MiB. floodgate's table is fixed by its configuration
(10.6 MiB by default); what it gains is that table being touched for the first time.

## Allowed and denied requests/s

![Requests/s as ratios](perf-throughput.png)

wrk, 32 connections, $ROUNDS alternating rounds of $DURATION per server, on loopback (wrk shares the
cores); each ratio is taken within a round, and the whiskers show the least and greatest round.
Allowed requests as a ratio to plain Caddy's \`respond\`: floodgate $(ratio "allowed: floodgate"),
caddy-ratelimit $(ratio "allowed: caddy-ratelimit"). Denied requests (one client over its limit, every
response a 429) as a ratio to plain Caddy's \`error 429\`: floodgate $(ratio "denied: floodgate"),
caddy-ratelimit $(ratio "denied: caddy-ratelimit"), plain \`respond 429\` $(ratio "denied: plain respond 429").

| server | requests/s (mean of rounds) |
|---|---|
$(awk -F, 'NR > 1 { gsub(/"/, "", $1); printf "| %s | %s |\n", $1, $2 }' "$data/throughput.csv")

## An attack

![Attack timeline](perf-timeline.png)

A zone per client IP (\`events 20 window 10s burst 10\`); 32 fair clients (2 requests/s each, under
their limit) throughout, and from 15 s to 45 s 64 other sources sending as fast as they can. During the
attack the fair clients were served $fair_attack of the time, and the flood was allowed $flood requests/s
on average (its sources' limits: 64 × 2/s = 128/s).

## False denials as a table fills

![False-deny rate](perf-falsedeny.png)

A table of 16,384 lines (1 MiB), K = 3, filled with flooding sources that each drained their counters;
200,000 fresh keys probed at each load. The estimate is \`limiter.EstimateFalseDeny\`, the formula the
sizing (\`sources\`, \`false_deny\`) uses.

| flooding sources per line | measured | estimated |
|---|---|---|
$(awk -F, 'NR > 1 { printf "| %s | %.4f%% | %.4f%% |\n", $1, 100 * $2, 100 * $3 }' "$data/falsedeny.csv")

EOF
	if [ -s "$data/fleet.csv" ]; then
		cat <<EOF
## Cluster over-admission against instances and sync interval

![Fleet: allowed ÷ limit and storage traffic against instances](perf-fleet.png)

From the fleet benchmark (\`go test -run - -bench Fleet -benchtime $FLEET ./storage\`, storage's
\`BenchmarkFleet\`, run on $(sed -n 's/^date=//p' "$data/fleet-run.txt") at commit $(sed -n 's/^commit=//p' "$data/fleet-run.txt");
\`FLEET_ONLY=1 bench/perf.sh\` runs it alone and rewrites this page): 2 to 128 instances of one distributed zone (events 100 per hour, sketch 4 × 4096,
1,000 active keys per instance, bursts split across the instances) in one process, over an in-memory
storage and over a real redis-server, syncing every 1 s or 5 s: every instance writes, then every
instance reads, the aggregator last (so the others read the previous sync's aggregate: the most lag an
aggregate adds). From 4 instances on, one instance aggregates and the others read its aggregate.

Spread: one request per instance per second for one key; burst: the limit sent to every instance at
once, then again after each of 5 syncs. Allowed ÷ limit above 1 would be over-admission; the highest
here is $fleet_max. Below 1 at many instances is the sketch, not the sync: 128,000 active keys on 4,096
counters per row put about 30 other keys' counts in each of a key's cells (noise ÷ limit: the key's
estimate before its first request), and a count-min sketch only over-estimates. Reset: the intervals
until a reset on one instance had taken the key's counts out of every instance's view. Failover: the
seconds from the aggregator's death until another one publishes and every instance reads it, and what
the fleet granted meanwhile of a key already at its limit; in memory the lock expires as FileStorage's
does (10 s after its last refresh, on the simulated clock), over Redis as caddy-storage-redis's does
(5 s, in real time, the rounds kept one interval apart; a dash over Redis where one process could not
keep the rounds in real time, see [the cluster page](cluster.md#fleets)). Traffic and CPU are per instance per interval; the most read is the aggregator's.
CPU is the process's on every core (garbage collection included) over the instances' syncs; the
aggregator's read is timed alone. Memory: what an instance holds between syncs (the heap after a
collection over the instances, the in-memory storage's copy of the snapshots included) and the most one
sync allocated (the aggregator's read, where there is one): an instance's peak is at most the two added.
Output: [docs/perf/fleet.txt](perf/fleet.txt).

| storage | sync (s) | instances | spread: allowed ÷ limit | burst: allowed ÷ limit | noise ÷ limit | read per instance (kB) | most read (kB) | written (kB) | CPU per sync (ms) | aggregator's read (ms) | held (kB) | most a sync allocated (kB) | reset (intervals) | failover (s) | granted in failover |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
$(awk -F, 'NR > 1 { printf "| %s | %s | %s | %.2f | %.2f | %.2f | %.1f | %.1f | %.1f | %.2f | %s | %.0f | %.0f | %g | %s | %s |\n", $1, $2, $3, $4, $5, $12, $6 / 1000, $7 / 1000, $8 / 1000, $15 / 1e6, ($16 == "" ? "–" : sprintf("%.2f", $16 / 1e6)), $10 / 1000, $17 / 1000, $11, ($13 == "" ? "–" : sprintf("%.0f", $13)), ($14 == "" ? "–" : $14) }' "$data/fleet.csv")

EOF
	fi
	if [ -s "$data/soak.csv" ]; then
		cat <<EOF
## Soak

![Soak](perf-soak.png)

\`bench/soak\` ($(head -1 "$data/soak.txt" | sed 's/^soak: \([^,]*\),.*/\1/'), run on $(sed -n 's/^date=//p' "$data/soak-run.txt") at commit
$(sed -n 's/^commit=//p' "$data/soak-run.txt"); \`SOAK_ONLY=1 bench/perf.sh\` runs it alone and rewrites this page): three instances sharing a real
redis-server, HTTP zones with every feature (keys, weights, a quota, \`action log\` and \`delay\`,
response costs) and a layer4 server; fair clients, a flood of distinct keys, a flood of source
addresses across 127.0.0.0/8, a client far over its limit; a reload every 2–5 s alternating configs
that raise and lower limits; instance 2 SIGKILLed and restarted every minute; redis-server restarted
once. Its verdict:

\`\`\`
$(grep -E '^soak: (ok|FAIL)' "$data/soak.txt")
\`\`\`

The cluster line measures the spread key (600 events per minute, burst 600, over all three
instances) against what its token bucket promises: in any interval, at most the burst plus the refill
over the interval's length. Every interval between two of its grants is checked, and the line shows
the worst ratio of grants to that bound, with the interval's grants and length; the trailing
window's count is shown beside it for reference (a token bucket whose burst is its events may grant
up to twice its events in one window). Samples every 10 s: [docs/perf/soak.csv](perf/soak.csv); the
run's output: [docs/perf/soak.txt](perf/soak.txt).

EOF
	fi
	cat bench/perf/micro.md
} >docs/performance.md
echo "wrote docs/performance.md and docs/perf-*.png"
