// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// synlimit: floodgate's XDP program. It takes one token from a layer4 zone's
// Bloom token-bucket table for every TCP SYN (not SYN-ACK) to a configured
// port, and drops the SYN when the source network has none left. The table
// is the same memory the Go side decides on (a BPF_F_MMAPABLE array mapped
// by package xdp into a limiter.Buckets), so every step here is a copy of
// limiter's: NetworkKey's masking, xxhash64 of the masked bytes, the line
// and subset picked from the hash, ticks from nanoseconds without a
// division, and the charge (the fullest of the key's counters grants, every
// counter pays, one 64-bit compare-and-swap per word). The Go tests run this
// program and limiter side by side and compare every counter.
//
// A SYN it grants is marked in charged, by its addresses and ports, for the
// layer4 matcher to find (and delete) when the connection is accepted: a
// connection is charged by the program if and only if it is marked, so one
// whose SYN the program could not parse is charged by the matcher.
//
// On the UDP ports named for QUIC it charges the same counters, one token,
// for a QUIC Initial that can open a connection (quic_packet, below), and
// remembers the connection in initials so that the client's next Initials
// of it (a ClientHello split over two, a retransmission) pass uncharged,
// until the client's first other long-header packet under the same source
// connection ID (its Handshake packet), HANDSHAKE_WINDOW or FREE_INITIALS
// ends that.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// params is written by the Go side before the program is attached and
// whenever the zone's settings change; the program only reads it.
struct params {
	__u64 epoch;   // CLOCK_MONOTONIC nanoseconds of the table's tick 0
	__u64 mult;    // limiter clock: ⌊2⁶⁴·pe/w⌋
	__u64 pe;      // ticks per token × events
	__u64 w;       // window in nanoseconds
	__u32 cost;    // one token, in ticks (limiter's per)
	__u32 cap;     // burst × per: how far ahead a counter may be and grant
	__u32 ceil;    // 2 × cap: how far ahead a charge may push a counter
	__u32 lines;   // lines in the table
	__u32 nsubs;   // entries of subsets in use: C(16, K)
	__u32 enabled; // 0: pass everything (set while the table is prepared)
	__u32 quic;    // QUIC Initials are limited on some port: see REFUSE
	__u8 mask4[4]; // the zone's IPv4 prefix as a byte mask
	__u8 mask6[16];
	__u64 ports[1024]; // bit p set: SYNs to TCP port p are limited
	__u64 quic_ports[1024]; // bit p set: QUIC Initials to UDP port p are limited
};

// A line is eight 64-bit words of two 32-bit counters each, as in
// limiter/line.go.
struct line {
	__u64 word[8];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct line);
	__uint(max_entries, 1); // set by the Go side to the zone's lines
} table SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct params);
	__uint(max_entries, 1);
} config SEC(".maps");

// subsets[s] is limiter's subset s: the counters in bits 0–15, the words
// holding them in bits 16–23. The Go side fills it from limiter.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 12870); // C(16, 8), the most a K allows
} subsets SEC(".maps");

// charged marks the SYNs the program granted, by their flow: the source
// and destination addresses (an IPv4 address as ::ffff:a.b.c.d) and the
// ports, as the accepted socket will show them. The matcher looks a
// connection up and deletes its mark (Table.Charged); a mark it does not
// find means the program did not charge the connection (it could not parse
// its SYN, or the mark was evicted by CHARGED_MARKS granted SYNs since),
// and the matcher charges it: a connection is charged once, or at worst
// twice, never by neither side.
struct flow {
	__u8 saddr[16];
	__u8 daddr[16];
	__u8 sport[2], dport[2]; // network order
};

#define CHARGED_MARKS 65536

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct flow);
	__type(value, __u8);
	__uint(max_entries, CHARGED_MARKS);
} charged SEC(".maps");

enum stat {
	STAT_PASSED,    // SYNs to a limited port that took a token
	STAT_DROPPED,   // SYNs to a limited port that found none
	STAT_CONTENDED, // of the dropped SYNs and Initials: given up after losing MAX_DECIDE races
	STAT_QUIC_PASSED,  // QUIC Initials of a new connection that took a token
	STAT_QUIC_DROPPED, // QUIC Initials of a new connection that found none, and the REFUSEd packets
	STAT_MAX,
};

// initials remembers the QUIC connections the program charged, by the
// client's address and port, the server's port and the Initials'
// destination connection ID (DCID), so that the connection's next Initials under that DCID pass
// uncharged: a ClientHello split over two Initials, a retransmission. Every
// charged Initial is remembered so, and only so: a key of the address and
// port alone once let every Initial from them under a token and a short
// DCID pass free, and quic-go opens a connection for each. So a client's
// Initials under a new DCID and a token (after the server's first Initial,
// when a Retry or NEW_TOKEN gave it a token) cost its connection a second
// token (through a Retry, a third: its ACK of the server's Initial under
// the server's connection ID carries the token too). It is a fixed-size LRU map: an entry evicted by newer ones (about
// INITIAL_IDS connections charged after it; the kernel's LRU lists are per
// CPU, so a few fewer on a loaded host) lets its connection's next Initial
// be charged again. Both err towards limiting: a connection costs one
// token or two, and no Initial that can open a connection passes
// unremembered and uncharged.
//
// An entry's free pass ends at the first of three (struct pass): the
// client's first datagram from the entry's address and port, under the
// SCID of the Initial that made the entry the latest, that starts with a
// long-header packet other than an Initial that opens a connection (its
// Handshake packet, or a 0-RTT packet with something coalesced behind it:
// ENDS_PASS, latest below), HANDSHAKE_WINDOW after the charge,
// FREE_INITIALS Initials passed. Then the next Initial under the DCID is
// charged as a new connection's (and, granted, starts a new pass). A
// client that opens its connections from an address and port (as a
// browser or quic-go does, one after another or several at once, each
// under a SCID of its own) pays one token for each, even if it sends every
// one under the same DCID (quic-go retires a client's first DCID a few
// round trips after the handshake, and then takes an Initial under it for
// a new connection; a free pass without an end let such a client open up
// to 16 for a token). The hostile client's bound is 1 + FREE_INITIALS
// connections a token, within HANDSHAKE_WINDOW of the charge: one that
// receives the server's replies and sends its Handshake packets from
// another address or port, or under another SCID than its Initials'
// (quic-go's server takes them), or interleaves the handshakes of several
// connections from one address, port and SCID. A
// blind spoofer completes no handshake, so it ends no pass and quic-go
// routes its Initials under a DCID to the connection the first opened for
// as long as that connection lives (the bound holds for it too). The
// server's port is in the key because each QUIC port is
// a socket of its own, where quic-go opens a connection of its own under
// the same DCID; the server's address is not (16 bytes more a key): a
// server listening on several addresses of one port on separate sockets
// lets a token open a handshake on each.
struct initial_id {
	__u8 saddr[16]; // an IPv4 address as ::ffff:a.b.c.d
	__u8 sport[2];  // network order
	__u8 dport[2];  // the server's port, network order: each QUIC port's socket opens its own connection
	__u8 dcid_len;
	__u8 dcid[20];
	__u8 pad[7];    // zero: the key is hashed and compared whole
} __attribute__((aligned(8))); // compared in words: to_latest

