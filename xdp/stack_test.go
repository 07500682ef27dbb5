//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// oldKernelFrame is a function's stack frame as the verifier of Linux
// before 6.9 counts it towards a call chain's 512 bytes, and any kernel's
// with the JIT off (bpf_jit_enable=0): rounded up to 32 bytes, and an empty
// frame as 32. Newer kernels with the JIT round to 16, so a chain that fits
// here fits there.
func oldKernelFrame(depth int) int { return (max(depth, 1) + 31) &^ 31 }

// maxStack is the verifier's bound on a call chain's stack (MAX_BPF_STACK).
const maxStack = 512

var stackDepths = regexp.MustCompile(`stack depth ((?:\d+\+)*\d+)`)

// TestEveryCallChainFitsTheStackOfOlderKernels loads the program with the
// verifier's statistics, reads each function's stack depth (the kernel
// lists them in the order of the program's functions, as its func infos),
// and checks that the deepest chain of calls from each entry point fits
// 512 bytes with every frame rounded as Linux 5.17–6.8 rounds it. This
// kernel rounds to 16 and loads a program those refuse: a merge that grew
// the program's frame from 184 to 240 bytes left it 512 here and 544
// there. As the verifier (check_max_stack_depth, since 5.15), it follows
// calls of functions and the callbacks passed to bpf_loop alike: a
// callback's frame sits on its caller's, so take → decide_once →
// charge_word is one chain. The depths it reads are those the kernel
// reports after inlining bpf_loop, which adds 24 bytes to the frame of a
// function calling it (take's, decide_once's) after the check: a chain
// through them is counted up to a rounded 32 bytes deeper than the
// verifier counts it, so the test errs towards refusing.
func TestEveryCallChainFitsTheStackOfOlderKernels(t *testing.T) {
	spec, err := loadSynlimit()
	if err != nil {
		t.Fatal(err)
	}
	spec.Maps["table"].MaxEntries = 1024
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats}})
	if err != nil {
		t.Fatal(explain("loading the program", err))
	}
	defer coll.Close()
	for _, name := range []string{"synlimit", "synlimit_at", "probe"} {
		prog := coll.Programs[name]
		m := stackDepths.FindStringSubmatch(prog.VerifierLog)
		if m == nil {
			t.Fatalf("%s: no stack depths in the verifier's log: %q", name, prog.VerifierLog)
		}
		var depths []int
		for _, s := range strings.Split(m[1], "+") {
			d, _ := strconv.Atoi(s)
			depths = append(depths, d)
		}
		info, err := prog.Info()
		if err != nil {
			t.Fatal(err)
		}
		funcs, err := info.FuncInfos()
		if err != nil {
			t.Fatal(err)
		}
		if len(funcs) != len(depths) {
			t.Fatalf("%s: %d functions, %d stack depths (%s)", name, len(funcs), len(depths), m[1])
		}
		depth := map[string]int{}
		for i, f := range funcs {
			depth[f.Func.Name] = depths[i]
		}
		// The calls, from the instructions as loaded.
		calls := map[string][]string{}
		fn := ""
		for _, ins := range spec.Programs[name].Instructions {
			if sym := ins.Symbol(); sym != "" {
				fn = sym
			}
			if ins.IsFunctionCall() || ins.IsFunctionReference() {
				calls[fn] = append(calls[fn], ins.Reference())
			}
		}
		// deepest is the deepest chain from f, and its bytes; the call
		// graph has no cycles (the verifier refuses recursion).
		var deepest func(f string) (int, []string)
		deepest = func(f string) (int, []string) {
			d, ok := depth[f]
			if !ok {
				t.Fatalf("%s: a function calls %s, which the kernel lists no stack depth for", name, f)
			}
			most, chain := 0, []string(nil)
			for _, c := range calls[f] {
				if n, ch := deepest(c); n > most {
					most, chain = n, ch
				}
			}
			return oldKernelFrame(d) + most, append([]string{fmt.Sprintf("%s %d (%d)", f, d, oldKernelFrame(d))}, chain...)
		}
		total, chain := deepest(name)
		var all []string
		for i, f := range funcs {
			all = append(all, fmt.Sprintf("%s %d", f.Func.Name, depths[i]))
		}
		t.Logf("%s: stack depth %s: %s", name, m[1], strings.Join(all, ", "))
		t.Logf("%s: deepest chain %d bytes rounded to 32 a frame (limit %d): %s", name, total, maxStack, strings.Join(chain, " → "))
		if total > maxStack {
			t.Errorf("%s: its deepest call chain takes %d bytes of stack on a kernel that rounds frames to 32 bytes (Linux before 6.9, or the JIT off), which refuses more than %d", name, total, maxStack)
		}
	}
}
