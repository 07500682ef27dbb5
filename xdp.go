package floodgate

import (
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/floodgate-rl/floodgate/zoneconf"
)

// xdpSpec is a zone's xdp setting with the prefixes its program masks
// sources with.
type xdpSpec struct {
	*zoneconf.XDP
	v4, v6 int
}

// xdpSpec returns z's xdp setting, nil if it has none; z's prefixes are set.
func (z *zone) xdpSpec(zc *Zone) *xdpSpec {
	if zc.XDP == nil {
		return nil
	}
	return &xdpSpec{XDP: zc.XDP, v4: z.v4, v6: z.v6}
}

// key is the spec as part of a tableKey: "" for none. The limit is not
// part of it: a table shared with the program changes its limit keeping
// its counters (xdpTable.setLimit), as any table does.
func (x *xdpSpec) key() string {
	if x == nil {
		return ""
	}
	return fmt.Sprintf("%s, ipv4_prefix %d, ipv6_prefix %d", x.XDP, x.v4, x.v6)
}

// XDPInfo is a zone's XDP side as GET /rate_limit/zones reports it: where
// the program runs and the SYNs it decided, since its table was made (a
// reload that changes the zone's prefixes or xdp setting makes a new one;
// one that changes its limit keeps it).
type XDPInfo struct {
	Interface string `json:"interface"`
	// Mode is native (in the driver) or generic.
	Mode    string `json:"mode"`
	Passed  uint64 `json:"syns_passed"`
	Dropped uint64 `json:"syns_dropped"`
}

// synPath is where a zone's XDP program charges SYNs, as the layer4
// matcher tells it from a connection's addresses (layer4.Zone.SYNCharged):
// captured when the program is attached, so that deciding costs two map
// lookups and no system call.
type synPath struct {
	// iface holds the addresses of the program's interface: a connection
	// to one of them arrived there, unless it came from the host itself.
	iface map[netip.Addr]struct{}
	// host holds every address of the host: a connection from one of them
	// went over loopback, where no program runs.
	host  map[netip.Addr]struct{}
	ports []uint16 // none: every port
}

// newSYNPath reads the addresses of the interface ifc and of the host (host),
// as the caller read them in its network namespace.
func newSYNPath(ifc, host []net.Addr, ports []uint16) *synPath {
	set := func(as []net.Addr) map[netip.Addr]struct{} {
		m := make(map[netip.Addr]struct{}, len(as))
		for _, a := range as {
			if n, ok := a.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok {
					m[ip.Unmap().WithZone("")] = struct{}{}
				}
			}
		}
		return m
	}
	return &synPath{iface: set(ifc), host: set(host), ports: slices.Clone(ports)}
}

// charged reports whether a connection from remote to local had its SYN
// charged by the program (never, for a nil path: not attached): it was sent to an address of the interface and
// one of the ports, and not from the host itself. Traffic to the
// interface's address that arrives on another interface (Linux accepts it)
// is taken for the program's and not charged again.
func (p *synPath) charged(local, remote netip.AddrPort) bool {
	if p == nil { // not attached
		return false
	}
	if _, ok := p.iface[local.Addr()]; !ok {
		return false
	}
	if _, ok := p.host[remote.Addr()]; ok || remote.Addr().IsLoopback() {
		return false
	}
	return len(p.ports) == 0 || slices.Contains(p.ports, local.Port())
}
