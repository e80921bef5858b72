/* The gateway's page table (gateway/core/index_table.py) in C: lookups, placements and a slice
   of page events on the arrays of one table, one event after another, with exactly the result of
   PageTable.add / discard called one by one (gateway/core/index_native.py drives them; the numpy
   code stays as the reference and the fallback). The sets of holders of pages several workers
   hold stay in Python (ints of any width, by id: gateway/core/holder_sets.py): the C loop
   records what Python must do with them. A holder (gateway/core/table_arrays.py): EMPTY, TOMB,
   PENDING (a page joined in this pt_apply call, its set Python's to make), a worker's slot, a
   pair of slots (PAIR + (high << PAIR_BITS) + low), a triple (TRIPLE + C(high, 3) + C(mid, 2) +
   low): both made and undone here, or SHARED + the id of a set of several. The constants are
   holder_sets.py's (tests/gateway/test_holder_sets.py compares them). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EMPTY (-3)
#define TOMB (-2)
#define PENDING (-1)
#define SHARED (1 << 30)
#define TRIPLE (1 << 29)
#define PAIR (1 << 28)
#define PAIR_BITS 14
#define PAIR_SLOTS (1 << PAIR_BITS)
#define TRIPLE_SLOTS 1477
/* Events between two looks at pt_apply's stop flag: ~5-20 us of work. */
#define STOP_EVERY 64
/* How many keys ahead a loop asks for its home slot's cache lines (a power of two): a table of
   millions of pages is far larger than the caches, so each key's first probe is a miss to
   memory (and its TLB entry); asked for ahead, the misses of consecutive keys overlap instead
   of coming one after another (pt_apply 1.4-1.5x the events/s at 1M and 10M pages, pt_find of a
   64-page lookup 1.2x: prefixcache_bench/gateway_fleet/table.py --baseline c_no_prefetch).
   pt_migrate gains nothing (measured): it reads the old table in order and only writes at
   random. 0: no prefetch (that baseline). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 16
#endif

static const uint64_t MIX = 0x9E3779B97F4A7C15ULL;
/* index_table._MIX_HI: a page hash's second word, multiplied in as it is folded into its key. */
static const uint64_t MIX_HI = 0xC2B2AE3D27D4EB4FULL;

/* index_table._home: the key multiplied, the product's high bits folded into its low. A key is
   the page hash's two words folded into one (index_table.key_of). */
static inline int64_t home(uint64_t key, int64_t cap) {
    uint64_t x = key * MIX;
    return (int64_t)((x ^ (x >> 29)) % (uint64_t)cap);
}

/* Keys[0..n) taken in order, each one's home slot asked for (`ask`) PREFETCH_AHEAD keys
   before it is taken (`home_of`); the homes asked for and not yet taken wait in a ring, so that
   each is computed once. `stamp` NULL: a loop that writes no stamp. */
typedef struct {
    const uint64_t *tkey, *key;
    const int32_t *holder;
    const uint32_t *stamp;
    int64_t cap, n;
    int64_t ring[PREFETCH_AHEAD > 0 ? PREFETCH_AHEAD : 1];
} Ahead;

static inline void ask(Ahead *a, int64_t i) {
#if PREFETCH_AHEAD > 0
    if (i < a->n) {
        int64_t p = a->ring[i & (PREFETCH_AHEAD - 1)] = home(a->key[i], a->cap);
        __builtin_prefetch(&a->holder[p]);
        __builtin_prefetch(&a->tkey[p]);
        if (a->stamp)
            __builtin_prefetch(&a->stamp[p], 1);
    }
#else
    (void)a; (void)i;
#endif
}

/* A loop from key `start` on: asks for the first PREFETCH_AHEAD keys. */
static inline void ask_from(Ahead *a, int64_t start) {
    for (int64_t j = start; j < start + PREFETCH_AHEAD; j++)
        ask(a, j);
}

/* Key i's home, asking for key i + PREFETCH_AHEAD's. */
static inline int64_t home_of(Ahead *a, int64_t i) {
#if PREFETCH_AHEAD > 0
    int64_t p = a->ring[i & (PREFETCH_AHEAD - 1)];
    ask(a, i + PREFETCH_AHEAD);
    return p;
#else
    return home(a->key[i], a->cap);
#endif
}

