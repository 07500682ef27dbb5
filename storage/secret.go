package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/certmagic"
)

// SecretKey is where the instances of a cluster keep the secret they mix
// into the hashes of their zones' keys (see Secret). No zone's snapshots
// are ever there: Dir escapes a zone's name, so no directory under Prefix
// has a space in its name.
const SecretKey = Prefix + "/hash secret"

// secretHeader starts the stored secret, so that a file that is something
// else is told apart from a secret.
const secretHeader = "floodgate hash secret v1 "

// Secret returns the secret that every instance sharing st mixes into the
// hashes of its distributed zones' keys: the one stored at SecretKey, or,
// if none is, candidate, stored there first. Without a secret, the
// counters a header's value lands on can be computed from the key's
// placeholder, so a client could choose values that land on another's.
// Every instance must hash a key alike to count it together, hence one
// secret for all, made by whichever instance first finds none. The check
// and the store are made under the storage's lock of SecretKey, so two
// instances that start together agree; the stored secret is then only
// read.
//
// A stored entry that is not a secret is an error, not replaced: instances
// already running hash with the secret it held, and a new one would split
// the cluster's counts. Secret never returns 0.
func Secret(ctx context.Context, st certmagic.Storage, candidate uint64) (uint64, error) {
	if v, err := loadSecret(ctx, st); !errors.Is(err, fs.ErrNotExist) {
		return v, err
	}
	// Instances that start together queue for the lock, which a storage
	// may poll slowly (caddy-storage-redis every second): each waiter
	// looks for the secret meanwhile and stops waiting once it is stored.
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stored := make(chan uint64, 1)
	go func() {
		tick := time.NewTicker(secretPoll)
		defer tick.Stop()
		for {
			select {
			case <-lctx.Done():
				return
			case <-tick.C:
				if v, err := loadSecret(lctx, st); err == nil {
					stored <- v
					cancel()
					return
				}
			}
		}
	}()
	if err := st.Lock(lctx, SecretKey); err != nil {
		select {
		case v := <-stored:
			return v, nil
		default:
			return 0, fmt.Errorf("locking %q: %w", SecretKey, err)
		}
	}
	defer func() { _ = st.Unlock(context.WithoutCancel(ctx), SecretKey) }()
	v, err := loadSecret(ctx, st)
	if !errors.Is(err, fs.ErrNotExist) {
		return v, err // stored by another between the two loads
	}
	candidate = max(candidate, 1)
	if err := st.Store(ctx, SecretKey, []byte(secretHeader+strconv.FormatUint(candidate, 16)+"\n")); err != nil {
		return 0, fmt.Errorf("storing %q: %w", SecretKey, err)
	}
	return candidate, nil
}

// secretPoll is how often an instance waiting for the secret's lock looks
// whether another stored the secret meanwhile.
const secretPoll = 100 * time.Millisecond

// maxSecretSize bounds what loadSecret reads: a secret is at most 42
// bytes. A larger entry is refused unread (loadBounded), as a snapshot is.
const maxSecretSize = 64

func loadSecret(ctx context.Context, st certmagic.Storage) (uint64, error) {
	bad := func(what string) error {
		return fmt.Errorf("%q does not hold a hash secret (%s): remove it when no instance runs, or restore it from a running instance's storage", SecretKey, what)
	}
	data, err := loadBounded(ctx, st, SecretKey, maxSecretSize)
	if errors.Is(err, errTooLarge) {
		return 0, bad(err.Error())
	}
	if err != nil {
		return 0, err
	}
	text, ok := strings.CutPrefix(string(data), secretHeader)
	v, perr := strconv.ParseUint(strings.TrimSuffix(text, "\n"), 16, 64)
	if !ok || perr != nil || v == 0 {
		return 0, bad(strconv.Itoa(len(data)) + " bytes")
	}
	return v, nil
}
