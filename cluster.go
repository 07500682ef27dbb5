package floodgate

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
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
	if d.Bursts != "" && d.Bursts != BurstsSplit && d.Bursts != BurstsFree {
		return fmt.Errorf("distributed: bursts %q: must be %s or %s", d.Bursts, BurstsSplit, BurstsFree)
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

// The values of Distributed.Bursts.
const (
	BurstsSplit = "split"
	BurstsFree  = "free"
)

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

// windowTooShort reports whether a window zone's window is too short for
// its instances' reads to hold the cluster's bound (docs/cluster.md,
// "Between reads"): each instance's shares, and the room a sub-window
// frees that it leaves the others, are known only for about a window after
// its read, and with fewer than shortWindowReads reads per window (a
// snapshot is found up to a read interval after its write, and a sync
// through an aggregate lags a read interval more) a burst after the view
// expired finds the whole limit free on every instance, up to events on
// each (a 500 ms window with reads every second: 90 of 30 in a span on
// three instances; with 2 read intervals and each instance reading at its
// own phase after its write, 44 of 30; storage's
// TestWindowZoneRandomClockSkewSchedulesKeepTheBound holds at 3).
func windowTooShort(window time.Duration, iv storage.Intervals) bool {
	return window < shortWindowReads*iv.Read
}

const shortWindowReads = 3

// parseDistributed reads a distributed block; the dispenser is on its name.
func parseDistributed(d *caddyfile.Dispenser) (*Distributed, error) {
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	dist := new(Distributed)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		var dst *caddy.Duration
		switch d.Val() {
		case "read_interval":
			dst = &dist.ReadInterval
		case "write_interval":
			dst = &dist.WriteInterval
		case "purge_age":
			dst = &dist.PurgeAge
		case "bursts":
			if !d.NextArg() {
				return nil, d.ArgErr()
			}
			dist.Bursts = d.Val()
			if d.NextArg() {
				return nil, d.ArgErr()
			}
			continue
		default:
			return nil, d.Errf("distributed: unrecognized subdirective %q", d.Val())
		}
		if err := parseDuration(d, dst); err != nil {
			return nil, err
		}
	}
	if err := dist.Validate(); err != nil {
		return nil, d.Err(err.Error())
	}
	return dist, nil
}

// parseStorage reads `storage <module> ...`, as Caddy's storage global
// option does; the dispenser is on the word storage.
func parseStorage(d *caddyfile.Dispenser) (json.RawMessage, error) {
	if !d.NextArg() {
		return nil, d.ArgErr()
	}
	modID := "caddy.storage." + d.Val()
	unm, err := caddyfile.UnmarshalModule(d, modID)
	if err != nil {
		return nil, err
	}
	storage, ok := unm.(caddy.StorageConverter)
	if !ok {
		return nil, d.Errf("storage: module %s is not a caddy.StorageConverter", modID)
	}
	return caddyconfig.JSONModuleObject(storage, "module", storage.(caddy.Module).CaddyModule().ID.Name(), nil), nil
}

// zoneStorage is the storage distributed zones sync through: st, or, while
// a zone's own storage module cannot be provisioned (its Redis down when
// the config loads), the module to provision again.
type zoneStorage struct {
	st   certmagic.Storage
	lazy *lazyStorage
}

// loadStorage returns the storage a module's StorageRaw names, or the
// config's storage (Caddy's `storage` global option) if raw is empty. A
// storage module that is not registered, or whose config does not decode,
// is an error; one whose provisioning fails (a Redis module dials its
// server) is not: the zones then start on local limits, the failure is
// logged once, and the module is provisioned again in the background until
// it works (lazyStorage).
func loadStorage(ctx caddy.Context, module any, field string, raw json.RawMessage) (zoneStorage, error) {
	if len(raw) == 0 {
		return zoneStorage{st: ctx.Storage()}, nil
	}
	lazy, err := newLazyStorage(ctx, raw)
	if err != nil {
		return zoneStorage{}, err
	}
	mod, err := ctx.LoadModule(module, field)
	if err != nil {
		ctx.Logger().Warn("the zones' storage is not available: they limit on this instance alone, and join the cluster when it answers (tried again after 1s, then at most every 10s)",
			zap.String("storage", lazy.id), zap.Error(err))
		return zoneStorage{lazy: lazy}, nil
	}
	st, err := certMagicStorage(mod)
	if err != nil {
		return zoneStorage{}, err
	}
	return zoneStorage{st: st}, nil
}

