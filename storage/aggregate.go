package storage

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"net/url"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
)

// The aggregate: a sync whose cost does not grow with the fleet.
//
// Reading every peer's snapshot costs each instance N − 1 loads per read
// interval, and the cluster N². So once a zone has AggregateFrom live
// instances, one of them, the aggregator, publishes after each of its
// reads the sum of every live snapshot (its own included) as one
// aggregate under AggregateKey, with the union of their blocks, the resets
// the sum has had applied, and the list of the instances it summed (name,
// write time and checksum of the snapshot it took). Every other instance
// then loads that one entry instead of every snapshot, and takes its own
// contribution back out: it keeps the last few snapshots it stored
// (Cluster.own), finds the one the list names, and subtracts it as the
// aggregator added it, so it is left with exactly the peers' sum the
// aggregator read. The live instances and this one's rank among them, for
// the burst shares, come from the list. So each instance reads about one
// sketch per interval, bounded by the sketch's size, whatever N; the
// aggregator alone reads every snapshot, as every instance did before.
//
// The aggregator is elected through the storage's own lock
// (certmagic.Locker, on AggregateKey): an instance that finds no fresh
// aggregate reads every snapshot, as without one, and tries the lock
// without waiting for it; it holds the lock while it runs and releases it
// at Stop (or when it yields to another aggregator, below, which then
// runs without the lock while its claim keeps the others from it). The
// storage expires the lock of a dead holder (FileStorage after 10 s
// without its refresh, caddy-storage-redis after 5 s), so when the
// aggregator dies its aggregate goes stale (aggregateMaxAge), every
// instance falls back to reading every snapshot, limiting as before, and
// the first to try the lock once it has expired takes over; a lock that
// nobody is seen to use for orphanLockAge is done without. Two
// aggregators at once (a FileStorage lock taken twice, a lock lost during
// a stall, one that went without the lock) each publish a true sum, and
// are soon down to one through the aggregator's claim (below).
//
// The view an aggregate gives is older than a direct read by up to the
// aggregator's read interval: the over-admission bound grows by that
// much, which the burst shares keep in check.
//
// An aggregate is an input from a peer like a snapshot: it is size-checked
// before it is loaded, and skipped when not well-formed, when its sum is
// not of its own time's window, or when it is stale or dated more than
// MaxClockSkew ahead. Its blocks last at most a window from its write and
// go with it; its resets are learned as a snapshot's are. So an aggregator
// can impose no more than a set of valid peers could. It can hide counts
// (publish less than it read), as no single peer can: an instance then
// still limits on its own counts, its token buckets and its own blocks.

// AggregateFrom is the least number of live instances (the aggregator
// included) for which an aggregate is published: below it, reading every
// snapshot costs no more than an aggregate, without its extra lag.
const AggregateFrom = 4

// MaxAggregateMembers bounds the instances an aggregate lists: a fleet
// with more live instances than this has no aggregate, and its instances
// read every snapshot.
const MaxAggregateMembers = 1024

// aggregateLockTry is how long an instance waits for the aggregator lock
// before it gives up until its next read.
const aggregateLockTry = 100 * time.Millisecond

// aggregateMaxAge is the age past which an aggregate is stale: its
// aggregator, which publishes one every read interval, has missed one (it
// is gone, or its storage fails), and the instances read every snapshot
// again. Until then they read its last one: what they grant after the
// aggregator died reaches each other up to this much later than if it
// lived.
func aggregateMaxAge(iv Intervals) time.Duration { return 2 * iv.Read }

// AggregateKey is where a zone's aggregate is published, and the name of
// the lock that elects its aggregator. It is outside the zone's directory,
// which holds only snapshots.
func AggregateKey(zone string) string { return Prefix + "_aggregate/" + url.PathEscape(zone) }

