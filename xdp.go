package floodgate

import (
	"fmt"

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
// the program runs and the SYNs and QUIC Initials it decided, since its
// table was made (a reload that changes the zone's prefixes or xdp setting
// makes a new one; one that changes its limit keeps it).
type XDPInfo struct {
	Interface string `json:"interface"`
	// Mode is native (in the driver) or generic.
	Mode    string `json:"mode"`
	Passed  uint64 `json:"syns_passed"`
	Dropped uint64 `json:"syns_dropped"`
	// InitialsPassed and InitialsDropped count the QUIC Initials that
	// open a connection, on the ports named for QUIC, that took a token
	// and that found none; an Initial of a connection charged already is
	// in neither. Zero without quic ports.
	InitialsPassed  uint64 `json:"quic_initials_passed"`
	InitialsDropped uint64 `json:"quic_initials_dropped"`
}