func certMagicStorage(mod any) (certmagic.Storage, error) {
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

// A lazyStorage is a storage module to provision outside Caddy's config
// load, once it can be: its Open is called by every zone's syncer until one
// succeeds, and the module is cleaned up with the config.
type lazyStorage struct {
	ctx  caddy.Context
	id   string
	info caddy.ModuleInfo
	raw  json.RawMessage // without the module name

	mu  sync.Mutex
	st  certmagic.Storage
	mod caddy.Module
}

// newLazyStorage checks that raw names a registered storage module and
// decodes into it, as ctx.LoadModule would, without provisioning it.
func newLazyStorage(ctx caddy.Context, raw json.RawMessage) (*lazyStorage, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, fmt.Errorf("storage: %v", err)
	}
	var name string
	if err := json.Unmarshal(fields["module"], &name); err != nil || name == "" {
		return nil, fmt.Errorf("storage: no module name")
	}
	delete(fields, "module")
	rest, err := json.Marshal(fields)
	if err != nil {
		return nil, fmt.Errorf("storage: %v", err)
	}
	info, err := caddy.GetModule("caddy.storage." + name)
	if err != nil {
		return nil, fmt.Errorf("storage: %v", err)
	}
	l := &lazyStorage{ctx: ctx, id: string(info.ID), info: info, raw: rest}
	if _, err := l.decode(); err != nil {
		return nil, err
	}
	ctx.OnCancel(l.close)
	return l, nil
}

func (l *lazyStorage) decode() (caddy.Module, error) {
	val := l.info.New()
	if err := caddy.StrictUnmarshalJSON(l.raw, &val); err != nil {
		return nil, fmt.Errorf("storage: decoding module config: %s: %v", l.id, err)
	}
	return val, nil
}

// Open provisions the module, if no call has yet, and returns its storage.
func (l *lazyStorage) Open(context.Context) (certmagic.Storage, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.st != nil {
		return l.st, nil
	}
	if err := l.ctx.Err(); err != nil {
		return nil, err // the config is gone
	}
	mod, err := l.decode()
	if err != nil {
		return nil, err
	}
	if p, ok := mod.(caddy.Provisioner); ok {
		err = p.Provision(l.ctx)
	}
	if v, ok := mod.(caddy.Validator); ok && err == nil {
		err = v.Validate()
	}
	var st certmagic.Storage
	if err == nil {
		st, err = certMagicStorage(mod)
	}
	if err != nil {
		if c, ok := mod.(caddy.CleanerUpper); ok {
			_ = c.Cleanup()
		}
		return nil, err
	}
	l.st, l.mod = st, mod
	return st, nil
}

func (l *lazyStorage) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if c, ok := l.mod.(caddy.CleanerUpper); ok {
		_ = c.Cleanup()
	}
	l.mod = nil
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
	secret, err := hashSecretOf(storageID(raw, st.st))
	if err != nil {
		return err
	}
	for _, z := range zones {
		if _, none := z.buckets.(noRate); none {
			// max_concurrent alone: places are per instance, nothing
			// to sync (docs/cluster.md).
			continue
		}
		if err := z.distribute(ctx, d, st, secret); err != nil {
			return err
		}
	}
	return nil
}

// restoreTimeout bounds how long loading a config waits for storage to
// give back this instance's last state; past it the state is restored by
// the background sync, which publishes nothing until then.
const restoreTimeout = 5 * time.Second

// distributedZone is what a zone needs to take part in a cluster: the
// cluster-wide counts of its rate and of each of its quotas, each synced on
// its own through the zone's storage.
type distributedZone struct {
	cluster *storage.Cluster // the rate's: synced[0]'s
	iv      storage.Intervals
	synced  []syncedCount
	// secret is the hash secret the zone's keys are sealed with (see
	// hashSecret), provisional while it is not yet the cluster's; mu
	// orders its syncers' adoptions of the cluster's.
	secret      atomic.Uint64
	provisional atomic.Bool
	mu          sync.Mutex
}

// A syncedCount is one cluster-wide count of a distributed zone: its rate's
// (events per window) or a quota's.
type syncedCount struct {
	cluster *storage.Cluster
	shape   storage.Shape
	events  int64           // what it grants a key per window, in force from start
	syncer  *storage.Syncer // while its config runs
}