// The stored form of an aggregate is
//
//	"FGAG" version=1
//	the body of a snapshot (snapshot.go): the aggregator's name, the time
//	    of the aggregate, the sum of the snapshots in the binary form of a
//	    sketch snapshot of that time's window, the union of their blocks,
//	    and the resets (each key's latest) applied to the sum
//	uvarint n, then n × (uvarint len(name), name, varint written,
//	    4-byte little-endian checksum of the snapshot summed)
//	4-byte little-endian CRC-32C of everything before it
const (
	aggregateMagic   = "FGAG"
	aggregateVersion = 1
)

// An aggregate is the sum of a zone's live snapshots, as published by its
// aggregator; the embedded snapshot's sketch is the sum.
type aggregate struct {
	snapshot
	members []member
}

// A member is an instance whose snapshot an aggregate summed, and which.
type member struct {
	name string
	w    written
}

func appendAggregate(dst []byte, a *aggregate) []byte {
	start := len(dst)
	dst = append(dst, aggregateMagic...)
	dst = append(dst, aggregateVersion)
	dst = appendSnapshotBody(dst, a.instance, a.written, a.sketch, a.blocks, a.resets)
	dst = binary.AppendUvarint(dst, uint64(len(a.members)))
	for _, m := range a.members {
		dst = binary.AppendUvarint(dst, uint64(len(m.name)))
		dst = append(dst, m.name...)
		dst = binary.AppendVarint(dst, m.w.at)
		dst = binary.LittleEndian.AppendUint32(dst, m.w.sum)
	}
	return binary.LittleEndian.AppendUint32(dst, crc32.Checksum(dst[start:], castagnoli))
}

// decodeAggregate decodes the stored form of an aggregate. data is
// untrusted: as decodeSnapshot, it never panics and rejects anything
// appendAggregate would not have written, including more than
// MitigationSlots blocks, MaxResets resets or MaxAggregateMembers members.
func decodeAggregate(data []byte) (*aggregate, error) {
	if len(data) < len(aggregateMagic)+1+4 || string(data[:len(aggregateMagic)]) != aggregateMagic {
		return nil, fmt.Errorf("not a floodgate cluster aggregate")
	}
	if v := data[len(aggregateMagic)]; v != aggregateVersion {
		return nil, fmt.Errorf("aggregate version %d, want %d", v, aggregateVersion)
	}
	body := data[:len(data)-4]
	if sum := binary.LittleEndian.Uint32(data[len(body):]); sum != crc32.Checksum(body, castagnoli) {
		return nil, fmt.Errorf("aggregate checksum mismatch (truncated or corrupt, %d bytes)", len(data))
	}
	r := reader{data: body, off: len(aggregateMagic) + 1}
	s, err := r.snapshotBody(true, MitigationSlots, MaxResets)
	if err != nil {
		return nil, err
	}
	a := &aggregate{snapshot: *s}
	n, err := r.uvarint("member count")
	if err != nil {
		return nil, err
	}
	if n > MaxAggregateMembers {
		return nil, fmt.Errorf("aggregate lists %d instances, at most %d", n, MaxAggregateMembers)
	}
	a.members = make([]member, 0, n)
	for range n {
		l, err := r.uvarint("member name length")
		if err != nil {
			return nil, err
		}
		if l == 0 || l > maxInstanceLen {
			return nil, fmt.Errorf("aggregate member name length %d: must be between 1 and %d", l, maxInstanceLen)
		}
		name, err := r.bytes(l, "member name")
		if err != nil {
			return nil, err
		}
		at, err := r.varint("member written")
		if err != nil {
			return nil, err
		}
		sum, err := r.bytes(4, "member checksum")
		if err != nil {
			return nil, err
		}
		a.members = append(a.members, member{name: string(name), w: written{at: at, sum: binary.LittleEndian.Uint32(sum)}})
	}
	if r.off != len(body) {
		return nil, fmt.Errorf("aggregate has %d trailing bytes", len(body)-r.off)
	}
	return a, nil
}

