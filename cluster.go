package floodgate

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/limiter"
	"github.com/floodgate-rl/floodgate/storage"
)

// Validate checks the sync settings, naming the field at fault. Zero means
// the default.
func (d *Distributed) Validate() error {
	for _, f := range []struct {
		name string
		v    caddy.Duration
	}{{"read_interval", d.ReadInterval}, {"write_interval", d.WriteInterval}} {
		if f.v != 0 && time.Duration(f.v) < storage.MinInterval {
			return fmt.Errorf("distributed: %s %v: must be at least %v", f.name, time.Duration(f.v), storage.MinInterval)
		}
	}
	if d.PurgeAge < 0 {
		return fmt.Errorf("distributed: purge_age %v: must not be negative", time.Duration(d.PurgeAge))
	}
	if w := d.intervals(0).Write; d.PurgeAge != 0 && time.Duration(d.PurgeAge) < 2*w {
		return fmt.Errorf("distributed: purge_age %v: must be at least twice write_interval (%v), or live instances would be purged",
			time.Duration(d.PurgeAge), w)
	}
	return nil
}

// intervals returns the sync settings for a zone of the given window, with
// the defaults filled in.
func (d *Distributed) intervals(window time.Duration) storage.Intervals {
	iv := storage.Intervals{
		Read:     time.Duration(d.ReadInterval),
		Write:    time.Duration(d.WriteInterval),
		PurgeAge: time.Duration(d.PurgeAge),
	}
	if iv.Read == 0 {
		iv.Read = storage.DefaultReadInterval
	}
	if iv.Write == 0 {
		iv.Write = storage.DefaultWriteInterval
	}
	if iv.PurgeAge == 0 {
		iv.PurgeAge = max(storage.DefaultMinPurgeAge, 2*window, 2*iv.Write)
	}
	return iv
}

// loadStorage returns the storage a module's StorageRaw names, or the
// config's storage (Caddy's `storage` global option) if raw is empty.
func loadStorage(ctx caddy.Context, module any, field string, raw json.RawMessage) (certmagic.Storage, error) {
	if len(raw) == 0 {
		return ctx.Storage(), nil
	}
	mod, err := ctx.LoadModule(module, field)
	if err != nil {
		return nil, fmt.Errorf("loading storage module: %v", err)
	}
	conv, ok := mod.(caddy.StorageConverter)
	if !ok {
		return nil, fmt.Errorf("storage module %T is not a caddy.StorageConverter", mod)
	}
	st, err := conv.CertMagicStorage()
	if err != nil {
		return nil, fmt.Errorf("creating storage: %v", err)
	}
	return st, nil
}

// distributeZones makes zones cluster-wide as d says, through the storage
// that module's field (raw) names or else the config's storage. The
// rate_limit app calls it for its global zones, a handler for the inline
// zones it owns.
func distributeZones(ctx caddy.Context, d *Distributed, module any, field string, raw json.RawMessage, zones []*zone) error {
	if err := d.Validate(); err != nil {
		return err
	}
	st, err := loadStorage(ctx, module, field, raw)
	if err != nil {
		return err
	}
	for _, z := range zones {
		if err := z.distribute(ctx, d, st); err != nil {
			return err
		}
	}
	return nil
}

// restoreTimeout bounds how long loading a config waits for storage to
// give back this instance's last state; past it the state is restored by
// the background sync, which publishes nothing until then.
const restoreTimeout = 5 * time.Second

// distributedZone is what a zone needs to take part in a cluster.
type distributedZone struct {
	cluster *storage.Cluster
	shape   storage.Shape
	st      certmagic.Storage
	iv      storage.Intervals
	syncer  *storage.Syncer // while its config runs
}

// distribute makes z cluster-wide through st: its requests then also count
// against the cluster's sliding-window estimate. The first config of the
// process to distribute a zone restores this instance's last published
// state of it before serving.
func (z *zone) distribute(ctx caddy.Context, d *Distributed, st certmagic.Storage) error {
	inst, err := caddy.InstanceID()
	if err != nil {
		return fmt.Errorf("zone %q: distributed: instance id: %v", z.name, err)
	}
	shape := storage.Shape{Zone: z.name, Window: z.limit.Window, Width: clusterWidth(z.tkey.lines)}
	c, created, err := storage.Acquire(shape, z.limit.Events)
	if err != nil {
		return fmt.Errorf("zone %q: distributed: %v", z.name, err)
	}
	z.dist = &distributedZone{cluster: c, shape: shape, st: st, iv: d.intervals(z.limit.Window)}
	// A reset read from another instance fills the key's buckets here, as
	// DELETE on that instance's admin API filled them there. The cluster
	// outlives the config; the latest config to distribute the zone gets
	// the call.
	c.OnReset(z.buckets.Fill)
	z.dist.syncer = storage.NewSyncer(c, st, inst.String(), z.dist.iv, ctx.Logger())
	if created {
		rctx, cancel := context.WithTimeout(ctx, restoreTimeout)
		defer cancel()
		if err := z.dist.syncer.Restore(rctx, time.Now()); err != nil {
			ctx.Logger().Warn("could not restore this instance's cluster state yet; it will be before the first publish",
				zap.String("zone", z.name), zap.Error(err))
		}
	}
	return nil
}

// clusterWidth is the width of a distributed zone's sketch: as many
// counters per row as the zone's table has lines, so the sketch's 4 rows
// of 16-byte cells take as much memory again as the table.
func clusterWidth(lines int) int {
	return min(max(lines, 64), limiter.MaxSketchWidth)
}

// take charges the key with hash h in the zone's token bucket and, if the
// zone is distributed, in its cluster estimate, as part of txn: the request
// passes when both allow it. The decision is the bucket's, with the
// cluster's denial, wait and remaining count where they are stricter.
func (z *zone) take(txn *limiter.Txn, h uint64, weight int64, now time.Time) limiter.Decision {
	d := txn.Take(z.buckets, h, weight, now)
	if z.dist == nil {
		return d
	}
	return stricter(d, txn.Take(z.dist.cluster, h, weight, now))
}

// peek answers what take would, charging nothing.
func (z *zone) peek(h uint64, weight int64, now time.Time) limiter.Decision {
	d := z.buckets.PeekHash(h, weight, now)
	if z.dist == nil {
		return d
	}
	return stricter(d, z.dist.cluster.PeekHash(h, weight, now))
}

// stricter combines the bucket's decision d with the cluster's c. The limit
// stays the bucket's (the burst the headers advertise).
func stricter(d, c limiter.Decision) limiter.Decision {
	d.Allowed = d.Allowed && c.Allowed
	d.Remaining = min(d.Remaining, c.Remaining)
	d.RetryAfter = max(d.RetryAfter, c.RetryAfter)
	d.Reset = max(d.Reset, c.Reset)
	return d
}
