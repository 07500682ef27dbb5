package xdp

// The program is compiled with clang into synlimit_bpfel.o and its Go loader
// synlimit_bpfel.go, both committed: building Caddy needs no clang. Run
// `go generate ./xdp` after changing bpf/synlimit.c (needs clang ≥ 14 and
// libbpf-dev). -mcpu=v3 for the 64-bit compare-and-swap (BPF_CMPXCHG,
// Linux 5.12+).
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go@v0.20.0 -cc clang -cflags "-O2 -g -Wall -Werror -mcpu=v3" -target bpfel -tags linux synlimit bpf/synlimit.c -- -I/usr/include/x86_64-linux-gnu