// quic_attempt is a client's long-header packet as the program reads it:
// the id of its connection (an Initial's, or the address and ports alone)
// and where its SCID is in the packet, which keys latest with the address
// and port. The SCID is read out of the packet only where latest is used
// (latest_key), into the key, not kept here: this is on the program's
// stack, under every call it makes (see to_latest).
struct quic_attempt {
	struct initial_id id;
	__u16 scid_at; // where the SCID's length byte is, from the packet's start
};

#define INITIAL_IDS 65536

// FREE_INITIALS is how many Initials a charged connection's entry lets
// pass free: a ClientHello split over two and its retransmissions through
// quic-go's handshake timeout fit. A quic-go client whose server never
// answers sends 9 or 10 first-flight Initials in those 5 s (8 or 9 free;
// TestAFairClientsRetransmittedInitialsPassFree); the rest is margin for
// clients that retransmit sooner or split their ClientHello in three.
#define FREE_INITIALS 16

// HANDSHAKE_WINDOW is how long after its charge an entry lets Initials
// pass free, in nanoseconds: quic-go's handshake idle timeout (5 s, which
// Caddy keeps), after which neither side of a handshake that made no
// progress goes on with it.
#define HANDSHAKE_WINDOW 5000000000ULL

// pass is an entry's value: when its connection was charged (nanoseconds
// on the table's clock: pass_clock) and how many Initials it let pass free
// since.
struct pass {
	__u64 at;
	__u32 free;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct initial_id);
	__type(value, struct pass);
	__uint(max_entries, INITIAL_IDS);
} initials SEC(".maps");

// latest holds, for a client's address, port and source connection ID
// (SCID), the id of the Initial most recently charged or passed free from
// them under that SCID, so that the client's Handshake packet from there
// under that SCID deletes its entry in initials (to_latest): RFC 9000 §7.2,
// a client sends Handshake packets only after the server's first Initial,
// and from then on sends every packet under the server's connection ID,
// never again an Initial under its first DCID; and it keeps its SCID on
// every long-header packet of the connection (§7.2, §17.2: the server
// answers to it, and checks it against the initial_source_connection_id
// transport parameter, §7.3). Any datagram from there that starts with
// another long-header packet than an Initial that opens a connection does
// the same (ENDS_PASS): quic-go's server reads every packet of a datagram
// under the first one's DCID, whatever their type and order, so a
// Handshake packet looked for by type and place could be hidden behind a
// junk 0-RTT packet or a second Initial. The SCID is in the key so that
// one connection's packets end its own pass and no other's: quic-go (as
// http3's client) dials connection after connection over one UDP socket,
// each under a fresh random SCID (4 bytes), and the previous connection's
// late Handshake packets from the same port (its close, its answers to
// the server's retransmissions) ended the new connection's pass, keyed by
// address and port alone, so that the new one's retransmitted Initial was
// charged again: up to 4 tokens a dial, 40 for 12 with the client reading
// 150 ms late. A client with a zero-length SCID (quic-go's single-use
// quic.Dial, one connection per socket) has one entry per address and
// port, as before. quic-go's server does not check the SCID of a
// Handshake packet, so a client can keep its pass by sending its
// Handshake packets under another SCID, as it can by sending them from
// another port: the pass then ends by time or count (initials). The entry
// stays (an Initial charged or passed from there overwrites it), so that
// such a packet never races an Initial's write into deleting the wrong
// pointer; it is as large as initials, and an entry evicted from it leaves
// its pass to end by time or count. A packet from another address, port
// or SCID ends nothing of the client's connection: each has its own
// latest.
struct client {
	__u8 saddr[16];
	__u8 sport[2];
	__u8 scid_len;
	__u8 scid[20]; // zero past scid_len
	__u8 pad;      // zero: the key is hashed and compared whole
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct client);
	__type(value, struct initial_id);
	__uint(max_entries, INITIAL_IDS);
} latest SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, STAT_MAX);
} stats SEC(".maps");

// ---- xxhash64 of 5 and 17 bytes (cespare/xxhash, seed 0) ----

#define P1 11400714785074694791ULL
#define P2 14029467366897019727ULL
#define P3 1609587929392839161ULL
#define P4 9650029242287828579ULL
#define P5 2870177450012600261ULL

static __always_inline __u64 rotl(__u64 x, int r) { return (x << r) | (x >> (64 - r)); }

static __always_inline __u64 xxh_round(__u64 acc, __u64 input)
{
	acc += input * P2;
	acc = rotl(acc, 31);
	return acc * P1;
}

static __always_inline __u64 xxh_avalanche(__u64 h)
{
	h ^= h >> 33;
	h *= P2;
	h ^= h >> 29;
	h *= P3;
	h ^= h >> 32;
	return h;
}

static __always_inline __u64 xxh_word(__u64 h, __u64 k)
{
	h ^= xxh_round(0, k);
	return rotl(h, 27) * P1 + P4;
}

static __always_inline __u64 xxh_half(__u64 h, __u32 k)
{
	h ^= (__u64)k * P1;
	return rotl(h, 23) * P2 + P3;
}

static __always_inline __u64 xxh_byte(__u64 h, __u8 b)
{
	h ^= (__u64)b * P5;
	return rotl(h, 11) * P1;
}

// Keys are limiter.NetKey bytes: a family tag (4 or 6), then the masked
// address. Words are read little-endian, as xxhash does.
static __always_inline __u64 le64(const __u8 *b)
{
	__u64 v = 0;
#pragma clang loop unroll(full)
	for (int i = 7; i >= 0; i--)
		v = v << 8 | b[i];
	return v;
}

static __always_inline __u64 xxh64_key5(const __u8 *b)
{
	__u64 h = P5 + 5;
	h = xxh_half(h, (__u32)b[0] | (__u32)b[1] << 8 | (__u32)b[2] << 16 | (__u32)b[3] << 24);
	h = xxh_byte(h, b[4]);
	return xxh_avalanche(h);
}

static __always_inline __u64 xxh64_key17(const __u8 *b)
{
	__u64 h = P5 + 17;
	h = xxh_word(h, le64(b));
	h = xxh_word(h, le64(b + 8));
	h = xxh_byte(h, b[16]);
	return xxh_avalanche(h);
}

// ---- the clock: limiter/limit.go's ticks, with 64×64→128 products ----

// mul64 is bits.Mul64: the 128-bit product of a and b, from 32-bit halves
// (BPF has no wider multiply).
static __always_inline void mul64(__u64 a, __u64 b, __u64 *hi, __u64 *lo)
{
	__u64 a0 = a & 0xffffffff, a1 = a >> 32;
	__u64 b0 = b & 0xffffffff, b1 = b >> 32;
	__u64 w0 = a0 * b0;
	__u64 t = a1 * b0 + (w0 >> 32);
	__u64 w1 = t & 0xffffffff, w2 = t >> 32;
	w1 += a0 * b1;
	*hi = a1 * b1 + w2 + (w1 >> 32);
	*lo = a * b;
}

// ticks_hi is ticks(ns) or one less, cheaper: the high half of ns·mult.
static __always_inline __u64 ticks_hi(const struct params *p, __u64 ns)
{
	__u64 hi, lo;
	mul64(ns, p->mult, &hi, &lo);
	return hi;
}