// maxAggregateSize is the size of the largest aggregate of a zone of shape
// s: a snapshot's largest, and the longest list of members.
func maxAggregateSize(s Shape) int64 {
	const v = binary.MaxVarintLen64
	return maxSnapshotSize(s) + v + MaxAggregateMembers*(v+maxInstanceLen+v+4)
}

// An ownSnapshot is one this instance stored (or restored), for taking its
// contribution out of an aggregate.
type ownSnapshot struct {
	key  string
	w    written
	data []byte
}

// noteOwnLocked remembers data, stored under key, as one of the last
// snapshots of this Cluster: as many as this Syncer writes while an
// aggregate is fresh and then some (ownKept). The caller holds c.mu.
func (s *Syncer) noteOwnLocked(key string, w written, data []byte) {
	c := s.c
	n := ownKept(s.iv)
	var reuse []byte
	if len(c.own) >= n {
		reuse = c.own[len(c.own)-1].data
		c.own = c.own[:n-1]
	}
	c.own = slices.Insert(c.own, 0, ownSnapshot{key: key, w: w, data: append(reuse[:0], data...)})
}

// ownKept is how many of its last snapshots an instance remembers: those
// an aggregate that is not stale may have summed (written within its
// maximum age and a write interval before it), and two more for the
// overlap of two configs' syncers during a reload, at most 16 (memory: one
// snapshot each). With a write interval shorter than about an eighth of
// the read interval, an aggregate may list a snapshot the instance no
// longer remembers: it then reads every snapshot instead.
func ownKept(iv Intervals) int {
	return min(16, int((aggregateMaxAge(iv)+iv.Write)/iv.Write)+2)
}

// ownLocked returns the snapshot this Cluster stored under key as w, if it
// still remembers it. The caller holds c.mu.
func (c *Cluster) ownLocked(key string, w written) []byte {
	for _, o := range c.own {
		if o.data != nil && o.key == key && o.w == w {
			return o.data
		}
	}
	return nil
}

// aggregateRead is what readAggregate did.
type aggregateRead uint8

const (
	// aggregateNone: no fresh, well-formed aggregate; read every
	// snapshot, and try to become the aggregator.
	aggregateNone aggregateRead = iota
	// aggregateForeign: a fresh aggregate that lists a snapshot of this
	// process's that it cannot take out (one it no longer remembers), or
	// another process's under this instance's name: read every snapshot,
	// which sorts that out.
	aggregateForeign
	// aggregateUsed: the Cluster's view was replaced from the aggregate.
	aggregateUsed
)

