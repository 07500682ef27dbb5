module github.com/floodgate-rl/floodgate/bench/soak

go 1.26.0
