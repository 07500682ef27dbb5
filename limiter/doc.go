// Package limiter holds floodgate's algorithms: a Bloom token-bucket table
// whose memory is fixed by configuration, a sliding-window count-min sketch
// for rolling quotas, and the small transaction that charges several of them
// as one. It imports nothing from Caddy and can be used on its own.
//
// Start with Buckets (buckets.go), then line.go for the cache-line layout.
//
// # Bloom token buckets
//
// A Buckets table is an array of 64-byte, 64-byte-aligned cache lines. A key
// (masked address bytes from NetworkKey, or any byte string) is hashed once
// with xxhash64; the high half of the hash picks a line, the low half one of
// the C(14, K) subsets of its 14 counters. A request of weight w is granted
// if the fullest of the key's K counters holds w tokens. A key whose counters
// all drain is denied; since a flooding key drains exactly its own counters,
// another key is denied only when all K of its counters collide with those
// of flooding keys: a Bloom false positive. No key is stored, so memory does
// not grow with the number of keys, and a flood of fresh keys cannot evict
// anyone's state to hand itself a full bucket.
//
// Every counter of the key pays, not only the fullest. This is the one point
// where floodgate departs from the patent it follows (US 9654483, where the
// one counter that grants pays): with K counters of a full burst each, a key
// alone on its counters could otherwise draw K bursts. Paying on all of
// them makes a lone key exactly one token bucket. The others pay first and
// the fullest pays last, with the CAS that grants; a deficit may run past
// empty (to twice the capacity), so charges and refunds are additions that
// commute, and concurrent requests of one key never get more than the burst
// plus the refill.
//
// # Layout: 14 counters of 31 bits and a 32-bit tick
//
// The patent's reference layout is 31 counters of 16 bits and a 16-bit tick.
// floodgate uses a clock word (32-bit tick, 31-bit pending refill,
// generation bit) and seven words of two 31-bit counters, because:
//
//   - A counter holds tokens in units of 1/512 token, so weights are exact
//     and a burst of up to MaxBurst (1,398,101) tokens fits, with room for
//     the stored deficit to reach three bursts (see charge); 16 bits hold
//     neither a burst of 10⁶ nor weight-1 requests against it.
//   - Refill per tick is a whole number of units (at least 1/16 token) over a
//     tick of at least 1µs rounded to a whole nanosecond, so any rate from
//     1/day to 10⁶/s is enforced within 0.05% (0.1% is the target; see
//     TestAnyRateIsEnforcedWithin01Percent).
//   - A 32-bit tick wraps after at least 2³² µs (71 minutes) and usually
//     decades; a table is swept once per 2³⁰ ticks so that no line's tick is
//     ambiguous, and a line idle past the wrap reads as full.
//   - The pending refill and the generation bit make refill exact and
//     lock-free (see line.go). A line is brought up to date only once a
//     full bucket's worth of refill is owed; in between, a charge lifts its
//     counter to the refill owed since the line's tick before adding, which
//     keeps the deficit exact relative to that tick. The patent's
//     refill-on-empty instead credits a line for the time it sat full,
//     which would grant a second burst.
//
// Counters hold deficits (how far from full), so a zeroed table is full, a
// changed capacity applies at once to existing state, and "add the refill,
// capped at capacity" is "subtract, floored at zero": one SWAR operation on
// both lanes of a word, checked against a per-lane reference in tests.
//
// # Sizing and false denies
//
// A table is sized in bytes, or from the number of sources expected to flood
// at once and a target false-deny probability (DefaultSources = 100,000,
// DefaultFalseDeny = 0.5%: 13 MB). EstimateFalseDeny gives the formula: with
// λ flooding sources per line,
//
//	P(false deny) = Σ_j Poisson(j; λ) Σ_{i=0..K} (−1)^i C(K,i) (C(14−i,K)/C(14,K))^j
//
// K = 4 is the best choice for loads below one source per line (0.14% at
// λ = 0.25, 0.52% at 0.5, 2.1% at 1). Measured (TestFalseDenyMatchesEstimate,
// flooding sources at three times the limit, light ones at half of it, no
// race detector): light sources were denied 0.39% of the time at λ = 0.5
// (formula 0.52%), 1.65% at λ = 1 (2.09%), 5.9% at λ = 2 (8.3%); on the
// default table with 100,000 flooding sources, 0.48% (0.50%). Stats reports
// the table's occupancy and its live false-deny estimate for a key never
// seen before, which matches what Peek finds for fresh keys to within
// sampling error.
//
// # Rolling quotas: the sliding-window sketch
//
// A Sketch holds Cloudflare's two fixed windows per key (estimate = previous ×
// (W − t)/W + current) in a count-min sketch: rows × width counters for each
// window, fixed memory, lazily rotated per counter by a window tag, mergeable
// by addition with another instance's snapshot, and encoded sparsely for
// storage by a decoder that treats its input as untrusted.
//
// Accuracy (TestSketchAccuracy: 10,000 keys, 12 windows, about a million
// requests; 85% of keys light, 8% near the quota, 4% abusive, 3% bursty):
// against an exact sliding log, the light keys' decisions differ on 0.11%
// (width 2¹⁴) and 0.074% (width 2¹⁶) of requests. Over the whole trace 12.5%
// of decisions differ, and that is the two-window rule itself, not the
// sketch: with exact per-key counters the rule differs on 12.51%, because for
// a key over its quota both grant about the quota per window but not the same
// requests (every shifted grant counts as one wrong allow and one wrong
// deny). Tokens granted match the exact log to within 0.2%; sketch collisions
// change 0.99% of decisions at width 2¹⁴ and 0.0016% at 2¹⁶, so size the
// width at several times the number of busy keys. The rule's known weakness
// remains: a bursty key held up to 1.85× its quota within one sliding window.
//
// # Concurrency and time
//
// Decisions take no lock and allocate nothing. Time is a parameter, as in
// golang.org/x/time/rate's AllowN(t, n): every call that depends on it takes
// a time.Time, so a request checked against several policies reads the clock
// once, and tests drive time by passing times. A Buckets table counts ticks
// from its creation with the monotonic reading of time.Now; a Sketch uses
// the wall clock, since its windows are aligned to Unix time.
package limiter