/* The key's position (-1: absent), probing from its home p; *free gets the first empty or
   deleted position of its path. */
static inline int64_t probe(const uint64_t *tkey, const int32_t *holder, int64_t cap,
                            uint64_t key, int64_t p, int64_t *free) {
    int64_t first_free = -1;
    for (;;) {
        int32_t hv = holder[p];
        if (hv == EMPTY) {
            *free = first_free < 0 ? p : first_free;
            return -1;
        }
        if (hv == TOMB) {
            if (first_free < 0)
                first_free = p;
        } else if (tkey[p] == key) {
            *free = -1;
            return p;
        }
        if (++p == cap)
            p = 0;
    }
}

/* out[i] = position of key i, -1 where absent (PageTable._find_many). */
void pt_find(const uint64_t *tkey, const int32_t *holder, int64_t cap, const uint64_t *key,
             int64_t n, int64_t *out) {
    int64_t free;
    Ahead a = {tkey, key, holder, NULL, cap, n, {0}};
    ask_from(&a, 0);
    for (int64_t i = 0; i < n; i++)
        out[i] = probe(tkey, holder, cap, key[i], home_of(&a, i), &free);
}

/* pt_find, and each key found stamped stamps[i]: a routed request's pages used again
   (PageTable.touch_stamps), in the same pass over the probes. */
void pt_find_touch(const uint64_t *tkey, const int32_t *holder, uint32_t *stamp, int64_t cap,
                   const uint64_t *key, const uint32_t *stamps, int64_t n, int64_t *out) {
    pt_find(tkey, holder, cap, key, n, out);
    for (int64_t i = 0; i < n; i++)
        if (out[i] >= 0)
            stamp[out[i]] = stamps[i];
}

/* Keys known to be absent written with their holders at the first free position of each one's
   path, in order (PageTable._place, and the keys too); out[i] = the position; returns how many
   of them were empty (not deleted) positions: the table's `used` grows by that. */
int64_t pt_place(uint64_t *tkey, int32_t *holder, int64_t cap, const uint64_t *key,
                 const int32_t *holders, int64_t n, int64_t *out) {
    int64_t fresh = 0;
    Ahead a = {tkey, key, holder, NULL, cap, n, {0}};
    ask_from(&a, 0);
    for (int64_t i = 0; i < n; i++) {
        int64_t p = home_of(&a, i);
        while (holder[p] >= PENDING)
            if (++p == cap)
                p = 0;
        fresh += holder[p] == EMPTY;
        tkey[p] = key[i];
        holder[p] = holders[i];
        out[i] = p;
    }
    return fresh;
}

/* The pair of two distinct slots, both below PAIR_SLOTS. */
static inline int32_t pair_of(int32_t a, int32_t b) {
    return a > b ? PAIR + (a << PAIR_BITS) + b : PAIR + (b << PAIR_BITS) + a;
}

static inline int64_t c3(int64_t k) { return k * (k - 1) * (k - 2) / 6; }
static inline int64_t c2(int64_t k) { return k * (k - 1) / 2; }

/* The triple of three distinct slots, all below TRIPLE_SLOTS, in any order. */
static inline int32_t triple_of(int32_t a, int32_t b, int32_t c) {
    int32_t t;
    if (a < b) { t = a; a = b; b = t; }
    if (b < c) { t = b; b = c; c = t; }
    if (a < b) { t = a; a = b; b = t; }
    return (int32_t)(TRIPLE + c3(a) + c2(b) + c);
}

/* A triple's slots, high first: the largest k with C(k, 3) <= its rank, and so on down. */
static inline void triple_slots(int32_t hv, int32_t out[3]) {
    int64_t rank = hv - TRIPLE, lo = 2, hi = TRIPLE_SLOTS - 1;
    while (lo < hi) {  /* the largest k in [lo, hi] with c3(k) <= rank */
        int64_t mid = (lo + hi + 1) / 2;
        if (c3(mid) <= rank) lo = mid; else hi = mid - 1;
    }
    out[0] = (int32_t)lo;
    rank -= c3(lo);
    hi = lo - 1;
    lo = 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (c2(mid) <= rank) lo = mid; else hi = mid - 1;
    }
    out[1] = (int32_t)lo;
    out[2] = (int32_t)(rank - c2(lo));
}

