package storage

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/floodgate-rl/floodgate/limiter"
)

// SketchRows is the number of rows of a distributed zone's sketch.
const SketchRows = limiter.DefaultSketchRows

// A Shape identifies a zone's cluster state: a zone keeps its state across
// config reloads while its name, window, sketch width and kind (a window
// zone's sliding count or a weighted one) stay the same.
type Shape struct {
	Zone   string
	Window time.Duration
	// Width is the number of counters per sketch row.
	Width int
	// Sliding is set for a window zone's rate: its sketch counts every
	// grant for a whole Window (limiter.SketchConfig.Sliding), where a
	// token bucket zone's rate and a quota weigh the previous window.
	Sliding bool
}

// A Cluster is one distributed zone's cluster-wide view: what this
// instance granted, the other instances' latest snapshots, and the keys
// blocked cluster-wide. It is a limiter.Policy: a request passes when the
// key is not blocked and its cluster estimate plus its weight is within the
// quota. It is safe for concurrent use; decisions take no lock and never
// touch storage.
type Cluster struct {
	shape  Shape
	sketch *limiter.Sketch
	// peers is the sum of the other instances' snapshots as last read; nil
	// before the first read.
	peers atomic.Pointer[limiter.SketchSum]
	// shared is the sum decisions read: peers plus, when bursts are split
	// and other instances are live, what this instance leaves to them of
	// each key (limiter.SketchSum.WithShares); else peers itself.
	shared atomic.Pointer[limiter.SketchSum]
	// sole marks the cells only this instance counts (Syncer.sole): a key
	// all of whose cells it marks decides on peers, without shares. A
	// window zone's is not read by decisions: its shares leave those
	// cells what the others may still take (replaceView).
	sole atomic.Pointer[[]uint64]
	// split is set when bursts are split (SplitBursts); shareWait is the
	// read interval, after which shares are re-balanced (nanoseconds).
	split atomic.Bool
	// live is the number of instances live at the last read, this one
	// included (0 before the first): what the shares divide among.
	live atomic.Int64
	// counted is the bytes of the syncer's bitmaps of the own counts
	// (Syncer.counted), for Memory.
	counted   atomic.Int64
	shareWait atomic.Int64
	blocks    mitigation

	// mu serialises the syncers' I/O (two overlap during a config reload)
	// and guards readGen and restored.
	mu sync.Mutex
	// skipped counts entries under the zone's directory that were not
	// well-formed snapshots of it; failed counts failed storage ops.
	skipped atomic.Uint64
	failed  [numOps]atomic.Uint64
	// lastOK is the time (Unix nanoseconds) of each op's last success; 0
	// before the first.
	lastOK [numOps]atomic.Int64

	// conflicts counts the reads that found another process's snapshot
	// under this process's name.
	conflicts atomic.Uint64

	// readGen numbers the reads, to lift the peers' blocks that a read no
	// longer finds (mitigation.dropStalePeers).
	readGen uint64

	// own holds the last snapshots this instance stored or restored,
	// newest first, for taking its contribution out of an aggregate
	// (aggregate.go, ownKept): an aggregate may be two read intervals
	// old, and syncers of two configs overlap during a reload.
	own []ownSnapshot

	// secret is what this instance's keys are hashed under (HashedUnder),
	// 0 before the first config set it.
	secret uint64

	// streak is this instance's run of snapshots the others count it live
	// by (Syncer.noteStreak); streakLive the instances it found live at
	// its last read while its publishes were not stale (its streak
	// lasted), and streakShared as many if it was counted then, else 0
	// (Syncer.shareRank): guarded by mu.
	streak       streak
	streakLive   int
	streakShared int

	// restored is set once this instance's own last snapshot has been
	// loaded back, or found missing: until then nothing is published, so
	// that a restart cannot overwrite its state before reading it.
	restored bool

	// rmu guards resets, the key resets applied here (resets.go), and
	// orders the changes of a reset with the replacement of peers. It is
	// held briefly: a reset never waits for storage.
	rmu    sync.Mutex
	resets resetTable
	// resetting is set while resets holds a reset, and before a reset
	// changes any count: see mitigate.
	resetting atomic.Bool
	// onReset is called with the hash of each key whose reset is learned
	// from a peer (OnReset).
	onReset atomic.Pointer[func(uint64)]
}