// readAggregate replaces the Cluster's view of its peers from the zone's
// aggregate, if there is a fresh one this instance can use. The caller
// holds c.mu.
func (s *Syncer) readAggregate(ctx context.Context, now time.Time) aggregateRead {
	c := s.c
	key := AggregateKey(c.shape.Zone)
	data, err := s.load(ctx, key, maxAggregateSize(c.shape))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) && ctx.Err() == nil {
			s.skipped(key, err)
		}
		return aggregateNone
	}
	a, err := decodeAggregate(data)
	if err != nil {
		s.skipped(key, err)
		return aggregateNone
	}
	if age := now.Sub(a.written); age > aggregateMaxAge(s.iv) || -age > MaxClockSkew {
		return aggregateNone
	}
	sum, err := c.sketch.SketchSumOfBinary(a.sketch)
	if err == nil && sum.Epoch() != limiter.WindowNumber(a.written, c.sketch.Slot()) {
		err = errors.New("the aggregate's sum is not of its own time's window")
	}
	if err != nil {
		s.skipped(key, err)
		return aggregateNone
	}
	// Take this instance's own snapshots out, as the aggregator added
	// them: less the keys of the resets the aggregate lists that they do
	// not.
	noteLatests(s.aggLatest, a.resets)
	own := s.proc.name(s.instance)
	live, rank := 1, 0
	for _, m := range a.members {
		k := Key(c.shape.Zone, m.name)
		if data := c.ownLocked(k, m.w); data != nil {
			snap, err := decodeSnapshot(data, MitigationSlots, MaxResets)
			if err != nil {
				return aggregateForeign
			}
			s.forget = appendForgets(s.forget[:0], s.aggLatest, snap.resets, s.listed)
			if _, err := sum.SubtractBinaryForgetting(snap.sketch, s.forget); err != nil {
				return aggregateForeign
			}
			continue
		}
		// Under this instance's name, a snapshot it does not hold:
		// another process's, or one it no longer remembers. Under a name
		// it published as before its alias, one it stored: its own past
		// state. The full read sorts out either. Any other snapshot is a
		// peer's, even under a name this process once used: another
		// process's.
		if m.name == own || s.proc.ours(k, m.w) {
			return aggregateForeign
		}
		// A member's new snapshot is in the aggregate within a read
		// interval of its write, and found here within another.
		if s.sight(now, m.name, m.w.at, s.iv.Write+2*s.iv.Read) {
			live++
			if m.name < own {
				rank++
			}
		}
	}
	late := s.endSight(now)
	srcs := []*snapshot{&a.snapshot}
	seq := s.learnResets(now, srcs)
	// Resets known here that the aggregate does not list: the aggregator
	// had not read them, so no snapshot it summed had had them applied.
	s.forget = appendForgets(s.forget[:0], s.latest, a.resets, s.listed)
	for _, f := range s.forget {
		sum.ForgetHash(f.Hash, f.At)
	}
	s.replaceView(now, sum, live, rank, seq, srcs, s.iv.Read, late)
	return aggregateUsed
}

// noteLatests fills latest with each key's latest reset in rs.
func noteLatests(latest map[uint64]int64, rs []reset) {
	clear(latest)
	for _, r := range rs {
		noteLatest(latest, r)
	}
}

// publishAggregate stores the aggregate of a full read at now: sum, the
// peers' snapshots as added (added), plus this instance's own stored
// snapshot mine (nil if none yet), with the blocks and resets that go with
// them. The caller holds c.mu and has learned the read's resets.
func (s *Syncer) publishAggregate(ctx context.Context, now time.Time, sum *limiter.SketchSum, added []*snapshot, mine *snapshot) {
	c := s.c
	n := now.UnixNano()
	agg := sum.Clone()
	a := aggregate{snapshot: snapshot{instance: s.proc.name(s.instance), written: now}}
	untils := make(map[uint64]int64)
	note := func(snap *snapshot) {
		a.members = append(a.members, member{name: snap.instance, w: written{at: snap.written.UnixNano(), sum: snap.sum}})
		s.forget = appendForgets(s.forget[:0], s.latest, snap.resets, s.listed)
		for _, b := range snap.blocks {
			if !forgotten(s.forget, b.hash) {
				untils[b.hash] = max(untils[b.hash], peerBlockUntil(b.until, snap.written.UnixNano(), n, c.shape.Window))
			}
		}
	}
	for _, snap := range added {
		note(snap)
	}
	if mine != nil {
		note(mine)
		if _, err := agg.AddBinaryForgetting(mine.sketch, s.forget); err != nil {
			return
		}
	}
	for _, b := range c.blocks.appendOwn(s.blocks[:0], n) {
		untils[b.hash] = max(untils[b.hash], b.until)
	}
	for h, until := range untils {
		a.blocks = append(a.blocks, block{hash: h, until: until})
	}
	if len(a.blocks) > MitigationSlots {
		// Those that last longest; the others' counts still deny them.
		slices.SortFunc(a.blocks, func(x, y block) int { return cmp.Compare(y.until, x.until) })
		a.blocks = a.blocks[:MitigationSlots]
	}
	for h, at := range s.latest {
		a.resets = append(a.resets, reset{hash: h, at: at})
	}
	slices.SortFunc(a.resets, func(x, y reset) int { return cmp.Compare(x.hash, y.hash) })
	a.sketch = agg.AppendBinary(s.sk[:0])
	s.buf = appendAggregate(s.buf[:0], &a)
	s.sk = a.sketch
	if err := s.st.Store(ctx, AggregateKey(c.shape.Zone), s.buf); err != nil {
		s.failed(OpWrite, now, err)
	}
}

