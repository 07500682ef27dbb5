//go:build linux && (386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64)

// Package xdp enforces a layer4 zone's token-bucket table on TCP SYNs and
// QUIC Initials, in an XDP program at the network driver: a SYN, or an
// Initial that opens a QUIC connection, from a source network that has no
// token left is dropped before the kernel allocates anything for it.
//
// The program (bpf/synlimit.c, compiled into synlimit_bpfel.o by bpf2go and
// committed) decides on the zone's own table: a BPF array map created
// BPF_F_MMAPABLE, mapped into this process and wrapped in a limiter.Buckets
// (limiter.NewBucketsOver). So one zone is one table: a connection the Go
// matcher charges and a SYN the program charges take from the same
// counters, and the admin API, metrics and top sources see both. The
// program copies limiter's arithmetic step for step — NetworkKey's mask,
// xxhash64 of the key, the line and subset the hash picks, ticks from
// nanoseconds with 64×64→128-bit products built from 32-bit halves, the
// charge (the fullest of the key's counters grants, every counter pays) —
// and the tests run both on the same inputs and compare every counter.
//
// Exactness across the two holds for the same reason it holds between two
// goroutines: each counter's whole state is its 32-bit time, and both
// sides change a word only with a 64-bit compare-and-swap of the value
// they computed from (lock cmpxchg on x86 for both; BPF_CMPXCHG in the
// program). Time is the one thing the sides do not share exactly: the
// program reads bpf_ktime_get_ns (CLOCK_MONOTONIC) minus the table's epoch,
// Go reads time.Now's monotonic reading (also CLOCK_MONOTONIC, less a
// constant the time package keeps to itself) minus the table's base; the
// epoch is bracketed to within Table.Slack (tens of nanoseconds), which
// shifts one side's view of the refill by at most that much time: at most
// Slack × rate tokens, a millionth of a token at 1,000 per second. The
// program first tries to deny a SYN on the coarse clock plus 100 ms (a time
// no earlier than now, a few nanoseconds to read) and reads the precise
// clock only for a SYN that would not be denied then: the same verdict,
// unless the coarse clock lagged by more than 100 ms (docs/xdp.md).
//
// The program parses a SYN behind VLAN tags, IPv4 options and IPv6
// extension headers (docs/xdp.md says which), and marks every SYN it grants
// by its flow; the layer4 matcher asks Table.Charged for each connection it
// accepts and charges the ones not marked, so a SYN the program passes
// unparsed is charged by the matcher, and no connection by both.
//
// On the UDP ports named for QUIC (Ports.QUIC) the program charges one
// token for each QUIC connection a client opens: an Initial that can open
// one (version 1 or 2, DCID and size as the server requires) is charged
// unless the program charged its connection already, which it remembers by
// the client's address and port, the server's port and the DCID in a
// fixed-size LRU map until the client's first other long-header packet
// from that address and port under the connection's source connection ID
// (its Handshake packet, or 0-RTT with something coalesced behind it; a
// 0-RTT packet alone is not one), 5 s, or 16 Initials end the
// connection's free pass. Nothing in Go sees those
// packets (Caddy's HTTP/3 does not go through the layer4 matcher), so the
// program alone charges them, and drops what would carry an Initial past
// it uncharged: a first fragment of a datagram to a QUIC port, a packet
// whose headers it cannot walk.
//
// Start reading at NewTable, then Attach.
package xdp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/floodgate-rl/floodgate/limiter"
)

// Config is a table's settings: the zone's limit and size, and how sources
// are grouped into networks.
type Config struct {
	Buckets    limiter.BucketsConfig
	IPv4Prefix int
	IPv6Prefix int
	// Zone names the zone the table serves. An interface runs one
	// program, so it serves one zone: tables of the same zone (a reload's)
	// take turns on it, another zone's table is refused (see Attach).
	Zone string
}