// ticks is limiter's clock.ticks: ⌊ns·pe/w⌋ exactly, as the high half of
// ns·mult (that or one less) and one comparison of 128-bit products.
static __always_inline __u64 ticks(const struct params *p, __u64 ns)
{
	__u64 tick, unused, xh, xl, th, tl;
	mul64(ns, p->mult, &tick, &unused);
	mul64(ns, p->pe, &xh, &xl);
	mul64(tick + 1, p->w, &th, &tl);
	if (th < xh || (th == xh && tl <= xl))
		tick++;
	return tick;
}

// ---- counters: limiter/line.go and buckets.go ----

static __always_inline __u32 ahead_of(__u32 v, __u32 now)
{
	__u32 d = v - now;
	if (v == 0 || (__s32)d <= 0)
		return 0;
	return d;
}

// valid is limiter's valid: 0 marks a full counter and a word of two
// 0xFFFFFFFF is FROZEN (below), so a value that would be either is stored
// as 1, a tick or two later, against the key. Letting 0xFFFFFFFF through
// froze a word whose two counters were the key's and ended there: the
// program then dropped the key's SYNs for good.
static __always_inline __u32 valid(__u32 v) { return v + 1 < 2 ? 1 : v; }

static __always_inline __u32 store(__u32 now, __u32 ahead) { return valid(now + ahead); }

// charge_lane is limiter's chargeLane: the counter charged cost, up to ceil
// ticks ahead; *shortfall gets what did not fit.
static __always_inline __u32 charge_lane(__u32 v, __u32 cost, __u32 ceil, __u32 now, __u32 *shortfall)
{
	__u32 base = ahead_of(v, now);
	__u32 room = ceil - (base < ceil ? base : ceil);
	__u32 add = cost < room ? cost : room;
	if (add == 0) {
		*shortfall = cost;
		return v;
	}
	*shortfall = cost - add;
	return store(now, base + add);
}

static __always_inline __u32 refund_lane(__u32 v, __u32 paid)
{
	if (v == 0 || paid == 0)
		return v;
	return valid(v - paid);
}

static __always_inline __u32 lane_of(__u64 w, int l) { return l ? (__u32)(w >> 32) : (__u32)w; }

static __always_inline __u64 with_lane(__u64 w, int l, __u32 v)
{
	if (l)
		return (w & 0xffffffffULL) | (__u64)v << 32;
	return (w & ~0xffffffffULL) | v;
}

// A decision that loses a compare-and-swap to another CPU takes back what it
// charged and decides again, at most MAX_DECIDE times; then the SYN is
// dropped (see STAT_CONTENDED): bounded work per packet, and never a grant
// that was not checked.
#define MAX_DECIDE 16

enum verdict { UNDECIDED, GRANT, DENY, CONTENDED };

// FROZEN is limiter's frozen marker: Go's SetLimitOver swaps it into every
// word of this table as it converts the counters into the next table, whose
// program replaces this one when the conversion is over. A frozen word is
// neither granted from nor written: its SYN is dropped (its client sends it
// again a second later, to the next table), and a charge already made to
// another word of the key stays there, converted (a token lost, never one
// granted).
#define FROZEN 0xffffffffffffffffULL

// A decision's state. Every loop runs through bpf_loop, whose callback the
// verifier checks on its own, and no callback retries a CAS: a decision
// that loses one starts over. Inline loops with retries made the verifier
// walk every path through eight words (over a million instructions).
struct decision {
	struct line *ln;
	__u32 counters; // the key's counters (limiter's subset.counters)
	__u32 cost, cap, ceil, now;
	__u32 best;     // how far ahead the fullest counter is
	__u32 fw, fl;   // the fullest counter's word and lane
	__u32 lost;     // a charge lost its CAS
	__u32 pending;  // words still to refund
	__u32 verdict;
	__u32 frozen;   // a word held FROZEN
	__u64 vals[8];  // the words as loaded
	__u32 paid[16]; // ticks charged to lane l of word w, at 2w+l
};

static __always_inline __u32 lanes_of(const struct decision *d, __u32 w) { return d->counters >> (2 * (w & 7)) & 3; }

// load_word reads word w and notes the fullest of the key's counters in it.
static long load_word(__u32 w, void *ctx)
{
	struct decision *d = ctx;
	w &= 7;
	__u32 lanes = lanes_of(d, w);
	if (!lanes)
		return 0;
	__u64 v = *(volatile __u64 *)&d->ln->word[w];
	d->vals[w] = v;
	if (v == FROZEN) {
		d->frozen = 1;
		return 1;
	}
	if (lanes & 1) {
		__u32 a = ahead_of((__u32)v, d->now);
		if (a < d->best) {
			d->best = a;
			d->fw = w;
			d->fl = 0;
		}
	}
	if (lanes & 2) {
		__u32 a = ahead_of((__u32)(v >> 32), d->now);
		if (a < d->best) {
			d->best = a;
			d->fw = w;
			d->fl = 1;
		}
	}
	return 0;
}

// charge_word is limiter's chargeWord for word w of the key (the fullest's
// word excepted): cost to each of the key's lanes, up to ceil ahead, with
// one CAS against the word as loaded.
static long charge_word(__u32 w, void *ctx)
{
	struct decision *d = ctx;
	w &= 7;
	__u32 lanes = lanes_of(d, w);
	if (!lanes || w == d->fw)
		return 0;
	__u64 v = d->vals[w], nv = v;
	__u32 s0 = 0, s1 = 0;
	if (lanes & 1)
		nv = with_lane(nv, 0, charge_lane(lane_of(v, 0), d->cost, d->ceil, d->now, &s0));
	if (lanes & 2)
		nv = with_lane(nv, 1, charge_lane(lane_of(v, 1), d->cost, d->ceil, d->now, &s1));
	if (nv != v && __sync_val_compare_and_swap(&d->ln->word[w], v, nv) != v) {
		d->lost = 1;
		return 1;
	}
	d->paid[2 * w] = (lanes & 1) ? d->cost - s0 : 0;
	d->paid[2 * w + 1] = (lanes & 2) ? d->cost - s1 : 0;
	d->pending |= 1 << w;
	return 0;
}

// refund_word is one try of limiter's refund of the pending word i mod 8:
// paid ticks back from each of its lanes. Refunds must happen, so the
// caller runs it over every word MAX_DECIDE times; one given up after that
// leaves counters charged: tokens lost, never granted.
static long refund_word(__u32 i, void *ctx)
{
	struct decision *d = ctx;
	__u32 w = i & 7;
	if (!d->pending)
		return 1;
	if (!(d->pending >> w & 1))
		return 0;
	__u32 lanes = lanes_of(d, w);
	__u64 v = *(volatile __u64 *)&d->ln->word[w], nv = v;
	if (v == FROZEN) { // converted with the charge: nothing to give back here
		d->pending &= ~(1u << w);
		return 0;
	}
	if (lanes & 1)
		nv = with_lane(nv, 0, refund_lane(lane_of(v, 0), d->paid[2 * w]));
	if (lanes & 2)
		nv = with_lane(nv, 1, refund_lane(lane_of(v, 1), d->paid[2 * w + 1]));
	if (nv == v || __sync_val_compare_and_swap(&d->ln->word[w], v, nv) == v)
		d->pending &= ~(1u << w);
	return 0;
}

