package zoneconf

import (
	"fmt"
	"slices"
	"strconv"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// XDP enforces a zone's table at a network interface, in an XDP program
// (package xdp), before the kernel answers: on TCP SYNs, and on the QUIC
// Initials that open HTTP/3 connections on the UDP ports named for QUIC. A
// source network that is over its limit never gets a SYN-ACK, nor a QUIC
// handshake. The program charges the same counters as the zone's layer4
// matchers and HTTP handlers, one token per SYN and per QUIC connection,
// keyed by the zone's ipv4_prefix and ipv6_prefix. Caddyfile:
// `xdp <interface> [ports…] [quic <ports…>] [optional]`.
type XDP struct {
	// Interface is the network interface whose incoming SYNs are limited,
	// e.g. eth0. Required.
	Interface string `json:"interface"`
	// Ports are the TCP destination ports whose SYNs are limited. Default:
	// every port, or none when QUICPorts names some (`xdp eth0 quic 443`
	// limits HTTP/3 alone).
	Ports []uint16 `json:"ports,omitempty"`
	// QUICPorts are the UDP destination ports whose QUIC Initials are
	// limited, one token per connection (HTTP/3 is served on 443).
	// Default: none; UDP passes untouched.
	QUICPorts []uint16 `json:"quic_ports,omitempty"`
	// Optional makes a host that cannot run the program (no CAP_BPF or
	// CAP_NET_ADMIN, a kernel without XDP) log why and limit in Go only,
	// rather than refuse the config. Default: refuse.
	Optional bool `json:"optional,omitempty"`
}

// xdpSyntax is the setting's Caddyfile syntax, for errors.
const xdpSyntax = "xdp <interface> [ports…] [quic <ports…>] [optional]"

// unmarshalXDP reads `xdp <interface> [ports…] [quic <ports…>] [optional]`;
// the dispenser is on xdp.
func (l *Limit) unmarshalXDP(d *caddyfile.Dispenser, where string) error {
	x := new(XDP)
	if !d.NextArg() {
		return d.Errf("%sxdp needs an interface: %s", where, xdpSyntax)
	}
	x.Interface = d.Val()
	quic := false
	for d.NextArg() {
		v := d.Val()
		switch {
		case v == "optional":
			x.Optional = true
			continue
		case v == "quic" && quic:
			return d.Errf("%sxdp: quic is written twice: list every UDP port after one quic", where)
		case v == "quic":
			quic = true
			continue
		}
		proto, ports := "TCP", &x.Ports
		if quic {
			proto, ports = "UDP", &x.QUICPorts
		}
		p, err := strconv.ParseUint(v, 10, 16)
		if err != nil || p == 0 {
			return d.Errf("%sxdp port %q: must be a %s port from 1 to 65535, quic, or optional", where, v, proto)
		}
		*ports = append(*ports, uint16(p))
	}
	if quic && len(x.QUICPorts) == 0 {
		return d.Errf("%sxdp: quic needs the UDP ports HTTP/3 is served on, e.g. quic 443", where)
	}
	if err := x.validate(); err != nil {
		return d.Errf("%s%v", where, err)
	}
	l.XDP = x
	return nil
}

// validate checks what the JSON can get wrong and the Caddyfile cannot
// always: an interface, ports from 1 to 65535, none listed twice.
func (x *XDP) validate() error {
	if x.Interface == "" {
		return fmt.Errorf("xdp needs an interface: %s", xdpSyntax)
	}
	for _, list := range []struct {
		name  string
		ports []uint16
	}{{"TCP port", x.Ports}, {"QUIC (UDP) port", x.QUICPorts}} {
		for i, p := range list.ports {
			if p == 0 {
				return fmt.Errorf("xdp %s: 0 is no port: from 1 to 65535", list.name)
			}
			if slices.Contains(list.ports[:i], p) {
				return fmt.Errorf("xdp %s %d is listed twice", list.name, p)
			}
		}
	}
	return nil
}

// String is the setting as the Caddyfile writes it.
func (x *XDP) String() string {
	s := "xdp " + x.Interface
	for _, p := range x.Ports {
		s += fmt.Sprintf(" %d", p)
	}
	if len(x.QUICPorts) > 0 {
		s += " quic"
		for _, p := range x.QUICPorts {
			s += fmt.Sprintf(" %d", p)
		}
	}
	if x.Optional {
		s += " optional"
	}
	return s
}