// Table is a zone's token-bucket table held in a BPF map, decided on by
// Buckets in Go and by the XDP program once attached. Close releases it;
// Buckets must not be used after.
type Table struct {
	// Buckets decides on the map's memory.
	Buckets *limiter.Buckets
	// Slack bounds how far apart the program's clock and Buckets' clock
	// may be (see the package documentation).
	Slack time.Duration

	zone string
	// mapped holds the mapping the Buckets decides on, for the cleanup
	// that unmaps it when the Buckets is garbage.
	mapped *atomic.Pointer[[]byte]

	setMu   sync.Mutex // serialises SetLimit
	mu      sync.Mutex // serialises writes of params, and SetLimit's swap
	objs    synlimitObjects
	mem     []byte
	params  synlimitParams
	counted Counts // by the programs SetLimit replaced
	closed  bool

	// marks is the programs' map of the SYNs they granted (see Charged):
	// one map for the table's life, handed to each program SetLimit loads,
	// so that a mark made before a limit change is found after it.
	marksMu sync.RWMutex // Close takes it to close marks; Charged, to read
	marks   *ebpf.Map
	// initials is the programs' map of the QUIC connections they charged,
	// and latest their map of the connection latest from each client
	// address, port and source connection ID (whose Handshake packet, or
	// another long-header packet that opens no connection, under that ID
	// ends its free pass), kept
	// across SetLimit as marks is: a handshake under way when the limit
	// changes is not charged again.
	initials, latest *ebpf.Map
}

