package weight

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestParseStatuses(t *testing.T) {
	s, err := ParseStatuses([]string{"401", "403", "5xx"})
	if err != nil {
		t.Fatal(err)
	}
	for code, want := range map[int]bool{401: true, 403: true, 500: true, 502: true, 599: true, 400: false, 404: false, 200: false, 499: false, 0: false, 600: false, -1: false} {
		if s.Has(code) != want {
			t.Errorf("Has(%d) = %v, want %v", code, !want, want)
		}
	}
	for _, bad := range [][]string{nil, {"4x"}, {"1xx"}, {"6xx"}, {"101"}, {"600"}, {"99"}, {"0401"}, {"abc"}, {"4xy"}, {"+40"}} {
		if _, err := ParseStatuses(bad); err == nil {
			t.Errorf("ParseStatuses(%q) took it", bad)
		} else if len(bad) > 0 && !strings.Contains(err.Error(), bad[0]) {
			t.Errorf("ParseStatuses(%q): %v does not name it", bad, err)
		}
	}
}

// A status is charged once, at the final status, whether the handler wrote
// it or returned it as an error for Caddy to write.
func TestResponseWriterReportsStatuses(t *testing.T) {
	fails, _ := ParseStatuses([]string{"401", "5xx"})
	for _, tt := range []struct {
		name  string
		serve func(w http.ResponseWriter) error
		want  reports
	}{
		{"written_401", func(w http.ResponseWriter) error { w.WriteHeader(401); return nil }, reports{"0:0→3@1"}},
		{"written_200", func(w http.ResponseWriter) error { w.WriteHeader(200); return nil }, nil},
		{"interim_then_401", func(w http.ResponseWriter) error { w.WriteHeader(103); w.WriteHeader(401); return nil }, reports{"0:0→3@1"}},
		{"401_then_error", func(w http.ResponseWriter) error { w.WriteHeader(401); return errors.New("late") }, reports{"0:0→3@1"}},
		{"200_then_error", func(w http.ResponseWriter) error { w.WriteHeader(200); return errors.New("late") }, nil},
		{"body_only", func(w http.ResponseWriter) error { _, err := w.Write([]byte("x")); return err }, nil},
		{"nothing", func(w http.ResponseWriter) error { return nil }, nil},
		{"error_401", func(w http.ResponseWriter) error { return caddyhttp.Error(401, errors.New("no")) }, reports{"0:0→3@1"}},
		{"error_404", func(w http.ResponseWriter) error { return caddyhttp.Error(404, errors.New("no")) }, nil},
		{"plain_error_is_500", func(w http.ResponseWriter) error { return errors.New("boom") }, reports{"0:0→3@1"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got reports
			var w ResponseWriter
			w.Init(httptest.NewRecorder(), &got, clock())
			w.Watch(Watch{Status: &fails, Cost: 3})
			w.Done(tt.serve(&w))
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("reported %q, want %q", got, tt.want)
			}
		})
	}
}
