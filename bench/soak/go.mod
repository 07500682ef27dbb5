module github.com/floodgate-rl/floodgate/bench/soak

go 1.26.0

require github.com/floodgate-rl/floodgate/bench/perf v0.0.0-00010101000000-000000000000

replace (
	github.com/floodgate-rl/floodgate => ../..
	github.com/floodgate-rl/floodgate/bench/perf => ../perf
)
