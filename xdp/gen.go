package xdp

// The program is compiled with clang into synlimit_bpfel.o and its Go loader
// synlimit_bpfel.go, both committed: building Caddy needs no clang. Run
// `go generate ./xdp` after changing bpf/synlimit.c (needs clang; 14 makes
// the committed object, and CI checks that regenerating it changes
// nothing). bpf2go is a tool of this module (go.mod), at the cilium/ebpf
// version the loader uses, and the headers the program includes are
// vendored under bpf/headers (-nostdinc: nothing from the host's
// /usr/include), so the output depends on clang alone. -mcpu=v3 for the
// 64-bit compare-and-swap (BPF_CMPXCHG, Linux 5.12+).
//go:generate go tool bpf2go -cc clang -cflags "-O2 -g -Wall -Werror -mcpu=v3" -target bpfel -tags linux synlimit bpf/synlimit.c -- -nostdinc -I./bpf/headers
