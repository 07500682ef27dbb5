//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package floodgate

import (
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/xdp"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// xdpTable is a table's XDP side: the program and its maps, and its
// attachment to the interface.
type xdpTable struct {
	t   *xdp.Table
	att *xdp.Attachment
	x   *zoneconf.XDP
	// path is where the program charges SYNs, read at attach and again
	// whenever a config with this table is loaded (refreshPath), so that
	// an address the interface gained since is known after a reload.
	path atomic.Pointer[synPath]
}

// newXDPBuckets makes a table whose buckets live in an XDP program's map,
// attached to x.Interface. If the host cannot run the program and x is
// optional, it logs why and returns plain buckets instead.
func newXDPBuckets(zone string, cfg limiter.BucketsConfig, x *zoneconf.XDP, v4, v6 int) (*limiter.Buckets, *xdpTable, error) {
	xt, err := xdp.NewTable(xdp.Config{Buckets: cfg, IPv4Prefix: v4, IPv6Prefix: v6, Zone: zone})
	if err == nil {
		var att *xdp.Attachment
		var path *synPath
		if path, err = readSYNPath(x); err == nil {
			att, err = xt.Attach(x.Interface, x.Ports)
		}
		if err == nil {
			caddy.Log().Named("rate_limit").Info(fmt.Sprintf("zone %q: SYNs limited by XDP on %s (%s mode)", zone, att.Interface, att.Mode),
				zap.String("zone", zone), zap.String("interface", att.Interface), zap.String("mode", att.Mode),
				zap.Uint16s("ports", x.Ports))
			xdt := &xdpTable{t: xt, att: att, x: x}
			xdt.path.Store(path)
			return xt.Buckets, xdt, nil
		}
		xt.Close()
	}
	if !x.Optional {
		return nil, nil, err
	}
	caddy.Log().Named("rate_limit").Warn(fmt.Sprintf("zone %q: xdp is optional and not available, limiting in Go only: %v", zone, err),
		zap.String("zone", zone))
	b, err := limiter.NewBuckets(cfg)
	return b, nil, err
}

// readSYNPath reads the addresses the program will see SYNs to, in this
// thread's network namespace (the one the program is attached in).
func readSYNPath(x *zoneconf.XDP) (*synPath, error) {
	ifc, err := net.InterfaceByName(x.Interface)
	if err != nil {
		return nil, fmt.Errorf("xdp: interface %q: %w", x.Interface, err)
	}
	ia, err := ifc.Addrs()
	if err != nil {
		return nil, fmt.Errorf("xdp: interface %q: %w", x.Interface, err)
	}
	ha, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("xdp: the host's addresses: %w", err)
	}
	return newSYNPath(ia, ha, x.Ports), nil
}

// synCharged is what the layer4 matchers ask whether the program charged a
// connection's SYN; nil if the table has no XDP side. It reads the
// addresses again first (a config using the table is being loaded, in the
// namespace the program was attached in); if that fails it keeps those it
// had.
func (x *xdpTable) synCharged() func(local, remote netip.AddrPort) bool {
	if x == nil {
		return nil
	}
	if p, err := readSYNPath(x.x); err == nil {
		x.path.Store(p)
	}
	return func(local, remote netip.AddrPort) bool { return x.path.Load().charged(local, remote) }
}

// close detaches the program and releases its maps; the buckets stay
// usable until they are garbage.
func (x *xdpTable) close() {
	if x == nil {
		return
	}
	_ = x.att.Close()
	_ = x.t.Close()
}

// info is the XDP side as the admin API reports it; nil if the table has
// none.
func (x *xdpTable) info() *XDPInfo {
	if x == nil {
		return nil
	}
	c, err := x.t.Counts()
	if err != nil {
		return nil
	}
	return &XDPInfo{Interface: x.att.Interface, Mode: x.att.Mode, Passed: c.Passed, Dropped: c.Dropped}
}