// charge_fullest is one try of limiter's chargeFullest: cost to the
// fullest counter if it still has room, and to the key's other lane of its
// word, in the CAS that grants.
static __always_inline int charge_fullest(struct decision *d)
{
	__u32 fw = d->fw & 7, fl = d->fl & 1, o = fl ^ 1;
	__u64 v = d->vals[fw];
	__u32 a = ahead_of(lane_of(v, fl), d->now);
	if (a + d->cost > d->cap)
		return 0;
	__u64 nv = with_lane(v, fl, store(d->now, a + d->cost));
	__u32 s = 0;
	if (lanes_of(d, fw) >> o & 1)
		nv = with_lane(nv, o, charge_lane(lane_of(v, o), d->cost, d->ceil, d->now, &s));
	return __sync_val_compare_and_swap(&d->ln->word[fw], v, nv) == v;
}

// decide_once is one decision: the fullest of the key's counters (the
// first of equals, in counter order) must hold cost ticks of room; the
// others pay first, the fullest last, with the CAS that grants. A decision
// that loses a CAS, or finds the fullest drained at its CAS, takes back its
// charges and lets the next try decide again.
static long decide_once(__u32 i, void *ctx)
{
	struct decision *d = ctx;
	d->best = 0xffffffff;
	d->fw = 0;
	d->fl = 0;
	bpf_loop(8, load_word, d, 0);
	if (d->frozen || d->best + d->cost > d->cap) {
		d->verdict = DENY;
		return 1;
	}
	d->lost = 0;
	d->pending = 0;
	bpf_loop(8, charge_word, d, 0);
	if (!d->lost && charge_fullest(d)) {
		d->verdict = GRANT;
		return 1;
	}
	bpf_loop(8 * MAX_DECIDE, refund_word, d, 0);
	return 0;
}

// take is limiter's decide for a weight of one, committing.
static __noinline enum verdict take(struct line *ln, __u32 counters, const struct params *p, __u32 now)
{
	struct decision d = {.ln = ln, .counters = counters, .cost = p->cost, .cap = p->cap, .ceil = p->ceil, .now = now};
	bpf_loop(MAX_DECIDE, decide_once, &d, 0);
	return d.verdict == UNDECIDED ? CONTENDED : d.verdict;
}

// denied_at is the deny of decide_once without its loops and calls, for
// the flood's fast path: whether the fullest of the key's counters in ln
// (counters as in struct decision) holds less than cost ticks of room at
// now, or a word of the key is FROZEN. It is straight-line arithmetic (no
// branch per word or lane), so the verifier walks it once.
static __noinline int denied_at(const struct line *ln, __u32 counters, const struct params *p, __u32 now)
{
	__u64 best = 0xffffffff, frozen = 0;
#pragma clang loop unroll(full)
	for (int w = 0; w < 8; w++) {
		__u64 v = *(volatile __u64 *)&ln->word[w];
		__u64 lanes = counters >> (2 * w) & 3;
		// in_key: all ones if the word holds a counter of the key.
		__u64 in_key = (__s64)(-(__s64)lanes) >> 63;
		__u64 nv = ~v;
		frozen |= ~((__s64)(nv | -nv) >> 63) & in_key; // v == FROZEN
#pragma clang loop unroll(full)
		for (int l = 0; l < 2; l++) {
			__u64 c = l ? v >> 32 : v & 0xffffffff;
			__s64 d = (__s32)((__u32)c - now);
			// ahead_of: d if the counter is set and ahead, else 0.
			__u64 ahead = (__u64)(__u32)d & ((__s64)(-d) >> 63) & ((__s64)(-(__s64)c) >> 63);
			// A lane not of the key counts as empty (never the fullest).
			ahead |= ~((__s64)(-(__s64)(lanes >> l & 1)) >> 63) & 0xffffffff;
			__s64 diff = (__s64)ahead - (__s64)best;
			best += diff & (diff >> 63); // min(best, ahead)
		}
	}
	return frozen || best + p->cost > p->cap;
}

static __always_inline void count(enum stat s)
{
	__u32 k = s;
	__u64 *c = bpf_map_lookup_elem(&stats, &k);
	if (c)
		*c += 1;
}

// COARSE_LAG bounds how far CLOCK_MONOTONIC_COARSE (bpf_ktime_get_coarse_ns,
// the time of the last timer tick, a few nanoseconds to read) lags
// CLOCK_MONOTONIC (bpf_ktime_get_ns, tens of nanoseconds under a
// hypervisor's clock): a timer tick or a few, 1 to 4 ms each; 100 ms is far
// beyond. A SYN denied at the coarse time plus COARSE_LAG, no earlier than
// now, is denied now without reading the precise clock; any other SYN is
// decided on the precise clock.
#define COARSE_LAG 100000000ULL

// probe is a 17-byte key and its length (5 or 17) in, and the program's
// readings out: the hash, and the tick of a given time.
struct probe {
	__u8 key[17];
	__u8 len;
	__u8 pad[6];
	__u64 ns;   // in: a time on the table's clock
	__u64 hash; // out
	__u64 tick; // out: ticks(ns)
	__u64 mono; // out: bpf_ktime_get_ns
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct probe);
	__uint(max_entries, 1);
} probes SEC(".maps");

// mark records that the SYN of flow f was charged here (see charged).
static __always_inline void mark(const struct flow *f)
{
	__u8 one = 1;
	bpf_map_update_elem(&charged, f, &one, BPF_ANY);
}

// pass_clock is the time for initials' passes: nanoseconds on the table's
// clock, the coarse one (a pass is timed in seconds), or probes[0].ns for
// the tests' synlimit_at.
static __always_inline __u64 pass_clock(const struct params *p, int at_probe)
{
	if (at_probe) {
		__u32 zero = 0;
		struct probe *pr = bpf_map_lookup_elem(&probes, &zero);
		return pr ? pr->ns : 0;
	}
	__u64 ns = bpf_ktime_get_coarse_ns();
	return ns > p->epoch ? ns - p->epoch : 0;
}

// limit decides a connection attempt from its source key's hash: GRANT,
// DENY, or UNDECIDED for one to pass unlimited (the maps failed, which they
// do not).
static __always_inline int limit(const struct params *p, __u64 h, int at_probe)
{
	__u32 idx = (__u32)(((__u64)(__u32)(h >> 32) * p->lines) >> 32);
	__u32 s = (__u32)(((__u64)(__u32)h * p->nsubs) >> 32);
	struct line *ln = bpf_map_lookup_elem(&table, &idx);
	__u32 *sub = bpf_map_lookup_elem(&subsets, &s);
	if (!ln || !sub)
		return UNDECIDED;
	__u32 counters = *sub & 0xffff;
	__u64 ns;
	if (at_probe) {
		__u32 zero = 0;
		struct probe *pr = bpf_map_lookup_elem(&probes, &zero);
		if (!pr)
			return UNDECIDED;
		ns = pr->ns;
	} else {
		ns = bpf_ktime_get_coarse_ns() + COARSE_LAG;
		ns = ns > p->epoch ? ns - p->epoch : 0;
	}
	// The flood's fast path: denied at a time no earlier than now, denied
	// now (a counter only gains room as time goes on).
	if (denied_at(ln, counters, p, (__u32)(ticks_hi(p, ns) + 1)))
		return DENY;
	if (!at_probe) {
		ns = bpf_ktime_get_ns();
		ns = ns > p->epoch ? ns - p->epoch : 0;
	}
	__u32 now = (__u32)ticks(p, ns);
	switch (take(ln, counters, p, now)) {
	case GRANT:
		return GRANT;
	case CONTENDED:
		count(STAT_CONTENDED);
		/* fallthrough */
	default:
		return DENY;
	}
}

