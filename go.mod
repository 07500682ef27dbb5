module github.com/floodgate-rl/floodgate

go 1.26

require github.com/cespare/xxhash/v2 v2.3.0

require golang.org/x/time v0.14.0 // indirect