// NewTable creates the table's maps and loads the program (not yet
// attached). It needs CAP_BPF (and CAP_PERFMON for the program's pointer
// arithmetic) or root, and Linux 5.17 or later (bpf_loop; compare-and-swap
// in BPF needs 5.12).
func NewTable(cfg Config) (*Table, error) {
	lines, err := cfg.Buckets.TableLines()
	if err != nil {
		return nil, err
	}
	if err := cfg.Buckets.Limit.Validate(); err != nil {
		return nil, err
	}
	objs, mem, err := loadObjects(lines, nil)
	if err != nil {
		return nil, err
	}
	marks, err := objs.Charged.Clone()
	if err != nil {
		unix.Munmap(mem)
		objs.Close()
		return nil, fmt.Errorf("xdp: the map of charged SYNs: %w", err)
	}
	initials, err := objs.Initials.Clone()
	if err != nil {
		unix.Munmap(mem)
		objs.Close()
		marks.Close()
		return nil, fmt.Errorf("xdp: the map of charged QUIC connections: %w", err)
	}
	latest, err := objs.Latest.Clone()
	if err != nil {
		unix.Munmap(mem)
		objs.Close()
		marks.Close()
		initials.Close()
		return nil, fmt.Errorf("xdp: the map of QUIC clients' latest connections: %w", err)
	}
	t := &Table{zone: cfg.Zone, objs: objs, mem: mem, marks: marks, initials: initials, latest: latest}
	base := time.Now()
	epoch, slack := monoEpoch(base)
	t.Slack = slack
	t.Buckets, err = limiter.NewBucketsOver(cfg.Buckets, t.mem, base)
	if err != nil {
		unix.Munmap(t.mem)
		t.objs.Close()
		t.marks.Close()
		t.initials.Close()
		t.latest.Close()
		return nil, err
	}
	// The mapping lives as long as the Buckets over it (and keeps the map
	// alive in the kernel after Close); after a SetLimit, the mapping it
	// made instead (mapped), while the old one is unmapped once nothing
	// reads it any more (SetLimitOver's release).
	t.mapped = new(atomic.Pointer[[]byte])
	t.mapped.Store(&t.mem)
	runtime.AddCleanup(t.Buckets, func(m *atomic.Pointer[[]byte]) { _ = unix.Munmap(*m.Load()) }, t.mapped)
	t.params = synlimitParams{Epoch: uint64(epoch)}
	v4 := limiter.NetworkKey(netip.AddrFrom4([4]byte{255, 255, 255, 255}), cfg.IPv4Prefix, cfg.IPv6Prefix)
	copy(t.params.Mask4[:], v4.Bytes()[1:])
	v6 := limiter.NetworkKey(netip.MustParseAddr("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), cfg.IPv4Prefix, cfg.IPv6Prefix)
	copy(t.params.Mask6[:], v6.Bytes()[1:])
	if err := writeGeometry(&t.objs, &t.params, t.Buckets.Geometry()); err != nil {
		t.Close()
		return nil, err
	}
	return t, nil
}

// loadObjects loads the program with a table of lines lines, and maps the
// table into this process. The program marks the SYNs it grants and the
// QUIC connections it charges in t's maps (marks, initials, latest), or in
// maps of its own if t is nil.
func loadObjects(lines int, t *Table) (synlimitObjects, []byte, error) {
	var objs synlimitObjects
	spec, err := loadSynlimit()
	if err != nil {
		return objs, nil, fmt.Errorf("xdp: reading the embedded program: %w", err)
	}
	spec.Maps["table"].MaxEntries = uint32(lines)
	opts := &ebpf.CollectionOptions{}
	if t != nil {
		opts.MapReplacements = map[string]*ebpf.Map{"charged": t.marks, "initials": t.initials, "latest": t.latest}
	}
	if err := spec.LoadAndAssign(&objs, opts); err != nil {
		return objs, nil, explain("loading the XDP program", err)
	}
	mem, err := unix.Mmap(objs.Table.FD(), 0, lines*64, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		objs.Close()
		return objs, nil, explain("mapping the table's BPF map (BPF_F_MMAPABLE, Linux 5.5+)", err)
	}
	return objs, mem, nil
}

// writeGeometry puts g in params (which hold the epoch, masks and ports
// already) and writes them and the subsets into objs' maps.
func writeGeometry(objs *synlimitObjects, params *synlimitParams, g limiter.Geometry) error {
	for i, s := range g.Subsets {
		if err := objs.Subsets.Put(uint32(i), s); err != nil {
			return fmt.Errorf("xdp: writing the subsets map: %w", err)
		}
	}
	params.Mult, params.Pe, params.W = g.Mult, g.PE, g.W
	params.Cost, params.Cap, params.Ceil = g.Cost, g.Cap, g.Ceil
	params.Lines, params.Nsubs = g.Lines, uint32(len(g.Subsets))
	if err := objs.Config.Put(uint32(0), params); err != nil {
		return fmt.Errorf("xdp: writing the program's parameters: %w", err)
	}
	return nil
}

// SetLimit changes the table's limit keeping what each key used, as
// limiter's SetLimit does: it loads the program again with a new map,
// converts the counters into it (limiter.Buckets.SetLimitOver: each old
// word frozen as it is read, so a charge either side makes meanwhile is
// converted or fails), and then puts the new program on the interface in
// place of the old (BPF_LINK_UPDATE). A SYN that meets a frozen word
// before the swap is dropped (and sent again by its client a second
// later): for about 10 ns a line of the table. The SYN counts go on from
// the old program's.
func (t *Table) SetLimit(l limiter.Limit, now time.Time) error {
	if err := l.Validate(); err != nil {
		return err
	}
	t.setMu.Lock()
	defer t.setMu.Unlock()
	t.mu.Lock()
	closed, params, oldMem := t.closed, t.params, t.mem
	t.mu.Unlock()
	if closed {
		return errors.New("xdp: the table is closed")
	}
	objs, mem, err := loadObjects(len(oldMem)/64, t)
	if err != nil {
		return err
	}
	// The new program decides on the new map only once it replaces the
	// old one on the interface, so its parameters are written first,
	// from the geometry the limit will have.
	err = writeGeometry(&objs, &params, t.Buckets.GeometryFor(l))
	if err == nil {
		err = t.Buckets.SetLimitOver(l, now, mem, func() { _ = unix.Munmap(oldMem) })
	}
	if err != nil {
		objs.Close()
		unix.Munmap(mem)
		return err
	}
	counts, _ := t.Counts()
	linksMu.Lock()
	defer linksMu.Unlock()
	t.mu.Lock()
	defer t.mu.Unlock()
	prev := t.objs
	t.objs, t.params, t.mem, t.counted = objs, params, mem, counts
	t.mapped.Store(&mem)
	if il := runningOn(t); il != nil {
		if err := updateLink(il.link, objs.Synlimit); err != nil {
			// The conversion cannot be undone: the old program runs on a
			// map whose every word is now frozen, and would drop every
			// SYN. Detach it instead: SYNs reach the kernel, and the zone
			// limits connections in Go (the caller stops taking them for
			// ones the program charged).
			detach(il)
			_ = prev.Close()
			return &ProgramNotReplacedError{Err: explain("replacing the program after a limit change", err)}
		}
	}
	return prev.Close()
}

// A ProgramNotReplacedError is SetLimit's error when the limit is in force
// on the table but the new program could not replace the old one on its
// interface: the program is detached, so SYNs and Initials reach the kernel unchecked
// until the table is attached again (the next config that starts).
type ProgramNotReplacedError struct{ Err error }

func (e *ProgramNotReplacedError) Error() string {
	return e.Err.Error() + "; the program is detached: SYNs and QUIC Initials reach the kernel unlimited until the next reload"
}

func (e *ProgramNotReplacedError) Unwrap() error { return e.Err }

// updateLink swaps the program on a link; a variable so that a test can
// make the kernel refuse it.
var updateLink = func(l link.Link, p *ebpf.Program) error { return l.Update(p) }

// notPermitted reports whether err is the kernel refusing this process BPF
// (EPERM, EACCES), not the verifier rejecting the program: the verifier
// answers EACCES too, for an access it cannot prove safe.
func notPermitted(err error) bool {
	var ve *ebpf.VerifierError
	return !errors.As(err, &ve) && (errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES))
}

// explain wraps a kernel error with what it most likely means.
func explain(what string, err error) error {
	var ve *ebpf.VerifierError
	switch {
	case errors.As(err, &ve):
		return fmt.Errorf("xdp: %s: the kernel's verifier rejected the program (it needs Linux 5.17 or later; on such a kernel, a bug): %w", what, err)
	case notPermitted(err):
		return fmt.Errorf("xdp: %s: not permitted: it needs CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN (or root), and kernel.unprivileged_bpf_disabled does not help: %w", what, err)
	case errors.Is(err, ebpf.ErrNotSupported), errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS):
		return fmt.Errorf("xdp: %s: the kernel refused it; the program needs Linux 5.17 or later (bpf_loop; compare-and-swap needs 5.12) built with BPF and XDP: %w", what, err)
	}
	return fmt.Errorf("xdp: %s: %w", what, err)
}

