/* RoutedPrefixes' pages (gateway/core/routed_prefixes.py) in C: per worker slot an LRU list of
   the page hashes routed to it, bounded by max_pages, and for each page the slots remembering it.
   gateway/core/routed_native.py drives it; routed_prefixes.DictPages stays as the reference and
   the fallback, with the same results (tests/gateway/test_routed_prefixes.py compares them).

   Why C: at 1,000 workers x 4,096 pages the Python store is 4M entries in 256 dicts plus an
   OrderedDict a worker, and a decision's record of ~32 new pages (each evicting an old one) is a
   dozen dict operations a page, each a cache miss: ~55 us of a ~170 us decision.

   Layout. An entry is one (page, slot) pair: its 16-byte key, its slot, its place in the slot's
   LRU list (prev/next) and in the page's list of holders (kprev/knext). Entries live in chunks
   of 2^CHUNK_BITS that are never moved (a new chunk, not a copy, when they run out). Two
   open-addressed tables of entry indexes (-1: empty), linear probing with backward-shift
   deletion (no tombstones, so steady churn never rebuilds a table; only growth does):
     by_pair: (page, slot) -> its entry              membership (record, extend)
     by_page: page -> the first entry of its holders (holders, match)
   Both are split in 2^SHARD_BITS shards by the page's hash (a page's pairs in its page's
   shard), each with 2^bits positions at most half used (pages <= pairs): a growth rehashes one
   shard, 1/256 of the whole, inside a decision (one table of 4M pairs would take ~10 ms). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK_BITS 16
#define CHUNK ((int64_t)1 << CHUNK_BITS)
#define SHARD_BITS 8
#define FIRST_BITS 6 /* a new shard's positions: 2^6 */

static const uint64_t MIX = 0x9E3779B97F4A7C15ULL, MIX_HI = 0xC2B2AE3D27D4EB4FULL,
                      MIX_SLOT = 0x632BE59BD9B4E019ULL;

typedef struct {
    uint64_t lo, hi;
    int32_t slot, prev, next, kprev, knext; /* slot -1: free (next: the next free entry) */
} Entry;

typedef struct {
    int32_t *by_pair, *by_page;
    int64_t live; /* pairs */
    int bits;
} Shard;

typedef struct {
    Entry **chunks;
    int64_t nchunks, top; /* entries ever used: top (below nchunks * CHUNK) */
    int32_t free_entry;
    int64_t max_pages;
    int32_t *head, *tail; /* per slot: most and least recently routed entry */
    int64_t *count, *mark;
    int32_t *alive; /* match's scratch, one per slot */
    int64_t slots_cap, epoch;
    Shard shards[1 << SHARD_BITS];
} Routed;

static inline Entry *at(const Routed *r, int32_t e) {
    return &r->chunks[e >> CHUNK_BITS][e & (CHUNK - 1)];
}

static inline uint64_t page_mix(uint64_t lo, uint64_t hi) { return (lo ^ (hi * MIX_HI)) * MIX; }

static inline Shard *shard_of(Routed *r, uint64_t lo, uint64_t hi) {
    return &r->shards[page_mix(lo, hi) >> (64 - SHARD_BITS)];
}

/* Homes in a shard of 2^bits positions: the page's from the bits after the shard's. */
static inline uint64_t page_home(uint64_t lo, uint64_t hi, int bits) {
    return (page_mix(lo, hi) << SHARD_BITS) >> (64 - bits);
}

static inline uint64_t pair_home(uint64_t lo, uint64_t hi, int32_t slot, int bits) {
    return (((lo ^ (hi * MIX_HI)) + (uint64_t)(uint32_t)slot * MIX_SLOT) * MIX) >> (64 - bits);
}

static inline uint64_t home_of(const Entry *x, int by_pair, int bits) {
    return by_pair ? pair_home(x->lo, x->hi, x->slot, bits) : page_home(x->lo, x->hi, bits);
}

/* The entry of (lo, hi, slot) or -1; *pos its position or the empty one ending its path. */
static int32_t find_pair(const Routed *r, const Shard *sh, uint64_t lo, uint64_t hi,
                         int32_t slot, uint64_t *pos) {
    uint64_t m = ((uint64_t)1 << sh->bits) - 1, p = pair_home(lo, hi, slot, sh->bits);
    for (;; p = (p + 1) & m) {
        int32_t e = sh->by_pair[p];
        const Entry *x;
        if (e < 0 || ((x = at(r, e))->lo == lo && x->hi == hi && x->slot == slot)) {
            *pos = p;
            return e;
        }
    }
}

