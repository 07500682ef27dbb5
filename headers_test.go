package floodgate

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/limiter"
)

func TestHeaderFormat(t *testing.T) {
	a := &zone{name: "api", policy: policyItem("api", limiter.Limit{Events: 100, Window: time.Minute}), rateW: time.Minute}
	b := &zone{name: "daily", policy: policyItem("daily", limiter.Limit{Events: 1000, Window: 1500 * time.Millisecond}), rateW: 2 * time.Second}
	hdr := http.Header{}
	new(responseHeaders).setRateLimit(hdr, []verdict{{z: a, d: limiter.Decision{Remaining: 42, Reset: 17100 * time.Millisecond}}}, 0, "")
	if got, want := hdr.Get("RateLimit-Policy"), `"api";q=100;w=60`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("RateLimit"), `"api";r=42;t=18`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	rh := new(responseHeaders)
	rh.setRateLimit(hdr, []verdict{
		{z: a, d: limiter.Decision{Remaining: 0, Reset: time.Minute}},
		{z: b, d: limiter.Decision{Remaining: -1, Reset: 0}},
	}, 0, "")
	rh.setRetryAfter(hdr, 1234567)
	if got, want := hdr.Get("RateLimit-Policy"), `"api";q=100;w=60, "daily";q=1000;w=2`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("RateLimit"), `"api";r=0;t=60, "daily";r=0;t=0`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	if got, want := hdr.Get("Retry-After"), "1234567"; got != want {
		t.Errorf("Retry-After %q, want %q", got, want)
	}
}

// Values longer than the headers' buffer spill to the heap, and every value
// keeps its own text.
func TestHeaderValuesOutgrowingTheBuffer(t *testing.T) {
	var verdicts []verdict
	var wantPolicy, wantLimit []string
	for i := range 6 {
		name := "zone-with-a-long-name-" + strconv.Itoa(i)
		verdicts = append(verdicts, verdict{z: &zone{name: name, policy: policyItem(name, limiter.Limit{Events: 100, Window: time.Minute}), rateW: time.Minute}, d: limiter.Decision{Remaining: int64(i), Reset: time.Second}})
		wantPolicy = append(wantPolicy, `"`+name+`";q=100;w=60`)
		wantLimit = append(wantLimit, `"`+name+`";r=`+strconv.Itoa(i)+`;t=1`)
	}
	hdr := http.Header{}
	rh := new(responseHeaders)
	rh.setRateLimit(hdr, verdicts, 0, "")
	rh.setRetryAfter(hdr, 42)
	if got, want := hdr.Get("RateLimit-Policy"), strings.Join(wantPolicy, ", "); got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("RateLimit"), strings.Join(wantLimit, ", "); got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	if got := hdr.Get("Retry-After"); got != "42" {
		t.Errorf("Retry-After %q, want 42", got)
	}
}
