package layer4

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// readByServer waits until the server has read everything c sent, as the
// kernel reports it (the receive queue of the server's end of c in
// /proc/net/tcp), and returns false if the server closed c instead.
func readByServer(t *testing.T, c net.Conn) bool {
	t.Helper()
	local := c.LocalAddr().(*net.TCPAddr).Port
	remote := c.RemoteAddr().(*net.TCPAddr).Port
	deadline := time.Now().Add(ioDeadline)
	for {
		queued, state, found := serverEnd(t, remote, local)
		switch {
		case !found || state != "01": // closed, or closing: not ESTABLISHED
			return false
		case queued == 0:
			return true
		case time.Now().After(deadline):
			t.Fatalf("the server left %d bytes unread for %v", queued, ioDeadline)
		}
		time.Sleep(time.Millisecond) // waiting for the server's goroutine to read, not for a rate
	}
}

// serverEnd finds the TCP socket whose local port is local and remote port
// remote, and returns its receive queue and state.
func serverEnd(t *testing.T, local, remote int) (queued int64, state string, found bool) {
	t.Helper()
	table, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	port := func(addr string) int {
		p, _ := strconv.ParseUint(addr[strings.LastIndexByte(addr, ':')+1:], 16, 16)
		return int(p)
	}
	// sl local_address rem_address st tx_queue:rx_queue ...
	for _, line := range strings.Split(string(table), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 5 || port(f[1]) != local || port(f[2]) != remote {
			continue
		}
		q, err := strconv.ParseInt(f[4][strings.IndexByte(f[4], ':')+1:], 16, 64)
		if err != nil {
			t.Fatalf("/proc/net/tcp: %q: %v", line, err)
		}
		return q, f[3], true
	}
	return 0, "", false
}

// Outcomes are what the admin API counts for a zone.
type Outcomes struct {
	Allowed, Denied, Logged, Delayed uint64
}

// ZoneCounts is the part of GET /rate_limit/zones/{zone} the tests read.
type ZoneCounts struct {
	Requests    Outcomes
	Connections *Outcomes
}

// adminGet gets path from the in-process Caddy's admin API into v.
func adminGet(t *testing.T, path string, v any) {
	t.Helper()
	testcaddy.JSON(t, http.DefaultClient, testcaddy.Request(t, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d%s", apiPort, path)), v)
}

// counts returns what the admin API counts for zone.
func counts(t *testing.T, zone string) ZoneCounts {
	t.Helper()
	var zc ZoneCounts
	adminGet(t, "/rate_limit/zones/"+zone, &zc)
	return zc
}

// remaining returns how many connections the network of ip has left in
// zone, by the admin API.
func remaining(t *testing.T, zone, ip string) int64 {
	t.Helper()
	var k struct {
		Policies []struct{ Remaining int64 }
	}
	adminGet(t, "/rate_limit/zones/"+zone+"/keys/"+ip, &k)
	if len(k.Policies) == 0 {
		t.Fatalf("zone %s, key %s: no policy", zone, ip)
	}
	return k.Policies[0].Remaining
}

// httpGetFrom makes one request to url from the loopback address src on a
// fresh connection and returns the status code.
func httpGetFrom(src, url string) (int, error) {
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: ioDeadline}
	client := &http.Client{Timeout: ioDeadline, Transport: &http.Transport{DialContext: dialer.DialContext, DisableKeepAlives: true}}
	return statusOf(client, url)
}

// statusOf makes one GET to url with client, reads the body, and returns the
// status code.
func statusOf(client *http.Client, url string) (int, error) {
	resp, err := client.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}