/* The first holder entry of page (lo, hi) or -1; *pos as find_pair's. */
static int32_t find_page(const Routed *r, const Shard *sh, uint64_t lo, uint64_t hi,
                         uint64_t *pos) {
    uint64_t m = ((uint64_t)1 << sh->bits) - 1, p = page_home(lo, hi, sh->bits);
    for (;; p = (p + 1) & m) {
        int32_t e = sh->by_page[p];
        const Entry *x;
        if (e < 0 || ((x = at(r, e))->lo == lo && x->hi == hi)) {
            *pos = p;
            return e;
        }
    }
}

/* Empties position i of a shard's table, moving later entries of its cluster back so that each
   stays reachable from its home (nothing after i is before its home, cyclically). */
static void table_delete(const Routed *r, Shard *sh, int by_pair, uint64_t i) {
    int32_t *table = by_pair ? sh->by_pair : sh->by_page;
    uint64_t m = ((uint64_t)1 << sh->bits) - 1, j = i;
    table[i] = -1;
    for (;;) {
        j = (j + 1) & m;
        int32_t e = table[j];
        if (e < 0)
            return;
        uint64_t h = home_of(at(r, e), by_pair, sh->bits);
        if (((j - h) & m) >= ((j - i) & m)) {
            table[i] = e;
            table[j] = -1;
            i = j;
        }
    }
}

/* One table of a shard moved into `to` (2^bits positions, all empty). */
static void move_table(const Routed *r, const int32_t *from, int64_t n, int32_t *to, int bits,
                       int by_pair) {
    uint64_t m = ((uint64_t)1 << bits) - 1;
    for (int64_t i = 0; i < n; i++) {
        if (from[i] < 0)
            continue;
        uint64_t p = home_of(at(r, from[i]), by_pair, bits);
        while (to[p] >= 0)
            p = (p + 1) & m;
        to[p] = from[i];
    }
}

/* The shard's tables with 2^bits positions (its entries moved over). -1: no memory. */
static int resize(const Routed *r, Shard *sh, int bits) {
    size_t n = (size_t)1 << bits;
    int32_t *pairs = malloc(n * sizeof(int32_t)), *pages = malloc(n * sizeof(int32_t));
    if (!pairs || !pages) {
        free(pairs);
        free(pages);
        return -1;
    }
    memset(pairs, 0xff, n * sizeof(int32_t));
    memset(pages, 0xff, n * sizeof(int32_t));
    if (sh->by_pair) {
        int64_t old = (int64_t)1 << sh->bits;
        move_table(r, sh->by_pair, old, pairs, bits, 1);
        move_table(r, sh->by_page, old, pages, bits, 0);
        free(sh->by_pair);
        free(sh->by_page);
    }
    sh->by_pair = pairs;
    sh->by_page = pages;
    sh->bits = bits;
    return 0;
}

#define GROW(field, type, n)                                                                  \
    do {                                                                                      \
        void *p_ = realloc(r->field, (size_t)(n) * sizeof(type));                             \
        if (!p_)                                                                              \
            return -1;                                                                        \
        r->field = p_;                                                                        \
    } while (0)

/* A free entry's index (a new chunk when none is left). -1: no memory. */
static int32_t alloc_entry(Routed *r) {
    int32_t e = r->free_entry;
    if (e >= 0) {
        r->free_entry = at(r, e)->next;
        return e;
    }
    if (r->top == r->nchunks * CHUNK) {
        if (r->top + CHUNK > INT32_MAX)
            return -1;
        Entry *chunk = malloc(CHUNK * sizeof(Entry));
        if (!chunk)
            return -1;
        void *p = realloc(r->chunks, (size_t)(r->nchunks + 1) * sizeof(Entry *));
        if (!p) {
            free(chunk);
            return -1;
        }
        r->chunks = p;
        r->chunks[r->nchunks++] = chunk;
    }
    return (int32_t)r->top++;
}

static int grow_slots(Routed *r, int32_t slot) {
    int64_t n = r->slots_cap ? r->slots_cap : 64;
    while (n <= slot)
        n *= 2;
    GROW(head, int32_t, n); GROW(tail, int32_t, n); GROW(count, int64_t, n);
    GROW(mark, int64_t, n); GROW(alive, int32_t, n);
    for (int64_t s = r->slots_cap; s < n; s++) {
        r->head[s] = r->tail[s] = -1;
        r->count[s] = r->mark[s] = 0;
    }
    r->slots_cap = n;
    return 0;
}

