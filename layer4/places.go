package layer4

import (
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

// A connection that a zone with max_concurrent admits holds a place in the
// zone's table (limiter.Concurrency) until it closes. caddy-l4 v0.1.2 tells
// a matcher nothing of that close: a layer4 server closes the accepted
// socket itself once routing returns (its handle's deferred conn.Close, on
// the socket, not on the layer4.Connection the matcher saw), the listener
// wrapper does the same or hands the connection to net/http, which closes
// it whenever it is done, and neither cancels a context or calls into a
// module. What every way out has in common is the accepted socket's close,
// so the matcher keeps the place with the socket, and a watch looks at the
// sockets of the places held every sweepInterval and gives back each place
// whose socket is closed: a closed socket's RawConn refuses Control, which
// takes no lock the connection's readers and writers hold. A place is
// thus given back within a sweep of its connection's close, whoever closes
// it, exactly once (limiter.Place.Release).

// sweepInterval is how often the watch looks for closed connections: the
// longest a closed connection keeps its place.
const sweepInterval = 100 * time.Millisecond

// A heldPlace is the place of one open connection, with the socket whose
// close gives it back.
type heldPlace struct {
	place  limiter.Place
	socket syscall.RawConn
}

// closed reports whether the connection's socket has been closed.
func (h *heldPlace) closed() bool {
	return h.socket.Control(func(uintptr) {}) != nil
}

// watchable returns the accepted socket under c (see socket) as a RawConn
// whose Control fails once it is closed, and false if c has none: a UDP
// flow (caddy-l4's packetConn shares the server's socket) or a connection
// of a wrapper the matcher cannot see through.
func watchable(c net.Conn) (syscall.RawConn, bool) {
	sc, ok := socket(c).(syscall.Conn)
	if !ok {
		return nil, false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, false
	}
	return rc, true
}

// closeWatch holds the places of open connections and gives each back when
// its socket closes. Its goroutine runs only while it holds a place, so a
// server at rest has none.
type closeWatch struct {
	mu      sync.Mutex
	held    []*heldPlace
	running bool
	// every is the time between sweeps (sweepInterval); 0 starts no
	// goroutine, leaving the sweeps to the caller.
	every time.Duration
}

// watch is the process's close watch: places outlive configs (a reload
// keeps the zone's table), and so does the watch that gives them back.
var watch = &closeWatch{every: sweepInterval}

// hold keeps h until its socket closes, then releases its place.
func (w *closeWatch) hold(h *heldPlace) {
	w.mu.Lock()
	w.held = append(w.held, h)
	start := !w.running
	w.running = true
	w.mu.Unlock()
	if start && w.every > 0 {
		go w.run()
	}
}

// run sweeps every w.every until no place is held.
func (w *closeWatch) run() {
	t := time.NewTicker(w.every)
	defer t.Stop()
	for range t.C {
		if w.sweep() == 0 {
			w.mu.Lock()
			if len(w.held) == 0 {
				w.running = false
				w.mu.Unlock()
				return
			}
			w.mu.Unlock()
		}
	}
}

// sweep releases the place of every closed connection and returns how many
// places it still holds. It looks at the sockets without the lock, so that
// connections admitted meanwhile do not wait for a sweep of many.
func (w *closeWatch) sweep() int {
	w.mu.Lock()
	held := w.held
	w.held = nil
	w.mu.Unlock()
	open := held[:0]
	for _, h := range held {
		if h.closed() {
			h.place.Release()
			continue
		}
		open = append(open, h)
	}
	clear(held[len(open):]) // let the released places go
	if cap(open) > 4*len(open)+1024 {
		// and the array a flood of connections grew, once most are gone
		open = append([]*heldPlace(nil), open...)
	}
	w.mu.Lock()
	w.held = append(open, w.held...)
	n := len(w.held)
	w.mu.Unlock()
	return n
}

// holding returns how many places w holds.
func (w *closeWatch) holding() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.held)
}
