// Package zoneconf is the part of a zone's configuration that is the same
// wherever the zone is used, in an HTTP handler or in a layer4 matcher: its
// rate, burst, source-network grouping and table size, with their JSON form,
// their Caddyfile subdirectives and their validation. The packages that use a
// zone embed Limit in their own configuration and add what is theirs (keys
// and request matchers for HTTP, zone names and reload identity for layer4).
package zoneconf

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/dustin/go-humanize"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Limit is a zone's rate and the table that holds it. Without burst it is
// caddy-ratelimit's window: at most max_events in any span of the window
// (limiter.Windows). With burst it is a token bucket:
// max_events per window sustained, up to burst at once (limiter.Buckets).
type Limit struct {
	// MaxEvents is how many events (requests, or connections for layer4)
	// a key may make in a window (without burst, at most 1,048,576), or
	// per window sustained (with burst). At least 1. Caddyfile: events.
	MaxEvents int64 `json:"max_events,omitempty"`

	// Window is the period max_events are counted over. Required; at
	// least 1ms and at most 365 days, and max_events per window at most
	// 1,000,000 per second. A JSON number is nanoseconds: write "1h".
	Window caddy.Duration `json:"window,omitempty"`

	// Burst makes the zone a token bucket: how many events a key may make
	// at once after being idle, refilled at max_events per window. At most
	// 1,048,576 (limiter.MaxBurst). Default: none, and the zone allows at
	// most max_events in any span of the window, as caddy-ratelimit does,
	// and answers Retry-After until a request would pass (up to a
	// sub-window later than caddy-ratelimit's exact log: see
	// limiter.Windows).
	Burst int64 `json:"burst,omitempty"`

	// IPv4Prefix groups IPv4 sources by network: sources in the same
	// /ipv4_prefix share a bucket. 1 to 32; 0 means no grouping (32), as
	// in caddy-ratelimit. The default depends on where the zone is used
	// (32 for HTTP keys, 24 for layer4 connections).
	IPv4Prefix *int `json:"ipv4_prefix,omitempty"`

	// IPv6Prefix groups IPv6 sources by network. 1 to 128; 0 means no
	// grouping (128), as in caddy-ratelimit. Default 64 for HTTP keys, 48
	// for layer4 connections.
	IPv6Prefix *int `json:"ipv6_prefix,omitempty"`

	// Memory is the size of the zone's table in bytes, fixed whatever the
	// number of keys. Default: sized from sources and false_deny. Do not
	// set both.
	Memory int64 `json:"memory,omitempty"`

	// Sources is the number of keys expected to be over the limit at the
	// same time. Used to size the table when memory is not set. Default:
	// 100000.
	Sources int `json:"sources,omitempty"`

	// FalseDeny is the largest acceptable probability that a key under its
	// limit is denied while sources others flood. Used to size the table
	// when memory is not set. Above 0, below 1. Default: 0.005.
	FalseDeny float64 `json:"false_deny,omitempty"`

	// XDP also enforces the table on TCP SYNs, and QUIC Initials on the
	// UDP ports it names, at a network interface (see XDP). Default: off.
	XDP *XDP `json:"xdp,omitempty"`

	// MaxConcurrent is how many of a key's requests may be in flight at
	// once (HTTP/1.1 requests and HTTP/2 and HTTP/3 streams alike), or,
	// in a layer4 zone, how many connections a source network may hold
	// open. 1 to 1,048,576. The counts live in a fixed table of their own,
	// sized by memory (or sources and false_deny) like the rate's; they
	// are per instance, never synced. A zone may have max_concurrent
	// alone (no max_events and window) or beside its rate. Default: no
	// limit.
	MaxConcurrent int64 `json:"max_concurrent,omitempty"`
}

// HasRate reports whether l limits a rate (max_events per window), which
// every zone does but one that only has max_concurrent.
func (l *Limit) HasRate() bool { return l.MaxEvents != 0 || l.Window != 0 || l.MaxConcurrent == 0 }