// tryAggregator tries to take the zone's aggregator lock without waiting
// for it, and reports whether this instance is the aggregator. Once its
// attempts have failed for orphanLockAge (lockHeldSince), with no
// aggregate and no claim by another seen meanwhile, it aggregates without
// the lock.
func (s *Syncer) tryAggregator(ctx context.Context, now time.Time) bool {
	lctx, cancel := context.WithTimeout(ctx, aggregateLockTry)
	defer cancel()
	err := s.st.Lock(lctx, AggregateKey(s.c.shape.Zone))
	if err != nil {
		// A read that ran out of time, or that Stop ended, failed by
		// no doing of the lock's: the wait goes on as it was.
		if ctx.Err() != nil {
			return false
		}
		if s.lockHeldSince.IsZero() {
			s.lockHeldSince = now
		}
		if now.Sub(s.lockHeldSince) < orphanLockAge(s.iv) {
			return false
		}
		s.log.Warn("the aggregator lock is held, but nobody has aggregated or claimed the role since: this instance aggregates without the lock",
			zap.String("zone", s.c.shape.Zone), zap.Duration("held_for", now.Sub(s.lockHeldSince)), zap.Error(err))
	}
	s.aggregating, s.locked, s.lockHeldSince = true, err == nil, time.Time{}
	s.log.Info("this instance aggregates the zone's cluster state", zap.String("zone", s.c.shape.Zone))
	return true
}

// orphanLockAge is how long an instance tries the aggregator lock in vain,
// finding no aggregate and no claim by another instance at any read
// meanwhile (a read with too few instances live for an aggregate, or a
// failed one, tells nothing either way), before it aggregates without the
// lock. The lock is only the first step
// of the election (the claim settles it, see below), and a storage's lock
// can outlive every holder: in our tests on certmagic's FileStorage, after
// the last aggregator had given the lock up, every instance found its lock
// file fresh for 40 s on end, none holding it (the goroutine that keeps a
// lock file fresh outlives Unlock and freshens whatever file is at that
// path when it wakes), and no instance would have aggregated again. The
// age is twice the longest a lock of a dead holder lasts in the storages
// we know (FileStorage: 10 s; caddy-storage-redis: 5 s), so a dead
// aggregator's lock is taken over through the storage first; an
// aggregator that holds the lock and publishes, every instance reading at
// the zone's one read_interval, keeps it from being reached (its aggregate
// or its claim is fresh at each read). An instance that aggregates
// without the lock never unlocks it (releaseAggregator).
func orphanLockAge(iv Intervals) time.Duration { return max(20*time.Second, 4*iv.Read) }

// releaseAggregator gives up the role, and the aggregator lock if this
// instance took it.
func (s *Syncer) releaseAggregator(ctx context.Context) {
	if !s.aggregating {
		return
	}
	s.aggregating = false
	if s.locked {
		// Only a lock this instance took: file_system's Unlock removes
		// the lock file whoever holds it.
		s.locked = false
		_ = s.st.Unlock(ctx, AggregateKey(s.c.shape.Zone))
	}
}

