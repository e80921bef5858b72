/* RoutedPrefixes' pages (gateway/core/routed_prefixes.py) in C: per worker slot an LRU list of
   the page hashes routed to it, bounded by max_pages, and for each page the slots remembering it.
   gateway/core/routed_native.py drives it; routed_prefixes.DictPages stays as the reference and
   the fallback, with the same results (tests/gateway/test_routed_prefixes.py compares them).

   Why C: at 1,000 workers x 4,096 pages the Python store is 4M entries in 256 dicts plus an
   OrderedDict a worker (~286 bytes a page, this store 57.5), and a decision's record of ~32 new
   pages (each evicting an old one) is a dozen dict operations a page, each a cache miss: ~55 us
   of a ~170 us decision (docs/results/gateway/fleet/routed_prefixes.txt).

   Layout. An entry is one (page, slot) pair: its 16-byte key, its slot, its place in the slot's
   LRU list (prev/next) and in the page's list of holders (kprev/knext). Entries live in chunks
   of 2^CHUNK_BITS that are never moved (a new chunk, not a copy, when they run out). Two
   open-addressed tables of entry indexes (-1: empty), linear probing with backward-shift
   deletion (no tombstones, so steady churn never rebuilds a table; only growth does):
     by_pair: (page, slot) -> its entry              membership (record, extend)
     by_page: page -> the first entry of its holders (holders, match)
   Both are split in 2^SHARD_BITS shards by the page's hash (a page's pairs in its page's
   shard), each with 2^bits positions at most half used (pages <= pairs): a growth rehashes one
   shard, 1/256 of the whole, inside a decision (one table of 4M pairs would take ~10 ms).
   A page with several holders also has a holder mask (a bit a slot; its first holder's `mask`
   names it), so that match ANDs one mask a page however many workers share a prefix.

     by_page[p] ──> entry (page P, slot 7, mask 3) ─knext─> entry (P, slot 2) ─knext─> -1
                                            └──> masks[3]: bits 2 and 7
     head[7] ──> most recent entry of slot 7 ─next─> ... ─next─> tail[7] (evicted first) */
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
    int32_t mask; /* in a page's first holder: the page's holder mask, -1 with one holder */
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
    int64_t *count;
    int64_t slots_cap;
    /* Holder masks of pages with several holders, `words` 64-bit words each (slots_cap bits),
       free ones chained through their first word; match's alive set in `alive`. */
    uint64_t *masks, *alive, *one; /* `one`: a single holder's bit as a mask (match) */
    int64_t words, masks_cap, masks_top;
    int64_t free_mask;
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

/* The masks re-laid with `words` words each (the words added are zero). */
static int relayout_masks(Routed *r, int64_t words) {
    if (r->masks_cap) {
        uint64_t *m = calloc((size_t)(r->masks_cap * words), sizeof(uint64_t));
        if (!m)
            return -1;
        for (int64_t i = 0; i < r->masks_top; i++)
            memcpy(&m[i * words], &r->masks[i * r->words], (size_t)r->words * sizeof(uint64_t));
        free(r->masks);
        r->masks = m;
    }
    GROW(alive, uint64_t, words); GROW(one, uint64_t, words);
    r->words = words;
    return 0;
}

static int grow_slots(Routed *r, int32_t slot) {
    int64_t n = r->slots_cap ? r->slots_cap : 64;
    while (n <= slot)
        n *= 2;
    GROW(head, int32_t, n); GROW(tail, int32_t, n); GROW(count, int64_t, n);
    if (relayout_masks(r, n / 64) < 0)
        return -1;
    for (int64_t s = r->slots_cap; s < n; s++) {
        r->head[s] = r->tail[s] = -1;
        r->count[s] = 0;
    }
    r->slots_cap = n;
    return 0;
}

/* A zeroed mask's index (the pool doubled when none is free). -1: no memory. */
static int64_t alloc_mask(Routed *r) {
    int64_t k = r->free_mask;
    if (k >= 0) {
        r->free_mask = (int64_t)r->masks[k * r->words];
    } else {
        if (r->masks_top == r->masks_cap) {
            int64_t n = r->masks_cap ? 2 * r->masks_cap : 64;
            GROW(masks, uint64_t, n * r->words);
            r->masks_cap = n;
        }
        k = r->masks_top++;
    }
    memset(&r->masks[k * r->words], 0, (size_t)r->words * sizeof(uint64_t));
    return k;
}

