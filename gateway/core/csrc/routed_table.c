/* RoutedPrefixes' pages (gateway/core/routed_prefixes.py) in C: per worker slot an LRU list of
   the page hashes routed to it, bounded by max_pages, and for each page the slots remembering it.
   gateway/core/routed_native.py drives it; routed_prefixes.DictPages stays as the reference and
   the fallback, with the same results (tests/gateway/test_routed_prefixes.py compares them).

   Why C: at 1,000 workers x 4,096 pages the Python store is 4M entries in 256 dicts plus an
   OrderedDict a worker, and a decision's record of ~32 new pages (each evicting an old one) is a
   dozen dict operations a page, each a cache miss: ~55 us of a ~170 us decision.

   Layout. An entry is one (page, slot) pair: its 16-byte key, its slot, its place in the slot's
   LRU list (prev/next) and in the page's list of holders (kprev/knext). Two open-addressed
   tables of entry indexes (-1: empty), linear probing with backward-shift deletion (no
   tombstones, so steady churn never rebuilds a table; only growth does):
     by_pair: (page, slot) -> its entry              membership (record, extend)
     by_page: page -> the first entry of its holders (holders, match)
   Both have 2^bits positions and at most half of them used (pages <= entries). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const uint64_t MIX = 0x9E3779B97F4A7C15ULL, MIX_HI = 0xC2B2AE3D27D4EB4FULL,
                      MIX_SLOT = 0x632BE59BD9B4E019ULL;

typedef struct {
    uint64_t *lo, *hi;
    int32_t *slot, *prev, *next, *kprev, *knext;
    int64_t entries_cap, entries_top; /* allocated; ever used (entries_top..cap never were) */
    int32_t free_entry;               /* free list through next[] */
    int64_t live, max_pages;
    int32_t *head, *tail; /* per slot: most and least recently routed entry */
    int64_t *count, *mark;
    int32_t *alive; /* match()'s scratch, one per slot */
    int64_t slots_cap, epoch;
    int32_t *by_pair, *by_page;
    int bits;
} Routed;

static inline uint64_t mask_of(const Routed *r) { return ((uint64_t)1 << r->bits) - 1; }

static inline uint64_t page_home(const Routed *r, uint64_t lo, uint64_t hi) {
    return ((lo ^ (hi * MIX_HI)) * MIX) >> (64 - r->bits);
}

static inline uint64_t pair_home(const Routed *r, uint64_t lo, uint64_t hi, int32_t slot) {
    return (((lo ^ (hi * MIX_HI)) + (uint64_t)(uint32_t)slot * MIX_SLOT) * MIX) >> (64 - r->bits);
}

/* The entry of (lo, hi, slot) or -1; *pos its position or the empty one ending its path. */
static int32_t find_pair(const Routed *r, uint64_t lo, uint64_t hi, int32_t slot, uint64_t *pos) {
    uint64_t m = mask_of(r), p = pair_home(r, lo, hi, slot);
    for (;; p = (p + 1) & m) {
        int32_t e = r->by_pair[p];
        if (e < 0 || (r->lo[e] == lo && r->hi[e] == hi && r->slot[e] == slot)) {
            *pos = p;
            return e;
        }
    }
}

/* The first holder entry of page (lo, hi) or -1; *pos as find_pair's. */
static int32_t find_page(const Routed *r, uint64_t lo, uint64_t hi, uint64_t *pos) {
    uint64_t m = mask_of(r), p = page_home(r, lo, hi);
    for (;; p = (p + 1) & m) {
        int32_t e = r->by_page[p];
        if (e < 0 || (r->lo[e] == lo && r->hi[e] == hi)) {
            *pos = p;
            return e;
        }
    }
}

/* Empties position i of a table, moving later entries of its cluster back so that each stays
   reachable from its home (nothing after i is before its home, cyclically). */
