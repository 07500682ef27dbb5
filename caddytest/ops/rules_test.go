package ops

import (
	"os/exec"
	"testing"
)

// TestPrometheusAlertingRules checks the alerting rules shipped in
// contrib/prometheus with promtool: that they load (check rules) and that
// each alert fires on the series its unit tests feed it, with the labels and
// annotations written there (test rules). It skips, saying so, where
// promtool is not installed (Debian's prometheus package ships it; .ci/run
// installs it).
func TestPrometheusAlertingRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool is not installed (apt-get install prometheus): contrib/prometheus's rules are not checked")
	}
	for _, args := range [][]string{
		{"check", "rules", "floodgate.rules.yml"},
		{"test", "rules", "floodgate.rules.test.yml"},
	} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "../../contrib/prometheus"
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %v: %v\n%s", args, err, out)
		}
	}
}