void rp_free(void *handle) {
    Routed *r = handle;
    if (!r)
        return;
    for (int64_t c = 0; c < r->nchunks; c++)
        free(r->chunks[c]);
    for (int s = 0; s < 1 << SHARD_BITS; s++) {
        free(r->shards[s].by_pair);
        free(r->shards[s].by_page);
    }
    free(r->chunks); free(r->head); free(r->tail); free(r->count); free(r->mark);
    free(r->alive);
    free(r);
}

void *rp_new(int64_t max_pages) {
    Routed *r = calloc(1, sizeof(Routed));
    if (!r)
        return NULL;
    r->max_pages = max_pages;
    r->free_entry = -1;
    for (int s = 0; s < 1 << SHARD_BITS; s++) {
        if (resize(r, &r->shards[s], FIRST_BITS) < 0) {
            rp_free(r);
            return NULL;
        }
    }
    return r;
}

static void lru_unlink(Routed *r, Entry *x) {
    int32_t p = x->prev, n = x->next;
    if (p >= 0) at(r, p)->next = n; else r->head[x->slot] = n;
    if (n >= 0) at(r, n)->prev = p; else r->tail[x->slot] = p;
}

static void lru_push_front(Routed *r, int32_t e, Entry *x) {
    int32_t h = r->head[x->slot];
    x->prev = -1;
    x->next = h;
    if (h >= 0) at(r, h)->prev = e; else r->tail[x->slot] = e;
    r->head[x->slot] = e;
}

/* The entry out of its slot's list, both tables and its page's holders; onto the free list. */
static void remove_entry(Routed *r, int32_t e) {
    Entry *x = at(r, e);
    Shard *sh = shard_of(r, x->lo, x->hi);
    uint64_t pos;
    lru_unlink(r, x);
    r->count[x->slot]--;
    find_pair(r, sh, x->lo, x->hi, x->slot, &pos);
    table_delete(r, sh, 1, pos);
    sh->live--;
    int32_t kp = x->kprev, kn = x->knext;
    if (kn >= 0)
        at(r, kn)->kprev = kp;
    if (kp >= 0) {
        at(r, kp)->knext = kn;
    } else {
        find_page(r, sh, x->lo, x->hi, &pos);
        if (kn >= 0)
            sh->by_page[pos] = kn; /* same page, same home: the position stays right */
        else
            table_delete(r, sh, 0, pos);
    }
    x->slot = -1;
    x->next = r->free_entry;
    r->free_entry = e;
}

/* A new entry for (lo, hi, slot), known absent: in both tables, first in its slot's list and
   first among its page's holders. -1: no memory. */
static int add_entry(Routed *r, Shard *sh, uint64_t lo, uint64_t hi, int32_t slot) {
    if ((sh->live + 1) * 2 > ((int64_t)1 << sh->bits) && resize(r, sh, sh->bits + 1) < 0)
        return -1;
    int32_t e = alloc_entry(r);
    if (e < 0)
        return -1;
    Entry *x = at(r, e);
    uint64_t pos;
    x->lo = lo;
    x->hi = hi;
    x->slot = slot;
    find_pair(r, sh, lo, hi, slot, &pos);
    sh->by_pair[pos] = e;
    sh->live++;
    int32_t first = find_page(r, sh, lo, hi, &pos);
    x->kprev = -1;
    x->knext = first;
    if (first >= 0)
        at(r, first)->kprev = e;
    sh->by_page[pos] = e;
    lru_push_front(r, e, x);
    r->count[slot]++;
    return 0;
}

/* The prompt with these pages (keys: lo, hi words a page) was routed to `slot`. Deepest page
   first, root last: the root ends most recent, so eviction drops leaves first and what stays is
   a prefix. Then the least recent pages over max_pages go. -1: out of memory. */
int rp_record(void *handle, int32_t slot, const uint64_t *keys, int64_t n) {
    Routed *r = handle;
    if (slot >= r->slots_cap && grow_slots(r, slot) < 0)
        return -1;
    for (int64_t i = n - 1; i >= 0; i--) {
        uint64_t pos, lo = keys[2 * i], hi = keys[2 * i + 1];
        Shard *sh = shard_of(r, lo, hi);
        int32_t e = find_pair(r, sh, lo, hi, slot, &pos);
        if (e >= 0) {
            Entry *x = at(r, e);
            lru_unlink(r, x);
            lru_push_front(r, e, x);
        } else if (add_entry(r, sh, lo, hi, slot) < 0) {
            return -1;
        }
    }
    while (r->count[slot] > r->max_pages)
        remove_entry(r, r->tail[slot]);
    return 0;
}