func newCluster(s Shape, quota int64) (*Cluster, error) {
	sk, err := limiter.NewSketch(limiter.SketchConfig{Quota: quota, Window: s.Window, Rows: SketchRows, Width: s.Width, Sliding: s.Sliding})
	if err != nil {
		return nil, fmt.Errorf("cluster sketch: %v", err)
	}
	return &Cluster{shape: s, sketch: sk}, nil
}

// clusters holds every zone's Cluster across config reloads, by Shape.
var clusters = caddy.NewUsagePool()

// Acquire returns the Cluster of shape s, creating it with quota if no
// running or loading config holds one (created is then true). Each
// successful Acquire must be matched by a Release. The quota of an existing
// Cluster is not changed: that is SetQuota's job when the config goes live.
func Acquire(s Shape, quota int64) (c *Cluster, created bool, err error) {
	v, loaded, err := clusters.LoadOrNew(s, func() (caddy.Destructor, error) { return newCluster(s, quota) })
	if err != nil {
		return nil, false, err
	}
	return v.(*Cluster), !loaded, nil
}

// Release gives back a reference taken by Acquire.
func Release(s Shape) { _, _ = clusters.Delete(s) }

// Destruct implements caddy.Destructor: a Cluster holds only memory.
func (*Cluster) Destruct() error { return nil }

// HashedUnder records that this instance's keys are hashed, from now on,
// under secret (the cluster's hash secret, or a provisional one before the
// instance could read it; see floodgate's hashSecret), and reports whether
// the counts it held were made under another. Those are then forgotten:
// they are in cells that are other keys' under the new secret. Every
// config that distributes the zone calls it, and the zone's syncers when
// they learn the cluster's secret, before they publish anything, so no
// peer sees counts made under a provisional secret (but those of requests
// hashed just before the change and charged just after it).
//
// Forgetting clears this instance's sketch, the resets it recorded and its
// own blocks, and has it restore its last published state before it next
// publishes (Syncer.Write), as after a restart; the peers' counts, read
// under the cluster's secret, are kept.
func (c *Cluster) HashedUnder(secret uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	forget := c.secret != 0 && c.secret != secret
	c.secret = secret
	if !forget {
		return false
	}
	c.sketch.Clear()
	c.rmu.Lock()
	c.resets = resetTable{}
	c.rmu.Unlock()
	c.blocks.dropOwn()
	c.restored = false
	return true
}

// SetQuota changes the events per window the cluster may grant a key.
func (c *Cluster) SetQuota(q int64) error { return c.sketch.SetQuota(q) }

// TakeHash grants weight to the key with hash h at now if it is not blocked
// and its cluster estimate plus weight is within the quota, and counts it
// in this instance's sketch. A key found over its limit (no request of
// weight 1 would pass) is blocked until one would.
func (c *Cluster) TakeHash(h uint64, weight int64, now time.Time) (limiter.Decision, limiter.Reservation) {
	if d, ok := c.blockedAt(h, now); ok {
		return d, limiter.Reservation{}
	}
	shared := c.decisionSum(h)
	d, r := c.sketch.TakeHashWith(h, weight, now, shared)
	if !d.Allowed {
		d = c.mitigate(h, weight, now, shared, d)
	}
	return d, r
}

// SplitBursts sets whether each instance grants a key at most its share of
// what the cluster has left for it (see limiter.SketchSum.WithShares), so
// that a key hit on every instance at once gets about its quota: from the
// next read on, which re-balances the shares every reread (keeping what it
// left the others while they may still be granting it; see shareHold).
func (c *Cluster) SplitBursts(on bool, reread time.Duration) {
	c.split.Store(on)
	c.shareWait.Store(int64(reread))
}

