package floodgate

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"text/tabwriter"
	"time"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "rate-limit",
		Usage: "zones | top <zone> | key <zone> <key> | reset <zone> <key> [--json] [--address <interface>] [--config <path> [--adapter <name>]]",
		Short: "Shows the rate_limit zones of a running Caddy, their top sources and keys, and resets keys",
		Long: `
Talks to the admin API of a running Caddy (/rate_limit/...):

  zones              every zone: limits, counts (of requests, and of
                     connections for a zone a layer4 matcher uses),
                     memory (by part, for a zone with more than a table),
                     occupancy; a distributed zone's sync state
  top <zone>         the sources the zone denied most in the last 1-2 minutes
  key <zone> <key>   what a key would get now; asking charges nothing; in a
                     distributed zone, what this instance and the others
                     counted for it
  reset <zone> <key> make the key's buckets full again, so it passes; in a
                     distributed zone, on every instance after a sync

An IP address as <key> is grouped by the zone's ipv4_prefix/ipv6_prefix, as
a request's would be. The admin address is --address if given, else the one
in --config, else Caddy's default (localhost:2019, or $CADDY_ADMIN), as for
'caddy reload'. --json prints the API's JSON for scripts.
`,
		CobraFunc: rateLimitCommand,
	})
}

// rateLimitCommand sets up `caddy rate-limit` and its subcommands on cmd.
func rateLimitCommand(cmd *cobra.Command) {
	cmd.PersistentFlags().String("address", "", "The address to use to reach the admin API endpoint, if not the default")
	cmd.PersistentFlags().StringP("config", "c", "", "Configuration file to use to parse the admin address, if --address is not used")
	cmd.PersistentFlags().StringP("adapter", "a", "", "Name of config adapter to apply (when --config is used)")
	cmd.PersistentFlags().Bool("json", false, "Print the admin API's JSON instead of a table")
	cmd.SilenceUsage = true
	sub := func(use, short string, args int, run func(c *cobra.Command, args []string) error) {
		cmd.AddCommand(&cobra.Command{Use: use, Short: short, Args: cobra.ExactArgs(args), RunE: run, SilenceUsage: true})
	}
	sub("zones", "List every zone", 0, func(c *cobra.Command, _ []string) error {
		var zs []ZoneInfo
		return adminCall(c, http.MethodGet, "/rate_limit/zones", &zs, func(w io.Writer) { printZones(w, zs) })
	})
	sub("top <zone>", "List the sources the zone denied most", 1, func(c *cobra.Command, args []string) error {
		var t TopInfo
		return adminCall(c, http.MethodGet, "/rate_limit/zones/"+url.PathEscape(args[0])+"/top?n=20", &t, func(w io.Writer) { printTop(w, t) })
	})
	sub("key <zone> <key>", "Show what a key would get now, charging nothing", 2, func(c *cobra.Command, args []string) error {
		var k KeyInfo
		return adminCall(c, http.MethodGet, keyPath(args), &k, func(w io.Writer) { printKey(w, k, "") })
	})
	sub("reset <zone> <key>", "Make a key's buckets full again", 2, func(c *cobra.Command, args []string) error {
		var k KeyInfo
		return adminCall(c, http.MethodDelete, keyPath(args), &k, func(w io.Writer) { printKey(w, k, "reset: ") })
	})
}

func keyPath(args []string) string {
	return "/rate_limit/zones/" + url.PathEscape(args[0]) + "/keys/" + url.PathEscape(args[1])
}

