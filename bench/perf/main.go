// Command perf runs the measurements behind docs/performance.md and writes
// each as a CSV file into -out; bench/perf.sh runs it, plots the files with
// gnuplot and writes the page. Every server runs on loopback on free ports.
//
//	memory     resident memory of Caddy against distinct keys sent, for
//	           floodgate and caddy-ratelimit (memory.csv)
//	throughput allowed and denied requests/s of floodgate and
//	           caddy-ratelimit beside plain Caddy (`respond`, `respond 429`,
//	           `error 429`), with wrk, in alternating rounds (throughput.csv)
//	timeline   an attack on floodgate, second by second: fair clients
//	           served, the flood's allowed rate, memory (timeline.csv)
//	falsedeny  measured against estimated false-deny rate as a table fills
//	           with flooding sources (falsedeny.csv)
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/floodgate-rl/floodgate/bench/perf/proc"
	"github.com/floodgate-rl/floodgate/limiter"
)

var (
	bins   = flag.String("bins", "", "directory holding caddy-plain, caddy-floodgate and caddy-ratelimit (bench/caddies.sh)")
	outDir = flag.String("out", ".", "where the CSV files go")
	rounds = flag.Int("rounds", 3, "throughput: alternating rounds")
	dur    = flag.Duration("duration", 5*time.Second, "throughput: length of one wrk run")
	keys   = flag.Int("keys", 200_000, "memory: distinct keys sent in all")
)

func main() {
	flag.Parse()
	if flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: perf [flags] memory|throughput|timeline|falsedeny...")
		os.Exit(2)
	}
	for _, what := range flag.Args() {
		var err error
		switch what {
		case "memory":
			err = memory()
		case "throughput":
			err = throughput()
		case "timeline":
			err = timeline()
		case "falsedeny":
			err = falseDeny()
		default:
			err = fmt.Errorf("unknown measurement %q", what)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "perf %s: %v\n", what, err)
			os.Exit(1)
		}
	}
}

// A server is one Caddy process serving one site on loopback.
type server struct {
	name string
	port int
	cmd  *exec.Cmd
	dir  string
}

// startServer runs bin with a site whose body is body (and global options
// extra), and waits until it answers.
func startServer(name, bin, extra, body string) (*server, error) {
	ports, err := proc.FreePorts(2)
	if err != nil {
		return nil, err
	}
	port, admin := ports[0], ports[1]
	dir, err := os.MkdirTemp("", "floodgate-perf-")
	if err != nil {
		return nil, err
	}
	cfg := fmt.Sprintf("{\n\tadmin 127.0.0.1:%d\n\tdefault_bind 127.0.0.1\n\tauto_https off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n%s\n}\nhttp://127.0.0.1:%d {\n%s\n}\n", admin, extra, port, body)
	file := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(file, []byte(cfg), 0o600); err != nil {
		return nil, err
	}
	s := &server{name: name, port: port, dir: dir}
	s.cmd = exec.Command(bin, "run", "--config", file, "--adapter", "caddyfile")
	s.cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir, "HOME="+dir)
	logf, err := os.Create(filepath.Join(dir, "caddy.log"))
	if err != nil {
		return nil, err
	}
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	for range 300 {
		if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 100*time.Millisecond); err == nil {
			c.Close()
			return s, nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	s.stop()
	log, _ := os.ReadFile(filepath.Join(dir, "caddy.log"))
	return nil, fmt.Errorf("%s did not start:\n%s", name, log)
}

func (s *server) url(path string) string { return fmt.Sprintf("http://127.0.0.1:%d%s", s.port, path) }

func (s *server) stop() {
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	os.RemoveAll(s.dir)
}

// rss is the server's resident memory in MiB.
func (s *server) rss() float64 { return float64(proc.RSS(s.cmd.Process.Pid)) / (1 << 20) }

func bin(name string) string { return filepath.Join(*bins, name) }

// perKeyZone is the zone both rate limiters get: a bucket per X-Key
// header, 100 events per 10 s (the README's comparison since the start).
const perKeyZone = `	rate_limit {
		zone per_key {
			key {http.request.header.X-Key}
			events 100
			window 10s
		}
	}
	respond "ok"`

// send makes n requests from conns goroutines, each with headers from hdr(i),
// and returns how many got each status.
func send(url string, n, conns int, hdr func(i int) (string, string)) map[int]int {
	var next atomic.Int64
	var mu sync.Mutex
	codes := map[int]int{}
	tr := &http.Transport{MaxIdleConnsPerHost: conns}
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	var wg sync.WaitGroup
	for range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := map[int]int{}
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					break
				}
				req, _ := http.NewRequest(http.MethodGet, url, nil)
				if hdr != nil {
					k, v := hdr(i)
					req.Header.Set(k, v)
				}
				resp, err := c.Do(req)
				if err != nil {
					local[0]++
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				local[resp.StatusCode]++
			}
			mu.Lock()
			for k, v := range local {
				codes[k] += v
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	tr.CloseIdleConnections()
	return codes
}

