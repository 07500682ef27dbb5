package storage

import (
	"context"
	"errors"
	"io/fs"
	"net/url"
	"path"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// Defaults and bounds of the sync intervals.
const (
	DefaultReadInterval  = 5 * time.Second
	DefaultWriteInterval = 5 * time.Second
	// MinInterval is the shortest read or write interval.
	MinInterval = 10 * time.Millisecond
	// DefaultMinPurgeAge is the least default purge_age; the default is
	// this or two windows, whichever is longer.
	DefaultMinPurgeAge = time.Minute
)

// Prefix is where every zone's snapshots live in the storage.
const Prefix = "rate_limit"

// Dir is the storage directory of a zone's snapshots. The zone name is
// path-escaped, so a name with a slash cannot reach another zone's files.
func Dir(zone string) string { return Prefix + "/" + url.PathEscape(zone) }

// Key is where an instance publishes a zone's snapshot.
func Key(zone, instance string) string { return Dir(zone) + "/" + instance }

// Intervals are a distributed zone's sync settings, all positive.
type Intervals struct {
	// Read is how often the other instances' snapshots are read.
	Read time.Duration
	// Write is how often this instance's snapshot is published.
	Write time.Duration
	// PurgeAge is the age at which another instance's snapshot is
	// ignored and deleted: that instance is gone.
	PurgeAge time.Duration
}

// A Syncer publishes a Cluster's state and reads its peers' through one
// storage, in one background goroutine, until Stop.
type Syncer struct {
	c        *Cluster
	st       certmagic.Storage
	instance string
	iv       Intervals
	log      *zap.Logger

	stop, done chan struct{}

	// Used only by the goroutine (or by a test calling Write and Read).
	buf, sk []byte
	blocks  []block
	// failing and logged implement "log once per interval": the first
	// failure after a success is logged at WARN, then at most one line per
	// interval until storage works again, which is logged at INFO.
	failing map[Op]time.Time
}

// NewSyncer returns a Syncer of c's state through st as instance; Start
// runs it.
func NewSyncer(c *Cluster, st certmagic.Storage, instance string, iv Intervals, log *zap.Logger) *Syncer {
	return &Syncer{
		c: c, st: st, instance: instance, iv: iv, log: log,
		failing: make(map[Op]time.Time, int(numOps)),
	}
}

// Start runs the read and write loops in a goroutine until Stop.
func (s *Syncer) Start() {
	s.stop, s.done = make(chan struct{}), make(chan struct{})
	go s.run()
}

// Stop ends the loops, publishes a last snapshot (within one write
// interval, at most 5 s) so that a restart finds the latest state, and
// returns when the goroutine is done.
func (s *Syncer) Stop() {
	if s.stop == nil {
		return
	}
	close(s.stop)
	<-s.done
	s.stop = nil
	ctx, cancel := context.WithTimeout(context.Background(), min(s.iv.Write, 5*time.Second))
	defer cancel()
	s.Write(ctx, time.Now())
}

func (s *Syncer) run() {
	defer close(s.done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-s.stop:
			cancel()
		case <-s.done:
		}
	}()
	s.do(ctx, s.iv.Read, s.Read)
	rt, wt := time.NewTicker(s.iv.Read), time.NewTicker(s.iv.Write)
	defer rt.Stop()
	defer wt.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-rt.C:
			s.do(ctx, s.iv.Read, s.Read)
		case <-wt.C:
			s.do(ctx, s.iv.Write, s.Write)
		}
	}
}

// do runs one sync op with a deadline: a storage that hangs (Redis
// unreachable) delays the next sync, never a request.
func (s *Syncer) do(ctx context.Context, interval time.Duration, op func(context.Context, time.Time)) {
	ctx, cancel := context.WithTimeout(ctx, min(max(2*interval, time.Second), 10*time.Second))
	defer cancel()
	op(ctx, time.Now())
}

// Write publishes the Cluster's sketch and own blocks as at now. Before
// its first write it restores this instance's last published state (see
// Restore); while that fails it publishes nothing.
func (s *Syncer) Write(ctx context.Context, now time.Time) {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.restored {
		if err := s.restoreLocked(ctx, now); err != nil {
			s.failed(OpRestore, now, err)
			return
		}
	}
	s.sk, _ = c.sketch.AppendSnapshot(s.sk[:0], now)
	s.blocks = c.blocks.appendOwn(s.blocks[:0], now.UnixNano())
	s.buf = appendSnapshot(s.buf[:0], s.instance, now, s.sk, s.blocks)
	if err := s.st.Store(ctx, Key(c.shape.Zone, s.instance), s.buf); err != nil {
		s.failed(OpWrite, now, err)
		return
	}
	s.ok(OpWrite, now)
}

