module github.com/floodgate-rl/floodgate/bench/perf

go 1.26.0

require github.com/floodgate-rl/floodgate v0.0.0-00010101000000-000000000000

require github.com/cespare/xxhash/v2 v2.3.0 // indirect

replace github.com/floodgate-rl/floodgate => ../..
