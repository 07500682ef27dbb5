package xdp

import (
	"errors"
	"fmt"
	"net"

	"github.com/cilium/ebpf/link"
)

// An Attachment is the program attached to one network interface through a
// BPF link: the kernel detaches it when the link is closed or this process
// exits, so a crash never leaves it attached. Nothing is pinned.
type Attachment struct {
	// Interface is the interface's name.
	Interface string
	// Mode is "native" (in the driver, before any socket buffer is
	// allocated) or "generic" (after, for drivers without XDP support:
	// still before the TCP stack, at a fraction of native's speed).
	Mode string

	link link.Link
}

// Attach starts enforcing the table on TCP SYNs to ports (every port if
// there are none) arriving on the named interface: natively if the driver
// supports XDP, generically otherwise. A table may be attached to several
// interfaces; ports are the table's, the last Attach's. It needs
// CAP_NET_ADMIN (and CAP_BPF).
func (t *Table) Attach(ifname string, ports []uint16) (*Attachment, error) {
	ifc, err := net.InterfaceByName(ifname)
	if err != nil {
		return nil, fmt.Errorf("xdp: interface %q: %w", ifname, err)
	}
	if err := t.enable(ports); err != nil {
		return nil, err
	}
	a := &Attachment{Interface: ifname}
	a.link, err = link.AttachXDP(link.XDPOptions{Program: t.objs.Synlimit, Interface: ifc.Index, Flags: link.XDPDriverMode})
	a.Mode = "native"
	if err != nil {
		var gerr error
		a.link, gerr = link.AttachXDP(link.XDPOptions{Program: t.objs.Synlimit, Interface: ifc.Index, Flags: link.XDPGenericMode})
		a.Mode = "generic"
		if gerr != nil {
			return nil, explain(fmt.Sprintf("attaching to %s (native: %v; generic)", ifname, err), gerr)
		}
	}
	return a, nil
}

// enable sets the limited ports and turns the program on.
func (t *Table) enable(ports []uint16) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return errors.New("xdp: the table is closed")
	}
	clear(t.params.Ports[:])
	for _, p := range ports {
		t.params.Ports[p>>6] |= 1 << (p & 63)
	}
	if len(ports) == 0 {
		for i := range t.params.Ports {
			t.params.Ports[i] = ^uint64(0)
		}
	}
	t.params.Enabled = 1
	return t.writeParams()
}

// Close detaches the program from the interface.
func (a *Attachment) Close() error {
	if a.link == nil {
		return nil
	}
	err := a.link.Close()
	a.link = nil
	return err
}