// dropAggregate deletes the aggregate this instance publishes and its
// claim (unless another instance's claim is there), and gives up the
// lock: at Stop, so that another instance takes over at its next read
// rather than once the aggregate is stale, and when the fleet is too small
// (or too large) for one. It says so, and why, in the log, where the
// aggregator's hand-overs can be followed.
func (s *Syncer) dropAggregate(ctx context.Context, why string, live int) {
	if cl, ok := s.loadClaim(ctx); !ok || s.ownClaim(cl) {
		// Not while another aggregator claims the role: the aggregate
		// is then likely its.
		_ = s.st.Delete(ctx, AggregateKey(s.c.shape.Zone))
		_ = s.st.Delete(ctx, ClaimKey(s.c.shape.Zone))
	}
	s.releaseAggregator(ctx)
	s.gaveUp(why, live)
}

// gaveUp logs that this instance no longer aggregates, and why.
func (s *Syncer) gaveUp(why string, live int, fields ...zap.Field) {
	s.log.Info("this instance no longer aggregates the zone's cluster state",
		append([]zap.Field{zap.String("zone", s.c.shape.Zone), zap.String("why", why), zap.Int("live_instances", live)}, fields...)...)
}

// The aggregator's claim. The storage's lock elects one aggregator, but
// not always only one: certmagic's FileStorage removes a lock file it finds
// stale and creates it again, so two instances that find the dead
// aggregator's lock stale at once can both end up holding it (and its
// Unlock removes the lock file whoever created it); any storage's lock is
// lost during a long enough stall. Two aggregators each publish a true
// sum, but each reads every snapshot, which the aggregate is there to
// save. So an aggregator names itself, before each publish, in a small
// entry under ClaimKey, with the time. A claim is fresh while it is dated
// at most aggregateMaxAge before the reader's clock (and MaxClockSkew
// after), or while the reader has seen it change within that age by its
// own clock between two looks within that age: so instances whose clocks
// disagree by more than the age still see each other's claims. An
// aggregator that finds a fresh claim naming another instance whose id
// sorts before its own gives the role up,
// leaving that one's aggregate and claim; an instance that finds no fresh
// aggregate but a fresh claim by another does not try the lock, which a
// yield may have freed while the claimant aggregates on. So two
// aggregators are down to one within about two read intervals of both
// publishing. An aggregator that stops or finds the fleet too small
// deletes the aggregate and the claim only if the claim is its own.
//
// A claim is an input from a peer like any: size-checked and checksummed.
// Forged claims can make every aggregator give up, which costs each
// instance a read of every snapshot, as without an aggregate, and imposes
// nothing on the counts.

// ClaimKey is where the instance that aggregates a zone's cluster state
// names itself. It is in a directory of its own, so that no zone's name
// can make it another zone's aggregate or snapshot.
func ClaimKey(zone string) string { return Prefix + "_aggregator/" + url.PathEscape(zone) }

// The stored form of a claim is
//
//	"FGAC" version=1
//	uvarint len(name), name, varint at (Unix nanoseconds)
//	4-byte little-endian CRC-32C of everything before it
const (
	claimMagic   = "FGAC"
	claimVersion = 1
	maxClaimSize = len(claimMagic) + 1 + binary.MaxVarintLen64 + maxInstanceLen + binary.MaxVarintLen64 + 4
)

// A claim is the aggregator's name and when it claimed the role.
type claim struct {
	name string
	at   int64 // Unix nanoseconds
}

func appendClaim(dst []byte, name string, at time.Time) []byte {
	start := len(dst)
	dst = append(dst, claimMagic...)
	dst = append(dst, claimVersion)
	dst = binary.AppendUvarint(dst, uint64(len(name)))
	dst = append(dst, name...)
	dst = binary.AppendVarint(dst, at.UnixNano())
	return binary.LittleEndian.AppendUint32(dst, crc32.Checksum(dst[start:], castagnoli))
}