static __always_inline int port_in(const __u64 *set, __be16 port)
{
	__u16 pt = bpf_ntohs(port);
	return set[(pt >> 6) & 1023] >> (pt & 63) & 1;
}

static __always_inline int limited_syn(const struct params *p, const struct tcphdr *tcp)
{
	return tcp->syn && !tcp->ack && port_in(p->ports, tcp->dest);
}

// REFUSE is a packet dropped unparsed, when the zone limits QUIC: a first
// fragment of a UDP datagram to a QUIC port (or whose UDP header it does
// not hold), and a packet whose headers the program cannot walk to its
// transport header (more VLAN tags or IPv6 extension headers than it
// walks). Nothing behind the program charges QUIC, and the kernel would
// deliver an Initial in either, reassembled or walked, uncharged. RFC 9000
// §14 forbids fragmenting a QUIC datagram, and no client sends such
// chains; for TCP alone the matcher charges what passes, so such packets
// pass when no QUIC port is limited. Counted as dropped Initials.
// ENDS_PASS is a client's long-header packet to a QUIC port that opens no
// connection (its Handshake packet, a 0-RTT packet with something behind
// it: see quic_packet), which ends the free pass of its connection, the
// one latest from its address, port and SCID.
enum attempt { NONE, SYN, INITIAL, REFUSE, ENDS_PASS };

// QUIC (RFC 9000, 9369). An Initial is a long-header packet (the first
// bit set) of version 1 with type 0, or of version 2 with type 1; the
// fixed bit is not checked (RFC 9287 lets a client clear it). What opens a
// connection at the server (quic-go's server.go, as the RFC says) is an
// Initial in a UDP datagram of 1200 bytes or more (RFC 9000 §14.1: a
// client pads every datagram that carries one) whose DCID is 8 to 20 bytes
// (§7.2: a client's first DCID is at least 8), or of any length under a
// token (the answer to a Retry, or a NEW_TOKEN's; quic-go makes a
// connection even when it cannot decode the token). Any other long-header
// packet of version 1 or 2 first in a datagram but a Retry (the server's)
// — a Handshake packet, a 0-RTT packet with anything behind it, an
// Initial under a shorter DCID and no token (a client's ACK of the
// server's Initial) or in a smaller datagram — passes and ends the free
// pass of the client's connection under its SCID (see latest). A 0-RTT
// packet alone in its datagram
// passes and ends nothing (zero_rtt): a resuming client sends it before
// its handshake, and then may retransmit its first Initial. Only 0-RTT is
// let so: every other such packet a client sends after the server's first
// Initial, when its first Initial is retransmitted no more.
// Every other packet — a short header, Retry, version negotiation
// (version 0), an unknown version, a long-header packet whose DCID or SCID
// is longer than 20 bytes, or whose datagram ends less than
// MIN_AFTER_SCID bytes after its SCID (quic_packet) — passes untouched:
// the server drops or routes it without a handshake.
#define QUIC_V1 0x00000001
#define QUIC_V2 0x6b3343cf
#define MIN_INITIAL_DATAGRAM 1200
#define MIN_NEW_DCID 8
#define MAX_CID 20
// MIN_AFTER_SCID is how many bytes a datagram must hold after its first
// packet's SCID for quic-go to read anything in it: the packet's Length
// (a byte or more) and the 20 bytes every packet quic-go decrypts holds
// after its Length (RFC 9001 §5.4.2: the packet number and the header
// protection's sample; quic-go drops a shorter packet undecrypted). A
// shorter datagram has no room for a packet coalesced behind either.
#define MIN_AFTER_SCID (1 + 20)
#define QUIC_HEAD (1 + 4 + 1 + MAX_CID + 1 + MAX_CID + 8)
#define QUIC_INITIAL 0   // long-header types, numbered as in version 1
#define QUIC_0RTT 1
#define QUIC_RETRY 3
// MAX_HEADERS bounds where a UDP header may start, for the verifier: the
// Ethernet, VLAN, IP and extension headers the program walks take less.
#define MAX_HEADERS 16384

// before is all ones if i < n, else 0, without a branch.
static __always_inline __u64 before(__s64 i, __s64 n) { return (__u64)((i - n) >> 63); }

// long_type is the long-header packet at q's type, numbered as in version
// 1 (version 2 numbers them one up, mod 4), in *version its version; -1
// for a short header or another version.
static __always_inline int long_type(const __u8 *q, __u32 *version)
{
	__u32 v = (__u32)q[1] << 24 | (__u32)q[2] << 16 | (__u32)q[3] << 8 | q[4];
	*version = v;
	if (!(q[0] & 0x80) || (v != QUIC_V1 && v != QUIC_V2))
		return -1;
	__u8 type = q[0] >> 4 & 3;
	return v == QUIC_V2 ? (type + 3) & 3 : type;
}

// varint is QUIC's variable-length integer at b (1, 2, 4 or 8 bytes, all
// 8 readable), its length in *n; branch-free, as the loops below.
static __always_inline __u64 varint(const __u8 *b, __s64 *n)
{
	__s64 len = 1 << (b[0] >> 6);
	// 1 to 8, which the verifier is told by the mask (and clang kept from
	// dropping it by the empty asm): a shift by a variable it cannot bound.
	asm volatile("" : "+r"(len));
	len &= 15;
	__u64 v = b[0] & 0x3f;
#pragma clang loop unroll(full)
	for (int i = 1; i < 8; i++) {
		__u64 in = before(i, len);
		v = v << (in & 8) | (b[i] & in);
	}
	*n = len;
	return v;
}

// after_cids returns where the field after the connection IDs of the
// long-header packet at q starts (a 0-RTT packet's Length, an Initial's
// token length), with MIN_AFTER_SCID bytes from it within the packet, and
// in *scid where the SCID's length byte is, with MAX_CID bytes after it
// within the packet (fewer than the first, checked apart for the
// verifier); or NULL for a connection ID longer than MAX_CID (no QUIC
// packet of versions 1 and 2), or a packet that ends before those bytes.
static __always_inline const __u8 *after_cids(const __u8 *q, const void *end, const __u8 **scid)
{
	if ((const void *)(q + 6) > end)
		return 0;
	__u32 dlen = q[5];
	if (dlen > MAX_CID)
		return 0;
	const __u8 *sl = q + 6 + dlen;
	if ((const void *)(sl + 1 + MAX_CID) > end)
		return 0;
	__u32 slen = sl[0];
	if (slen > MAX_CID)
		return 0;
	const __u8 *f = sl + 1 + slen;
	if ((const void *)(f + MIN_AFTER_SCID) > end) // 8 readable, for varint
		return 0;
	*scid = sl;
	return f;
}