static void free_mask(Routed *r, int64_t k) {
    r->masks[k * r->words] = (uint64_t)r->free_mask;
    r->free_mask = k;
}

static inline uint64_t *mask_at(const Routed *r, int64_t k) { return &r->masks[k * r->words]; }

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
    free(r->chunks); free(r->head); free(r->tail); free(r->count); free(r->masks);
    free(r->alive); free(r->one);
    free(r);
}

void *rp_new(int64_t max_pages) {
    Routed *r = calloc(1, sizeof(Routed));
    if (!r)
        return NULL;
    r->max_pages = max_pages;
    r->free_entry = -1;
    r->free_mask = -1;
    if (grow_slots(r, 0) < 0) {
        rp_free(r);
        return NULL;
    }
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
    int32_t head = kp < 0 ? e : find_page(r, sh, x->lo, x->hi, &pos), k = at(r, head)->mask;
    if (k >= 0)
        mask_at(r, k)[x->slot >> 6] &= ~((uint64_t)1 << (x->slot & 63));
    if (kn >= 0)
        at(r, kn)->kprev = kp;
    if (kp >= 0) {
        at(r, kp)->knext = kn;
    } else {
        find_page(r, sh, x->lo, x->hi, &pos);
        head = kn;
        if (kn >= 0) {
            sh->by_page[pos] = kn; /* same page, same home: the position stays right */
            at(r, kn)->mask = k;
        } else {
            table_delete(r, sh, 0, pos);
        }
    }
    if (k >= 0 && head >= 0 && at(r, head)->knext < 0) { /* one holder left: no mask */
        free_mask(r, k);
        at(r, head)->mask = -1;
    }
    x->slot = -1;
    x->next = r->free_entry;
    r->free_entry = e;
}

/* A new entry for (lo, hi, slot), known absent: in both tables, first in its slot's list and
   first among its page's holders (a page's second holder gives it a mask). -1: no memory. */