// decodeClaim decodes the stored form of a claim. data is untrusted: it
// never panics and rejects anything appendClaim would not have written.
func decodeClaim(data []byte) (claim, error) {
	if len(data) < len(claimMagic)+1+4 || string(data[:len(claimMagic)]) != claimMagic {
		return claim{}, fmt.Errorf("not a floodgate aggregator claim")
	}
	if v := data[len(claimMagic)]; v != claimVersion {
		return claim{}, fmt.Errorf("aggregator claim version %d, want %d", v, claimVersion)
	}
	body := data[:len(data)-4]
	if sum := binary.LittleEndian.Uint32(data[len(body):]); sum != crc32.Checksum(body, castagnoli) {
		return claim{}, fmt.Errorf("aggregator claim checksum mismatch (truncated or corrupt, %d bytes)", len(data))
	}
	r := reader{data: body, off: len(claimMagic) + 1}
	n, err := r.uvarint("claim name length")
	if err != nil {
		return claim{}, err
	}
	if n == 0 || n > maxInstanceLen {
		return claim{}, fmt.Errorf("aggregator claim name length %d: must be between 1 and %d", n, maxInstanceLen)
	}
	b, err := r.bytes(n, "claim name")
	if err != nil {
		return claim{}, err
	}
	ns, err := r.varint("claim time")
	if err != nil {
		return claim{}, err
	}
	if r.off != len(body) {
		return claim{}, fmt.Errorf("aggregator claim has %d trailing bytes", len(body)-r.off)
	}
	return claim{name: string(b), at: ns}, nil
}

// loadClaim returns the zone's claim, if there is a well-formed one.
func (s *Syncer) loadClaim(ctx context.Context) (claim, bool) {
	key := ClaimKey(s.c.shape.Zone)
	data, err := s.load(ctx, key, int64(maxClaimSize))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) && ctx.Err() == nil {
			s.skipped(key, err)
		}
		return claim{}, false
	}
	cl, err := decodeClaim(data)
	if err != nil {
		s.skipped(key, err)
		return claim{}, false
	}
	return cl, true
}

// ownClaim reports whether cl is this instance's: under the name it
// publishes as, or the last claim it stored, or tried to (under the
// instance id, before it took an alias: identity.go). Any other claim
// under the id is another process's.
func (s *Syncer) ownClaim(cl claim) bool {
	return cl.name == s.proc.name(s.instance) || cl == s.claimStored
}

// otherClaim reads the zone's claim at now and returns the instance it
// names, if that is another one and the claim is fresh: dated at most
// aggregateMaxAge before now and MaxClockSkew after, or seen to change
// within aggregateMaxAge of now by this instance's clock (to an instance
// whose clock runs ahead of the claimant's by more than that age, every
// claim would look stale by its date) since a look within that age. The
// caller holds c.mu.
func (s *Syncer) otherClaim(ctx context.Context, now time.Time) string {
	cl, ok := s.loadClaim(ctx)
	if !ok {
		return ""
	}
	maxAge := aggregateMaxAge(s.iv)
	if s.claimSeen.name != "" && cl != s.claimSeen && now.Sub(s.claimSeenAt) <= maxAge {
		// Changed between two looks close enough together that the
		// claimant lives; after a longer gap only its date can tell.
		s.claimMoved = now
	}
	s.claimSeen, s.claimSeenAt = cl, now
	if s.ownClaim(cl) {
		return ""
	}
	if age := now.Sub(time.Unix(0, cl.at)); age <= maxAge && -age <= MaxClockSkew || !s.claimMoved.IsZero() && now.Sub(s.claimMoved) <= maxAge {
		return cl.name
	}
	return ""
}

// storeClaim names this instance the zone's aggregator as of now. The
// caller holds c.mu.
func (s *Syncer) storeClaim(ctx context.Context, now time.Time) {
	cl := claim{name: s.proc.name(s.instance), at: now.UnixNano()}
	// Known for this instance's before it is stored: a store that fails
	// (times out) may still land.
	s.claimStored = cl
	if err := s.st.Store(ctx, ClaimKey(s.c.shape.Zone), appendClaim(nil, cl.name, now)); err != nil {
		s.failed(OpWrite, now, err)
		return
	}
	s.claimSeen, s.claimSeenAt = cl, now
}
