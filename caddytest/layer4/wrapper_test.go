package layer4

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// httpsCaddyfile returns the Caddyfile of an HTTPS site with a locally
// issued certificate (and site, more of its directives), served by the
// caddy process with the given listener wrappers (before tls) and extra
// global options.
func httpsCaddyfile(extra, wrappers, site string) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	persist_config off
	skip_install_trust
	auto_https disable_redirects
	http_port %d
	https_port %d
	%s
	servers 127.0.0.1:%d {
		protocols h1 h2
		listener_wrappers {
			%s
			tls
		}
	}
}

https://localhost:%d {
	bind 127.0.0.1
	tls internal
	%s
	respond "OK" 200
}
`, adminPort, httpPort, httpsPort, extra, httpsPort, wrappers, httpsPort, site)
}

// wrapperCaddyfile puts the matcher in the caddy.listeners.layer4 wrapper,
// before tls.
func wrapperCaddyfile() string {
	return httpsCaddyfile("", `layer4 {
				@flood rate_limit {
					events 3
					window 1h
				}
				route @flood {
					close
				}
			}`, "")
}

// startCaddy builds ./cmd/caddy and runs it with caddyfile, in a home of
// its own, until the test ends.
func startCaddy(t *testing.T, caddyfile string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs a caddy process")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "caddy-floodgate") // $XDG_DATA_HOME/caddy is Caddy's data
	build := exec.Command("go", "build", "-o", bin, "github.com/floodgate-rl/floodgate/cmd/caddy")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/caddy: %v\n%s", err, out)
	}
	cf := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(cf, []byte(caddyfile), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	cmd := exec.Command(bin, "run", "--config", cf, "--adapter", "caddyfile")
	cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("caddy output:\n%s", logs.String())
		}
	})
	// Ready when a TLS request succeeds. Each attempt comes from a /24 of
	// its own (127.0.2x.1), so readiness costs the tested networks nothing.
	for i := 0; ; i++ {
		select {
		case <-exited:
			t.Fatalf("caddy exited: %v", waitErr)
		default:
		}
		if _, err := httpsGet(fmt.Sprintf("127.0.%d.1", 20+i)); err == nil {
			return
		}
		if i == 100 {
			t.Fatal("caddy did not serve HTTPS within 100 attempts")
		}
		time.Sleep(100 * time.Millisecond) // waiting for a process to start, not for a rate
	}
}

// httpsGet makes one request to the site from src on a fresh connection and
// returns the status code.
func httpsGet(src string) (int, error) {
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: ioDeadline}
	return httpsGetDialing(dialer.DialContext)
}

// httpsGetDialing makes one request to the site on a fresh connection made
// by dial and returns the status code.
func httpsGetDialing(dial func(ctx context.Context, network, addr string) (net.Conn, error)) (int, error) {
	client := &http.Client{
		Timeout: ioDeadline,
		Transport: &http.Transport{
			DialContext:       dial,
			TLSClientConfig:   &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"},
			DisableKeepAlives: true,
		},
	}
	return statusOf(client, fmt.Sprintf("https://localhost:%d/", httpsPort))
}

// handshake reports whether a TLS handshake from src completes.
func handshake(t *testing.T, src string) error {
	t.Helper()
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: ioDeadline}
	ctx, cancel := context.WithTimeout(context.Background(), ioDeadline)
	defer cancel()
	d := tls.Dialer{NetDialer: dialer, Config: &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"}}
	c, err := d.DialContext(ctx, "tcp", fmt.Sprintf("127.0.0.1:%d", httpsPort))
	if err == nil {
		c.Close()
	}
	return err
}

func TestListenerWrapperDropsFloodBeforeTLS(t *testing.T) {
	startCaddy(t, wrapperCaddyfile())
	for _, src := range []string{"127.0.9.1", "127.0.9.2", "127.0.9.3"} {
		if code, err := httpsGet(src); err != nil || code != http.StatusOK {
			t.Fatalf("request from %s under the limit: %d, %v; want 200", src, code, err)
		}
	}
	for _, src := range []string{"127.0.9.4", "127.0.9.5"} {
		err := handshake(t, src)
		if err == nil {
			t.Fatalf("connection from %s over the limit completed a TLS handshake", src)
		}
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("connection from %s over the limit hung instead of being closed: %v", src, err)
		}
	}
	if code, err := httpsGet("127.0.10.1"); err != nil || code != http.StatusOK {
		t.Fatalf("request from another network: %d, %v; want 200", code, err)
	}
}

// proxyWrapperCaddyfile puts Caddy's proxy_protocol listener wrapper,
// trusting the load balancer at 127.0.66.0/24, before the layer4 wrapper:
// documented order 3 behind a load balancer.
func proxyWrapperCaddyfile() string {
	return httpsCaddyfile("", `proxy_protocol {
				allow 127.0.66.0/24
			}
			layer4 {
				@flood rate_limit {
					events 2
					burst 2
					window 1h
				}
				route @flood {
					close
				}
			}`, "")
}

// httpsGetVia makes one request to the site through the load balancer at
// 127.0.66.1, which sends a PROXY protocol header for client first.
func httpsGetVia(client string) (int, error) {
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.66.1")}, Timeout: ioDeadline}
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if _, err := fmt.Fprintf(c, "PROXY TCP4 %s 127.0.0.1 40000 %d\r\n", client, httpsPort); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}
	return httpsGetDialing(dial)
}

func TestProxyProtocolWrapperBeforeLayer4LimitsTheClient(t *testing.T) {
	startCaddy(t, proxyWrapperCaddyfile())
	var got []string
	for _, client := range []string{"192.0.2.1", "192.0.2.2", "192.0.2.3", "198.51.100.1"} {
		code, err := httpsGetVia(client)
		if err != nil {
			got = append(got, "closed")
		} else {
			got = append(got, fmt.Sprint(code))
		}
	}
	if fmt.Sprint(got) != "[200 200 closed 200]" {
		t.Errorf("through the load balancer: %v, want [200 200 closed 200]: two connections from 192.0.2.0/24, one from 198.51.100.0/24", got)
	}
}