static void table_delete(Routed *r, int32_t *table, int by_pair, uint64_t i) {
    uint64_t m = mask_of(r), j = i;
    table[i] = -1;
    for (;;) {
        j = (j + 1) & m;
        int32_t e = table[j];
        if (e < 0)
            return;
        uint64_t h = by_pair ? pair_home(r, r->lo[e], r->hi[e], r->slot[e])
                             : page_home(r, r->lo[e], r->hi[e]);
        if (((j - h) & m) >= ((j - i) & m)) {
            table[i] = e;
            table[j] = -1;
            i = j;
        }
    }
}

/* Both tables rebuilt with 2^bits positions. */
static int rehash(Routed *r, int bits) {
    size_t n = (size_t)1 << bits;
    int32_t *pairs = malloc(n * sizeof(int32_t)), *pages = malloc(n * sizeof(int32_t));
    if (!pairs || !pages) {
        free(pairs);
        free(pages);
        return -1;
    }
    memset(pairs, 0xff, n * sizeof(int32_t));
    memset(pages, 0xff, n * sizeof(int32_t));
    free(r->by_pair);
    free(r->by_page);
    r->by_pair = pairs;
    r->by_page = pages;
    r->bits = bits;
    for (int32_t e = 0; e < r->entries_top; e++) {
        if (r->slot[e] < 0)
            continue;
        uint64_t p;
        find_pair(r, r->lo[e], r->hi[e], r->slot[e], &p);
        pairs[p] = e;
        if (r->kprev[e] < 0) {
            find_page(r, r->lo[e], r->hi[e], &p);
            pages[p] = e;
        }
    }
    return 0;
}

#define GROW(field, type, n)                                                                  \
    do {                                                                                      \
        void *p_ = realloc(r->field, (size_t)(n) * sizeof(type));                             \
        if (!p_)                                                                              \
            return -1;                                                                        \
        r->field = p_;                                                                        \
    } while (0)