// ConcurrencyLines is the number of 64-byte lines of l's table of places
// in flight (see Lines).
func (l *Limit) ConcurrencyLines() int {
	if l.Memory != 0 {
		return int(l.Memory / 64)
	}
	return limiter.LinesFor(l.EffectiveSources(), l.EffectiveFalseDeny(), limiter.DefaultK)
}

// Concurrency is the configuration of l's table of places in flight, sized
// as the rate's is.
func (l *Limit) Concurrency() limiter.ConcurrencyConfig {
	return limiter.ConcurrencyConfig{Max: l.MaxConcurrent, Bytes: int(l.Memory), Sources: l.Sources, FalseDeny: l.FalseDeny}
}

// The range of rates a zone may have, documented in docs/limits.md#rates:
// from one event per MaxWindow to MaxPerSecond events per second.
const (
	// MaxWindow is the longest window, a year: slower limits have waits
	// (Retry-After) of years, which no client honours.
	MaxWindow = 365 * 24 * time.Hour
	// MaxPerSecond is the fastest sustained rate, in events per second.
	MaxPerSecond = 1_000_000
	// MinWindow is the shortest window: a shorter one is almost always a
	// JSON number of seconds read as nanoseconds, and the fastest rate
	// can be written over a millisecond (events 1000 window 1ms).
	MinWindow = time.Millisecond
)

// Rate is the limit of l: a window's (Burst 0) if l has no burst, else a
// token bucket's.
func (l *Limit) Rate() limiter.Limit {
	return limiter.Limit{Events: l.MaxEvents, Window: time.Duration(l.Window), Burst: l.Burst}
}

// Windowed reports whether l is a window (no burst) rather than a token
// bucket.
func (l *Limit) Windowed() bool { return l.Burst == 0 }

// Prefixes returns the network sizes l groups IPv4 and IPv6 sources by:
// its ipv4_prefix and ipv6_prefix, v4 and v6 where it has none. 0 means
// what it means in caddy-ratelimit, whose configs (and JSON templates) write
// it for "not set": no grouping, each address its own source (/32, /128).
// Grouping every address of a family into one bucket, which /0 would be, is
// what a key without placeholders does.
func (l *Limit) Prefixes(v4, v6 int) (int, int) {
	if l.IPv4Prefix != nil {
		v4 = *l.IPv4Prefix
		if v4 == 0 {
			v4 = 32
		}
	}
	if l.IPv6Prefix != nil {
		v6 = *l.IPv6Prefix
		if v6 == 0 {
			v6 = 128
		}
	}
	return v4, v6
}

// Buckets is the configuration of l's table.
func (l *Limit) Buckets() limiter.BucketsConfig {
	return limiter.BucketsConfig{Limit: l.Rate(), Bytes: int(l.Memory), Sources: l.Sources, FalseDeny: l.FalseDeny}
}

// Lines is the number of 64-byte lines of l's table.
func (l *Limit) Lines() int {
	if l.Memory != 0 {
		return int(l.Memory / 64)
	}
	if l.Windowed() {
		return limiter.WindowLinesFor(l.EffectiveSources(), l.EffectiveFalseDeny(), limiter.DefaultK)
	}
	return limiter.LinesFor(l.EffectiveSources(), l.EffectiveFalseDeny(), limiter.DefaultK)
}

// EstimateFalseDeny is the false-deny probability of l's table (buckets or
// windows: see limiter.EstimateFalseDeny) when sources keys flood it.
func (l *Limit) EstimateFalseDeny(sources int) float64 {
	if l.Windowed() {
		return limiter.EstimateWindowFalseDeny(sources, l.Lines(), limiter.DefaultK)
	}
	return limiter.EstimateFalseDeny(sources, l.Lines(), limiter.DefaultK)
}

