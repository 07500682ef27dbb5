package cluster

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/floodgate-rl/floodgate/caddytest/internal/testcaddy"
)

// A distributed zone's responses tell the truth as a single instance's do
// (testcaddy.CheckHonest): the cluster's sliding estimate can ask a key to
// wait up to two windows, and a bucket zone told that as it was (a 10 s
// window answered Retry-After 11 to 12, a 60 s one t=92) though its
// RateLimit item's w is the window. Told w, the client comes back and is
// told again. For a window zone and a token-bucket one, on two instances.
func TestClusterDenialsTellTheTruth(t *testing.T) {
	for _, kind := range []string{"window", "bucket"} {
		t.Run(kind, func(t *testing.T) {
			body := zoneBody("10s", "1m")
			if kind == "bucket" {
				body = strings.Replace(body, "\t\t\tmemory 64KiB", "\t\t\tmemory 64KiB\n\t\t\tburst 20", 1)
			}
			nodes := startCluster(t, 2, fileStorage(t.TempDir()), body)
			denied := 0
			deadline := time.Now().Add(30 * time.Second) // a bound, should the nodes be slow
			for i := 0; i < 80 && time.Now().Before(deadline); i++ {
				n := nodes[i%2]
				resp := n.response("honest")
				testcaddy.CheckHonest(t, fmt.Sprintf("request %d on node %d", i+1, n.i), resp)
				if resp.StatusCode == http.StatusTooManyRequests {
					denied++
				}
				time.Sleep(50 * time.Millisecond) // spread over syncs: real clients' pace, not rate logic
			}
			if denied == 0 {
				t.Fatal("no request denied: the denials' headers were not checked")
			}
			t.Logf("%d of 80 denied", denied)
		})
	}
}