// PeekHash answers whether TakeHash would grant the request, charging and
// blocking nothing; Remaining and Reset are what the key holds now, and a
// denial waits as TakeHash's does (denial).
func (c *Cluster) PeekHash(h uint64, weight int64, now time.Time) limiter.Decision {
	if d, ok := c.blockedAt(h, now); ok {
		return d
	}
	shared := c.decisionSum(h)
	d := c.sketch.PeekHashWith(h, weight, now, shared)
	if !d.Allowed {
		d, _ = c.denial(h, weight, now, shared, d)
	}
	return d
}

// ShareDenies reports whether a request of weight for the key with hash h
// is denied at now only by the share this instance leaves the other
// instances (bursts split): on the other instances' counts alone, without
// the shares, it would pass, so the next read, which re-balances the
// shares, may let it through. A zone that holds requests (action delay)
// holds such a one until then.
func (c *Cluster) ShareDenies(h uint64, weight int64, now time.Time) bool {
	if _, ok := c.blockedAt(h, now); ok {
		return false
	}
	shared := c.decisionSum(h)
	return !c.sketch.PeekHashWith(h, weight, now, shared).Allowed && c.shareOnly(h, weight, now, shared)
}

// shareOnly reports whether a denial decided on the sum shared is by the
// shares alone: shared holds them, and a request of weight passes on the
// peers' counts without them.
func (c *Cluster) shareOnly(h uint64, weight int64, now time.Time, shared *limiter.SketchSum) bool {
	peers := c.peers.Load()
	return shared != peers && c.sketch.PeekHashWith(h, weight, now, peers).Allowed
}

// shareDenial is the denial d by this instance's share alone: its wait is
// at most until the next read re-balances the shares.
func (c *Cluster) shareDenial(d limiter.Decision) limiter.Decision {
	if wait := time.Duration(c.shareWait.Load()); wait > 0 && wait < d.RetryAfter {
		d.RetryAfter = wait
	}
	return d
}

// denial returns the decision to answer the denial d of a request of
// weight, decided on the sum shared, with (told), and over, a request of
// weight 1 decided on the peers' counts alone, without the shares: denied
// if the key is over its limit, rather than the request too heavy for what
// is left or over this instance's share.
//
// d's wait is right on peers, not on a sum with the shares: there what
// this instance leaves the others is a count of the current sub-window,
// which stays until that leaves the view, up to W + L on (slidingWait
// assumes no new copy), where each read re-balances the shares and a
// share is held for the others only while they may be granting it
// (shareHold). So a request denied by its share alone (a request of its
// weight passes on the peers' counts; asked of weight 1, a heavy one that
// fitted nowhere was taken for one and told the next read, 65 s early on
// a 1 m window) is told to retry at the next read at most
// (shareDenial), and one over its limit, or too heavy for what is left,
// when it passes on the peers' counts alone: for weight 1, when
// mitigate's block has lifted, as blockedAt tells every request after it.
// (A heavier one may be denied again then by its share of the room that
// freed, if that is less than its weight: docs/cluster.md.)
func (c *Cluster) denial(h uint64, weight int64, now time.Time, shared *limiter.SketchSum, d limiter.Decision) (told, over limiter.Decision) {
	peers := c.peers.Load()
	over = d
	if weight > 1 || shared != peers {
		over = c.sketch.PeekHashWith(h, 1, now, peers)
	}
	if shared == peers {
		return d, over
	}
	fits := over
	if weight > 1 {
		fits = c.sketch.PeekHashWith(h, weight, now, peers)
	}
	switch {
	case fits.Allowed:
		d = c.shareDenial(d)
	case weight > 1:
		d.RetryAfter = fits.RetryAfter
	default:
		d.RetryAfter = over.RetryAfter
	}
	return d, over
}