// writeParams stores t.params in the config map; t.mu is held or t is not
// yet shared.
func (t *Table) writeParams() error {
	if err := t.objs.Config.Put(uint32(0), &t.params); err != nil {
		return fmt.Errorf("xdp: writing the program's parameters: %w", err)
	}
	return nil
}

// Counts are the program's counters, summed over CPUs.
type Counts struct {
	// Passed is how many SYNs to a limited port took a token.
	Passed uint64
	// Dropped is how many found none (including their Contended).
	Dropped uint64
	// Contended is how many of the dropped SYNs and Initials were given
	// up after losing sixteen compare-and-swaps in a row to other CPUs.
	Contended uint64
	// InitialsPassed is how many QUIC Initials that open a connection, to
	// a limited UDP port, took a token; InitialsDropped, how many found
	// none, and how many packets the program dropped unparsed because the
	// zone limits QUIC (first fragments of a UDP datagram to a QUIC port,
	// packets it cannot walk to their transport header: docs/xdp.md). An
	// Initial of a connection charged already is in neither.
	InitialsPassed, InitialsDropped uint64
}

// Counts reads the program's counters.
func (t *Table) Counts() (Counts, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	c := t.counted
	// In the order of the program's enum stat.
	for i, dst := range []*uint64{&c.Passed, &c.Dropped, &c.Contended, &c.InitialsPassed, &c.InitialsDropped} {
		var per []uint64
		if err := t.objs.Stats.Lookup(uint32(i), &per); err != nil {
			return Counts{}, fmt.Errorf("xdp: reading counters: %w", err)
		}
		for _, v := range per {
			*dst += v
		}
	}
	return c, nil
}

// Charged reports whether the program charged the SYN of the connection
// from remote to local (the accepted socket's addresses), and forgets it:
// a second call for the same connection reports false. A connection the
// program did not charge is one whose SYN it passed unparsed (see
// docs/xdp.md), or one that did not come through its interface, or whose
// mark was evicted by the 65,536 SYNs the program granted after it (the
// marks are a fixed-size LRU map); the caller charges it, so that every
// connection is charged once, and at worst twice, never by neither side.
// It makes one system call (BPF_MAP_LOOKUP_AND_DELETE_ELEM, Linux 5.14+).
func (t *Table) Charged(local, remote netip.AddrPort) bool {
	f := synlimitFlow{Saddr: remote.Addr().As16(), Daddr: local.Addr().As16()}
	binary.BigEndian.PutUint16(f.Sport[:], remote.Port())
	binary.BigEndian.PutUint16(f.Dport[:], local.Port())
	var v uint8
	t.marksMu.RLock()
	defer t.marksMu.RUnlock()
	return t.marks != nil && t.marks.LookupAndDelete(&f, &v) == nil
}

// Close releases the program and its maps; close the table's Attachments
// first. Buckets stays usable (its memory is unmapped once Buckets is
// garbage), so a request still running on an old config's zone never
// touches unmapped memory; its charges then reach no program, and Charged
// reports false.
func (t *Table) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	t.marksMu.Lock()
	t.marks.Close()
	t.marks = nil
	t.marksMu.Unlock()
	t.initials.Close()
	t.latest.Close()
	return t.objs.Close()
}
