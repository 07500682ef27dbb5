//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package floodgate

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/xdp"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// xdpTable is a table's XDP side: the program and its maps, and its
// attachment to the interface once a config using it has started.
type xdpTable struct {
	t    *xdp.Table
	x    *zoneconf.XDP
	zone string

	mu  sync.Mutex // serialises attach and close
	att *xdp.Attachment
}

// newXDPBuckets makes a table whose buckets live in an XDP program's map,
// for the program to be attached to x.Interface when a config using it
// starts (attach): provisioning alone, as `caddy validate` does, loads the
// program and checks the interface but attaches nothing. If the host
// cannot load the program and x is optional, it logs why and returns plain
// buckets instead.
func newXDPBuckets(zone string, cfg limiter.BucketsConfig, x *zoneconf.XDP, v4, v6 int) (*limiter.Buckets, *xdpTable, error) {
	xt, err := xdp.NewTable(xdp.Config{Buckets: cfg, IPv4Prefix: v4, IPv6Prefix: v6, Zone: zone})
	if err == nil {
		if err = checkInterface(x); err == nil {
			return xt.Buckets, &xdpTable{t: xt, x: x, zone: zone}, nil
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

// attach attaches the program to the interface, unless it already is: a
// config using the table is starting. If that fails and the setting is
// optional, it logs why and the zone limits in Go only, on the same table.
func (x *xdpTable) attach() error {
	if x == nil {
		return nil
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.att != nil {
		return nil
	}
	err := checkInterface(x.x)
	var att *xdp.Attachment
	if err == nil {
		att, err = x.t.Attach(x.x.Interface, xdp.Ports{TCP: x.x.Ports, QUIC: x.x.QUICPorts})
	}
	if err != nil {
		if !x.x.Optional {
			return err
		}
		caddy.Log().Named("rate_limit").Warn(fmt.Sprintf("zone %q: xdp is optional and not available, limiting in Go only: %v", x.zone, err),
			zap.String("zone", x.zone))
		return nil
	}
	caddy.Log().Named("rate_limit").Info(fmt.Sprintf("zone %q: SYNs limited by XDP on %s (%s mode)", x.zone, att.Interface, att.Mode),
		zap.String("zone", x.zone), zap.String("interface", att.Interface), zap.String("mode", att.Mode),
		zap.Uint16s("ports", x.x.Ports), zap.Uint16s("quic_ports", x.x.QUICPorts))
	x.att = att
	return nil
}

// checkInterface checks that the interface exists in this thread's network
// namespace (the one the program is attached in).
func checkInterface(x *zoneconf.XDP) error {
	if _, err := net.InterfaceByName(x.Interface); err != nil {
		return fmt.Errorf("xdp: interface %q: %w", x.Interface, err)
	}
	return nil
}

// synCharged is what the layer4 matchers ask whether the program charged a
// connection's SYN (xdp.Table.Charged: the program marked it, whatever
// shape or interface it came in); nil if the table has no XDP side.
func (x *xdpTable) synCharged() func(local, remote netip.AddrPort) bool {
	if x == nil {
		return nil
	}
	return x.t.Charged
}

// setLimit puts l in force on the table and its program, keeping what each
// key used (xdp.Table.SetLimit). If the limit is in force but the kernel
// refused the new program, the program is detached: it logs that, and the
// zone's matchers charge every connection again (none came through the
// program, so none is marked) until a config attaches the table anew.
func (x *xdpTable) setLimit(l limiter.Limit, now time.Time) error {
	err := x.t.SetLimit(l, now)
	var notReplaced *xdp.ProgramNotReplacedError
	if !errors.As(err, &notReplaced) {
		return err
	}
	x.mu.Lock()
	x.att = nil
	x.mu.Unlock()
	caddy.Log().Named("rate_limit").Error(fmt.Sprintf("zone %q: limiting connections in Go only: %v", x.zone, err),
		zap.String("zone", x.zone))
	return nil
}

// close detaches the program and releases its maps; the buckets stay
// usable until they are garbage.
func (x *xdpTable) close() {
	if x == nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.att != nil {
		_ = x.att.Close()
	}
	_ = x.t.Close()
}

// info is the XDP side as the admin API reports it; nil if the table has
// none.
func (x *xdpTable) info() *XDPInfo {
	if x == nil {
		return nil
	}
	x.mu.Lock()
	att := x.att
	x.mu.Unlock()
	if att == nil {
		return nil
	}
	c, err := x.t.Counts()
	if err != nil {
		return nil
	}
	return &XDPInfo{Interface: att.Interface, Mode: att.Mode, Passed: c.Passed, Dropped: c.Dropped,
		InitialsPassed: c.InitialsPassed, InitialsDropped: c.InitialsDropped}
}