func memory() error {
	steps := []int{0, *keys / 8, *keys / 4, *keys / 2, 3 * *keys / 4, *keys}
	var b strings.Builder
	b.WriteString("keys,floodgate_mib,caddy_ratelimit_mib\n")
	rows := make([][2]float64, len(steps))
	for col, s := range []struct{ name, bin, order string }{
		{"floodgate", bin("caddy-floodgate"), ""},
		{"caddy-ratelimit", bin("caddy-ratelimit"), "\torder rate_limit before basic_auth"},
	} {
		srv, err := startServer(s.name, s.bin, s.order, perKeyZone)
		if err != nil {
			return err
		}
		sent := 0
		for i, k := range steps {
			if k > sent {
				base := sent
				codes := send(srv.url("/"), k-sent, 16, func(i int) (string, string) { return "X-Key", "key-" + strconv.Itoa(base+i) })
				if codes[200] != k-sent {
					srv.stop()
					return fmt.Errorf("%s: %v for %d fresh keys", s.name, codes, k-sent)
				}
				sent = k
			}
			time.Sleep(time.Second)
			rows[i][col] = srv.rss()
			fmt.Printf("memory: %-16s %7d keys %7.1f MiB\n", s.name, k, rows[i][col])
		}
		srv.stop()
	}
	for i, k := range steps {
		fmt.Fprintf(&b, "%d,%.1f,%.1f\n", k, rows[i][0], rows[i][1])
	}
	return os.WriteFile(filepath.Join(*outDir, "memory.csv"), []byte(b.String()), 0o644)
}

var wrkRPS = regexp.MustCompile(`Requests/sec:\s+([0-9.]+)`)
var wrkNon2xx = regexp.MustCompile(`Non-2xx or 3xx responses:\s+([0-9]+)`)
var wrkTotal = regexp.MustCompile(`([0-9]+) requests in`)

// wrk runs wrk against url and returns requests/s and the share of non-2xx
// responses.
func wrk(url string) (float64, float64, error) {
	out, err := exec.Command("wrk", "-t2", "-c32", "-d"+dur.String(), url).CombinedOutput()
	if err != nil {
		return 0, 0, fmt.Errorf("wrk: %v\n%s", err, out)
	}
	m := wrkRPS.FindSubmatch(out)
	t := wrkTotal.FindSubmatch(out)
	if m == nil || t == nil {
		return 0, 0, fmt.Errorf("wrk output: %s", out)
	}
	rps, _ := strconv.ParseFloat(string(m[1]), 64)
	total, _ := strconv.ParseFloat(string(t[1]), 64)
	non := 0.0
	if n := wrkNon2xx.FindSubmatch(out); n != nil {
		non, _ = strconv.ParseFloat(string(n[1]), 64)
	}
	return rps, non / total, nil
}

func throughput() error {
	allowAll := `	rate_limit {
		zone all {
			key {remote_host}
			events 1000000
			window 1s
			burst 1000000
		}
	}
	respond "ok"`
	denyAll := `	rate_limit {
		zone none {
			key {remote_host}
			events 1
			window 1h
			burst 1
		}
	}
	respond "ok"`
	order := "\torder rate_limit before basic_auth"
	type cfg struct{ name, bin, extra, body, want string }
	cfgs := []cfg{
		{"plain respond", bin("caddy-plain"), "", `	respond "ok"`, "2xx"},
		{"floodgate allowed", bin("caddy-floodgate"), "", allowAll, "2xx"},
		{"caddy-ratelimit allowed", bin("caddy-ratelimit"), order, allowAll, "2xx"},
		{"plain respond 429", bin("caddy-plain"), "", `	respond 429`, "429"},
		{"plain error 429", bin("caddy-plain"), "", `	error 429`, "429"},
		{"floodgate denied", bin("caddy-floodgate"), "", denyAll, "429"},
		{"caddy-ratelimit denied", bin("caddy-ratelimit"), order, denyAll, "429"},
	}
	srvs := make([]*server, len(cfgs))
	defer func() {
		for _, s := range srvs {
			if s != nil {
				s.stop()
			}
		}
	}()
	for i, c := range cfgs {
		s, err := startServer(c.name, c.bin, c.extra, c.body)
		if err != nil {
			return err
		}
		srvs[i] = s
		send(s.url("/"), 2, 1, nil) // the deniers' first request passes
	}
	sum := make([]float64, len(cfgs))
	for r := range *rounds {
		// Each round starts one server later, so that a drift of the
		// machine's load within rounds favours no server.
		for j := range cfgs {
			i := (j + r) % len(cfgs)
			c := cfgs[i]
			rps, non, err := wrk(srvs[i].url("/"))
			if err != nil {
				return err
			}
			if c.want == "2xx" && non != 0 || c.want == "429" && non != 1 {
				return fmt.Errorf("%s: %.4f of responses not 2xx, want %s", c.name, non, c.want)
			}
			sum[i] += rps
			fmt.Printf("throughput: round %d %-24s %9.0f req/s\n", r+1, c.name, rps)
		}
	}
	var b strings.Builder
	b.WriteString("server,rps\n")
	for i, c := range cfgs {
		fmt.Fprintf(&b, "%q,%.0f\n", c.name, sum[i]/float64(*rounds))
	}
	return os.WriteFile(filepath.Join(*outDir, "throughput.csv"), []byte(b.String()), 0o644)
}

