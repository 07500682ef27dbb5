// Package limiter holds floodgate's algorithms: a Bloom token-bucket table
// whose memory is fixed by configuration, a sliding-window count-min sketch
// for rolling quotas, and the small transaction that charges several of them
// as one. It imports nothing from Caddy and can be used on its own. What
// the algorithms were measured to do, and the rules they replaced, are in
// docs/design.md ("The limiter package").
//
// Start with Buckets (buckets.go), then line.go for the cache-line layout;
// table.go is what Buckets and Windows (window.go) share, hook.go the one
// place every atomic word and table's parameters are read and written;
// limit.go turns a Limit into ticks, sweep.go and setlimit.go are the
// table's maintenance, sizing.go and stats.go its false denies.
//
// # Bloom token buckets
//
// A Buckets table is an array of 64-byte, 64-byte-aligned cache lines. A key
// (masked address bytes from NetworkKey, or any byte string) is hashed once
// with xxhash64; the high half of the hash picks a line, the low half one of
// the C(16, K) subsets of its 16 counters. A request of weight w is granted
// if the fullest of the key's K counters holds w tokens. A key whose counters
// all drain is denied; since a flooding key drains exactly its own counters,
// another key is denied only when all K of its counters collide with those
// of flooding keys: a Bloom false positive. No key is stored, so memory does
// not grow with the number of keys, and a flood of fresh keys cannot evict
// anyone's state to hand itself a full bucket.
//
// Every counter of the key pays, not only the fullest (as in the patent it
// follows, US 9654483): with K counters of a full burst each, a key alone
// on its counters could otherwise draw K bursts. Paying on all of them
// makes a lone key exactly one token bucket.
//
// # Layout: 16 counters of 32 bits, each a time (GCRA)
//
// A counter holds its theoretical arrival time (TAT, as in the GCRA of ATM
// networks and of Brandur's throttled): the tick at which it will be full
// again, modulo 2³², two counters to a word, eight words to a line, and no
// other state. A counter TAT − now ticks ahead of now is that many ticks
// short of full; charging cost ticks moves its TAT to max(TAT, now) + cost.
// Refill is the passing of time: nothing is written to refill. 0 is reserved
// for "full" (so a zeroed table is full and untouched pages stay
// untouched), and a computed TAT of 0 is stored as 1, a tick less granted
// (as is one of 0xFFFFFFFF, two ticks less, which SetLimit reserves).
//
//   - A token is per ticks, per a power of two (4096 for most limits, 512
//     at a million per second and for bursts of a million), so weights are
//     exact and tokens a shift away. A burst and its debt (Limit.Debt, a
//     burst by default) are at most 2³⁰ ticks, a counter at most that far
//     ahead of the latest time, and times compare as serial numbers (less
//     than 2³¹ ticks ahead, or past), so a request whose time was read
//     before it runs (a stall, a GC pause; up to 2²⁹ ticks, a second at a
//     million per second, hours for most limits, also across a Sweep or
//     SetLimit) still sees a drained counter as drained. The tick is
//     Window/(Events·per), more than a nanosecond, and time converts to
//     ticks exactly (multiplications and one comparison, no division),
//     rounded down, so the rate is exact.
//   - The only rounding is to whole ticks. Reading the time down to a tick
//     grants up to a tick later than a textbook bucket would; a full
//     counter charged inside a tick is charged from the tick's start, so
//     its next token may come up to a tick early (a 4096th of a token's
//     time), once per refill from full: the alternative, charging from the
//     next tick, denies the last token of a burst taken within one tick.
//     RetryAfter is exact for the table (the request is granted at
//     RetryAfter, not a nanosecond before); Reset, which every granted
//     request reports, is computed without a division, at most a tick
//     long. Both saturate at Never. A request whose time is late by Δ and
//     whose counter is full is charged from its own time: at most Δ of
//     refill early, as with any token bucket fed times out of order.
//   - A past TAT must be cleared before it is 2³¹ ticks old and would
//     read as ahead (four seconds at a million per second, hours to years
//     for most limits): Sweep does that, run in the background at least
//     every SweepInterval (2³⁰ ticks; the Caddy module sweeps again at
//     once after SetLimit, whose new limit may need it sooner). It clears
//     only TATs at least 2²⁹ ticks past (sweepMargin), which every request
//     less late than that reads as full anyway, so a request whose time
//     was read before the sweep's still sees a drained counter as drained.
//     It never runs in a decision, writes only with CAS, and skips zero
//     words, so it never writes a line no key touched.
//   - SetLimit keeps what each key used, in tokens: it converts every
//     counter into a table with the new tick, rounding against the key,
//     and keeps recently-past TATs as long past in the new ticks. A table
//     over memory another program shares (NewBucketsOver, for package xdp)
//     refuses it: the counters would move where the other side never
//     looks.
//
// # Exactness under concurrency
//
// A decision loads the key's words, finds the fullest counter, charges the
// others first (one CAS per word: counters of the key sharing a word are
// charged together) and the fullest last, with the CAS that grants; if
// that CAS fails it reloads, and if the counter no longer has room it
// refunds the others and decides again. Each counter's whole state is its
// 32-bit TAT and time is an argument, so every CAS validates everything its
// new value was computed from: no refill or clock word can change between a
// decision's loads and its CASes. Above the floor at "full", charges and
// refunds are additions, which commute, so a decision that rolls back
// undoes exactly what it did, and since the others pay before the fullest,
// every grant is checked against a counter that already holds every
// earlier grant's charge: a lone key is exactly one token bucket. A counter
// may run past empty up to the limit's Debt, a burst by default (a key's
// other counters pay while its fullest still has room); beyond, a charge
// falls short and its Reservation records by how much, so a refund returns
// exactly what was paid. Charge applies a cost without the room check,
// within the same ceiling: a key in debt is denied until it repays.
//
// A refund that comes later (a Txn rolled back after a held client went
// away, the reservation of a request that never ran) gives back what of
// its own charge is certainly still ahead of the refund's time: the charge
// as if it had been made from a full counter at its own time, what it paid
// less the ticks since (a Reservation records the tick and what each
// counter paid), in a CAS. An exact refund would give back the charge's
// place in the counter's queue, but that place moves down when a charge
// under it is refunded, and nothing in the line records it: burst 2 at one
// a second, X and Y at 0, X refunded at 0, Z at 0.9 s, Y refunded at 0.9 s
// leaves the counter and Y's Reservation exactly as they are with neither
// X's refund nor Z, yet Y then owes a token and here a tenth of one
// (TestARefundAfterAnEarlierOnesGivesBackNoLaterCharge). Since no charge
// starts before its own time, paid − elapsed is the most a refund can give
// back that is never another request's, however refunds and takes
// interleave (TestRefundsRacingATakeGiveBackNoOtherCharge). So after a
// refund a key holds never more than if the charge had never been made
// (what went past the ceiling, at the charge or at a SetLimit's cap,
// staying dropped), and less only for a charge queued behind others and
// refunded later than it was made: a grant too few, by at most the refill
// between the charge and the refund, and at most the charge (burst 2 at
// one a second, X and Y at 0, Y refunded at 0.5 s gives back half a token
// where the queue would give back one). A refund at the charge's own time
// (a Txn that a later zone denies, a decision that lost a race) gives back
// the whole charge: those are exact.
//
// SetLimit is exact too. It swaps every word of the table it replaces for
// a frozen marker (a value no counter holds) as it reads it, converts what
// it read into new lines, and then puts them in force. A charge made to
// the old lines before the swap is converted with the rest; one after it
// fails its CAS, and the decision waits for the new table, gives back
// there what it had already charged (converted: charges are whole tokens),
// and decides again under the new limit. A decision that loaded the old
// limit and finished before the swap is one made under the old limit:
// its charge is converted as if made at SetLimit's time, exact when its
// own time is not later than that (a later one can only make the key pay
// the difference of rates between the two times). The debt a conversion
// drops beyond a burst is the latest charges' (the top of the counter),
// and a Reservation refunds nothing of what was dropped.
//
// Every atomic load, CAS and swap of a word, and every load and store of a
// table's parameters, goes through hook.go, where a test hook (nil in
// production) stops the goroutine, so the tests run concurrent requests,
// SetLimit, Sweep, Charge, Fill and refunds through every interleaving of
// their steps and check each against a token bucket in exact rationals.
//
// # Windows: caddy-ratelimit's meaning
//
// A Windows table (window.go) holds, in the same 64-byte lines, eight
// counters of 64 bits: each counts what it granted in each of the last s+1
// sub-windows of Window/s (aligned to the table's clock), with the tick of
// its latest charge. A grant counts until its sub-window's end is a Window
// old (the newest one until its own tick's end is), so a key never gets
// more than Events in any span of Window, caddy-ratelimit's promise, on
// racing requests, weights, refunds and reloads; the price of fixed memory
// is a wait of at most a sub-window (ExtraWait) beyond an exact sliding
// log's. s is as many as 64 bits hold for Events (see windowLayout).
// Table is what the two kinds of table share.
//
// Windows is exact on the same paths as Buckets, by the same means (shared
// in table.go, hook.go and line.go): SetLimit freezes each old word as it
// reads it (no window counter has its top bit set, so none is the frozen
// marker), and a decision, Charge, Fill or refund that meets a frozen word
// waits for the new table, takes back there what it had counted and starts
// again; a refund takes back from the group its charge went to, and
// nothing once that group is gone; and Sweep keeps counters that stopped
// counting less than a margin ago, so a request whose time was read before
// the sweep's still sees what it counted.
//
// # Sizing and false denies
//
// A table is sized in bytes, or from the number of sources expected to flood
// at once and a target false-deny probability (DefaultSources = 100,000,
// DefaultFalseDeny = 0.5%: 11 MB). EstimateFalseDeny gives the formula: with
// λ flooding sources per line,
//
//	P(false deny) = Σ_j Poisson(j; λ) Σ_{i=0..K} (−1)^i C(K,i) (C(16−i,K)/C(16,K))^j
//
// K = 3 is the default: K = 4 needs a little less memory for the same
// target, but a decision then touches more words of the line, one locked
// CAS each. A window table has eight counters to a line, so 16 becomes 8
// in the formula (EstimateWindowFalseDeny, WindowLinesFor). Stats reports
// the table's share of empty counters and its live false-deny estimate for
// a key never seen before, which matches what Peek finds for fresh keys to
// within sampling error.
//
// # Rolling quotas: the sliding-window sketch
//
// A Sketch holds Cloudflare's two fixed windows per key (estimate = previous ×
// (W − t)/W + current) in a count-min sketch: rows × width counters for each
// window, fixed memory, lazily rotated per counter by a window tag, mergeable
// by addition with another instance's snapshot, and encoded sparsely for
// storage by a decoder that treats its input as untrusted. A key's
// estimate is inflated by the keys it shares a counter with on every row,
// so size the width at several times the number of busy keys. The rule
// itself is not a sliding log: a bursty key can get more than its quota
// within one sliding window.
//
// A sliding Sketch (SketchConfig.Sliding: a window zone's cluster count) has
// no such weakness: its cells hold 8 sub-windows of W/7 in one 64-byte line,
// a grant counts until its sub-window's end is W old, as in Windows, and the
// estimate is their plain sum. No span of W grants a key more than the quota
// (from the counts it decides on); a request the exact log would grant waits
// at most 8⌈W/7⌉ − W longer (TestSlidingClusterNeverGrantsMoreThanItsQuotaInASpan,
// against the exact log of several instances' grants). The Sketch's doc says
// why 8 and what it costs.
//
// # Concurrency and time
//
// Decisions take no lock and allocate nothing. Time is a parameter, as in
// golang.org/x/time/rate's AllowN(t, n): every call that depends on it takes
// a time.Time, so a request checked against several policies reads the clock
// once, and tests drive time by passing times. A Buckets table counts ticks
// from its creation with the monotonic reading of time.Now (a time before
// that counts as its creation); a Sketch uses the wall clock, since its
// windows are aligned to Unix time.
package limiter