// decisionSum is the peers' sum a decision on the key with hash h reads:
// with shares, unless all of the key's cells are this instance's alone.
// A window zone's always has shares: it leaves the others, in the cells
// that are this instance's alone, what they may still take of the key
// rather than nothing (see replaceView).
func (c *Cluster) decisionSum(h uint64) *limiter.SketchSum {
	shared := c.shared.Load()
	sole := c.sole.Load()
	if sole == nil || len(*sole) == 0 || c.shape.Sliding {
		return shared
	}
	var cells [limiter.MaxSketchRows]int
	for _, i := range cells[:c.sketch.KeyCells(h, &cells)] {
		if (*sole)[i/64]&(1<<(i%64)) == 0 {
			return shared
		}
	}
	return c.peers.Load()
}

// Refund gives back what TakeHash charged.
func (c *Cluster) Refund(r limiter.Reservation) { c.sketch.Refund(r) }

// Add counts n for the key with hash h at now in this instance's sketch,
// deciding nothing: a cost learned after the request was granted (a weight
// the response reports). The other instances count it from this
// instance's next snapshot on, as they count its grants, and it uses up
// this instance's share as a grant does; a key it drives over the limit is
// denied, and blocked, at its next request. An n below 1 adds nothing.
func (c *Cluster) Add(h uint64, n int64, now time.Time) { c.sketch.Add(h, n, now) }

// Quota returns the events per window the cluster grants a key.
func (c *Cluster) Quota() int64 { return c.sketch.Quota() }

func (c *Cluster) blockedAt(h uint64, now time.Time) (limiter.Decision, bool) {
	until, ok := c.blocks.blocked(h, now.UnixNano())
	if !ok {
		return limiter.Decision{}, false
	}
	wait := time.Duration(until - now.UnixNano())
	return limiter.Decision{Limit: c.sketch.Quota(), RetryAfter: wait, Reset: wait}, true
}

// mitigate blocks the key after the denial d, on the sum shared, of a
// request of weight, if the key is over its limit rather than the request
// too heavy for what is left or over this instance's share: until a
// request of weight 1 would pass on the peers' counts alone. A denial by
// the share alone blocks nothing (the other instances may still grant the
// key). It returns the decision to answer with, its wait as denial tells
// it.
func (c *Cluster) mitigate(h uint64, weight int64, now time.Time, shared *limiter.SketchSum, d limiter.Decision) limiter.Decision {
	d, over := c.denial(h, weight, now, shared, d)
	if over.Allowed || over.RetryAfter <= 0 || over.RetryAfter == limiter.Never {
		return d
	}
	n := now.UnixNano()
	until := n + int64(over.RetryAfter)
	c.blocks.add(h, until, n)
	// A reset may have forgotten the counts this decision read, and lifted
	// the key's block, before the block above went in: it would then stand
	// on counts that are gone. While resets are recent, the block is
	// checked against the counts as they are now.
	if c.resetting.Load() && c.sketch.PeekHashWith(h, 1, now, c.peers.Load()).Allowed {
		c.blocks.remove(h, until)
	}
	return d
}

// An Op is a kind of storage operation a Syncer does.
type Op uint8

// The storage operations, for Failed.
const (
	OpRead Op = iota
	OpWrite
	OpRestore
	numOps
)

// Ops lists every Op.
var Ops = [numOps]Op{OpRead, OpWrite, OpRestore}

func (o Op) String() string { return [numOps]string{"read", "write", "restore"}[o] }

// Skipped returns how many entries under the zone's storage directory were
// skipped because they were not well-formed snapshots of it (each time they
// were read).
func (c *Cluster) Skipped() uint64 { return c.skipped.Load() }

// Conflicts returns how many times another process was found publishing
// this zone's state under this process's instance id: processes that share
// a data directory (see identity.go).
func (c *Cluster) Conflicts() uint64 { return c.conflicts.Load() }

// Failed returns how many storage operations of kind op failed.
func (c *Cluster) Failed(op Op) uint64 { return c.failed[op].Load() }

// LastSuccess returns when an operation of kind op last succeeded, and false
// if none has yet: how stale this instance's view of the cluster (read) or
// the cluster's view of it (write) may be.
func (c *Cluster) LastSuccess(op Op) (time.Time, bool) {
	ns := c.lastOK[op].Load()
	return time.Unix(0, ns), ns != 0
}
