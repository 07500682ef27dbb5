package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"
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
func Secret(ctx context.Context, st Loader, candidate uint64) (uint64, error) {
	if v, err := loadSecret(ctx, st); !errors.Is(err, fs.ErrNotExist) {
		return v, err
	}
	if err := st.Lock(ctx, SecretKey); err != nil {
		return 0, fmt.Errorf("locking %q: %w", SecretKey, err)
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

// A Loader is the part of a certmagic.Storage that Secret uses.
type Loader interface {
	Lock(ctx context.Context, name string) error
	Unlock(ctx context.Context, name string) error
	Store(ctx context.Context, key string, value []byte) error
	Load(ctx context.Context, key string) ([]byte, error)
}

// maxSecretSize bounds what loadSecret reads: a secret is 42 bytes.
const maxSecretSize = 64

func loadSecret(ctx context.Context, st Loader) (uint64, error) {
	data, err := st.Load(ctx, SecretKey)
	if err != nil {
		return 0, err
	}
	text, ok := strings.CutPrefix(string(data[:min(len(data), maxSecretSize)]), secretHeader)
	v, perr := strconv.ParseUint(strings.TrimSuffix(text, "\n"), 16, 64)
	if !ok || perr != nil || v == 0 || len(data) > maxSecretSize {
		return 0, fmt.Errorf("%q does not hold a hash secret (%d bytes): remove it when no instance runs, or restore it from a running instance's storage", SecretKey, len(data))
	}
	return v, nil
}
