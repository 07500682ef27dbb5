package storage

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// errTooLarge is loadBounded's error for an entry larger than what it can
// be (a snapshot or aggregate of the zone, the hash secret).
var errTooLarge = errors.New("larger than the entry can be")

// load loads the entry under key if the storage reports it no larger than
// max, the largest snapshot (or aggregate) of the zone's shape: an entry
// that is not one (a stray file, a peer gone wrong) never costs more
// memory than a real one (loadBounded).
func (s *Syncer) load(ctx context.Context, key string, max int64) ([]byte, error) {
	return loadBounded(ctx, s.st, key, max)
}

// loadBounded loads the entry under key from st if st reports it no larger
// than max bytes, else fails with errTooLarge. A storage whose Stat fetches
// the whole entry (statLoads) is not asked for it: the entry is loaded once
// and refused after, its Stat having held it in memory as well
// (caddy-storage-redis also bounds what it decompresses to 4 MiB).
func loadBounded(ctx context.Context, st certmagic.Storage, key string, max int64) ([]byte, error) {
	if !statLoads(st) {
		info, err := st.Stat(ctx, key)
		if err != nil {
			return nil, err
		}
		if info.Size > max {
			return nil, fmt.Errorf("%w: %d bytes, at most %d", errTooLarge, info.Size, max)
		}
	}
	data, err := st.Load(ctx, key)
	if err == nil && int64(len(data)) > max {
		// It grew between the two calls: refused all the same.
		return nil, fmt.Errorf("%w: %d bytes", errTooLarge, len(data))
	}
	return data, err
}

// statLoads reports whether st's Stat fetches the whole entry to report
// its size, as caddy-storage-redis's does (a GET of the stored value and
// its decoding): asking it before each Load would double what a read
// moves, and guard no memory. Stat is cheap on the file system.
func statLoads(st certmagic.Storage) bool {
	t := reflect.TypeOf(st)
	if t == nil {
		return false
	}
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t.PkgPath() == "github.com/pberkel/caddy-storage-redis"
}

// maxDecompressed is the most caddy-storage-redis decompresses of one
// value when its compression is on: a larger value fails to load.
const maxDecompressed = 4 << 20

// CheckStorage returns an error if st cannot hold a zone of shape s's
// cluster entries: caddy-storage-redis with compression on refuses to load
// a value that decompresses to more than 4 MiB, and an instance would
// skip every snapshot or aggregate over that, counting nothing of it.
// Other storages hold any size.
func CheckStorage(st certmagic.Storage, s Shape) error {
	if !statLoads(st) {
		return nil
	}
	v := reflect.Indirect(reflect.ValueOf(st))
	if v.Kind() != reflect.Struct {
		return nil
	}
	f := v.FieldByName("Compression")
	if !f.IsValid() || f.Kind() != reflect.String || f.String() == "" || f.String() == "false" {
		return nil
	}
	if most := maxAggregateSize(s); most > maxDecompressed { // the largest entry, above any snapshot
		return fmt.Errorf("the Redis storage has compression on (%s), and caddy-storage-redis loads no value that decompresses to more than 4 MiB, "+
			"but this zone's cluster entries can reach %.1f MiB: turn compression off in the storage, or give the zone less memory",
			f.String(), float64(most)/(1<<20))
	}
	return nil
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