// zero_rtt is a 0-RTT packet's kind, first in a datagram of len bytes of
// QUIC at q, whose Length starts at ll (with 8 bytes readable): ENDS_PASS
// if anything follows the packet's Length (a packet coalesced behind it,
// which quic-go reads under its DCID, whatever its type: a Handshake
// packet hidden so), NONE if nothing does. A resuming client sends its
// 0-RTT data before the server's reply, in datagrams of their own (quic-go
// coalesces 0-RTT only behind its Initial), so such a datagram says
// nothing of the handshake's progress, and its first Initial retransmitted
// after one is no new connection. quic-go reads nothing past a packet's
// Length but a coalesced packet, and drops the rest of the datagram at a
// Length that runs past it. A 0-RTT packet has no token field: its Length
// follows the SCID.
static __always_inline int zero_rtt(const __u8 *q, __s64 len, const __u8 *ll)
{
	__s64 n;
	__u64 length = varint(ll, &n);
	__s64 behind = len - (ll - q) - n - (__s64)length; // length < 2^62
	return behind > 0 ? ENDS_PASS : NONE;
}

// copy_scid writes the SCID whose length byte is at sl (≤ MAX_CID, with
// MAX_CID bytes after it within the packet: after_cids) into the key c,
// zero past its length. The copy is branch-free (before(i, n) is all ones if
// i < n): a branch per byte on a length read from the packet would
// multiply the paths the verifier walks by the lengths.
static __always_inline void copy_scid(struct client *c, const __u8 *sl)
{
	__u32 slen = sl[0];
	c->scid_len = slen;
#pragma clang loop unroll(full)
	for (int i = 0; i < MAX_CID; i++)
		c->scid[i] = sl[1 + i] & before(i, slen);
}

// quic_packet looks at the UDP datagram at offset off in the packet:
// INITIAL for a QUIC Initial that can open a connection, with its DCID
// written into qa's id; ENDS_PASS for a client's other long-header packet
// as above; NONE for anything else. For either of the first two, where
// its SCID is goes into qa's scid_at.
// ip_len is the datagram's length as its IP header says (see ip_len). It
// is a global function (see parse), so the verifier walks it once, not
// once for each path through the headers to it: inlined, with a walk to a
// coalesced Handshake packet the program once made, it walked more than a
// million instructions.
__noinline int quic_packet(struct xdp_md *ctx, __u32 off, __u32 ip_len, struct quic_attempt *qa)
{
	const void *data = (void *)(long)ctx->data;
	const void *end = (void *)(long)ctx->data_end;
	if (!qa || off > MAX_HEADERS)
		return NONE;
	const struct udphdr *udp = data + off;
	if ((const void *)(udp + 1) > end)
		return NONE;
	const __u8 *q = (const void *)(udp + 1);
	// The datagram's length is udp->len, which the kernel trims it to (it
	// drops one whose IP payload is shorter), or, for a udp->len of 0, the
	// rest of the IP payload: Linux delivers an IPv6 datagram of length 0
	// so (the jumbogram convention), and drops an IPv4 one.
	__u32 len = bpf_ntohs(udp->len);
	if (!len)
		len = ip_len;
	if ((const void *)(q + 5) > end)
		return NONE;
	__u32 version;
	int type = long_type(q, &version);
	// A Retry (type 3) is the server's; a short header or another version
	// is no client's long-header packet.
	if (type < 0 || type == QUIC_RETRY)
		return NONE;
	// A datagram that ends less than MIN_AFTER_SCID bytes after its first
	// packet's SCID holds nothing quic-go reads and passes as NONE, as
	// does one whose connection IDs are longer than MAX_CID (no packet of
	// versions 1 and 2). (It ended passes from MAX_CID bytes after the
	// SCID's start, or 8 after its end, whichever came later: 1 to 13
	// bytes short of anything quic-go reads.)
	const __u8 *sl;
	const __u8 *after = after_cids(q, end, &sl);
	if (!after)
		return NONE;
	int kind = ENDS_PASS;
	if (type == QUIC_0RTT) {
		kind = zero_rtt(q, (__s64)len - (__s64)sizeof(*udp), after);
	} else if (type == QUIC_INITIAL && len >= sizeof(*udp) + MIN_INITIAL_DATAGRAM &&
		   (const void *)(q + QUIC_HEAD) <= end) {
		// QUIC_HEAD bytes hold every field read here, at their longest:
		// the first byte, version, both connection IDs with their lengths,
		// and an 8-byte token length. The kernel delivers no datagram
		// shorter than its length says, so one of 1200 bytes that holds
		// fewer is not one.
		__u32 dlen = q[5];
		// The token's length, a variable-length integer of 1, 2, 4 or 8
		// bytes, at after: only whether it is zero matters.
		__s64 n;
		__u64 token = varint(after, &n);
		if (dlen >= MIN_NEW_DCID || token) {
			struct initial_id *id = &qa->id;
			id->dcid_len = dlen;
			const __u8 *d = q + 6;
			// Branch-free, as copy_scid.
#pragma clang loop unroll(full)
			for (int i = 0; i < MAX_CID; i++)
				id->dcid[i] = d[i] & before(i, dlen); // within QUIC_HEAD
			kind = INITIAL;
		}
	}
	// The SCID is read only where latest is used (latest_key): the
	// flood's Initials, dropped, need none.
	qa->scid_at = off + sizeof(*udp) + 6 + q[5];
	return kind;
}

// latest_key writes the key in latest of qa's address, port and SCID into
// c, the SCID read out of the packet where quic_packet found it; it
// returns 0, or -1 if it cannot read it (never: a bound for the verifier).
static __always_inline int latest_key(struct xdp_md *ctx, struct client *c, const struct quic_attempt *qa)
{
	const __u8 *data = (void *)(long)ctx->data;
	const void *end = (void *)(long)ctx->data_end;
	__u32 at = qa->scid_at;
	if (at > MAX_HEADERS + 64)
		return -1;
	const __u8 *sl = data + at;
	if ((const void *)(sl + 1 + MAX_CID) > end) // quic_packet read as much
		return -1;
	__builtin_memcpy(c->saddr, qa->id.saddr, 16);
	__builtin_memcpy(c->sport, qa->id.sport, 2);
	copy_scid(c, sl);
	return 0;
}

// What to_latest does for a QUIC packet.
enum latest_op {
	PASSED_FREE, // an Initial passed free within its pass
	CHARGED,     // an Initial that took a token
	ENDED,       // an ENDS_PASS packet
};

