package storage

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Two processes with one Caddy instance id.
//
// Caddy keeps its instance id in its data directory, so two processes that
// share one (the natural way to share the default file storage on one host
// or volume) publish under one key and overwrite each other's snapshot:
// each then counts only what the other published last, not what it has
// granted, and the cluster grants a key once per process.
//
// This process remembers the snapshots it stored under each key, by time
// and checksum (process.writes: the last few it tried to store, every
// one since the last that landed, and that one). At each read it also loads its own key: a
// snapshot there that it did not store was stored by another process under
// its id. It then logs an error once, counts it (Cluster.Conflicts), and
// from then on publishes every zone as <instance id>-<process nonce>, a
// name no other process uses, so the two share the limit again. The other
// process keeps the instance id (with several zones, each may find the
// other first in one of them and both take an alias: what is left under
// the id is then a snapshot that ages out and a claim that goes stale). A
// snapshot this process stored, found under a name it no longer publishes
// as, is its own past state and is not counted again; any other under the
// id, in a listing or an aggregate, is another process's, a peer's. So is
// an aggregator's claim under the id, unless it is the last this process
// stored or tried to (aggregator.ownClaim).

// A process is what this process knows of its own publishing: a test
// makes several to play several processes.
type process struct {
	// nonce tells this process apart from every other with the same Caddy
	// instance id.
	nonce string

	mu sync.Mutex
	// writes holds, per storage key, the snapshots this process stored
	// (or tried to) under it that the storage may hold: syncers of two
	// configs overlap during a reload, and a store that timed out may
	// still have landed. One entry per zone and name published under.
	writes map[string]*writes
	// aliased is set once another process was found publishing under the
	// instance id: the id is the process's, so every zone then publishes
	// under the alias.
	aliased bool
}

// writes is what the process stored under one key: the snapshots it
// tried to store, newest first, and the last one it surely stored (its
// store succeeded). tried holds the last few tries (two syncers of a
// reload overlap), and every one since the last that landed: a store that
// failed may still have landed, and the storage holds it until a later
// one lands, however many fail in between. Forgetting it, the process
// took its own snapshot for another process's (checkOwn), counted a
// conflict, logged an error, published under an alias from then on, and
// counted its own past state, under the id, as a live peer (4 live of 3
// instances, a fresh key 19 of 30 for seconds): after four failed stores
// when it kept only the last four tries, after a failed store that landed
// and four more when it kept the last that landed besides. A try older
// than purge_age is forgotten, as checkOwn takes no snapshot that old for
// another process's (the others delete it as a dead instance's), and at
// most maxTried are kept.
type writes struct {
	tried  []written
	landed written
}

// minTried is how many of its last tries under a key a process always
// remembers, and maxTried how many at most: a run of failed writes longer
// than that (5.7 hours at the default write interval; purge_age is
// shorter unless set longer), after one that failed but landed, is still
// taken for another process's.
const minTried, maxTried = 4, 4096

// written identifies a stored snapshot: its time and checksum. Two
// processes' snapshots that agree on both are the same bytes.
type written struct {
	at  int64
	sum uint32
}

func writtenOf(at time.Time, data []byte) written {
	return written{at: at.UnixNano(), sum: binary.LittleEndian.Uint32(data[len(data)-4:])}
}

func newProcess() *process {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &process{nonce: hex.EncodeToString(b[:]), writes: make(map[string]*writes)}
}

// thisProcess is the process the Syncers of a running Caddy belong to.
var thisProcess = newProcess()

// noteWrite notes that the process stores data, a snapshot written at at,
// under key, before it tries to: a store that fails may still land. It
// forgets the tries it need not remember (writes), keep being the zone's
// purge_age.
func (p *process) noteWrite(key string, at time.Time, data []byte, keep time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.writes[key]
	if r == nil {
		r = new(writes)
		p.writes[key] = r
	}
	r.tried = slices.Insert(r.tried, 0, writtenOf(at, data))
	n := len(r.tried)
	for n > minTried {
		if o := r.tried[n-1]; n <= maxTried && o.at >= r.landed.at && at.UnixNano()-o.at <= int64(keep) {
			break
		}
		n--
	}
	if cap(r.tried) > 2*n+minTried {
		r.tried = slices.Clone(r.tried[:n]) // an outage's run, over
	} else {
		r.tried = r.tried[:n]
	}
}

// noteLanded notes that the store of w under key succeeded: the storage
// holds it until the process's next store there.
func (p *process) noteLanded(key string, w written) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.writes[key]; r != nil {
		r.landed = w
	}
}

// stored reports whether this process has stored a snapshot under key.
func (p *process) stored(key string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.writes[key] != nil
}

// ours reports whether w identifies a snapshot this process stored, or
// tried to, under key and still remembers (writes).
func (p *process) ours(key string, w written) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.writes[key]; r != nil {
		if r.landed == w && w != (written{}) {
			return true
		}
		for _, e := range r.tried {
			if e == w {
				return true
			}
		}
	}
	return false
}

// name is what the process publishes as, given its instance id: the id, or
// id-nonce once another process was found publishing under the id.
func (p *process) name(instance string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.aliased {
		return instance + "-" + p.nonce
	}
	return instance
}

// alias switches the process to its alias; it reports whether it did now.
func (p *process) alias() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	was := p.aliased
	p.aliased = true
	return !was
}

// checkOwn loads what is stored under this process's own key and, if
// another process stored it, switches the process to its alias (see
// above), logging an error the first time. It returns the snapshot if it
// is this process's (for an aggregate), else nil. A snapshot older than
// purge_age at now is no other process's to worry about: the others
// delete it as a dead instance's, and this process forgets its own tries
// that old (writes). The caller holds c.mu.
func (s *Syncer) checkOwn(ctx context.Context, key string, now time.Time) *snapshot {
	if !s.proc.stored(key) {
		return nil // nothing stored here yet: a restart finds its predecessor's
	}
	data, err := s.load(ctx, key, maxSnapshotSize(s.c.shape))
	if err != nil {
		return nil
	}
	snap, err := decodeSnapshot(data, MitigationSlots, MaxResets)
	if err != nil {
		return nil
	}
	if s.proc.ours(key, writtenOf(snap.written, data)) {
		return snap
	}
	if now.Sub(snap.written) > s.iv.PurgeAge {
		return nil
	}
	c := s.c
	c.conflicts.Add(1)
	if !s.proc.alias() {
		return nil
	}
	s.log.Error("another process publishes cluster state under this instance's id: the two share a data directory "+
		"(XDG_DATA_HOME), hence one Caddy instance id, and were overwriting each other's counts; this process now publishes "+
		"under a name of its own. Give each process its own data directory.",
		zap.String("zone", c.shape.Zone), zap.String("instance", s.instance), zap.String("now_publishing_as", s.proc.name(s.instance)),
		zap.Time("their_snapshot_written", snap.written))
	return nil
}
