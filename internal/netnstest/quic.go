//go:build linux

package netnstest

import (
	"net"
	"sync"
	"sync/atomic"
)

// A HandshakeHider is a QUIC client's UDP socket that puts a junk version 1
// 0-RTT packet under the same DCID and SCID in front of every datagram it
// sends that starts with a long-header packet other than a first flight's
// Initial (one under a DCID of 8 bytes or more): quic-go's server skips
// the junk (it has no 0-RTT keys for it) and reads the Handshake packet
// behind it, from the same address and port. It is how a client hides its
// Handshake packets from a program that looks for them by type and place.
// Hidden counts the datagrams it changed; FirstDCID is the DCID of the
// first Initial it sent.
type HandshakeHider struct {
	net.PacketConn
	Hidden atomic.Int64
	mu     sync.Mutex
	first  []byte
}

// FirstDCID is the DCID of the first first-flight Initial h sent, or nil.
func (h *HandshakeHider) FirstDCID() []byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.first
}

func (h *HandshakeHider) WriteTo(b []byte, addr net.Addr) (int, error) {
	if len(b) < 7 || b[0]&0x80 == 0 || len(b) < 7+int(b[5]) || len(b) < 7+int(b[5])+int(b[6+int(b[5])]) {
		return h.PacketConn.WriteTo(b, addr)
	}
	dcid := b[6 : 6+int(b[5])]
	scid := b[6+len(dcid) : 7+len(dcid)+int(b[6+len(dcid)])] // its length, then it
	if b[0]>>4&3 == 0 && len(dcid) >= 8 {
		h.mu.Lock()
		if h.first == nil {
			h.first = append([]byte(nil), dcid...)
		}
		h.mu.Unlock()
		return h.PacketConn.WriteTo(b, addr)
	}
	p := append([]byte{0xd0, 0, 0, 0, 1, byte(len(dcid))}, dcid...) // version 1, 0-RTT
	p = append(p, scid...)
	p = append(p, 0x40, 20) // Length 20
	p = append(p, make([]byte, 20)...)
	if _, err := h.PacketConn.WriteTo(append(p, b...), addr); err != nil {
		return 0, err
	}
	h.Hidden.Add(1)
	return len(b), nil
}