/* The end of the run of pages remembered for `slot` from position `start` on. */
int64_t rp_extend(void *handle, int32_t slot, const uint64_t *keys, int64_t n, int64_t start) {
    Routed *r = handle;
    uint64_t pos;
    if (slot >= r->slots_cap || r->count[slot] == 0)
        return start;
    for (; start < n; start++) {
        uint64_t lo = keys[2 * start], hi = keys[2 * start + 1];
        if (find_pair(r, shard_of(r, lo, hi), lo, hi, slot, &pos) < 0)
            break;
    }
    return start;
}

/* The slots remembering page (lo, hi), most recent holder first; returns how many there are
   (out gets the first `cap` of them). */
int64_t rp_holders(void *handle, uint64_t lo, uint64_t hi, int32_t *out, int64_t cap) {
    Routed *r = handle;
    uint64_t pos;
    int64_t k = 0;
    for (int32_t e = find_page(r, shard_of(r, lo, hi), lo, hi, &pos); e >= 0;
         e = at(r, e)->knext, k++)
        if (k < cap)
            out[k] = at(r, e)->slot;
    return k;
}

static int by_slot(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Marks the slots holding page (lo, hi) with `epoch`. */
static void mark_holders(Routed *r, uint64_t lo, uint64_t hi, int64_t epoch) {
    uint64_t pos;
    for (int32_t e = find_page(r, shard_of(r, lo, hi), lo, hi, &pos); e >= 0; e = at(r, e)->knext)
        r->mark[at(r, e)->slot] = epoch;
}

/* The leading pages each slot remembers, as (out_slot[k], out_end[k]) for the k returned, in
   the order the runs end (ascending slots within a page); slots matching no page are absent.
   out_* hold one per slot (rp_slots). */
int64_t rp_match(void *handle, const uint64_t *keys, int64_t n, int32_t *out_slot,
                 int64_t *out_end) {
    Routed *r = handle;
    int64_t alive = 0, k = 0;
    if (n == 0)
        return 0;
    alive = rp_holders(r, keys[0], keys[1], r->alive, r->slots_cap);
    qsort(r->alive, (size_t)alive, sizeof(int32_t), by_slot);
    for (int64_t i = 1; i < n && alive; i++) {
        int64_t epoch = ++r->epoch, kept = 0;
        mark_holders(r, keys[2 * i], keys[2 * i + 1], epoch);
        for (int64_t j = 0; j < alive; j++) {
            int32_t s = r->alive[j];
            if (r->mark[s] == epoch) {
                r->alive[kept++] = s;
            } else {
                out_slot[k] = s;
                out_end[k++] = i;
            }
        }
        alive = kept;
    }
    for (int64_t j = 0; j < alive; j++) {
        out_slot[k] = r->alive[j];
        out_end[k++] = n;
    }
    return k;
}

/* Slot capacity (the size match's outputs need); makes room for `slot` first. -1: no memory. */
int64_t rp_slots(void *handle, int32_t slot) {
    Routed *r = handle;
    if (slot >= r->slots_cap && grow_slots(r, slot) < 0)
        return -1;
    return r->slots_cap;
}

int64_t rp_size(void *handle, int32_t slot) {
    Routed *r = handle;
    return slot < r->slots_cap ? r->count[slot] : 0;
}

/* Everything remembered for `slot` forgotten. */
void rp_remove(void *handle, int32_t slot) {
    Routed *r = handle;
    if (slot >= r->slots_cap)
        return;
    while (r->tail[slot] >= 0)
        remove_entry(r, r->tail[slot]);
}

/* Pages remembered, all slots together. */
int64_t rp_pages(void *handle) {
    Routed *r = handle;
    int64_t n = 0;
    for (int64_t s = 0; s < r->slots_cap; s++)
        n += r->count[s];
    return n;
}

/* Bytes held: entry chunks, the shards' tables and the per-slot arrays. */
int64_t rp_bytes(void *handle) {
    Routed *r = handle;
    int64_t tables = 0;
    for (int s = 0; s < 1 << SHARD_BITS; s++)
        tables += ((int64_t)2 << r->shards[s].bits) * (int64_t)sizeof(int32_t);
    return r->nchunks * CHUNK * (int64_t)sizeof(Entry) + tables + r->slots_cap * 28;
}
