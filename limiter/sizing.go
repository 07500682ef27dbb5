package limiter

import "math"

// EstimateFalseDeny is the probability that a fresh key is denied because all
// K of its counters are drained, when sources flooding keys are spread over
// a token-bucket table (Buckets) of lines lines.
//
// Each flooding key drains the K counters it draws on (it always takes from
// its fullest, so it empties all of them). The number j of flooding keys on
// a given line is Poisson with mean λ = sources/lines. A fresh key on that
// line is denied if each of its K counters is among theirs; for j keys with
// independent uniform K-subsets of the 16 counters, by inclusion–exclusion
//
//	q(j) = Σ_{i=0..K} (−1)^i C(K,i) (C(16−i,K) / C(16,K))^j
//
// and the false-deny probability is Σ_j Poisson(j; λ) q(j).
//
// For K = 3: λ = 0.25 gives 0.12%, λ = 0.5 gives 0.39%, λ = 1 gives 1.4%.
// Keys under their limit drain nothing, so only flooding sources count.
func EstimateFalseDeny(sources, lines, k int) float64 {
	return estimateFalseDeny(sources, lines, k, countersPerLine)
}

// EstimateWindowFalseDeny is EstimateFalseDeny for a window table
// (Windows), whose lines hold 8 counters rather than 16: 16 in the formula
// becomes 8. A flooding key covers a larger share of its line, so a window
// table needs about 3.4 times the lines of a token-bucket table for the
// same target: for K = 3, λ = 0.25 gives 0.87%, λ = 0.5 gives 2.5%, λ = 1
// gives 7.6%.
func EstimateWindowFalseDeny(sources, lines, k int) float64 {
	return estimateFalseDeny(sources, lines, k, windowCounters)
}

// estimateFalseDeny is the formula for lines of m counters.
func estimateFalseDeny(sources, lines, k, m int) float64 {
	if sources <= 0 || lines <= 0 {
		return 0
	}
	lambda := float64(sources) / float64(lines)
	if lambda > 1000 {
		// A thousand flooding keys on a line cover every counter.
		return 1
	}
	base := choose(m, k)
	var ratio [9]float64 // C(m−i,K)/C(m,K)
	for i := 0; i <= k; i++ {
		ratio[i] = choose(m-i, k) / base
	}
	// Poisson terms in log space, over the mean ± 40 standard deviations:
	// beyond that they are below 1e-300 of the total.
	spread := 40 * math.Sqrt(lambda)
	lo, hi := max(0, int(lambda-spread)), int(lambda+spread)+40
	total := 0.0
	for j := lo; j <= hi; j++ {
		lg, _ := math.Lgamma(float64(j + 1))
		term := math.Exp(-lambda + float64(j)*math.Log(lambda) - lg)
		q := 0.0
		for i := 0; i <= k; i++ {
			sign := 1.0
			if i%2 == 1 {
				sign = -1
			}
			q += sign * choose(k, i) * math.Pow(ratio[i], float64(j))
		}
		total += term * q
	}
	return max(0, min(1, total))
}

// LinesFor is the smallest number of lines at which sources flooding keys
// leave a fresh key a false-deny probability of at most fd (see
// EstimateFalseDeny), in a token-bucket table.
func LinesFor(sources int, fd float64, k int) int {
	return linesFor(sources, fd, k, countersPerLine)
}

// WindowLinesFor is LinesFor for a window table (see
// EstimateWindowFalseDeny): 38 MB rather than 11 MB at the defaults.
func WindowLinesFor(sources int, fd float64, k int) int {
	return linesFor(sources, fd, k, windowCounters)
}

// linesFor is LinesFor for lines of m counters.
func linesFor(sources int, fd float64, k, m int) int {
	lo, hi := 1, 1
	for estimateFalseDeny(sources, hi, k, m) > fd {
		lo = hi
		hi *= 2
		if hi > MaxBytes/64 {
			return hi // more than any table may hold; NewBuckets says so
		}
	}
	for lo < hi {
		mid := lo + (hi-lo)/2
		if estimateFalseDeny(sources, mid, k, m) > fd {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo
}

func choose(n, k int) float64 {
	if k < 0 || k > n {
		return 0
	}
	r := 1.0
	for i := 0; i < k; i++ {
		r = r * float64(n-i) / float64(i+1)
	}
	return r
}
