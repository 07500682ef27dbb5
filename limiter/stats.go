package limiter

import "time"

// BucketStats describes the state of a token-bucket table.
type BucketStats struct {
	Lines    int
	Counters int
	Bytes    int
	K        int
	// Empty is the share of counters that are empty: holding less than
	// one token.
	Empty float64
	// Busy is the share of counters that are not full.
	Busy float64
	// FalseDeny is the probability that a key never seen before would be
	// denied now: the mean over lines of C(e, K)/C(m, K), e being the
	// line's empty counters.
	FalseDeny float64
	// Sampled is the number of lines the figures were computed from: every
	// line up to 65,536, an even spread of 65,536 beyond.
	Sampled int
}

// maxStatLines bounds the work of Stats.
const maxStatLines = 1 << 16

// Stats measures the table at now. It reads (at most 65,536) lines without
// locking them, so under traffic its figures are a consistent-enough sample,
// not a snapshot.
func (b *Buckets) Stats(now time.Time) BucketStats {
	p := b.params()
again:
	tick := p.ticks(b.nowNanos(now))
	n := len(p.lines)
	step := 1
	if n > maxStatLines {
		step = n / maxStatLines
	}
	// A counter more than capT − per ticks ahead holds less than a token.
	emptyFrom := uint32(p.capT - p.per)
	base := choose(countersPerLine, b.k)
	var empty, busy, sampled int
	var fd float64
	var a [countersPerLine]uint32
	for i := 0; i < n; i += step {
		if !aheads(&p.lines[i], uint32(tick), &a) {
			p = b.moved(p) // SetLimit replaced the table: start over
			empty, busy, sampled, fd = 0, 0, 0, 0
			goto again
		}
		lineEmpty := 0
		for _, v := range a {
			if v > 0 {
				busy++
			}
			if v > emptyFrom {
				lineEmpty++
			}
		}
		empty += lineEmpty
		fd += choose(lineEmpty, b.k) / base
		sampled++
	}
	return statsOf(n, b.k, countersPerLine, sampled, empty, busy, fd)
}

// statsOf is the BucketStats of a table of n lines of m counters and k
// counters a key, from the counts over its sampled lines: empty and busy
// counters, and the sum over lines of their false-deny probability.
func statsOf(n, k, m, sampled, empty, busy int, fd float64) BucketStats {
	counters := sampled * m
	return BucketStats{
		Lines:     n,
		Counters:  n * m,
		Bytes:     n * 64,
		K:         k,
		Empty:     float64(empty) / float64(counters),
		Busy:      float64(busy) / float64(counters),
		FalseDeny: fd / float64(sampled),
		Sampled:   sampled,
	}
}