// EffectiveSources is how many sources l's memory is sized for: sources,
// or limiter.DefaultSources if unset. It is the one place that default is
// applied, for the table and for the quotas' sketches.
func (l *Limit) EffectiveSources() int {
	if l.Sources == 0 {
		return limiter.DefaultSources
	}
	return l.Sources
}

// EffectiveFalseDeny is the false-deny rate l's memory is sized for:
// false_deny, or limiter.DefaultFalseDeny if unset.
func (l *Limit) EffectiveFalseDeny() float64 {
	if l.FalseDeny == 0 {
		return limiter.DefaultFalseDeny
	}
	return l.FalseDeny
}

// Validate reports the first setting of l that cannot work, as where
// followed by the field, its value and why (where is e.g. `zone "api": `).
func (l *Limit) Validate(where string) error {
	bad := func(field string, value any, why string) error {
		return fmt.Errorf("%s%s %v: %s", where, field, value, why)
	}
	if l.MaxConcurrent < 0 || l.MaxConcurrent > limiter.MaxConcurrent {
		return bad("max_concurrent", l.MaxConcurrent, fmt.Sprintf("must be between 1 and %d", limiter.MaxConcurrent))
	}
	if !l.HasRate() {
		if l.Burst != 0 {
			return bad("burst", l.Burst, "needs max_events and window: a burst is part of a rate")
		}
		return l.validateTable(where, bad)
	}
	switch {
	case l.MaxEvents == 0 && l.MaxConcurrent != 0:
		return fmt.Errorf("%swindow %v needs max_events (events): a rate is events per window; for a limit of requests in flight alone, max_concurrent needs neither", where, time.Duration(l.Window))
	case l.Window == 0 && l.MaxConcurrent != 0:
		return fmt.Errorf("%smax_events %d needs a window: a rate is events per window; for a limit of requests in flight alone, max_concurrent needs neither", where, l.MaxEvents)
	case l.MaxEvents == 0:
		return fmt.Errorf("%smax_events is required (at least 1)", where)
	case l.MaxEvents < 0:
		return bad("max_events", l.MaxEvents, "must be at least 1")
	case l.Window == 0:
		return fmt.Errorf("%swindow is required (e.g. \"1m\")", where)
	}
	if why := windowProblem(time.Duration(l.Window)); why != "" {
		return bad("window", time.Duration(l.Window), why)
	}
	if why := rateProblem(l.MaxEvents, time.Duration(l.Window)); why != "" {
		return fmt.Errorf("%s%s", where, why)
	}
	if l.Burst < 0 {
		return bad("burst", l.Burst, "must not be negative")
	}
	if l.Rate().EffectiveBurst() > limiter.MaxBurst {
		if l.Windowed() {
			return bad("max_events", l.MaxEvents, fmt.Sprintf("at most %d in a window; for more, set burst: a token bucket of max_events per window", limiter.MaxBurst))
		}
		return bad("burst", l.Burst, fmt.Sprintf("must be at most %d", limiter.MaxBurst))
	}
	if l.XDP != nil && l.Windowed() {
		return bad("xdp", l.XDP.Interface, "needs burst: the XDP program enforces token buckets, not windows (write burst, e.g. burst "+fmt.Sprint(l.MaxEvents)+")")
	}
	validate := l.Rate().Validate
	if l.Windowed() {
		validate = l.Rate().ValidateWindow
	}
	if err := validate(); err != nil {
		return fmt.Errorf("%s%v", where, err)
	}
	return l.validateTable(where, bad)
}

