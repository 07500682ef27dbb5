package zoneconf

import (
	"fmt"
	"strconv"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// XDP enforces a zone's table on TCP SYNs at a network interface, in an XDP
// program (package xdp), before the kernel answers them: a source network
// that is over its limit never gets a SYN-ACK. The program charges the same
// counters as the zone's layer4 matchers and HTTP handlers, one token per
// SYN, keyed by the zone's ipv4_prefix and ipv6_prefix. Caddyfile:
// `xdp <interface> [ports…] [optional]`.
type XDP struct {
	// Interface is the network interface whose incoming SYNs are limited,
	// e.g. eth0. Required.
	Interface string `json:"interface"`
	// Ports are the TCP destination ports whose SYNs are limited. Default:
	// every port.
	Ports []uint16 `json:"ports,omitempty"`
	// Optional makes a host that cannot run the program (no CAP_BPF or
	// CAP_NET_ADMIN, a kernel without XDP) log why and limit in Go only,
	// rather than refuse the config. Default: refuse.
	Optional bool `json:"optional,omitempty"`
}

// unmarshalXDP reads `xdp <interface> [ports…] [optional]`; the dispenser is
// on xdp.
func (l *Limit) unmarshalXDP(d *caddyfile.Dispenser, where string) error {
	x := new(XDP)
	if !d.NextArg() {
		return d.Errf("%sxdp needs an interface: xdp <interface> [ports…] [optional]", where)
	}
	x.Interface = d.Val()
	for d.NextArg() {
		v := d.Val()
		if v == "optional" {
			x.Optional = true
			continue
		}
		p, err := strconv.ParseUint(v, 10, 16)
		if err != nil || p == 0 {
			return d.Errf("%sxdp port %q: must be a TCP port from 1 to 65535, or optional", where, v)
		}
		x.Ports = append(x.Ports, uint16(p))
	}
	l.XDP = x
	return nil
}

// String is the setting as the Caddyfile writes it.
func (x *XDP) String() string {
	s := "xdp " + x.Interface
	for _, p := range x.Ports {
		s += fmt.Sprintf(" %d", p)
	}
	if x.Optional {
		s += " optional"
	}
	return s
}
