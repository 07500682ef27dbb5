package weight

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"
)

// reports records what a ResponseWriter reports.
type reports []string

func (r *reports) Reported(i int, from, to int64, now time.Time) {
	*r = append(*r, fmt.Sprintf("%d:%d→%d@%d", i, from, to, now.Unix()))
}

// clock reads 1, 2, 3, … seconds: each report shows when it read it.
func clock() func() time.Time {
	var s int64
	return func() time.Time { s++; return time.Unix(s, 0) }
}

// readFromRecorder is a ResponseWriter with a ReadFrom of its own (as the
// server's, which uses sendfile), which records that it was used.
type readFromRecorder struct {
	*httptest.ResponseRecorder
	readFrom bool
}

func (w *readFromRecorder) ReadFrom(r io.Reader) (int64, error) {
	w.readFrom = true
	return io.Copy(w.ResponseRecorder, r)
}

func TestResponseWriter(t *testing.T) {
	for _, tt := range []struct {
		name         string
		watches      []Watch
		write        func(w http.ResponseWriter)
		want         []string
		wantReadFrom bool
	}{
		{"a header, once, at the final status", []Watch{{Header: "X-Cost"}, {Header: "X-Other"}}, func(w http.ResponseWriter) {
			w.Header().Set("X-Cost", "5")
			w.WriteHeader(http.StatusEarlyHints) // a 1xx reports nothing
			w.Header().Set("X-Cost", " 7 ")
			w.Header().Set("X-Other", "0") // not a weight: nothing
			w.WriteHeader(http.StatusOK)
			w.WriteHeader(http.StatusOK)
			w.Write([]byte("body"))
		}, []string{"0:0→7@1"}, false},
		{"the body's bytes as they are written", []Watch{{Header: "X-Cost"}, {Bytes: true}}, func(w http.ResponseWriter) {
			w.Header().Set("X-Cost", "2")
			w.Write([]byte("abc"))
			w.Write(nil)
			w.Write([]byte("de"))
		}, []string{"0:0→2@1", "1:0→3@2", "1:3→5@3"}, false},
		{"bytes through ReadFrom go through Write", []Watch{{Bytes: true}}, func(w http.ResponseWriter) {
			w.(io.ReaderFrom).ReadFrom(strings.NewReader("abcdef"))
		}, []string{"0:0→6@1"}, false},
		{"no bytes watched: ReadFrom keeps the writer's own", []Watch{{Header: "X-Cost"}}, func(w http.ResponseWriter) {
			w.(io.ReaderFrom).ReadFrom(strings.NewReader("abcdef"))
		}, nil, true},
	} {
		var got reports
		rec := &readFromRecorder{ResponseRecorder: httptest.NewRecorder()}
		var w ResponseWriter
		w.Init(rec, &got, clock())
		for _, x := range tt.watches {
			w.Watch(x)
		}
		tt.write(&w)
		if !reflect.DeepEqual([]string(got), tt.want) {
			t.Errorf("%s: reported %q, want %q", tt.name, got, tt.want)
		}
		if rec.readFrom != tt.wantReadFrom {
			t.Errorf("%s: the writer's own ReadFrom used: %v, want %v", tt.name, rec.readFrom, tt.wantReadFrom)
		}
		if w.Unwrap() != rec {
			t.Errorf("%s: Unwrap is not the writer wrapped", tt.name)
		}
	}
}
