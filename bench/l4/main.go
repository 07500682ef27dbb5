// Command l4 measures what floodgate's layer4 matcher costs a caddy-l4
// server, in one process on loopback:
//
//  1. accepted connections per second through two layer4 echo servers
//     running side by side, one plain and one with `rate_limit` in its first
//     route (a limit no client reaches, so every connection is echoed),
//     measured in alternating rounds so the ratio holds on a noisy machine;
//  2. resident memory before and after connections from 50,000 distinct
//     source addresses, one per /24 across 127.0.0.0/8, all through the
//     matcher: the matcher's table is fixed by configuration, so the count of
//     sources must not show.
//
// Run: go run ./bench/l4 [-seconds 3] [-rounds 3] [-workers 32] [-sources 50000]
// Linux only (clients bind to 127.x.y.z and RSS is read from /proc).
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/floodgate-rl/floodgate"
)

// plainAddr and limitedAddr are the two servers' addresses, on loopback
// ports free when the program starts (freePort), so that it runs beside
// anything else on the machine.
var plainAddr, limitedAddr = freePort(), freePort()

// freePort returns a loopback address on a port that was free a moment
// ago.
func freePort() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer l.Close()
	return l.Addr().String()
}

var config = fmt.Sprintf(`{
	admin off
	persist_config off
	layer4 {
		%s {
			route {
				echo
			}
		}
		%s {
			@flood rate_limit {
				events 1000000
				window 1s
			}
			route @flood {
				close
			}
			route {
				echo
			}
		}
	}
}
`, plainAddr, limitedAddr)

// source returns the i-th client address: one address in each of 50,000+
// distinct /24 networks of 127.0.0.0/8 (127.c.b.a, c from 1).
func source(i int) net.IP {
	n := i % (250 * 256 * 250)
	return net.IPv4(127, byte(1+n/256%250), byte(n%256), byte(1+n/(256*250)))
}

// roundTrip opens one connection from src, sends a byte and waits for its echo.
func roundTrip(src net.IP, addr string) error {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: src}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte{'x'}); err != nil {
		return err
	}
	var b [1]byte
	_, err = io.ReadFull(c, b[:])
	return err
}

// rate runs workers for d against addr and returns echoed connections per
// second and the number of failures.
func rate(addr string, workers int, d time.Duration, next *atomic.Int64) (float64, int64) {
	var ok, failed atomic.Int64
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				if roundTrip(source(int(next.Add(1))), addr) == nil {
					ok.Add(1)
				} else {
					failed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	return float64(ok.Load()) / d.Seconds(), failed.Load()
}

func rssKiB() int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return -1
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "VmRSS:"); ok {
			var kib int64
			fmt.Sscan(strings.TrimSuffix(strings.TrimSpace(v), " kB"), &kib)
			return kib
		}
	}
	return -1
}

func main() {
	seconds := flag.Float64("seconds", 3, "length of each measuring phase")
	rounds := flag.Int("rounds", 3, "alternating rounds of plain and limited")
	workers := flag.Int("workers", 32, "concurrent clients")
	sources := flag.Int("sources", 50000, "distinct source addresses for the memory figure")
	flag.Parse()

	rss0 := rssKiB()
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(config), nil)
	if err == nil {
		err = caddy.Load(cfg, true)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer caddy.Stop()
	runtime.GC()
	rssLoaded := rssKiB()
	fmt.Printf("GOMAXPROCS=%d workers=%d phase=%.1fs\n", runtime.GOMAXPROCS(0), *workers, *seconds)

	// The memory figure first, on a fresh table: sources distinct addresses,
	// sequentially, each a new /24, through the plain server (the cost of the
	// connections themselves) and then, from other /24s, through the matcher.
	connect := func(first int, addr string) (rss int64, failed int) {
		for i := first; i < first+*sources; i++ {
			if roundTrip(source(i), addr) != nil {
				failed++
			}
		}
		runtime.GC()
		return rssKiB(), failed
	}
	rssPlain, fp := connect(0, plainAddr)
	rssLimited, fl := connect(*sources, limitedAddr)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fmt.Printf("RSS: %d KiB before loading Caddy, %d KiB with the config loaded\n", rss0, rssLoaded)
	fmt.Printf("RSS: %d KiB after %d connections from distinct /24s to the plain server (%d failed): +%d KiB\n",
		rssPlain, *sources, fp, rssPlain-rssLoaded)
	fmt.Printf("RSS: %d KiB after %d more from other distinct /24s through rate_limit (%d failed): +%d KiB; Go heap in use %d KiB\n",
		rssLimited, *sources, fl, rssLimited-rssPlain, ms.HeapInuse/1024)

	var next atomic.Int64
	next.Store(int64(2 * *sources))
	d := time.Duration(*seconds * float64(time.Second))
	var sumPlain, sumLimited float64
	for r := 1; r <= *rounds; r++ {
		p, pf := rate(plainAddr, *workers, d, &next)
		l, lf := rate(limitedAddr, *workers, d, &next)
		sumPlain += p
		sumLimited += l
		fmt.Printf("round %d: plain %.0f conn/s (%d failed), with rate_limit %.0f conn/s (%d failed), ratio %.3f\n", r, p, pf, l, lf, l/p)
	}
	fmt.Printf("mean: plain %.0f conn/s, with rate_limit %.0f conn/s, ratio %.3f\n",
		sumPlain/float64(*rounds), sumLimited/float64(*rounds), sumLimited/sumPlain)
}
