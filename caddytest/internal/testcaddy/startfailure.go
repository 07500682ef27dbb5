package testcaddy

import (
	"errors"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(StartFailure{})
}

// StartFailure is the app floodgate_test_start_failure, which always fails
// to start, with StartFailureError. Before it fails, it sends Probe one GET
// with Header and keeps the answer for Probed: whatever the probe shows (a
// new key's RateLimit header on a site, the zones the admin API lists) is the
// state at that moment, which another app of the failing config has changed
// if it started first. Caddy starts apps in map order, so a test loads the
// failing config until the probe shows that it did.
type StartFailure struct {
	Probe  string            `json:"probe"`
	Header map[string]string `json:"header,omitempty"`
}

// StartFailureError is the error of StartFailure's Start.
const StartFailureError = "fails to start, as this test app always does"

// A Probe is what StartFailure's last probe got: the response, or Err.
type Probe struct {
	Header http.Header
	Body   string
	Err    error
}

var probed struct {
	sync.Mutex
	p Probe
}

// Probed returns what the last StartFailure's probe got.
func Probed() Probe {
	probed.Lock()
	defer probed.Unlock()
	return probed.p
}

func (StartFailure) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "floodgate_test_start_failure",
		New: func() caddy.Module { return new(StartFailure) },
	}
}

// Start probes and fails. A probe that meets the socket of the admin
// endpoint this load replaces may be reset as that socket closes; it is sent
// again, on a new connection, for up to 10 s rather than hold Caddy's start.
func (s StartFailure) Start() error {
	p := probe(s.Probe, s.Header)
	for deadline := time.Now().Add(10 * time.Second); p.Err != nil && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond) // a socket closing, not a rate
		p = probe(s.Probe, s.Header)
	}
	probed.Lock()
	probed.p = p
	probed.Unlock()
	return errors.New(StartFailureError)
}

func probe(url string, header map[string]string) Probe {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return Probe{Err: err}
	}
	for name, value := range header {
		req.Header.Set(name, value)
	}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		return Probe{Err: err}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return Probe{Header: resp.Header, Body: string(body), Err: err}
}

// Stop does nothing: Start never succeeds.
func (StartFailure) Stop() error { return nil }

var _ caddy.App = StartFailure{}
