package weight

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tt := range []struct {
		in      string
		fixed   int64
		tmpl    string
		wantErr string
	}{
		{in: "1", fixed: 1},
		{in: "10", fixed: 10},
		{in: "{http.request.header.X-Cost}", tmpl: "{http.request.header.X-Cost}"},
		{in: "{header.X-Cost}", tmpl: "{header.X-Cost}"},
		{in: "0", wantErr: "weight 0: must be at least 1"},
		{in: "-2", wantErr: "weight -2: must be at least 1"},
		{in: "1.5", wantErr: `weight "1.5": must be a whole number of at least 1 or a placeholder`},
		{in: "ten", wantErr: `weight "ten": must be a whole number`},
		{in: "", wantErr: `weight "": must be a whole number`},
		{in: "99999999999999999999", wantErr: `weight "99999999999999999999"`},
	} {
		v, err := Parse(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("Parse(%q): error %v, want %q", tt.in, err, tt.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("Parse(%q): %v", tt.in, err)
			continue
		}
		if v.n != tt.fixed || v.template != tt.tmpl || v.String() != tt.in {
			t.Errorf("Parse(%q) = %d %q (%s), want %d %q", tt.in, v.n, v.template, v, tt.fixed, tt.tmpl)
		}
	}
}

func TestResolveNeverGivesAFreePass(t *testing.T) {
	v, _ := Parse("{cost}")
	for _, tt := range []struct {
		expanded string
		want     int64
		wantErr  string
	}{
		{"3", 3, ""},
		{" 7 ", 7, ""},
		{"20", 20, ""},
		{"", 0, `{cost} is empty: the request must give a whole number of at least 1`},
		{"  ", 0, `is empty`},
		{"0", 0, `= "0": must be a whole number`},
		{"-1", 0, `= "-1"`},
		{"2.5", 0, `= "2.5"`},
		{"abc", 0, `= "abc"`},
		{"21", 0, "= 21: above 20, the most the zone can grant"},
		{"9223372036854775808", 0, "must be a whole number"},
		{strings.Repeat("9", 1<<16), 0, "…"},
	} {
		got, err := v.Resolve(func(string) string { return tt.expanded }, 20)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || len(err.Error()) > 200 {
				t.Errorf("expanded %.20q: %d, error %.200v, want a short error with %q", tt.expanded, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("expanded %q: %d, %v, want %d", tt.expanded, got, err, tt.want)
		}
	}
	if n, err := Static(5).Resolve(nil, 20); n != 5 || err != nil {
		t.Errorf("a fixed weight resolves to itself: %d %v", n, err)
	}
}

func TestCheckFixed(t *testing.T) {
	if err := Static(6).CheckFixed(5, "the zone"); err == nil || err.Error() != "weight 6: above 5, the most the zone can grant: such a request could never pass" {
		t.Errorf("weight 6 with burst 5: %v", err)
	}
	if err := Static(5).CheckFixed(5, "the zone"); err != nil {
		t.Errorf("weight 5 with burst 5: %v", err)
	}
	v, _ := Parse("{cost}")
	if err := v.CheckFixed(1, "the zone"); err != nil {
		t.Errorf("a template is checked per request, not at load: %v", err)
	}
}

func TestJSON(t *testing.T) {
	var got struct {
		A Value `json:"a"`
		B Value `json:"b"`
		C Value `json:"c"`
		D Value `json:"d,omitzero"`
	}
	if err := json.Unmarshal([]byte(`{"a": 10, "b": "{http.request.header.X-Cost}", "c": "4"}`), &got); err != nil {
		t.Fatal(err)
	}
	out, _ := json.Marshal(got)
	if want := `{"a":10,"b":"{http.request.header.X-Cost}","c":4}`; string(out) != want {
		t.Errorf("round trip: %s, want %s", out, want)
	}
	for _, bad := range []string{`{"a": 0}`, `{"a": -2}`, `{"a": 1.5}`, `{"a": "x"}`, `{"a": true}`} {
		if err := json.Unmarshal([]byte(bad), &got); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}
