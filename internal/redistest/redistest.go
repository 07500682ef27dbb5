// Package redistest runs a real redis-server on loopback for floodgate's
// tests and benchmarks: on a port the caller picked free, in a directory of
// its own, persisting nothing, killed when the test ends. Only tests import
// it.
package redistest

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Server is a redis-server on 127.0.0.1:Port, or the place for one: it runs
// from Start to Stop, and may be started again on the same port (an outage
// and its end).
type Server struct {
	Port int
	t    testing.TB
	bin  string
	dir  string
	cmd  *exec.Cmd
	out  bytes.Buffer // the server's log, shown if it does not start
}

// New returns a server for port, not started, in a temporary directory of
// t's. Its error, if redis-server is not installed, says how to install it.
func New(t testing.TB, port int) (*Server, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not installed (apt-get install redis-server): %w", err)
	}
	return &Server{Port: port, t: t, bin: bin, dir: t.TempDir()}, nil
}

// Start starts the server (again) on its port and waits until it answers;
// it fails the test if it does not within ten seconds.
func (s *Server) Start() {
	t := s.t
	t.Helper()
	s.out.Reset()
	s.cmd = exec.Command(s.bin, "--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", s.dir)
	s.cmd.Stdout, s.cmd.Stderr = &s.out, &s.out
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := s.Keys("*")
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			s.Stop() // its log is complete once it has exited
			t.Fatalf("redis-server on port %d does not answer: %v\n%s", s.Port, err, s.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server, if it runs.
func (s *Server) Stop() {
	if s.cmd != nil {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
		s.cmd = nil
	}
}

// Keys returns the number of keys matching pattern.
func (s *Server) Keys(pattern string) (int, error) {
	line, err := s.Do("KEYS", pattern)
	if err != nil {
		return 0, err
	}
	if !strings.HasPrefix(line, "*") {
		return 0, fmt.Errorf("KEYS: %q", line)
	}
	return strconv.Atoi(line[1:])
}

// Do sends the server one command and returns the first line of its
// answer, without its line end (RESP, no client library needed): "+OK", a
// count such as "*3" or ":1", or an error "-ERR …", which is returned as an
// error.
func (s *Server) Do(args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", s.Port), time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	var cmd strings.Builder
	fmt.Fprintf(&cmd, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&cmd, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(cmd.String())); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimSpace(line)
	if strings.HasPrefix(line, "-") {
		return "", fmt.Errorf("%s: %s", args[0], line[1:])
	}
	return line, nil
}