// distribute makes z cluster-wide through st: its requests then also count
// against the cluster's sliding-window estimate of its rate, and its quotas
// decide on the cluster's counts instead of this instance's (a quota's
// cluster state is named by quotaClusterName). The first config of the
// process to distribute a zone restores this instance's last published
// state of it before serving.
func (z *zone) distribute(ctx caddy.Context, d *Distributed, st zoneStorage, secret *hashSecret) error {
	inst, err := caddy.InstanceID()
	if err != nil {
		return fmt.Errorf("zone %q: distributed: instance id: %v", z.name, err)
	}
	z.dist = &distributedZone{iv: d.intervals(z.limit.Window)}
	// Every instance must find a key's counts under one hash: the keys
	// are sealed with the cluster's secret, not this table's.
	rctx, cancel := context.WithTimeout(ctx, restoreTimeout)
	defer cancel()
	joined := z.joinCluster(rctx, ctx.Logger(), secret, st.st)
	// A window zone's cluster count is sliding, as its own window is: no
	// span of the window grants a key more than events (docs/cluster.md).
	rate := storage.Shape{Zone: z.name, Window: z.limit.Window, Width: clusterWidth(z.tkey.lines), Sliding: z.window > 0}
	if rate.Sliding && windowTooShort(rate.Window, z.dist.iv) {
		ctx.Logger().Warn("a window zone's window is shorter than three read intervals: the cluster cannot hold it to 1.1 × events + 1, each instance may grant a key up to events (docs/cluster.md)",
			zap.String("zone", z.name), zap.Duration("window", rate.Window), zap.Duration("read_interval", z.dist.iv.Read))
	}
	counts := []syncedCount{{shape: rate, events: z.limit.Events}}
	for i, k := range z.skeys {
		counts = append(counts, syncedCount{shape: storage.Shape{Zone: quotaClusterName(z.quotaNames[i]), Window: k.window, Width: k.width}, events: k.quota})
	}
	var restore []*storage.Syncer
	for _, sc := range counts {
		if st.lazy == nil {
			// A storage opened later is checked when it opens (Syncer).
			if err := storage.CheckStorage(st.st, sc.shape); err != nil {
				return fmt.Errorf("zone %q: distributed: %v", z.name, err)
			}
		}
		c, created, err := storage.Acquire(sc.shape, sc.events)
		if err != nil {
			return fmt.Errorf("zone %q: distributed: %v", z.name, err)
		}
		sc.cluster = c
		c.SplitBursts(d.Bursts != BurstsFree, z.dist.iv.Read)
		// A quota's counts outlive the rate's: by default a silent
		// instance's snapshot of it is kept for two of its windows.
		iv := d.intervals(sc.shape.Window)
		if st.lazy != nil {
			sc.syncer = storage.NewSyncerOpening(c, st.lazy.Open, inst.String(), iv, ctx.Logger())
		} else {
			sc.syncer = storage.NewSyncer(c, st.st, inst.String(), iv, ctx.Logger())
		}
		if z.hasSalts() {
			sc.syncer.Joining(z.join(secret, ctx.Logger()))
		}
		z.dist.synced = append(z.dist.synced, sc) // released with the zone
		if created && joined {
			restore = append(restore, sc.syncer)
		}
	}
	z.dist.cluster = z.dist.synced[0].cluster
	if z.hasSalts() {
		// A state counted under another secret (this process's
		// provisional one, while an older config could not read the
		// cluster's) forgets those counts before anything publishes them.
		z.dist.hashedUnder(z.dist.secret.Load())
	}
	// A reset read from another instance fills the key's buckets here, as
	// DELETE on that instance's admin API filled them there. The cluster
	// outlives the config; the latest config to distribute the zone gets
	// the call.
	z.dist.cluster.OnReset(z.buckets.Fill)
	// The quotas' own counts are their clusters' sketches: the local
	// sketches are not needed.
	for i, sc := range z.dist.synced[1:] {
		z.quotas[i] = sc.cluster
	}
	z.releaseQuotas()
	z.skeys = nil
	if len(restore) > 0 {
		for _, s := range restore {
			if err := s.Restore(rctx, time.Now()); err != nil {
				ctx.Logger().Warn("could not restore this instance's cluster state yet; it will be before the first publish",
					zap.String("zone", z.name), zap.Error(err))
				break
			}
		}
	}
	return nil
}

// quotaClusterName names the cluster state of a quota, whose name in the
// RateLimit headers is quota ("api/24h"), in the storage and in the logs:
// "api/24h quota". No zone's name has a space, so no zone's state is ever
// stored under it.
func quotaClusterName(quota string) string { return quota + " quota" }

// start puts each count's events in force and starts its sync.
func (d *distributedZone) start() error {
	for _, sc := range d.synced {
		if err := sc.cluster.SetQuota(sc.events); err != nil {
			return err
		}
		sc.syncer.Start()
	}
	return nil
}

// stop stops the syncs start started, each after a last publish.
func (d *distributedZone) stop() {
	for _, sc := range d.synced {
		sc.syncer.Stop()
	}
}

// release gives back the zone's references to its cluster states.
func (d *distributedZone) release() {
	for _, sc := range d.synced {
		storage.Release(sc.shape)
	}
}

// clusterWidth is the width of a distributed zone's sketch: as many
// counters per row as the zone's table has lines, so the sketch's 4 rows
// of 16-byte cells take as much memory again as the table.
func clusterWidth(lines int) int {
	return min(max(lines, 64), limiter.MaxSketchWidth)
}
