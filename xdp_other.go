//go:build !linux || !(386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

package floodgate

import (
	"errors"
	"net/netip"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/zoneconf"
)

// xdpTable has no XDP side where XDP does not exist.
type xdpTable struct{}

var errNoXDP = errors.New("xdp needs Linux on a little-endian CPU")

// newXDPBuckets refuses, or for an optional setting logs why and returns
// plain buckets.
func newXDPBuckets(zone string, cfg limiter.BucketsConfig, x *zoneconf.XDP, v4, v6 int) (*limiter.Buckets, *xdpTable, error) {
	if !x.Optional {
		return nil, nil, errNoXDP
	}
	caddy.Log().Named("rate_limit").Warn("zone " + zone + ": xdp is optional and not available, limiting in Go only: " + errNoXDP.Error())
	b, err := limiter.NewBuckets(cfg)
	return b, nil, err
}

func (x *xdpTable) attach() error { return nil }

func (x *xdpTable) setLimit(limiter.Limit, time.Time) error { return errNoXDP }

func (x *xdpTable) close() {}

func (x *xdpTable) info() *XDPInfo { return nil }

func (x *xdpTable) synCharged() func(local, remote netip.AddrPort) bool { return nil }