/* Events start..n-1 (store[i] ? add : discard of key i by worker slot[i]), in order, on one
   table (every key of the slice is in it, or absent from both tables: the caller pulled them out
   of an old one and made room for every placement). state = {used, live, clock, pairs, triples},
   updated (pairs, triples: the change in pages held by pairs and by triples).
   delta[slot] += pages the worker gained (stores) or lost (removals) here.
   A page one worker holds that another stores becomes their pair, a pair a third stores their
   triple, and a triple or a pair one of them removes the others' pair or slot, here. What only
   Python can do is recorded, rec[3k..3k+2] = (position, holder before, slot), *nrec of them:
   `slot` joins a page a triple without it, a set or PENDING held (or a pair or slot it cannot
   join in place, a slot being past PAIR_SLOTS or TRIPLE_SLOTS), the holder is now PENDING; its
   set is Python's to make, and the count of `slot`'s delta when new to it. A removal from a
   page a set holds (or PENDING) stops the loop: the return value is its index
   (n when every event is done); Python applies the
   records so far, then that removal, then calls again from the next event.
   Called without the GIL (index_native.apply): a routing decision that wants the router's lock
   meanwhile sets *stop (gateway/core/decisions_first.py); once `before_stop` events are done in
   this call (so that ingest goes on however many decisions come), the loop looks at it every
   STOP_EVERY events and, set, returns with *stopped = 1, every event before the returned index
   applied, for Python to let the decision in and call again from there. */
int64_t pt_apply(uint64_t *tkey, int32_t *holder, uint32_t *stamp, int64_t cap, int64_t *state,
                 const uint64_t *key, const int32_t *slot, const uint8_t *store, int64_t start,
                 int64_t n, int64_t *delta, int64_t *rec, int64_t *nrec,
                 const volatile int64_t *stop, int64_t before_stop, int64_t *stopped) {
    int64_t used = state[0], live = state[1], clock = state[2], pairs = state[3];
    int64_t triples = state[4], k = 0;
    int32_t three[3];
    int64_t i = start;
    Ahead a = {tkey, key, holder, stamp, cap, n, {0}};
    *stopped = 0;
    ask_from(&a, start);
    for (; i < n; i++) {
        if (i - start >= before_stop && (i - start) % STOP_EVERY == 0 && *stop) {
            *stopped = 1;
            break;
        }
        int64_t free, p = probe(tkey, holder, cap, key[i], home_of(&a, i), &free);
        int32_t s = slot[i];
        if (store[i]) {
            clock++;
            if (p < 0) {
                used += holder[free] == EMPTY;
                tkey[free] = key[i];
                holder[free] = s;
                stamp[free] = (uint32_t)clock;
                live++;
                delta[s]++;
                continue;
            }
            stamp[p] = (uint32_t)clock;
            int32_t hv = holder[p];
            if (hv == s)
                continue;
            if (hv >= 0 && hv < PAIR_SLOTS && s < PAIR_SLOTS) {
                holder[p] = pair_of(hv, s);
                pairs++;
                delta[s]++;
                continue;
            }
            if (hv >= PAIR && hv < TRIPLE) {
                int32_t high = (hv - PAIR) >> PAIR_BITS, low = (hv - PAIR) & (PAIR_SLOTS - 1);
                if (high == s || low == s)
                    continue;
                if (high < TRIPLE_SLOTS && s < TRIPLE_SLOTS) {
                    holder[p] = triple_of(high, low, s);
                    pairs--;
                    triples++;
                    delta[s]++;
                    continue;
                }
            } else if (hv >= TRIPLE && hv < SHARED) {
                triple_slots(hv, three);
                if (three[0] == s || three[1] == s || three[2] == s)
                    continue;
            }
            rec[3 * k] = p;
            rec[3 * k + 1] = hv;
            rec[3 * k + 2] = s;
            k++;
            holder[p] = PENDING;
        } else if (p >= 0) {
            int32_t hv = holder[p];
            if (hv == s) {
                holder[p] = TOMB;
                live--;
                delta[s]--;
            } else if (hv >= PAIR && hv < TRIPLE) {
                int32_t high = (hv - PAIR) >> PAIR_BITS, low = (hv - PAIR) & (PAIR_SLOTS - 1);
                if (high == s || low == s) {
                    holder[p] = high == s ? low : high;
                    pairs--;
                    delta[s]--;
                }
            } else if (hv >= TRIPLE && hv < SHARED) {
                triple_slots(hv, three);
                if (three[0] == s || three[1] == s || three[2] == s) {
                    /* the other two, high first: both below TRIPLE_SLOTS < PAIR_SLOTS */
                    int32_t a = three[0] == s ? three[1] : three[0];
                    int32_t b = three[2] == s ? three[1] : three[2];
                    holder[p] = PAIR + (a << PAIR_BITS) + b;
                    triples--;
                    pairs++;
                    delta[s]--;
                }
            } else if (hv == PENDING || hv >= SHARED) {
                break;
            }
        }
    }
    state[0] = used;
    state[1] = live;
    state[2] = clock;
    state[3] = pairs;
    state[4] = triples;
    *nrec = k;
    return i;
}

