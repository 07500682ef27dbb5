// Package proc holds what bench/perf and bench/soak read of the processes
// they start and of the machine: free ports, resident memory, descriptors.
package proc

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// FreePorts returns n distinct TCP ports free on every address, between
// 20000 and 32000: below the kernel's ephemeral range (32768 and up on
// Linux), whose ports any process's outgoing connection may take meanwhile
// (the floods make thousands), so that a server restarted on its port gets
// it back.
func FreePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for try := 0; len(ports) < n; try++ {
		if try > 1000 {
			return nil, errors.New("no free ports between 20000 and 32000")
		}
		p := 20000 + rand.IntN(12000)
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", p))
		if err != nil {
			continue
		}
		ls = append(ls, l)
		ports = append(ports, p)
	}
	return ports, nil
}

// RSS returns the resident memory of process pid in bytes, 0 if unknown.
func RSS(pid int) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// FDs returns how many descriptors process pid has open, 0 if unknown.
func FDs(pid int) int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return 0
	}
	return len(ents)
}
