// Package inprocess is what the integration test packages that run Caddy
// inside the test process share: waiting after a config load until only the
// new config listens (Settle), an events handler that records what it is
// given (Events), and an app that fails to start (StartFailure). Only tests
// import it.
package inprocess

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Settle waits until none of ports has more than one listening socket, and
// fails the test after 10 s. Call it after every config load, failed or not.
//
// Caddy listens with SO_REUSEPORT: a load opens the new config's sockets
// beside the old ones, and the replaced HTTP servers and admin endpoint (or
// the servers of a config that failed to start) close theirs in goroutines,
// after /load has answered. Until then the kernel hands some new connections
// to an old socket, where the old config answers them or its closing resets
// them. /load answers after the new sockets listen, so nothing else needs
// waiting for.
func Settle(t testing.TB, ports ...int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		port, n := 0, 0
		for _, p := range ports {
			c, err := Listening(p)
			if err != nil {
				t.Fatalf("counting the sockets listening on port %d: %v", p, err)
			}
			if c > 1 {
				port, n = p, c
			}
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s after a config load, %d sockets still listen on port %d", n, port)
		}
		time.Sleep(time.Millisecond) // Caddy's goroutines closing sockets, not a rate
	}
}

// Listening returns how many TCP sockets of this network namespace listen on
// port, IPv4 and IPv6. It reads /proc/net, so it works on Linux only, as do
// the 127.0.0.0/8 client addresses the tests use.
func Listening(port int) (int, error) {
	n := 0
	for _, file := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		table, err := os.ReadFile(file)
		if err != nil {
			return 0, err
		}
		// sl local_address rem_address st ...; addresses are HEXIP:HEXPORT,
		// state 0A is LISTEN.
		for _, line := range strings.Split(string(table), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) < 4 || f[3] != "0A" {
				continue
			}
			p, err := strconv.ParseUint(f[1][strings.LastIndexByte(f[1], ':')+1:], 16, 16)
			if err != nil {
				return 0, fmt.Errorf("%s: %q: %v", file, line, err)
			}
			if int(p) == port {
				n++
			}
		}
	}
	return n, nil
}
