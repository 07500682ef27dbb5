package layer4

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// A zone a listener wrapper's matcher and the site's handler share tells
// an HTTP client the truth about what connections and requests took
// together (testcaddy.CheckHonest), in a window zone and a token-bucket one:
// each connection costs a token, each request one more.
func TestSharedZoneTellsHTTPClientsTheTruth(t *testing.T) {
	startCaddy(t, httpsCaddyfile(`rate_limit {
		zone honest_window {
			key {client_ip}
			events 5
			window 1h
		}
		zone honest_bucket {
			key {client_ip}
			events 5
			window 1h
			burst 5
		}
	}`, `layer4 {
				@window rate_limit zone honest_window
				route @window {
					close
				}
				@bucket rate_limit zone honest_bucket
				route @bucket {
					close
				}
			}`, "rate_limit honest_window honest_bucket"))
	// 127.0.30.1 takes 2 of each zone's 5 a request: the third connection
	// takes the fifth, and its request is denied by both.
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.30.1")}, Timeout: ioDeadline}
	client := &http.Client{Timeout: ioDeadline, Transport: &http.Transport{
		DialContext:       dialer.DialContext,
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"},
		DisableKeepAlives: true,
	}}
	var codes []int
	for i := range 3 {
		resp, err := client.Get(fmt.Sprintf("https://localhost:%d/", httpsPort))
		if err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		items, _ := testcaddy.CheckHonest(t, fmt.Sprintf("request %d", i+1), resp)
		if len(items) != 2 {
			t.Fatalf("request %d: %d RateLimit items, want the two zones'", i+1, len(items))
		}
		codes = append(codes, resp.StatusCode)
	}
	if fmt.Sprint(codes) != "[200 200 429]" {
		t.Fatalf("statuses %v, want [200 200 429]", codes)
	}
}