/* The live slots of an old table in [start, end) moved into the new one (PageTable._step): each
   key written at the first free position of its path there, with its holder and stamp, and its
   old slot made a tombstone (which keeps the old table's other keys reachable). Returns how
   many moved; *fresh gets how many empty positions they took. */
int64_t pt_migrate(const uint64_t *okey, int32_t *oholder, const uint32_t *ostamp,
                   int64_t start, int64_t end, uint64_t *tkey, int32_t *holder, uint32_t *stamp,
                   int64_t cap, int64_t *fresh) {
    int64_t moved = 0, empties = 0;
    for (int64_t q = start; q < end; q++) {
        int32_t hv = oholder[q];
        if (hv < PENDING)
            continue;
        int64_t p = home(okey[q], cap);
        while (holder[p] >= PENDING)
            if (++p == cap)
                p = 0;
        empties += holder[p] == EMPTY;
        tkey[p] = okey[q];
        holder[p] = hv;
        stamp[p] = ostamp[q];
        oholder[q] = TOMB;
        moved++;
    }
    *fresh = empties;
    return moved;
}

/* Tombstones cleared in place (gateway/core/index_sweep.py), a cluster at a time: the slots
   from the first empty one at or after `start` on, `max_slots` of them at least and then to the
   next empty slot, so that every cluster (a run of used slots between two empty ones) is
   whole. A cluster with tombstones is written anew, its live keys in their order, each at the
   first empty slot from its home: every key of a cluster has its home in it (its path holds no
   empty slot), so each lands in it, at or before its old slot, and stays reachable, without the
   tombstones. *end gets the empty slot the sweep stopped at, *scanned how many slots it passed;
   returns the tombstones cleared. */
#define SWEEP_BLOCK 8