// adminCall sends a request to the admin API and prints the answer: as it
// came with --json, else decoded into v and printed by table.
func adminCall(c *cobra.Command, method, uri string, v any, table func(io.Writer)) error {
	fl := c.Flags()
	address, _ := fl.GetString("address")
	config, _ := fl.GetString("config")
	adapter, _ := fl.GetString("adapter")
	asJSON, _ := fl.GetBool("json")
	addr, err := caddycmd.DetermineAdminAPIAddress(address, nil, config, adapter)
	if err != nil {
		return fmt.Errorf("couldn't determine admin API address: %v", err)
	}
	resp, err := caddycmd.AdminAPIRequest(addr, method, uri, nil, nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if asJSON {
		_, err = c.OutOrStdout().Write(body)
		return err
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("reading the answer of %s: %v", uri, err)
	}
	table(c.OutOrStdout())
	return nil
}

func printZones(out io.Writer, zs []ZoneInfo) {
	if len(zs) == 0 {
		fmt.Fprintln(out, "no rate_limit zones in the running config")
		return
	}
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "ZONE\tLIMIT\tKEY\tALLOWED\tDENIED\tLOGGED\tDELAYED\tMEMORY\tOCCUPANCY\tFALSE DENY")
	for _, z := range zs {
		var limits []string
		for _, p := range z.Policies {
			switch p.Kind {
			case "window":
				limits = append(limits, fmt.Sprintf("%d in %s", p.Events, p.Window))
			case "quota":
				limits = append(limits, fmt.Sprintf("quota %d in %s", p.Events, p.Window))
			default:
				limits = append(limits, fmt.Sprintf("%d/%s burst %d", p.Events, p.Window, p.Burst))
			}
		}
		key := strings.Join(z.Key, " ")
		if key == "" {
			key = "(none)"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%s\t%.2f%%\t%.4f%%\n", z.Name, strings.Join(limits, ", "), key,
			z.Requests.Allowed, z.Requests.Denied, z.Requests.Logged, z.Requests.Delayed,
			bytesText(z.Memory.Bytes), 100*z.Occupancy, 100*z.FalseDeny)
	}
	w.Flush()
	for _, z := range zs {
		// The table's counts are of HTTP requests; a zone a layer4
		// matcher uses counts connections beside them.
		if c := z.Connections; c != nil {
			fmt.Fprintf(out, "zone %s: layer4 connections: %d allowed, %d denied, %d logged\n", z.Name, c.Allowed, c.Denied, c.Logged)
		}
		if x := z.XDP; x != nil {
			fmt.Fprintf(out, "zone %s: XDP on %s (%s mode): %d SYNs passed, %d dropped; %d QUIC Initials passed, %d dropped\n",
				z.Name, x.Interface, x.Mode, x.Passed, x.Dropped, x.InitialsPassed, x.InitialsDropped)
		}
		if c := z.Concurrent; c != nil {
			fmt.Fprintf(out, "zone %s: max_concurrent %d: %d in flight, %d denied for want of a place (%s)\n",
				z.Name, c.MaxConcurrent, c.InFlight, c.Denied, bytesText(c.Memory.Bytes))
		}
		printZoneExtras(out, z, time.Now())
	}
}

func printTop(out io.Writer, t TopInfo) {
	if len(t.Sources) == 0 {
		fmt.Fprintf(out, "zone %s has denied nothing in the last 1-2 minutes\n", t.Zone)
		return
	}
	fmt.Fprintf(out, "zone %s: most denied sources since %s\n", t.Zone, t.Since.Local().Format(time.TimeOnly))
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "SOURCE\tDENIED\tOVERCOUNT UP TO")
	for _, s := range t.Sources {
		fmt.Fprintf(w, "%s\t%d\t%d\n", s.Source, s.Denied, s.Error)
	}
	w.Flush()
}

func printKey(out io.Writer, k KeyInfo, prefix string) {
	state := "allowed"
	if !k.Allowed {
		state = "denied"
	}
	fmt.Fprintf(out, "%szone %s, source %s: a request now would be %s\n", prefix, k.Zone, k.Source, state)
	if k.ClusterReset != "" {
		fmt.Fprintf(out, "cluster: %s\n", k.ClusterReset)
		fmt.Fprintln(out, "cluster: this instance no longer counts the key's earlier requests to the other instances; they count them until they read the reset")
	}
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "POLICY\tLIMIT\tREMAINING\tRETRY AFTER\tFULL IN")
	for _, p := range k.Policies {
		name := p.name()
		if p.InFlight != nil {
			name += fmt.Sprintf(" (%d in flight)", *p.InFlight)
		}
		fmt.Fprintf(w, "%s\t%d\t%d\t%ds\t%ds\n", name, p.Limit, p.Remaining, p.RetryAfter, p.Reset)
	}
	w.Flush()
	for _, p := range k.Policies {
		if p.Cluster != nil {
			printKeyCluster(out, p.name(), p.Cluster, time.Now())
		}
	}
}

// bytesText writes n bytes in the largest binary unit that keeps it at
// least 1.
func bytesText(n int) string {
	const units = "KMGT"
	if n < 1024 {
		return fmt.Sprintf("%d B", n)
	}
	v, i := float64(n)/1024, 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	return fmt.Sprintf("%.1f %ciB", v, units[i])
}