// Restore loads this instance's own last snapshot, if any, into the
// Cluster once per Cluster: a restarted instance keeps what its keys used
// before, so a key exhausted before a restart (or a crash after the last
// write) is still exhausted after it.
func (s *Syncer) Restore(ctx context.Context, now time.Time) error {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	if s.c.restored {
		return nil
	}
	return s.restoreLocked(ctx, now)
}

func (s *Syncer) restoreLocked(ctx context.Context, now time.Time) error {
	c := s.c
	data, err := s.st.Load(ctx, Key(c.shape.Zone, s.instance))
	if errors.Is(err, fs.ErrNotExist) {
		c.restored = true
		return nil
	}
	if err != nil {
		return err
	}
	c.restored = true
	snap, err := decodeSnapshot(data, MitigationSlots)
	if err == nil && snap.instance != s.instance {
		err = errors.New("snapshot of instance " + snap.instance)
	}
	if err == nil {
		err = c.sketch.MergeBinary(snap.sketch, now)
	}
	if err != nil {
		// Not ours to trust; it is overwritten by the next write.
		s.skipped(Key(c.shape.Zone, s.instance), err)
		return nil
	}
	n := now.UnixNano()
	for _, b := range snap.blocks {
		c.blocks.add(b.hash, b.until, n, true)
	}
	s.log.Info("restored this instance's cluster state", zap.String("zone", c.shape.Zone),
		zap.Time("written", snap.written), zap.Int("blocked_keys", len(snap.blocks)))
	return nil
}

// Read reads every other instance's snapshot of the zone and replaces the
// Cluster's peers' sum with their sum as at now. Snapshots older than the
// purge age are deleted; entries that are not well-formed snapshots are
// skipped and counted. If listing fails the previous sum is kept: its
// counts age out with their windows, so a storage outage degrades to local
// limiting.
func (s *Syncer) Read(ctx context.Context, now time.Time) {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	dir := Dir(c.shape.Zone)
	keys, err := s.st.List(ctx, dir, false)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.failed(OpRead, now, err)
		return
	}
	sum := c.sketch.NewSketchSum(now)
	n := now.UnixNano()
	var loadErr error
	for _, key := range keys {
		name := path.Base(key)
		if name == s.instance || path.Dir(key) != dir {
			continue
		}
		data, err := s.st.Load(ctx, key)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				continue // deleted since the listing
			}
			if ctx.Err() != nil {
				loadErr = err
				break
			}
			s.skipped(key, err) // a directory, an unreadable file
			continue
		}
		snap, err := decodeSnapshot(data, MitigationSlots)
		if err == nil && snap.instance != name {
			err = errors.New("snapshot of instance " + snap.instance + " under another name")
		}
		if err != nil {
			s.skipped(key, err)
			continue
		}
		if now.Sub(snap.written) > s.iv.PurgeAge {
			if err := s.st.Delete(ctx, key); err == nil {
				s.log.Info("deleted the snapshot of an instance gone for longer than purge_age",
					zap.String("zone", c.shape.Zone), zap.String("instance", name), zap.Time("written", snap.written))
			}
			continue
		}
		if _, err := sum.AddBinary(snap.sketch); err != nil {
			s.skipped(key, err)
			continue
		}
		for _, b := range snap.blocks {
			c.blocks.add(b.hash, b.until, n, false)
		}
	}
	if loadErr != nil {
		s.failed(OpRead, now, loadErr)
		return
	}
	c.peers.Store(sum)
	s.ok(OpRead, now)
}

func (s *Syncer) skipped(key string, err error) {
	s.c.skipped.Add(1)
	s.log.Debug("skipped an entry that is not a snapshot of this zone", zap.String("key", key), zap.Error(err))
}

// failed logs a failed op at most once per its interval and counts it.
func (s *Syncer) failed(op Op, now time.Time, err error) {
	s.c.failed[op].Add(1)
	every := s.iv.Write
	if op == OpRead {
		every = s.iv.Read
	}
	if last, ok := s.failing[op]; ok && now.Sub(last) < every {
		return
	}
	s.failing[op] = now
	s.log.Warn("cluster storage failed: limiting with what this instance knows until it works again",
		zap.String("zone", s.c.shape.Zone), zap.Stringer("op", op), zap.Error(err))
}

func (s *Syncer) ok(op Op, now time.Time) {
	s.c.lastOK[op].Store(now.UnixNano())
	if _, ok := s.failing[op]; !ok {
		return
	}
	delete(s.failing, op)
	s.log.Info("cluster storage works again", zap.String("zone", s.c.shape.Zone), zap.Stringer("op", op))
}