// validateTable checks the settings every zone has, with a rate or not:
// prefixes and the size of its tables.
func (l *Limit) validateTable(where string, bad func(field string, value any, why string) error) error {
	if l.XDP != nil && !l.HasRate() {
		return bad("xdp", l.XDP.Interface, "needs a rate (events, window and burst): the XDP program enforces token buckets, not max_concurrent")
	}
	if l.XDP != nil {
		if err := l.XDP.validate(); err != nil {
			return fmt.Errorf("%s%v", where, err)
		}
	}
	if p := l.IPv4Prefix; p != nil && (*p < 0 || *p > 32) {
		return bad("ipv4_prefix", *p, "must be between 0 and 32")
	}
	if p := l.IPv6Prefix; p != nil && (*p < 0 || *p > 128) {
		return bad("ipv6_prefix", *p, "must be between 0 and 128")
	}
	if l.Memory != 0 && (l.Sources != 0 || l.FalseDeny != 0) {
		return bad("memory", l.Memory, "set either memory or sources and false_deny, not both")
	}
	if why := memoryProblem(l.Memory); l.Memory != 0 && why != "" {
		return bad("memory", l.Memory, why)
	}
	if l.Sources < 0 {
		return bad("sources", l.Sources, "must be positive")
	}
	if l.FalseDeny != 0 && !(l.FalseDeny > 0 && l.FalseDeny < 1) {
		return bad("false_deny", l.FalseDeny, "must be above 0 and below 1")
	}
	if l.Memory == 0 && l.Lines() > limiter.MaxBytes/64 {
		return fmt.Errorf("%s%s need a table larger than the maximum of %s: raise false_deny, lower sources, or set memory",
			where, l.Sizing(), humanize.IBytes(limiter.MaxBytes))
	}
	return nil
}

// Sizing names the settings a table was sized from, saying which are
// defaults, e.g. "false_deny 0.000000001 and sources 100000 (the default)",
// or its memory.
func (l *Limit) Sizing() string {
	if l.Memory != 0 {
		return "memory " + humanize.IBytes(uint64(l.Memory))
	}
	fd := "false_deny " + strconv.FormatFloat(l.EffectiveFalseDeny(), 'f', -1, 64)
	if l.FalseDeny == 0 {
		fd += " (the default)"
	}
	src := fmt.Sprintf("sources %d", l.EffectiveSources())
	if l.Sources == 0 {
		src += " (the default)"
	}
	if l.Sources == 0 {
		return fd + " and " + src
	}
	return src + " and " + fd
}

// windowProblem says why a positive window w cannot be used, or "".
func windowProblem(w time.Duration) string {
	if w < 0 {
		return "must be positive"
	}
	if w < MinWindow {
		// In JSON, Caddy reads a number as nanoseconds: "window": 3600
		// is 3.6µs, not an hour.
		return fmt.Sprintf("must be at least %v (a number in JSON is nanoseconds: write a duration such as \"1h\", or 3600000000000 for an hour)", MinWindow)
	}
	if w > MaxWindow {
		return "must be at most 365d (8760h)"
	}
	return ""
}

// rateProblem says why events per window (both positive) is out of the
// supported range, or "".
func rateProblem(events int64, window time.Duration) string {
	perSecond := float64(events) / window.Seconds()
	if perSecond > MaxPerSecond {
		return fmt.Sprintf("%d events per %v is %.4g per second, above the maximum of %d per second: lengthen window or lower events",
			events, window, perSecond, MaxPerSecond)
	}
	return ""
}

// memoryProblem says why a table of n bytes cannot be made, or "".
func memoryProblem(n int64) string {
	if n < 64 || n > limiter.MaxBytes {
		return fmt.Sprintf("must be between 64 B and %s", humanize.IBytes(limiter.MaxBytes))
	}
	return ""
}

// IsZero reports whether no setting of l is set.
func (l *Limit) IsZero() bool {
	return l.MaxEvents == 0 && l.Window == 0 && l.Burst == 0 && l.IPv4Prefix == nil && l.IPv6Prefix == nil &&
		l.Memory == 0 && l.Sources == 0 && l.FalseDeny == 0 && l.XDP == nil && l.MaxConcurrent == 0
}

// Options are the subdirectives UnmarshalOption reads.
var Options = []string{"events", "window", "burst", "ipv4_prefix", "ipv6_prefix", "memory", "sources", "false_deny", "xdp", "max_concurrent"}