// timeline: 60 s; from 15 s to 45 s an attack: 64 sources over their limit
// and a flood of fresh keys. Fair clients (32 sources, 2 requests/s each)
// stay under theirs throughout.
func timeline() error {
	body := `	rate_limit {
		zone per_client {
			key {client_ip}
			events 20
			window 10s
			burst 10
			ipv4_prefix 32
		}
	}
	respond "ok"`
	srv, err := startServer("floodgate", bin("caddy-floodgate"), "", body)
	if err != nil {
		return err
	}
	defer srv.stop()
	const secs, from, to = 60, 15, 45
	type second struct{ fairOK, fairAll, floodOK, floodAll atomic.Int64 }
	var sec [secs + 1]second
	start := time.Now()
	now := func() int { return min(int(time.Since(start)/time.Second), secs) }
	ctx, cancel := context.WithTimeout(context.Background(), secs*time.Second)
	defer cancel()
	client := func(src net.IP) *http.Client {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: src}}
		return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: d.DialContext}}
	}
	get := func(c *http.Client) int {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.url("/"), nil)
		resp, err := c.Do(req)
		if err != nil {
			return 0
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := client(net.IPv4(127, 10, 0, byte(1+i)))
			t := time.NewTicker(500 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				code := get(c)
				if ctx.Err() != nil {
					return
				}
				s := &sec[now()]
				s.fairAll.Add(1)
				if code == 200 {
					s.fairOK.Add(1)
				}
			}
		}()
	}
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := client(net.IPv4(127, 20, byte(i/250), byte(1+i%250)))
			for ctx.Err() == nil {
				if t := now(); t < from || t >= to {
					time.Sleep(50 * time.Millisecond)
					continue
				}
				code := get(c)
				if ctx.Err() != nil {
					return
				}
				s := &sec[now()]
				s.floodAll.Add(1)
				if code == 200 {
					s.floodOK.Add(1)
				}
			}
		}()
	}
	rss := make([]float64, secs)
	for t := range secs {
		time.Sleep(time.Until(start.Add(time.Duration(t+1) * time.Second)))
		rss[t] = srv.rss()
	}
	cancel()
	wg.Wait()
	var b strings.Builder
	b.WriteString("t,fair_served,flood_sent_per_s,flood_allowed_per_s,rss_mib\n")
	for t := range secs {
		s := &sec[t]
		fair := 1.0
		if n := s.fairAll.Load(); n > 0 {
			fair = float64(s.fairOK.Load()) / float64(n)
		}
		fmt.Fprintf(&b, "%d,%.4f,%d,%d,%.1f\n", t, fair, s.floodAll.Load(), s.floodOK.Load(), rss[t])
	}
	fmt.Print("timeline:\n", b.String())
	return os.WriteFile(filepath.Join(*outDir, "timeline.csv"), []byte(b.String()), 0o644)
}

// falseDeny fills a table of 16,384 lines (1 MiB) with more and more
// flooding sources, each drained, and measures the share of fresh keys
// denied against limiter.EstimateFalseDeny.
func falseDeny() error {
	const lines = 16384
	key := func(i int) uint64 {
		var k [8]byte
		binary.LittleEndian.PutUint64(k[:], uint64(i)*0x9e3779b97f4a7c15)
		return limiter.Hash(k[:])
	}
	var b strings.Builder
	b.WriteString("sources_per_line,measured,estimated\n")
	for _, load := range []float64{0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3} {
		bk, err := limiter.NewBuckets(limiter.BucketsConfig{Limit: limiter.Limit{Events: 10, Window: time.Hour, Burst: 10}, Bytes: lines * 64})
		if err != nil {
			return err
		}
		now := time.Now()
		heavy := int(load * lines)
		for i := range heavy {
			for bk.PeekHash(key(i), 1, now).Allowed {
				bk.TakeHash(key(i), 1, now)
			}
		}
		const probes = 200_000
		denied := 0
		for i := range probes {
			if !bk.PeekHash(key(-1-i), 1, now).Allowed {
				denied++
			}
		}
		est := limiter.EstimateFalseDeny(heavy, lines, limiter.DefaultK)
		fmt.Fprintf(&b, "%.2f,%.6f,%.6f\n", load, float64(denied)/probes, est)
	}
	fmt.Print("falsedeny:\n", b.String())
	return os.WriteFile(filepath.Join(*outDir, "falsedeny.csv"), []byte(b.String()), 0o644)
}
