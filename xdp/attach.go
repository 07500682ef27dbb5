//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package xdp

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"

	"github.com/cilium/ebpf/link"
)

// An Attachment is a table's program attached to one network interface.
//
// An interface holds one XDP program, and a config reload builds its tables
// while the old config still runs, so the attachments of one interface
// share one BPF link: the newest attachment's program runs, and closing it
// puts the next newest back (BPF_LINK_UPDATE swaps the program atomically;
// no SYN goes unchecked in between). Closing the last detaches the program.
// The kernel also detaches it when this process exits, since the link is
// tied to its file descriptor: nothing is pinned, and a crash never leaves
// the program attached.
type Attachment struct {
	// Interface is the interface's name.
	Interface string
	// Mode is "native" (in the driver, before any socket buffer is
	// allocated) or "generic" (after, for drivers without XDP support:
	// still before the TCP stack, at a fraction of native's speed).
	Mode string

	t *Table
}

// ifaceLink is the one BPF link of an interface and the tables attached to
// it through it, oldest first; the last one's program runs.
type ifaceLink struct {
	link   link.Link
	mode   string
	tables []*Table
}

var (
	linksMu sync.Mutex
	links   = map[string]*ifaceLink{}
)

// Ports are the destination ports a table's program limits.
type Ports struct {
	// TCP are the ports whose SYNs are limited; none means every port,
	// unless QUIC names ports: then none means no TCP port (an operator
	// who limits HTTP/3 alone does not have SSH's SYNs spend its budget).
	TCP []uint16
	// QUIC are the UDP ports whose QUIC Initials are limited; none means
	// no UDP port.
	QUIC []uint16
}

// Attach starts enforcing the table on TCP SYNs and QUIC Initials to ports
// arriving on the named interface, in this process's network namespace:
// natively if the driver supports XDP, generically otherwise. The ports
// are the table's, whichever interface it is attached to. An interface
// that runs another zone's table refuses it. It needs CAP_NET_ADMIN (and
// CAP_BPF).
func (t *Table) Attach(ifname string, ports Ports) (*Attachment, error) {
	ifc, err := net.InterfaceByName(ifname)
	if err != nil {
		return nil, fmt.Errorf("xdp: interface %q: %w", ifname, err)
	}
	if err := t.enable(ports); err != nil {
		return nil, err
	}
	linksMu.Lock()
	defer linksMu.Unlock()
	key := fmt.Sprintf("%s#%d", ifname, ifc.Index)
	il := links[key]
	if il == nil {
		il = new(ifaceLink)
		il.link, il.mode, err = attachLink(t, ifc)
		if err != nil {
			return nil, err
		}
		links[key] = il
	} else if other := il.tables[len(il.tables)-1].zone; other != t.zone {
		return nil, fmt.Errorf("xdp: interface %s already limits SYNs for zone %q; an interface takes one zone's program", ifname, other)
	} else if err := il.link.Update(t.objs.Synlimit); err != nil {
		return nil, explain(fmt.Sprintf("replacing the program on %s", ifname), err)
	}
	il.tables = append(il.tables, t)
	return &Attachment{Interface: ifname, Mode: il.mode, t: t}, nil
}

// attachLink attaches t's program to ifc, natively if the driver allows.
func attachLink(t *Table, ifc *net.Interface) (link.Link, string, error) {
	l, err := link.AttachXDP(link.XDPOptions{Program: t.objs.Synlimit, Interface: ifc.Index, Flags: link.XDPDriverMode})
	if err == nil {
		return l, "native", nil
	}
	l, gerr := link.AttachXDP(link.XDPOptions{Program: t.objs.Synlimit, Interface: ifc.Index, Flags: link.XDPGenericMode})
	if gerr != nil {
		return nil, "", explain(fmt.Sprintf("attaching to %s (native mode: %v; generic mode)", ifc.Name, err), gerr)
	}
	return l, "generic", nil
}

// enable sets the limited ports and turns the program on.
func (t *Table) enable(ports Ports) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return errors.New("xdp: the table is closed")
	}
	portSet(&t.params.Ports, ports.TCP)
	if len(ports.TCP) == 0 && len(ports.QUIC) == 0 {
		for i := range t.params.Ports {
			t.params.Ports[i] = ^uint64(0)
		}
	}
	portSet(&t.params.QuicPorts, ports.QUIC)
	t.params.Quic = 0
	if len(ports.QUIC) > 0 {
		t.params.Quic = 1
	}
	t.params.Enabled = 1
	return t.writeParams()
}

// Close detaches the table from the interface: the next newest table
// attached there runs instead, or none.
func (a *Attachment) Close() error {
	linksMu.Lock()
	defer linksMu.Unlock()
	if a.t == nil {
		return nil
	}
	t := a.t
	a.t = nil
	for key, il := range links {
		i := slices.Index(il.tables, t)
		if i < 0 {
			continue
		}
		il.tables = slices.Delete(il.tables, i, i+1)
		if len(il.tables) == 0 {
			delete(links, key)
			return il.link.Close()
		}
		if i == len(il.tables) { // it was running
			return il.link.Update(il.tables[len(il.tables)-1].objs.Synlimit)
		}
		return nil
	}
	return nil
}

// detach closes il, taking its program off the interface, and forgets it:
// the tables attached through it are attached no more (their Attachments'
// Close finds nothing to do). linksMu is held.
func detach(il *ifaceLink) {
	for key, l := range links {
		if l == il {
			delete(links, key)
		}
	}
	_ = il.link.Close()
}

// runningOn returns the link whose running program is t's, or nil; linksMu
// is held.
func runningOn(t *Table) *ifaceLink {
	for _, il := range links {
		if il.tables[len(il.tables)-1] == t {
			return il
		}
	}
	return nil
}

// portSet makes set the bit set of ports (bit p of word p/64 for port p).
func portSet(set *[1024]uint64, ports []uint16) {
	clear(set[:])
	for _, p := range ports {
		set[p>>6] |= 1 << (p & 63)
	}
}