// UnmarshalOption reads the Caddyfile subdirective the dispenser is on if it
// is one of l's (events, window, burst, ipv4_prefix, ipv6_prefix, memory,
// sources, false_deny, xdp, max_concurrent), and reports whether it was. Errors start with
// where and name the subdirective and its value as written. seen holds the
// subdirectives of the block read so far: a setting written twice is an
// error, not a silent "last one wins".
func (l *Limit) UnmarshalOption(d *caddyfile.Dispenser, where string, seen Fields) (bool, error) {
	field := d.Val()
	if !slices.Contains(Options, field) {
		return false, nil
	}
	if err := seen.Once(d, where); err != nil {
		return true, err
	}
	if field == "xdp" {
		return true, l.unmarshalXDP(d, where)
	}
	v, err := Arg(d, where)
	if err != nil {
		return true, err
	}
	bad := func(why string) error { return d.Errf("%s%s %q: %s", where, field, v, why) }
	switch field {
	case "events", "burst":
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 {
			return true, bad("must be a whole number of at least 1")
		}
		if field == "burst" && n > limiter.MaxBurst {
			return true, bad(fmt.Sprintf("must be at most %d", limiter.MaxBurst))
		}
		if field == "events" {
			l.MaxEvents = n
		} else {
			l.Burst = n
		}
	case "window":
		dur, err := caddy.ParseDuration(v)
		if err != nil {
			return true, bad(fmt.Sprintf("not a duration: %v", err))
		}
		if dur == 0 {
			return true, bad("must be positive")
		}
		if why := windowProblem(dur); why != "" {
			return true, bad(why)
		}
		l.Window = caddy.Duration(dur)
	case "ipv4_prefix", "ipv6_prefix":
		bits, err := strconv.Atoi(v)
		if err != nil {
			return true, bad("must be a number of bits")
		}
		if field == "ipv4_prefix" {
			l.IPv4Prefix = &bits
		} else {
			l.IPv6Prefix = &bits
		}
	case "memory":
		size, err := humanize.ParseBytes(v)
		if err != nil || size > math.MaxInt64 {
			return true, bad("must be a size such as 16MiB")
		}
		if why := memoryProblem(int64(size)); why != "" {
			return true, bad(why)
		}
		l.Memory = int64(size)
	case "max_concurrent":
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 || n > limiter.MaxConcurrent {
			return true, bad(fmt.Sprintf("must be a whole number from 1 to %d", limiter.MaxConcurrent))
		}
		l.MaxConcurrent = n
	case "sources":
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return true, bad("must be a whole number of at least 1")
		}
		l.Sources = n
	case "false_deny":
		p, err := strconv.ParseFloat(v, 64)
		if err != nil || !(p > 0 && p < 1) {
			return true, bad("must be a probability above 0 and below 1")
		}
		l.FalseDeny = p
	}
	return true, nil
}

// Fields records where each subdirective of one Caddyfile block was
// written, by name.
type Fields map[string]string

// Once records the subdirective the dispenser is on, or reports an error
// naming both places if the block already has it. Caddy's own directives
// let the last of two settings win silently; for a limit that is a limit
// the operator believes in and does not have.
func (f Fields) Once(d *caddyfile.Dispenser, where string) error {
	return f.OnceAs(d, where, d.Val())
}

// OnceAs is Once for a setting named otherwise than the token the
// dispenser is on (`weight response_header`).
func (f Fields) OnceAs(d *caddyfile.Dispenser, where, field string) error {
	if first, ok := f[field]; ok {
		return d.Errf("%s%s is set twice (first at %s): keep one", where, field, first)
	}
	f[field] = fmt.Sprintf("%s:%d", d.File(), d.Line())
	return nil
}

// Require reports an error naming the first of the subdirectives that the
// block did not set.
func (f Fields) Require(d *caddyfile.Dispenser, where string, fields ...string) error {
	for _, field := range fields {
		if _, ok := f[field]; !ok {
			return d.Errf("%s%s is required", where, field)
		}
	}
	return nil
}