// to_latest does what the QUIC packet qa does to latest and initials:
// PASSED_FREE makes the Initial's id the latest of its address, port and
// SCID, if it is not already, which one lookup tells (a split
// ClientHello's second Initial, free, finds its first's id there, and an
// update costs some 100 ns more than a lookup); CHARGED records that the
// Initial's connection was charged here at now (see initials), with none
// of its free Initials passed yet, and makes it the latest; ENDED ends
// the free pass of the Initial latest from the packet's address, port and
// SCID (see latest). It is a function of its own so that the key, with
// its SCID, is in a frame of its own, which only the QUIC packets that
// pass call: the program's frame lies under every call the program makes,
// denied_at's on a dropped SYN included, and a chain of calls must fit
// 512 bytes of stack with each frame rounded up to 32 bytes (Linux before
// 6.9, or with the JIT off; TestEveryCallChainFitsTheStackOfOlderKernels).
// It is static: the verifier checks it at each of its three calls, with op
// known.
static __noinline int to_latest(struct xdp_md *ctx, const struct quic_attempt *qa, __u64 now, int op)
{
	struct client c = {};
	if (latest_key(ctx, &c, qa))
		return 0;
	if (op == ENDED) {
		const struct initial_id *last = bpf_map_lookup_elem(&latest, &c);
		if (!last)
			return 0;
		struct initial_id k;
		__builtin_memcpy(&k, last, sizeof(k)); // a key off the map's value, which may change meanwhile
		bpf_map_delete_elem(&initials, &k);
		return 0;
	}
	if (op == CHARGED) {
		struct pass ps = {.at = now};
		bpf_map_update_elem(&initials, &qa->id, &ps, BPF_ANY);
	} else {
		const __u64 *last = bpf_map_lookup_elem(&latest, &c), *w = (const __u64 *)&qa->id;
		if (last) {
			__u64 diff = 0;
#pragma clang loop unroll(full)
			for (int i = 0; i < sizeof(qa->id) / 8; i++)
				diff |= last[i] ^ w[i];
			if (!diff)
				return 0;
		}
	}
	bpf_map_update_elem(&latest, &c, &qa->id, BPF_ANY);
	return 0;
}

// attempt_id is a SYN's flow or a QUIC packet's id and where its SCID is:
// one or the other, in the same bytes (the program's stack, with the
// table's decision below it, holds no more: see to_latest), both starting
// with the source address.
union attempt_id {
	__u8 saddr[16];
	struct flow f;
	struct quic_attempt q;
};

// attempt looks at the transport header at l4 (protocol proto): a limited
// SYN fills a's flow's ports, a QUIC Initial that opens a connection
// a's id's ports and DCID, an ENDS_PASS packet a's id's ports; it
// returns which, REFUSE for a first fragment (first_frag) of a UDP datagram to a limited QUIC port, or NONE
// for any other packet. ip_len is a UDP datagram's length as its IP header
// says.
static __always_inline int attempt(struct xdp_md *ctx, const struct params *p, __u8 proto, const void *l4, __u32 ip_len, int first_frag, const void *end, union attempt_id *a)
{
	struct flow *f = &a->f;
	struct initial_id *id = &a->q.id;
	if (proto == IPPROTO_TCP) {
		const struct tcphdr *tcp = l4;
		if ((const void *)(tcp + 1) > end || !limited_syn(p, tcp))
			return NONE;
		__builtin_memcpy(f->sport, &tcp->source, 2);
		__builtin_memcpy(f->dport, &tcp->dest, 2);
		return SYN;
	}
	if (proto != IPPROTO_UDP)
		return NONE;
	const struct udphdr *udp = l4;
	if (!p->quic)
		return NONE;
	if ((const void *)(udp + 1) > end)
		return first_frag ? REFUSE : NONE;
	if (!port_in(p->quic_ports, udp->dest))
		return NONE;
	if (first_frag)
		return REFUSE;
	int kind = quic_packet(ctx, (const void *)udp - (void *)(long)ctx->data, ip_len, &a->q);
	if (kind != NONE) {
		__builtin_memcpy(id->sport, &udp->source, 2);
		__builtin_memcpy(id->dport, &udp->dest, 2);
	}
	return kind;
}

// What the program walks through to a SYN's TCP header or an Initial's UDP
// header: at most MAX_VLANS VLAN tags (802.1Q or 802.1ad: a double tag is
// QinQ) and MAX_EXT IPv6 extension headers (hop-by-hop, routing,
// destination options, and a fragment header of a first fragment). Another
// header (ESP, AH, an unknown one), or a fragment that is not the first
// passes unparsed and uncharged: the matcher charges its connection, if it
// makes one; the kernel delivers no UDP behind ESP or AH without a security
// association, nor behind an unknown header, and a later fragment is not
// delivered without its first. A longer chain passes so too, or is REFUSEd
// when the zone limits QUIC. The bounds keep the walk a fixed number of
// steps, as the verifier requires, and are beyond what a real handshake
// carries.
#define MAX_VLANS 2
#define MAX_EXT 6

struct vlan_hdr {
	__be16 tci;
	__be16 proto;
};

static __always_inline int ipv6_ext(__u8 nh)
{
	return nh == IPPROTO_HOPOPTS || nh == IPPROTO_ROUTING || nh == IPPROTO_DSTOPTS || nh == IPPROTO_FRAGMENT;
}

// What ipv6_upper found besides the transport header.
#define WALK_FIRST_FRAG 1 // a fragment header of a first fragment of several
#define WALK_LOST 2       // a chain it cannot walk to its transport header

// ipv6_upper walks the IPv6 extension headers from *nh, the fixed header's
// next header, at cur, and returns the TCP or UDP header with its protocol
// in *nh, or NULL; *walk gets WALK_ flags, *ext the headers' length.
static __always_inline const void *ipv6_upper(__u8 *nh, const void *cur, const void *end, int *walk, __u32 *ext)
{
	__u8 next = *nh;
	for (int i = 0; i < MAX_EXT; i++) {
		if (next == IPPROTO_TCP || next == IPPROTO_UDP)
			break;
		const __u8 *h = cur;
		if (!ipv6_ext(next))
			return 0;
		if ((const void *)(h + 8) > end) { // every extension header is 8 bytes or more
			if (*walk & WALK_FIRST_FRAG) // the chain goes on in a later fragment
				*walk |= WALK_LOST;
			return 0;
		}
		__u32 len = 8;
		if (next == IPPROTO_FRAGMENT) {
			if ((h[2] << 8 | h[3]) & 0xfff8) // an offset: not the first fragment
				return 0;
			if (h[3] & 1) // M: more fragments
				*walk |= WALK_FIRST_FRAG;
		} else {
			len = ((__u32)h[1] + 1) * 8;
		}
		cur += len;
		*ext += len;
		next = h[0];
	}
	if (next != IPPROTO_TCP && next != IPPROTO_UDP) {
		if (ipv6_ext(next))
			*walk |= WALK_LOST;
		return 0;
	}
	*nh = next;
	return cur;
}

