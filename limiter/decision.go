package limiter

import (
	"math"
	"time"
)

// Never is the RetryAfter of a request that can never be granted: its weight
// is larger than the policy's capacity.
const Never = time.Duration(math.MaxInt64)

// A Decision is what a policy answers for one request.
//
// All counts are in the policy's tokens (requests, or whatever unit the
// weights speak in); durations are measured from the moment of the decision.
type Decision struct {
	// Allowed reports whether the request was granted. A denied request is
	// charged nothing.
	Allowed bool
	// Limit is the policy's capacity: the burst of a token bucket or the
	// quota of a rolling window.
	Limit int64
	// Remaining is what the key could still take right now, after this
	// request was charged (if it was). It is rounded down.
	Remaining int64
	// RetryAfter is zero for a granted request. For a denied one it is the
	// time until the same request would be granted, assuming no other
	// traffic; Never if its weight exceeds Limit.
	RetryAfter time.Duration
	// Reset is the time until the key is back to its full Limit, assuming
	// no other traffic.
	Reset time.Duration
}

// A Reservation records what a granted Take charged, so that Refund can give
// back what of it is still owed (for a token-bucket table, the part not yet
// refilled; see Buckets). The zero Reservation refunds nothing.
type Reservation struct {
	index uint64 // where the charge went: a counter (buckets) or a key hash (sketch)
	epoch int64  // the window the charge was counted in (sketch), the table's SetLimit generation (buckets)
	units int64  // how much was charged, in the policy's internal units; 0 means nothing
	// short[i] is how much less than units the i-th counter of a bucket
	// key was charged, because the charge reached the ceiling of two
	// bursts short of full (see chargeLane); a refund gives back at most
	// units − short[i]. units and short are in ticks for buckets.
	short [8]uint32
	// end[i] is the TAT the i-th counter of a bucket key had just after
	// the charge: never earlier than where its charge ends now (a refund
	// of a charge under it moves it down), which is what a SetLimit's
	// cap needs (see Reservation.outstanding).
	end [8]uint32
	// tick is when the charge was made, in the table's ticks, whole: a
	// refund gives back what was paid less the ticks since (see
	// Reservation.outstanding).
	tick uint64
}

// Charged reports whether the reservation holds a charge that Refund would
// return.
func (r Reservation) Charged() bool { return r.units > 0 }