int64_t pt_sweep(uint64_t *tkey, int32_t *holder, uint32_t *stamp, int64_t cap,
                 int64_t start, int64_t max_slots, int64_t *end, int64_t *scanned) {
    int64_t q = start % cap, seen = 0, cleared = 0;
    while (holder[q] != EMPTY && seen <= cap) {
        if (++q == cap)
            q = 0;
        seen++;
    }
    /* The step may end at that empty slot already (a step shorter than the cluster it began in),
       as index_sweep.sweep_slots checks before each cluster; else it ends at an empty slot. */
    if (seen < max_slots && seen <= cap) for (;;) {
        /* Blocks of SWEEP_BLOCK slots with no tombstone, none of which could end the step (below
           max_slots, within one round, no wrap), are passed in one test each: a loop the
           compiler vectorises, where tombstones are few (the usual round). */
        while (q + SWEEP_BLOCK < cap && seen + SWEEP_BLOCK < max_slots
               && seen + SWEEP_BLOCK <= cap) {
            int tomb = 0;
            for (int j = 1; j <= SWEEP_BLOCK; j++)
                tomb |= holder[q + j] == TOMB;
            if (tomb)
                break;
            q += SWEEP_BLOCK;
            seen += SWEEP_BLOCK;
        }
        if (++q == cap)
            q = 0;
        seen++;
        int32_t hv = holder[q];
        if (hv == EMPTY) {  /* a cluster's end: the step may stop here */
            if (seen >= max_slots || seen > cap)
                break;
            continue;
        }
        if (hv != TOMB)
            continue;
        /* The cluster's first tombstone: the keys before it stay where they are (each is at
           the first free slot from its home already), those after it are placed anew. */
        for (; hv != EMPTY; hv = holder[q]) {
            holder[q] = EMPTY;
            if (hv == TOMB) {
                cleared++;
            } else {
                int64_t p = home(tkey[q], cap);
                while (holder[p] != EMPTY)
                    if (++p == cap)
                        p = 0;
                holder[p] = hv;
                if (p != q) {
                    tkey[p] = tkey[q];
                    stamp[p] = stamp[q];
                }
            }
            if (++q == cap)
                q = 0;
            seen++;
        }
        if (seen >= max_slots || seen > cap)  /* q: the cluster's end */
            break;
    }
    *end = q;
    *scanned = seen;
    return cleared;
}

/* KvIndex.holders' probes in one call (index_scan.held_masks' rounds, in C). The request's n
   pages (16-byte hashes, packed) are folded into keys as index_table.key_of does, then looked
   up in each table m given (tables[4 m .. 4 m + 3]: its keys', holders' and stamps' addresses
   and its capacity; keys 0: left out) round by round: first_chunk pages, then twice as many each
   round, until the round holding the first page no table holds. Each page found on table m is
   stamped touch[m] - i where touch[m] >= 0 (a routed request's pages used again).
   Out: the pages held anywhere from page 0 (*end), cut into segments of pages whose holder
   values are the same on every table: seg[k] is segment k's first page, val[m * stride + k] its
   value on table m (-1: absent there); returns the number of segments. Pages probed: *probed. */
int64_t pt_held(const int64_t *tables, const unsigned char *packed, int64_t n,
                int64_t first_chunk, const int64_t *touch, int64_t *seg, int32_t *val,
                int64_t stride, int64_t *end, int64_t *probed) {
    int64_t start = 0, size = first_chunk, k = 0, held = 0;
    int32_t last[3] = {0, 0, 0};
    while (start < n) {
        int64_t stop = start + size < n ? start + size : n, nowhere = -1;
        for (int64_t i = start; i < stop; i++) {
            uint64_t lo, hi, key;
            int32_t v[3];
            int any = 0;
            memcpy(&lo, packed + 16 * i, 8);
            memcpy(&hi, packed + 16 * i + 8, 8);
            key = lo ^ (hi * MIX_HI);
            for (int m = 0; m < 3; m++) {
                const int64_t *t = tables + 4 * m;
                int64_t free, p;
                v[m] = -1;
                if (!t[0])
                    continue;
                p = probe((const uint64_t *)t[0], (const int32_t *)t[1], t[3], key,
                          home(key, t[3]), &free);
                if (p < 0)
                    continue;
                v[m] = ((const int32_t *)t[1])[p];
                any = 1;
                if (touch[m] >= 0)
                    ((uint32_t *)t[2])[p] = (uint32_t)(touch[m] - i);
            }
            if (nowhere >= 0 || !any) {  /* past the run held anywhere: probed and stamped */
                if (nowhere < 0)
                    nowhere = i;
                continue;
            }
            if (!i || v[0] != last[0] || v[1] != last[1] || v[2] != last[2]) {
                seg[k] = i;
                for (int m = 0; m < 3; m++)
                    val[m * stride + k] = last[m] = v[m];
                k++;
            }
            held = i + 1;
        }
        *probed = stop;
        if (nowhere >= 0)
            break;
        start = stop;
        size *= 2;
    }
    *end = held;
    return k;
}