static int grow_entries(Routed *r) {
    int64_t n = r->entries_cap ? r->entries_cap * 2 : 1024;
    if (n > INT32_MAX)
        return -1;
    GROW(lo, uint64_t, n); GROW(hi, uint64_t, n); GROW(slot, int32_t, n);
    GROW(prev, int32_t, n); GROW(next, int32_t, n); GROW(kprev, int32_t, n);
    GROW(knext, int32_t, n);
    r->entries_cap = n;
    return 0;
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

void *rp_new(int64_t max_pages) {
    Routed *r = calloc(1, sizeof(Routed));
    if (!r)
        return NULL;
    r->max_pages = max_pages;
    r->free_entry = -1;
    if (rehash(r, 10) < 0) {
        free(r);
        return NULL;
    }
    return r;
}

void rp_free(void *handle) {
    Routed *r = handle;
    if (!r)
        return;
    free(r->lo); free(r->hi); free(r->slot); free(r->prev); free(r->next); free(r->kprev);
    free(r->knext); free(r->head); free(r->tail); free(r->count); free(r->mark); free(r->alive);
    free(r->by_pair); free(r->by_page);
    free(r);
}

static void lru_unlink(Routed *r, int32_t e) {
    int32_t s = r->slot[e], p = r->prev[e], n = r->next[e];
    if (p >= 0) r->next[p] = n; else r->head[s] = n;
    if (n >= 0) r->prev[n] = p; else r->tail[s] = p;
}

static void lru_push_front(Routed *r, int32_t e) {
    int32_t s = r->slot[e], h = r->head[s];
    r->prev[e] = -1;
    r->next[e] = h;
    if (h >= 0) r->prev[h] = e; else r->tail[s] = e;
    r->head[s] = e;
}

/* The entry out of its slot's list, both tables and its page's holders; onto the free list. */
static void remove_entry(Routed *r, int32_t e) {
    uint64_t pos;
    lru_unlink(r, e);
    r->count[r->slot[e]]--;
    find_pair(r, r->lo[e], r->hi[e], r->slot[e], &pos);
    table_delete(r, r->by_pair, 1, pos);
    int32_t kp = r->kprev[e], kn = r->knext[e];
    if (kn >= 0)
        r->kprev[kn] = kp;
    if (kp >= 0) {
        r->knext[kp] = kn;
    } else {
        find_page(r, r->lo[e], r->hi[e], &pos);
        if (kn >= 0)
            r->by_page[pos] = kn;  /* same page, same home: the position stays right */
        else
            table_delete(r, r->by_page, 0, pos);
    }
    r->slot[e] = -1;
    r->next[e] = r->free_entry;
    r->free_entry = e;
    r->live--;
}

/* A new entry for (lo, hi, slot), known absent: in both tables, first in its slot's list and
   first among its page's holders. */
static int add_entry(Routed *r, uint64_t lo, uint64_t hi, int32_t slot) {
    if ((r->live + 1) * 2 > ((int64_t)1 << r->bits) && rehash(r, r->bits + 1) < 0)
        return -1;
    int32_t e = r->free_entry;
    if (e >= 0) {
        r->free_entry = r->next[e];
    } else {
        if (r->entries_top == r->entries_cap && grow_entries(r) < 0)
            return -1;
        e = (int32_t)r->entries_top++;
    }
    uint64_t pos;
    r->lo[e] = lo;
    r->hi[e] = hi;
    r->slot[e] = slot;
    find_pair(r, lo, hi, slot, &pos);
    r->by_pair[pos] = e;
    int32_t first = find_page(r, lo, hi, &pos);
    r->kprev[e] = -1;
    r->knext[e] = first;
    if (first >= 0)
        r->kprev[first] = e;
    r->by_page[pos] = e;
    lru_push_front(r, e);
    r->count[slot]++;
    r->live++;
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
        int32_t e = find_pair(r, lo, hi, slot, &pos);
        if (e >= 0) {
            lru_unlink(r, e);
            lru_push_front(r, e);
        } else if (add_entry(r, lo, hi, slot) < 0) {
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
    while (start < n && find_pair(r, keys[2 * start], keys[2 * start + 1], slot, &pos) >= 0)
        start++;
    return start;
}

/* The slots remembering page (lo, hi), most recent holder first; returns how many there are
   (out gets the first `cap` of them). */
int64_t rp_holders(void *handle, uint64_t lo, uint64_t hi, int32_t *out, int64_t cap) {
    Routed *r = handle;
    uint64_t pos;
    int64_t k = 0;
    for (int32_t e = find_page(r, lo, hi, &pos); e >= 0; e = r->knext[e], k++)
        if (k < cap)
            out[k] = r->slot[e];
    return k;
}

static int by_slot(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The leading pages each slot remembers, as (out_slot[k], out_end[k]) for the k returned, in
   the order the runs end (ascending slots within a page); slots matching no page are absent.
   out_* hold one per slot (rp_slots). */
int64_t rp_match(void *handle, const uint64_t *keys, int64_t n, int32_t *out_slot,
                 int64_t *out_end) {
    Routed *r = handle;
    uint64_t pos;
    int64_t alive = 0, k = 0;
    if (n == 0)
        return 0;
    for (int32_t e = find_page(r, keys[0], keys[1], &pos); e >= 0; e = r->knext[e])
        r->alive[alive++] = r->slot[e];
    qsort(r->alive, (size_t)alive, sizeof(int32_t), by_slot);
    for (int64_t i = 1; i < n && alive; i++) {
        int64_t epoch = ++r->epoch, kept = 0;
        for (int32_t e = find_page(r, keys[2 * i], keys[2 * i + 1], &pos); e >= 0;
             e = r->knext[e])
            r->mark[r->slot[e]] = epoch;
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

/* Bytes held: entries, tables and per-slot arrays. */
int64_t rp_bytes(void *handle) {
    Routed *r = handle;
    return r->entries_cap * (2 * 8 + 5 * 4) + ((int64_t)2 << r->bits) * 4 + r->slots_cap * 28;
}
