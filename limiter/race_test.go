//go:build race

package limiter

// raceEnabled scales long simulations down under the race detector, which
// slows them about tenfold.
const raceEnabled = true