// source_key writes the key of a connection attempt's source network into
// key, and the attempt into a (a SYN's flow, or an Initial's source and
// DCID); it returns the key's length (5 or 17) and the attempt's kind in
// *kind, or 0 for any other packet (with *kind REFUSE for one to drop). Both are copied out of the packet, so
// that the paths through the headers meet again here for the verifier.
static __always_inline int source_key(struct xdp_md *ctx, const struct params *p, __u8 *key, union attempt_id *a, int *kind)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return 0;
	__be16 proto = eth->h_proto;
	void *cur = eth + 1;
	for (int i = 0; i < MAX_VLANS; i++) {
		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(ETH_P_8021AD))
			break;
		struct vlan_hdr *vh = cur;
		if ((void *)(vh + 1) > end)
			return 0;
		proto = vh->proto;
		cur = vh + 1;
	}
	if (proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD))
		goto lost;
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = cur;
		if ((void *)(ip + 1) > end || ip->ihl < 5)
			return 0;
		if (ip->frag_off & bpf_htons(0x1fff)) // not the first fragment
			return 0;
		// The transport header is past any options.
		__u32 hl = ip->ihl * 4, tot = bpf_ntohs(ip->tot_len);
		*kind = attempt(ctx, p, ip->protocol, (void *)ip + hl, tot > hl ? tot - hl : 0,
				!!(ip->frag_off & bpf_htons(0x2000)), end, a);
		if (*kind == NONE || *kind == REFUSE)
			return 0;
		__u8 *src = (__u8 *)&ip->saddr;
		a->saddr[10] = a->saddr[11] = 0xff;
		__builtin_memcpy(a->saddr + 12, &ip->saddr, 4);
		if (*kind == SYN) {
			a->f.daddr[10] = a->f.daddr[11] = 0xff;
			__builtin_memcpy(a->f.daddr + 12, &ip->daddr, 4);
		}
		key[0] = 4;
#pragma clang loop unroll(full)
		for (int i = 0; i < 4; i++)
			key[1 + i] = src[i] & p->mask4[i];
		return 5;
	}
	if (proto != bpf_htons(ETH_P_IPV6))
		return 0;
	struct ipv6hdr *ip6 = cur;
	if ((void *)(ip6 + 1) > end)
		return 0;
	__u8 nh = ip6->nexthdr;
	int walk = 0;
	__u32 ext = 0;
	const void *l4 = ipv6_upper(&nh, ip6 + 1, end, &walk, &ext);
	if (!l4) {
		if (walk & WALK_LOST)
			goto lost;
		return 0;
	}
	// A payload length of 0 is a jumbogram's: the datagram's length is
	// then unknown here, and taken as the longest.
	__u32 plen = bpf_ntohs(ip6->payload_len);
	*kind = attempt(ctx, p, nh, l4, !plen ? 0xffff : plen > ext ? plen - ext : 0, walk & WALK_FIRST_FRAG, end, a);
	if (*kind == NONE || *kind == REFUSE)
		return 0;
	__u8 *src = ip6->saddr.in6_u.u6_addr8;
	__builtin_memcpy(a->saddr, src, 16);
	if (*kind == SYN)
		__builtin_memcpy(a->f.daddr, ip6->daddr.in6_u.u6_addr8, 16);
	// ::ffff:a.b.c.d counts as IPv4, as NetworkKey unmaps it.
	int mapped = src[10] == 0xff && src[11] == 0xff;
#pragma clang loop unroll(full)
	for (int i = 0; i < 10; i++)
		mapped = mapped && src[i] == 0;
	if (mapped) {
		key[0] = 4;
#pragma clang loop unroll(full)
		for (int i = 0; i < 4; i++)
			key[1 + i] = src[12 + i] & p->mask4[i];
		return 5;
	}
	key[0] = 6;
#pragma clang loop unroll(full)
	for (int i = 0; i < 16; i++)
		key[1 + i] = src[i] & p->mask6[i];
	return 17;
lost:
	if (p->quic)
		*kind = REFUSE;
	return 0;
}

// A parsed packet: the attempt it makes, if any, and the hash of its
// source network's key.
struct parsed {
	union attempt_id a;
	__u64 hash;
	__u32 kind; // enum attempt
	__u32 pad;
};

// parse fills pd from the packet, under the parameters p (the caller's
// lookup, passed in: a second lookup here cost a nanosecond a packet):
// kind NONE for a packet that is no connection attempt to limit. It is a global function, which the
// verifier checks once on its own: inlined (or static), the decision after
// it was checked again for every path through the headers (each kind of
// packet, family, shape), over a million instructions once QUIC was
// parsed; a global function's caller goes on from one state.
__noinline int parse(struct xdp_md *ctx, const struct params *p, struct parsed *pd)
{
	if (!pd || !p)
		return 0;
	__u8 key[17];
	int kind = NONE;
	int len = source_key(ctx, p, key, &pd->a, &kind);
	if (kind == REFUSE)
		pd->kind = REFUSE;
	if (!len)
		return 0;
	pd->kind = kind;
	if (kind != ENDS_PASS) // which charges nothing
		pd->hash = len == 5 ? xxh64_key5(key) : xxh64_key17(key);
	return 0;
}

// decide_syn is the program: at_probe (a constant) takes the time from
// probes instead of the clock, for the tests' synlimit_at.
static __always_inline int decide_syn(struct xdp_md *ctx, int at_probe)
{
	__u32 zero = 0;
	const struct params *p = bpf_map_lookup_elem(&config, &zero);
	if (!p || !p->enabled)
		return XDP_PASS;
	struct parsed pd = {};
	parse(ctx, p, &pd);
	if (pd.kind == NONE)
		return XDP_PASS;
	if (pd.kind == REFUSE) {
		count(STAT_QUIC_DROPPED);
		return XDP_DROP;
	}
	if (pd.kind == ENDS_PASS) {
		to_latest(ctx, &pd.a.q, 0, ENDED);
		return XDP_PASS;
	}
	// An Initial of a connection charged already passes free, within its
	// pass (see initials).
	if (pd.kind == INITIAL) {
		struct pass *ps = bpf_map_lookup_elem(&initials, &pd.a.q.id);
		if (ps && pass_clock(p, at_probe) - ps->at < HANDSHAKE_WINDOW && ps->free < FREE_INITIALS &&
		    __sync_fetch_and_add(&ps->free, 1) < FREE_INITIALS) {
			to_latest(ctx, &pd.a.q, 0, PASSED_FREE);
			return XDP_PASS;
		}
	}
	int v = limit(p, pd.hash, at_probe);
	if (v == UNDECIDED)
		return XDP_PASS;
	if (pd.kind == SYN) {
		if (v == GRANT)
			mark(&pd.a.f);
		count(v == GRANT ? STAT_PASSED : STAT_DROPPED);
	} else {
		if (v == GRANT) {
			to_latest(ctx, &pd.a.q, pass_clock(p, at_probe), CHARGED);
		}
		count(v == GRANT ? STAT_QUIC_PASSED : STAT_QUIC_DROPPED);
	}
	return v == GRANT ? XDP_PASS : XDP_DROP;
}

SEC("xdp")
int synlimit(struct xdp_md *ctx) { return decide_syn(ctx, 0); }

// ---- test entry points, run with BPF_PROG_TEST_RUN by the Go tests ----

// synlimit_at is synlimit at the time probes[0].ns on the table's clock.
SEC("xdp")
int synlimit_at(struct xdp_md *ctx) { return decide_syn(ctx, 1); }

SEC("xdp")
int probe(struct xdp_md *ctx)
{
	__u32 zero = 0;
	const struct params *p = bpf_map_lookup_elem(&config, &zero);
	struct probe *pr = bpf_map_lookup_elem(&probes, &zero);
	if (!p || !pr)
		return XDP_ABORTED;
	__u8 key[17];
	__builtin_memcpy(key, pr->key, 17);
	pr->hash = pr->len == 5 ? xxh64_key5(key) : xxh64_key17(key);
	pr->tick = ticks(p, pr->ns);
	pr->mono = bpf_ktime_get_ns();
	return XDP_PASS;
}
