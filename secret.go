package floodgate

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	"github.com/floodgate-rl/floodgate/storage"
)

// A distributed zone's instances must find a key's counts under one hash,
// so they cannot each mix a secret of their own into their keys' salts as
// a zone of one instance does (tables.go): they share one, kept in their
// storage (storage.Secret). The first instance to find none makes it.
//
// A hashSecret is what this process knows of the secret of the instances
// syncing through one storage: a random provisional value until the
// storage has been read, then the cluster's. Zones that load while their
// storage does not answer hash with the provisional value, limiting on
// this instance's counts alone (as they must then anyway), and adopt the
// cluster's secret when their syncer reaches the storage, before it
// publishes anything (zone.adopt). It outlives configs, so a reload does
// not read the storage again before serving, and keeps a provisional
// value while the storage stays away.
type hashSecret struct {
	mu      sync.Mutex
	value   uint64
	known   bool      // value is the cluster's
	checked time.Time // when it was last read from the storage
}

// hashSecrets holds a hashSecret per storage (storageID), for the life of
// the process: one per storage an operator ever configured.
var hashSecrets = struct {
	sync.Mutex
	m map[string]*hashSecret
}{m: make(map[string]*hashSecret)}

// hashSecretOf returns this process's hashSecret of the storage named id.
func hashSecretOf(id string) (*hashSecret, error) {
	hashSecrets.Lock()
	defer hashSecrets.Unlock()
	if s := hashSecrets.m[id]; s != nil {
		return s, nil
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("drawing a hash secret: %v", err)
	}
	s := &hashSecret{value: max(binary.LittleEndian.Uint64(b[:]), 1)}
	hashSecrets.m[id] = s
	return s, nil
}

// get returns the secret as known now, and whether it is the cluster's.
func (s *hashSecret) get() (uint64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.value, s.known
}

// learn reads the cluster's secret from st, storing the one this process
// holds there if the storage has none (the cluster's first instance, or a
// storage that lost it: a Redis without persistence restarting empty), and
// returns it. The zones' syncers call it after each write (Syncer.rejoin),
// so the secret is back soon after their snapshots are, and a storage whose
// secret changed (another instance stored one before this one could;
// another storage under the same name in a new config) is followed. A
// secret read within recheck is taken as it is: however many zones and
// quotas sync through the storage, the process reads it at most once per
// recheck.
func (s *hashSecret) learn(ctx context.Context, st certmagic.Storage) (uint64, error) {
	s.mu.Lock()
	candidate, fresh := s.value, s.known && time.Since(s.checked) < recheck
	s.mu.Unlock()
	if fresh {
		return candidate, nil
	}
	// Not held across the storage's calls: a reload would wait on them.
	v, err := storage.Secret(ctx, st, candidate)
	if err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.value, s.known, s.checked = v, true, time.Now()
	return v, nil
}

// recheck is how long a secret read from the storage is taken as still
// there (learn).
const recheck = time.Second

// storageID names the storage a distributed zone syncs through: the
// module's JSON, or the config's default storage (Caddy's file system
// storage by its path).
func storageID(raw json.RawMessage, st certmagic.Storage) string {
	if len(raw) > 0 {
		return "module " + string(raw)
	}
	if s, ok := st.(fmt.Stringer); ok {
		return "default " + s.String()
	}
	return fmt.Sprintf("default %T", st)
}

// joinCluster has z hash with the cluster's secret: at once if this process
// knows it or can read it from st within ctx, else with a provisional one
// until z's syncers reach the storage (adopt). It returns whether z hashes
// with the cluster's secret now. A zone keyed by the source address alone
// hashes nothing with a secret, and needs none.
func (z *zone) joinCluster(ctx context.Context, log *zap.Logger, s *hashSecret, st certmagic.Storage) bool {
	if !z.hasSalts() {
		return true
	}
	v, known := s.get()
	if !known && st != nil {
		var err error
		if v, err = s.learn(ctx, st); err == nil {
			known = true
		} else {
			v, _ = s.get()
			log.Warn("could not read the cluster's hash secret: this instance counts its keys on its own until it can",
				zap.String("zone", z.name), zap.Error(err))
		}
	}
	z.seal(v)
	z.dist.secret.Store(v)
	z.dist.provisional.Store(!known)
	return known
}

// join is what each of z's syncers does with its storage before it reads
// or publishes anything, and after each write: learn the cluster's secret,
// and adopt it.
func (z *zone) join(s *hashSecret, log *zap.Logger) func(context.Context, certmagic.Storage) error {
	return func(ctx context.Context, st certmagic.Storage) error {
		if !z.hasSalts() {
			return nil // nothing to hash under a secret (distribute sets no join then)
		}
		v, err := s.learn(ctx, st)
		if err == nil && z.adopt(v) {
			log.Info("the zone now hashes its keys with its cluster's secret: this instance's own counts of it start over",
				zap.String("zone", z.name))
		}
		return err
	}
}

// adopt has z hash with the cluster's secret v, learned by one of its
// syncers, and reports whether that changed its hashes. If z counted under
// another (a provisional one, or one the storage lost), its cluster states
// forget what this instance counted (storage.Cluster.HashedUnder). Its
// table's counts of keys with salts start over; they are this instance's
// alone, and the cells they were in empty within a window.
func (z *zone) adopt(v uint64) (changed bool) {
	z.dist.mu.Lock()
	defer z.dist.mu.Unlock()
	defer z.dist.provisional.Store(false)
	if z.dist.secret.Load() == v {
		return false
	}
	z.seal(v)
	z.dist.secret.Store(v)
	z.dist.hashedUnder(v)
	return true
}

// hashedUnder tells each of the zone's cluster states that its keys are
// hashed under v from now on (storage.Cluster.HashedUnder).
func (d *distributedZone) hashedUnder(v uint64) {
	for _, sc := range d.synced {
		sc.cluster.HashedUnder(v)
	}
}

// hasSalts reports whether any of z's keys is hashed with a salt: the source
// address's hash is its network's, whatever the secret.
func (z *zone) hasSalts() bool {
	for i := range z.keys {
		if z.keys[i].salt != 0 {
			return true
		}
	}
	return false
}
