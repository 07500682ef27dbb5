package floodgate

import (
	"fmt"
	"strings"
	"time"
)

// What each zone means, in words, logged at INFO once per config load
// (App.warn), so that an operator reads what a config does rather than
// what they meant it to: "zone "api": at most 10 in any 2 seconds per
// X-Api-Key header or client address; and at most 3 in any day".

// meaning describes zone z in words.
func (z *zone) meaning() string {
	zc := z.conf
	var b strings.Builder
	if !zc.HasRate() {
		fmt.Fprintf(&b, "at most %d requests in flight at once %s, on this instance (max_concurrent is never shared across a cluster)", zc.MaxConcurrent, z.keyWords())
		return b.String()
	}
	if zc.Windowed() {
		fmt.Fprintf(&b, "at most %d in any %s", zc.MaxEvents, spanWords(time.Duration(zc.Window)))
	} else {
		fmt.Fprintf(&b, "%d per %s sustained, up to %d at once", zc.MaxEvents, spanWords(time.Duration(zc.Window)), zc.Burst)
	}
	switch {
	case zc.WeightResponseBytes:
		b.WriteString(" (bytes of response body)")
	case zc.WeightResponseTime:
		b.WriteString(" (milliseconds of response time)")
	case zc.WeightResponseStatus != nil:
		b.WriteString(" (responses with status " + strings.Join(zc.WeightResponseStatus, ", ") + " only)")
	}
	b.WriteString(" " + z.keyWords())
	for _, q := range zc.Quotas {
		fmt.Fprintf(&b, "; and at most %d in any %s", q.MaxEvents, spanWords(time.Duration(q.Window)))
	}
	if z.dist != nil {
		b.WriteString(", across the cluster")
	}
	if zc.MaxConcurrent != 0 {
		fmt.Fprintf(&b, "; and at most %d requests in flight at once, on this instance", zc.MaxConcurrent)
	}
	switch {
	case !z.action.enforces():
		b.WriteString("; a dry run (action log): requests over it are logged, not denied")
	case z.action.holds():
		fmt.Fprintf(&b, "; a request over it waits up to %s for its turn, then is denied", time.Duration(zc.MaxDelay))
	}
	return b.String()
}

// keyWords says whom z limits: "per client address", "per X-Api-Key header
// or client address", "for all its requests together".
func (z *zone) keyWords() string {
	if len(z.keys) == 0 {
		if z.counts.layer4.Load() {
			return "per source network of a connection" + z.prefixWords()
		}
		return "for all its requests together (no key)"
	}
	var names []string
	address := false
	for _, k := range z.keys {
		switch k.kind {
		case keyClientIP:
			names, address = append(names, "client address"), true
		case keyRemoteIP:
			names, address = append(names, "peer address"), true
		case keyHeader:
			names = append(names, k.name+" header")
		default:
			if len(k.parts) == 1 && !k.parts[0].placeholder {
				return "for all its requests together (the constant key " + k.text + ")"
			}
			names = append(names, k.text)
		}
	}
	s := "per " + strings.Join(names, " or ")
	if address {
		s += z.prefixWords()
	}
	return s
}

// prefixWords names the networks addresses are grouped by, if they are.
func (z *zone) prefixWords() string {
	if z.v4 == 32 && z.v6 == 128 {
		return ""
	}
	return fmt.Sprintf(" (networks of /%d for IPv4, /%d for IPv6)", z.v4, z.v6)
}

// spanWords writes d as a span of time in words: "second", "2 seconds",
// "day", "90 minutes", "1.5s".
func spanWords(d time.Duration) string {
	for _, u := range []struct {
		d    time.Duration
		name string
	}{{24 * time.Hour, "day"}, {time.Hour, "hour"}, {time.Minute, "minute"}, {time.Second, "second"}} {
		if d >= u.d && d%u.d == 0 {
			if n := d / u.d; n > 1 {
				return fmt.Sprintf("%d %ss", n, u.name)
			}
			return u.name
		}
	}
	return d.String()
}
