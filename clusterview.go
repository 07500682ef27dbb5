package floodgate

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/floodgate-rl/floodgate/storage"
)

// What the admin API shows of a distributed zone's cluster: its sync state
// (ZoneInfo.Cluster) and a key's counts (KeyPolicy.Cluster), so that an
// operator can tell why the cluster denies a key and what a reset can do.

// clusterInfo is the sync state of the zone's rate's cluster count.
func (d *distributedZone) info() *ClusterInfo {
	cl := d.cluster
	ci := &ClusterInfo{
		ReadErrors:    cl.Failed(storage.OpRead),
		WriteErrors:   cl.Failed(storage.OpWrite),
		RestoreErrors: cl.Failed(storage.OpRestore),
		Skipped:       cl.Skipped(),
		Instances:     cl.Live(),
		ReadInterval:  d.iv.Read.String(),
		WriteInterval: d.iv.Write.String(),
		Bursts:        BurstsFree,
	}
	if cl.Split() {
		ci.Bursts = BurstsSplit
	}
	ci.LastRead, ci.LastWrite = lastSuccess(cl, storage.OpRead), lastSuccess(cl, storage.OpWrite)
	return ci
}

func lastSuccess(cl *storage.Cluster, op storage.Op) *time.Time {
	if at, ok := cl.LastSuccess(op); ok {
		return &at
	}
	return nil
}

// KeyCluster is a key's standing in one of a distributed zone's cluster
// counts (its rate's, or a quota's), as this instance knows it: estimates
// of the rolling window, rounded up, in the zone's units.
type KeyCluster struct {
	// Here is what this instance counted for the key; Others what the
	// other instances had counted when their snapshots were last read
	// (LastRead).
	Here   int64 `json:"here"`
	Others int64 `json:"others"`
	// LeftToOthers is what this instance leaves the other instances of
	// what the cluster has left for the key (bursts split): it does not
	// grant it, though they have not used it yet.
	LeftToOthers int64 `json:"left_to_others"`
	// Blocked is how long (seconds, rounded up) the cluster's cache of
	// keys over their limit still denies the key: decided here, or read
	// from another instance.
	Blocked int64 `json:"blocked"`
	// Instances is the number of instances, this one included, live at
	// the last read.
	Instances int        `json:"instances"`
	LastRead  *time.Time `json:"last_read,omitempty"`
}

// keyCluster is the key with hash h's standing in cl at now.
func keyCluster(cl *storage.Cluster, h uint64, now time.Time) *KeyCluster {
	v := cl.View(h, now)
	return &KeyCluster{Here: v.Here, Others: v.Others, LeftToOthers: v.LeftToOthers, Blocked: ceilSeconds(v.Blocked),
		Instances: cl.Live(), LastRead: lastSuccess(cl, storage.OpRead)}
}

// clusterResetText says what a reset of a distributed zone's key did
// beyond this instance, and what it could not: the other instances keep
// their counts of the key until they read the reset, which they can only
// once this instance has written it.
func (d *distributedZone) clusterResetText(now time.Time) string {
	text := fmt.Sprintf("published with this instance's next write (every %v); each other instance lets the key through after its next read (every %v)",
		d.iv.Write, d.iv.Read)
	// A write that has not succeeded within a few intervals is failing:
	// the reset stays here until one does.
	if at, ok := d.cluster.LastSuccess(storage.OpWrite); !ok || now.Sub(at) > 3*d.iv.Write+time.Second {
		last := "none yet"
		if ok {
			last = "last " + now.Sub(at).Round(time.Millisecond).String() + " ago"
		}
		text = fmt.Sprintf("NOT yet published: this instance's writes to the cluster storage are failing (%s succeeded); until one does, the other instances keep counting the key as before and may still deny it", last)
	}
	if d.provisional.Load() {
		// Its keys' hashes are not the cluster's yet: a reset of this
		// hash would reset nobody there, and is dropped when it joins.
		text = "NOT published: this instance has not read its cluster's hash secret yet (its storage has not answered since the zone loaded), so the reset is this instance's alone; the other instances keep counting the key, and this instance starts the key's counts over when it joins: reset the key on another instance to reset it across the cluster"
	}
	return text
}

// printZoneExtras prints, below `caddy rate-limit zones`' table, a zone's
// memory by part when it has more than its table, and a distributed
// zone's sync state.
func printZoneExtras(out io.Writer, z ZoneInfo, now time.Time) {
	if len(z.Memory.Parts) > 1 {
		var parts []string
		for _, p := range memoryPartOrder {
			if n, ok := z.Memory.Parts[p]; ok {
				parts = append(parts, p+" "+bytesText(n))
			}
		}
		fmt.Fprintf(out, "zone %s: memory %s: %s\n", z.Name, bytesText(z.Memory.Bytes), strings.Join(parts, ", "))
	}
	if c := z.Cluster; c != nil {
		fmt.Fprintf(out, "zone %s: cluster: %s; last read %s (every %s), last write %s (every %s); bursts %s; errors: %d read, %d write, %d restore\n",
			z.Name, instancesText(c.Instances), ago(c.LastRead, now), c.ReadInterval, ago(c.LastWrite, now), c.WriteInterval, c.Bursts,
			c.ReadErrors, c.WriteErrors, c.RestoreErrors)
	}
}

func instancesText(n int) string {
	switch n {
	case 0:
		return "no read yet"
	case 1:
		return "1 instance live (this one)"
	}
	return fmt.Sprintf("%d instances live (this one included)", n)
}

// ago says how long before now t was, or that it has not happened.
func ago(t *time.Time, now time.Time) string {
	if t == nil {
		return "never"
	}
	return now.Sub(*t).Round(time.Millisecond).String() + " ago"
}

// printKeyCluster prints a key's standing in a cluster count, below
// `caddy rate-limit key`'s table.
func printKeyCluster(out io.Writer, name string, c *KeyCluster, now time.Time) {
	fmt.Fprintf(out, "%s: %d counted here, %d by the other instances (as of the last read, %s; %s)", name, c.Here, c.Others,
		ago(c.LastRead, now), instancesText(c.Instances))
	if c.LeftToOthers > 0 {
		fmt.Fprintf(out, ", %d left to the other instances (bursts split)", c.LeftToOthers)
	}
	if c.Blocked > 0 {
		fmt.Fprintf(out, "; blocked cluster-wide for %ds more", c.Blocked)
	}
	fmt.Fprintln(out)
}

// name is how `caddy rate-limit key` names the policy: with its window if
// it is a quota's.
func (p KeyPolicy) name() string {
	if p.Window != "" {
		return p.Policy + " " + p.Window
	}
	return p.Policy
}