static int add_entry(Routed *r, Shard *sh, uint64_t lo, uint64_t hi, int32_t slot) {
    if ((sh->live + 1) * 2 > ((int64_t)1 << sh->bits) && resize(r, sh, sh->bits + 1) < 0)
        return -1;
    uint64_t pos, page_pos;
    int32_t first = find_page(r, sh, lo, hi, &page_pos);
    int64_t k = first >= 0 ? at(r, first)->mask : -1;
    int new_mask = first >= 0 && k < 0;
    if (new_mask) {
        if ((k = alloc_mask(r)) < 0)
            return -1;
        int32_t other = at(r, first)->slot;
        mask_at(r, k)[other >> 6] |= (uint64_t)1 << (other & 63);
    }
    int32_t e = alloc_entry(r);
    if (e < 0) {
        if (new_mask)
            free_mask(r, k);
        return -1;
    }
    Entry *x = at(r, e);
    x->lo = lo;
    x->hi = hi;
    x->slot = slot;
    find_pair(r, sh, lo, hi, slot, &pos);
    sh->by_pair[pos] = e;
    sh->live++;
    x->kprev = -1;
    x->knext = first;
    x->mask = (int32_t)k;
    if (first >= 0) {
        at(r, first)->kprev = e;
        at(r, first)->mask = -1;
        mask_at(r, k)[slot >> 6] |= (uint64_t)1 << (slot & 63);
    }
    sh->by_page[page_pos] = e;
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

/* Page (lo, hi)'s holders as a mask of `words` words: its own, or r->one set to its single
   holder's bit; NULL when nobody holds it. */
static const uint64_t *holder_bits(Routed *r, uint64_t lo, uint64_t hi) {
    uint64_t pos;
    Shard *sh = shard_of(r, lo, hi);
    int32_t e = find_page(r, sh, lo, hi, &pos);
    if (e < 0)
        return NULL;
    if (at(r, e)->mask >= 0)
        return mask_at(r, at(r, e)->mask);
    int32_t s = at(r, e)->slot;
    memset(r->one, 0, (size_t)r->words * sizeof(uint64_t));
    r->one[s >> 6] = (uint64_t)1 << (s & 63);
    return r->one;
}

/* The slots remembering page (lo, hi), ascending; returns how many there are (out gets the
   first `cap` of them). */
int64_t rp_holders(void *handle, uint64_t lo, uint64_t hi, int32_t *out, int64_t cap) {
    Routed *r = handle;
    const uint64_t *m = holder_bits(r, lo, hi);
    int64_t k = 0;
    for (int64_t w = 0; m && w < r->words; w++)
        for (uint64_t left = m[w]; left; left &= left - 1, k++)
            if (k < cap)
                out[k] = (int32_t)(w * 64 + __builtin_ctzll(left));
    return k;
}

/* The leading pages each slot remembers, as (out_slot[k], out_end[k]) for the k returned, in
   the order the runs end (ascending slots within a page); slots matching no page are absent.
   A page's holders are ANDed as masks: O(pages x slots / 64) words, however many share them.
   out_* hold one per slot (rp_slots). */
int64_t rp_match(void *handle, const uint64_t *keys, int64_t n, int32_t *out_slot,
                 int64_t *out_end) {
    Routed *r = handle;
    int64_t k = 0, words = r->words;
    const uint64_t *m = n ? holder_bits(r, keys[0], keys[1]) : NULL;
    if (!m)
        return 0;
    memcpy(r->alive, m, (size_t)words * sizeof(uint64_t));
    int any = 1;
    for (int64_t i = 1; i < n && any; i++) {
        m = holder_bits(r, keys[2 * i], keys[2 * i + 1]);
        any = 0;
        for (int64_t w = 0; w < words; w++) {
            uint64_t keep = m ? r->alive[w] & m[w] : 0, gone = r->alive[w] & ~keep;
            for (; gone; gone &= gone - 1) {
                out_slot[k] = (int32_t)(w * 64 + __builtin_ctzll(gone));
                out_end[k++] = i;
            }
            r->alive[w] = keep;
            any |= keep != 0;
        }
    }
    for (int64_t w = 0; any && w < words; w++)
        for (uint64_t left = r->alive[w]; left; left &= left - 1) {
            out_slot[k] = (int32_t)(w * 64 + __builtin_ctzll(left));
            out_end[k++] = n;
        }
    return k;
}

/* rp_extend for k slots over the same keys: ends[i] for (slots[i], starts[i]). Each page is
   probed once, when a slot's run first reaches it, and its holders' mask kept for the other
   slots: a shared prompt's first page is remembered by as many workers as it was routed to
   lately (~100 at 1,000 workers), whose runs cover the same pages, and a probe each, page after
   page, was most of such a routing decision's tail (RoutedPrefixes.extend_many). */
void rp_extend_many(void *handle, const int32_t *slots, const int64_t *starts, int64_t k,
                    const uint64_t *keys, int64_t n, int64_t *ends) {
    Routed *r = handle;
    int64_t from = n, words = r->words;
    for (int64_t i = 0; i < k; i++)
        if (starts[i] < from)
            from = starts[i];
    int64_t pages = n - from;
    uint64_t *bits = pages > 0 ? malloc((size_t)(pages * words) * sizeof(uint64_t)) : NULL;
    unsigned char *known = pages > 0 ? calloc((size_t)pages, 1) : NULL;
    if (pages > 0 && (!bits || !known)) { /* no memory for the masks: a probe each */
        free(bits);
        free(known);
        for (int64_t i = 0; i < k; i++)
            ends[i] = rp_extend(handle, slots[i], keys, n, starts[i]);
        return;
    }
    for (int64_t i = 0; i < k; i++) {
        int32_t s = slots[i];
        int64_t e = starts[i];
        if (s < r->slots_cap && r->count[s] > 0) /* as rp_extend: s >> 6 < words then */
            for (; e < n; e++) {
                uint64_t *m = &bits[(e - from) * words];
                if (!known[e - from]) {
                    const uint64_t *held = holder_bits(r, keys[2 * e], keys[2 * e + 1]);
                    if (held)
                        memcpy(m, held, (size_t)words * sizeof(uint64_t));
                    else
                        memset(m, 0, (size_t)words * sizeof(uint64_t));
                    known[e - from] = 1;
                }
                if (!((m[s >> 6] >> (s & 63)) & 1))
                    break;
            }
        ends[i] = e;
    }
    free(bits);
    free(known);
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

/* Bytes held: entry chunks, the shards' tables, the masks and the per-slot arrays. */
int64_t rp_bytes(void *handle) {
    Routed *r = handle;
    int64_t tables = 0;
    for (int s = 0; s < 1 << SHARD_BITS; s++)
        tables += ((int64_t)2 << r->shards[s].bits) * (int64_t)sizeof(int32_t);
    return r->nchunks * CHUNK * (int64_t)sizeof(Entry) + tables
           + (r->masks_cap + 2) * r->words * (int64_t)sizeof(uint64_t) + r->slots_cap * 16;
}
