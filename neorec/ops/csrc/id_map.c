/*
 * Id -> slot map of a dynamic embedding table (neorec.ops.id_map.IdMap): raw 64-bit ids, any
 * value, map to one of `cap` slots without collisions. Compiled into the same library as
 * tbe_cpu.c (neorec/ops/cpu.py appends this file). neorec/ops/id_map.py has a NumPy version that
 * takes the same decisions; tests compare the two.
 *
 * State (arrays owned by Python): per slot id_of, live, last (step of the last use), hits (uses
 * since admission), a stack free[] of free slots; an open-addressing hash table ht of (key, value)
 * pairs, interleaved so a probe reads one cache line (linear probing, value -1 = empty, deletion
 * by backward shift, so probing stays correct); the count-min
 * sketch of the threshold admission (depth rows of width counters, int32, saturating); for lru and
 * ttl, a doubly linked list nxt/prv of the live slots in last-use order (head = least recently
 * used; -2 = not linked): the batch's used slots move to its tail after each batch (they all
 * have last = step, the largest), so ttl expiry and lru victims are a walk from the head, not a
 * scan of every slot. Within one step's run of the list the order is arbitrary: victims take
 * whole runs, and the smallest ids of the last run they need (a selection, not a sort).
 * Derived state: im_rebuild makes it from id_of / live / last.
 *
 * One call maps one batch of one table, in this order (the decisions the NumPy version copies):
 *  1. ttl: every live, unpinned slot unused for more than ttl steps is evicted (slot order);
 *  2. lookups: a hit counts one use per occurrence (hits += 1, last = step) and marks its slot as
 *     used by the batch; the distinct misses are collected and sorted (signed int64 order);
 *  3. admission of the misses: always; threshold (each miss's occurrences are added to its
 *     sketch counters, then an id is admitted when the minimum of its counters >= threshold;
 *     then, while the sketch's count of sightings is >= `period`, every counter and the count
 *     halve);
 *     probability (admitted when mix64(id ^ salt) >> 11 < limit);
 *  4. slots: admitted ids take free slots; when too few are free, victims are evicted among the
 *     live slots not used by the batch and not pinned, smallest key first: lru (last, id), lfu
 *     (hits, last, id), ttl (last, id) -- ties go by raw id, never by slot, so a map rebuilt
 *     from its ids (other slots) takes the same decisions. Admitted ids that still find no slot are unadmitted
 *     for this batch (the later ones in id order). Victims go on the free stack in slot order;
 *     the k admitted ids (id order) take free[n_free - k .. n_free) in order;
 *  5. every occurrence gets its slot, or miss_value (counted as an unadmitted lookup);
 *  6. the batch's used slots (hits and new, each once) are listed (and, optionally,
 *     their pins incremented and touched marks set), and the evicted slots not reassigned listed
 *     as freed. im_reset_rows then writes the new slots' initial rows and zeroes the freed ones.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t cap, hmask;
    int64_t *ht, *unused; /* ht: 2 * (hmask + 1) int64, (key, value) pairs */
    int64_t *id_of, *last, *hits, *free_stack;
    uint8_t *live;
    int32_t *sketch;
    const uint64_t *sk_salt;
    int64_t sk_depth, sk_wmask, sk_period;
    int64_t policy; /* 0 lru, 1 lfu, 2 ttl */
    int64_t ttl;
    int64_t admission; /* 0 always, 1 threshold, 2 probability */
    int64_t threshold;
    uint64_t prob_salt, prob_limit;
    int64_t n_free, sk_total; /* updated by the calls */
    int64_t *nxt, *prv;       /* lru / ttl order of the live slots; NULL = none (lfu) */
    int64_t head, tail;       /* updated by the calls; -1 = empty */
} im_state;

enum { IM_ADMITTED, IM_EVICTED, IM_UNADMITTED, IM_NEW, IM_EV, IM_HITS, IM_USED, IM_FREED,
       IM_NCOUNTS };

static inline uint64_t im_mix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline int64_t im_home(const im_state *m, int64_t id) {
    return (int64_t)(im_mix64((uint64_t)id ^ 0x2545F4914F6CDD1DULL) & (uint64_t)m->hmask);
}

static inline int64_t im_mset_home(int64_t id, int64_t smask) {
    return (int64_t)(im_mix64((uint64_t)id ^ 0x6A09E667F3BCC909ULL) & (uint64_t)smask);
}

static int64_t im_find(const im_state *m, int64_t id) {
    int64_t i = im_home(m, id);
    while (m->ht[2 * i + 1] >= 0) {
        if (m->ht[2 * i] == id) return m->ht[2 * i + 1];
        i = (i + 1) & m->hmask;
    }
    return -1;
}

static void im_insert(im_state *m, int64_t id, int64_t slot) {
    int64_t i = im_home(m, id);
    while (m->ht[2 * i + 1] >= 0) i = (i + 1) & m->hmask;
    m->ht[2 * i] = id;
    m->ht[2 * i + 1] = slot;
}

/* Remove id (present) by backward shift: later entries of the probe run move up. */
static void im_erase(im_state *m, int64_t id) {
    int64_t i = im_home(m, id);
    while (m->ht[2 * i] != id || m->ht[2 * i + 1] < 0) i = (i + 1) & m->hmask;
    int64_t j = i;
    for (;;) {
        j = (j + 1) & m->hmask;
        if (m->ht[2 * j + 1] < 0) break;
        const int64_t k = im_home(m, m->ht[2 * j]);
        /* entry j may move to hole i unless its home lies cyclically in (i, j] */
        const int in_range = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!in_range) {
            m->ht[2 * i] = m->ht[2 * j];
            m->ht[2 * i + 1] = m->ht[2 * j + 1];
            i = j;
        }
    }
    m->ht[2 * i + 1] = -1;
}

static void im_unlink(im_state *m, int64_t s) {
    if (m->nxt == NULL || m->nxt[s] == -2) return;
    const int64_t p = m->prv[s], n = m->nxt[s];
    if (p >= 0) m->nxt[p] = n;
    else m->head = n;
    if (n >= 0) m->prv[n] = p;
    else m->tail = p;
    m->nxt[s] = -2;
    m->prv[s] = -2;
}

static void im_append(im_state *m, int64_t s) {
    m->prv[s] = m->tail;
    m->nxt[s] = -1;
    if (m->tail >= 0) m->nxt[m->tail] = s;
    else m->head = s;
    m->tail = s;
}

static void im_evict(im_state *m, int64_t s, int64_t *ev_slots, int64_t *ev_ids, int64_t *counts) {
    im_erase(m, m->id_of[s]);
    im_unlink(m, s);
    m->live[s] = 0;
    m->free_stack[m->n_free++] = s;
    ev_slots[counts[IM_EV]] = s;
    ev_ids[counts[IM_EV]++] = m->id_of[s];
    counts[IM_EVICTED]++;
}

static int im_cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Sort a[0..n) ascending (signed); tmp: n int64 scratch. LSD radix, 8 bits a pass (the sign
   bit flipped), insertion sort for short arrays. */
static void im_sort_i64(int64_t *a, int64_t n, int64_t *tmp) {
    if (n < 48) {
        for (int64_t i = 1; i < n; i++) {
            const int64_t x = a[i];
            int64_t j = i - 1;
            while (j >= 0 && a[j] > x) {
                a[j + 1] = a[j];
                j--;
            }
            a[j + 1] = x;
        }
        return;
    }
    int64_t *src = a, *dst = tmp;
    for (int pass = 0; pass < 8; pass++) {
        int64_t count[257] = {0};
        const int shift = 8 * pass;
        for (int64_t i = 0; i < n; i++)
            count[(((uint64_t)src[i] ^ 0x8000000000000000ULL) >> shift & 0xFF) + 1]++;
        if (count[1 + ((((uint64_t)src[0] ^ 0x8000000000000000ULL) >> shift) & 0xFF)] == n)
            continue; /* one digit value: this pass moves nothing */
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (int64_t i = 0; i < n; i++)
            dst[count[((uint64_t)src[i] ^ 0x8000000000000000ULL) >> shift & 0xFF]++] = src[i];
        int64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, sizeof(int64_t) * (size_t)n);
}

typedef struct {
    int64_t k1, k2, id, slot;
} im_key;

/* Victim order: k1, k2, then the raw id (distinct among live slots), so decisions never depend
   on slot numbers (a map rebuilt from its ids with other slots decides the same). */
static int im_cmp_key(const void *a, const void *b) {
    const im_key *x = (const im_key *)a, *y = (const im_key *)b;
    if (x->k1 != y->k1) return x->k1 < y->k1 ? -1 : 1;
    if (x->k2 != y->k2) return x->k2 < y->k2 ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Partial quickselect: afterwards a[0..k) hold the k smallest of a[0..n) (any order); keys
   are distinct (the id breaks ties), so the set is unique. 0 < k < n. */
static void im_select(im_key *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        /* median of three as the pivot, moved to hi */
        if (im_cmp_key(&a[mid], &a[lo]) < 0) { im_key t = a[mid]; a[mid] = a[lo]; a[lo] = t; }
        if (im_cmp_key(&a[hi], &a[lo]) < 0) { im_key t = a[hi]; a[hi] = a[lo]; a[lo] = t; }
        if (im_cmp_key(&a[mid], &a[hi]) < 0) { im_key t = a[mid]; a[mid] = a[hi]; a[hi] = t; }
        const im_key pivot = a[hi];
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++) {
            if (im_cmp_key(&a[i], &pivot) < 0) {
                im_key t = a[i];
                a[i] = a[store];
                a[store++] = t;
            }
        }
        im_key t = a[store];
        a[store] = a[hi];
        a[hi] = t;
        /* a[lo..store) < pivot = a[store] < a(store..hi] */
        if (store == k || store == k - 1) return;
        if (store > k) hi = store - 1;
        else lo = store + 1;
    }
}

/* Rebuild the hash table (and the lru / ttl list) from id_of / live / last (after the state
   was loaded or edited). */
void im_rebuild(im_state *m) {
    for (int64_t i = 0; i <= m->hmask; i++) m->ht[2 * i + 1] = -1;
    for (int64_t s = 0; s < m->cap; s++)
        if (m->live[s]) im_insert(m, m->id_of[s], s);
    if (m->nxt == NULL) return;
    m->head = m->tail = -1;
    im_key *order = (im_key *)malloc(sizeof(im_key) * (size_t)(m->cap > 0 ? m->cap : 1));
    int64_t n = 0;
    for (int64_t s = 0; s < m->cap; s++) {
        m->nxt[s] = m->prv[s] = -2;
        if (!m->live[s]) continue;
        order[n].k1 = m->last[s];
        order[n].k2 = 0;
        order[n].id = m->id_of[s];
        order[n++].slot = s;
    }
    qsort(order, (size_t)n, sizeof(im_key), im_cmp_key);
    for (int64_t j = 0; j < n; j++) im_append(m, order[j].slot);
    free(order);
}

/* The initial rows of raw ids (or zeros: ids NULL) into rows `slots` of w [*, dim], and zero
   optimizer state there (row_state: one float a row; st1, st2: dim floats a row; each NULL =
   none). Row element c of id x: 24 bits u of mix64(mix64(x ^ salt) + c / 2) (bits 40-63 for
   even c, 16-39 for odd c), then in float32 u * 2^-24 * twob - b, rounded as torch rounds
   neorec.storage.dynamic.dynamic_init_rows. */
void im_reset_rows(const int64_t *slots, const int64_t *ids, int64_t k, float *w, int64_t dim,
                   float *row_state, float *st1, float *st2, uint64_t salt, float twob, float b) {
    for (int64_t j = 0; j < k; j++) {
        const int64_t s = slots[j];
        float *r = w + s * dim;
        if (ids != NULL) {
            const uint64_t h = im_mix64((uint64_t)ids[j] ^ salt);
            for (int64_t c = 0; c < dim; c += 2) { /* two elements a hash */
                const uint64_t x = im_mix64(h + (uint64_t)(c >> 1));
                float v = (float)(x >> 40) * 0x1p-24f;
                v = v * twob;
                r[c] = v - b;
                if (c + 1 < dim) {
                    float v1 = (float)((x >> 16) & 0xFFFFFF) * 0x1p-24f;
                    v1 = v1 * twob;
                    r[c + 1] = v1 - b;
                }
            }
        } else {
            memset(r, 0, sizeof(float) * (size_t)dim);
        }
        if (row_state != NULL) row_state[s] = 0.0f;
        if (st1 != NULL) memset(st1 + s * dim, 0, sizeof(float) * (size_t)dim);
        if (st2 != NULL) memset(st2 + s * dim, 0, sizeof(float) * (size_t)dim);
    }
}

/* Where im_map_batch writes the rows of the slots it assigns and frees (im_reset_rows). */
typedef struct {
    float *w;
    int64_t dim;
    float *row_state, *st1, *st2;
    uint64_t salt;
    float twob, b;
} im_rows;

/* Read-only: out[i] = slot of ids[i] or -1. */
void im_lookup(const im_state *m, const int64_t *ids, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = im_find(m, ids[i]);
}

/*
 * Map one batch (see the top of the file). pins: NULL or int32[cap] (> 0 = not evictable).
 * mark: uint8[cap] zeroed scratch, zeroed again on return. mset_key / mset_cnt: int64[mset_size]
 * scratch, mset_size a power of two >= 2 n; miss, miss_tmp: int64[n] scratch; keys: 5 * cap
 * int64 scratch (cap im_key entries, then cap victims). Outputs: out[n] (miss_value where unadmitted); new_slots /
 * new_ids [<= n]; ev_slots / ev_ids [<= cap]; used [<= cap] (any order); freed [<= cap];
 * counts[IM_NCOUNTS]. pin_used: increment pins of the used slots; touched: NULL or uint8[cap]
 * set to 1 at the used slots; rows: NULL, or where to write the freed (zero) and new (initial)
 * rows and zero their optimizer state (im_reset_rows).
 */
void im_map_batch(im_state *m, const int64_t *ids, int64_t n, int64_t step, int32_t *pins,
                  uint8_t *mark, int64_t *mset_key, int64_t *mset_cnt, int64_t mset_size,
                  int64_t *miss, int64_t *keys, int64_t *out, int64_t *new_slots,
                  int64_t *new_ids, int64_t *ev_slots, int64_t *ev_ids, int64_t *counts,
                  int64_t miss_value, int64_t *used, int64_t *freed, int64_t pin_used,
                  uint8_t *touched, int64_t *miss_tmp, const im_rows *rows) {
    memset(counts, 0, sizeof(int64_t) * IM_NCOUNTS);
    int64_t n_used = 0;
    /* 1. ttl expiry (slot order) */
    if (m->policy == 2) {
        if (m->nxt != NULL) { /* the expired ids are a prefix of the list */
            int64_t n_exp = 0;
            for (int64_t s = m->head; s >= 0 && step - m->last[s] > m->ttl; s = m->nxt[s])
                if (pins == NULL || pins[s] <= 0) keys[n_exp++] = s;
            im_sort_i64(keys, n_exp, keys + m->cap);
            for (int64_t j = 0; j < n_exp; j++) im_evict(m, keys[j], ev_slots, ev_ids, counts);
        } else {
            for (int64_t s = 0; s < m->cap; s++)
                if (m->live[s] && (pins == NULL || pins[s] <= 0) && step - m->last[s] > m->ttl)
                    im_evict(m, s, ev_slots, ev_ids, counts);
        }
    }
    /* 2. lookups; distinct misses through a scratch set (mset_cnt 0 = empty) */
    const int64_t smask = mset_size - 1;
    memset(mset_cnt, 0, sizeof(int64_t) * (size_t)mset_size);
    int64_t n_miss = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        const int64_t s = im_find(m, id);
        out[i] = s; /* a hit's slot is final (only ttl and victims free slots, and neither
                       touches a slot this batch uses); misses are looked up again in 6. */
        if (s >= 0) {
            m->hits[s]++;
            m->last[s] = step;
            if (!mark[s]) {
                mark[s] = 1;
                used[n_used++] = s;
            }
            counts[IM_HITS]++;
            continue;
        }
        int64_t j = im_mset_home(id, smask);
        while (mset_cnt[j] > 0 && mset_key[j] != id) j = (j + 1) & smask;
        if (mset_cnt[j] == 0) {
            mset_key[j] = id;
            miss[n_miss++] = id;
        }
        mset_cnt[j]++;
    }
    im_sort_i64(miss, n_miss, miss_tmp);
    /* occurrences of each miss, in sorted order (new_ids as scratch: cnt[j] is read before
       new_ids[j] is written in 5.) */
    int64_t *cnt = new_ids;
    for (int64_t q = 0; q < n_miss; q++) {
        int64_t j = im_mset_home(miss[q], smask);
        while (mset_key[j] != miss[q] || mset_cnt[j] == 0) j = (j + 1) & smask;
        cnt[q] = mset_cnt[j];
    }
    /* 3. admission: compact the admitted misses (and their counts) to the front */
    int64_t k = 0;
    if (m->admission == 1) {
        for (int64_t q = 0; q < n_miss; q++) {
            for (int64_t d = 0; d < m->sk_depth; d++) {
                int32_t *c = m->sketch + d * (m->sk_wmask + 1) +
                             (int64_t)(im_mix64((uint64_t)miss[q] ^ m->sk_salt[d]) &
                                       (uint64_t)m->sk_wmask);
                const int64_t v = (int64_t)*c + cnt[q];
                *c = v > INT32_MAX ? INT32_MAX : (int32_t)v;
            }
            m->sk_total += cnt[q];
        }
        for (int64_t q = 0; q < n_miss; q++) {
            int64_t est = INT32_MAX;
            for (int64_t d = 0; d < m->sk_depth; d++) {
                const int64_t v = m->sketch[d * (m->sk_wmask + 1) +
                                            (int64_t)(im_mix64((uint64_t)miss[q] ^ m->sk_salt[d]) &
                                                      (uint64_t)m->sk_wmask)];
                est = v < est ? v : est;
            }
            if (est >= m->threshold) {
                miss[k] = miss[q];
                cnt[k++] = cnt[q];
            }
        }
        while (m->sk_total >= m->sk_period) {
            const int64_t total = m->sk_depth * (m->sk_wmask + 1);
            for (int64_t i = 0; i < total; i++) m->sketch[i] >>= 1;
            m->sk_total >>= 1;
        }
    } else if (m->admission == 2) {
        for (int64_t q = 0; q < n_miss; q++) {
            if ((im_mix64((uint64_t)miss[q] ^ m->prob_salt) >> 11) < m->prob_limit) {
                miss[k] = miss[q];
                cnt[k++] = cnt[q];
            }
        }
    } else {
        k = n_miss;
    }
    /* 4. victims when too few slots are free */
    if (k > m->n_free) {
        const int64_t need = k - m->n_free;
        int64_t *victims = keys + 4 * m->cap;
        int64_t nv = 0;
        if (m->nxt != NULL && m->policy != 1) {
            /* lru / ttl: unused, unpinned slots from the head, a run of equal last use at a
               time (slots used by this batch still sit at their old places: skipped) */
            im_key *cand = (im_key *)keys;
            int64_t s = m->head;
            while (nv < need) {
                while (s >= 0 && mark[s]) s = m->nxt[s];
                if (s < 0) break;
                const int64_t t = m->last[s];
                int64_t nc = 0;
                for (; s >= 0; s = m->nxt[s]) {
                    if (mark[s]) continue;
                    if (m->last[s] != t) break;
                    if (pins != NULL && pins[s] > 0) continue;
                    cand[nc].k1 = cand[nc].k2 = 0;
                    cand[nc].id = m->id_of[s];
                    cand[nc++].slot = s;
                }
                const int64_t take = need - nv < nc ? need - nv : nc;
                if (take < nc) im_select(cand, nc, take); /* the smallest ids of the run */
                for (int64_t j = 0; j < take; j++) victims[nv++] = cand[j].slot;
            }
        } else {
            im_key *cand = (im_key *)keys;
            int64_t e = 0;
            for (int64_t s = 0; s < m->cap; s++) {
                if (!m->live[s] || mark[s] || (pins != NULL && pins[s] > 0)) continue;
                cand[e].k1 = m->policy == 1 ? m->hits[s] : m->last[s];
                cand[e].k2 = m->policy == 1 ? m->last[s] : 0;
                cand[e].id = m->id_of[s];
                cand[e++].slot = s;
            }
            nv = need < e ? need : e;
            if (nv < e) im_select(cand, e, nv); /* cand[0..nv) = the nv smallest, any order */
            /* the victims' slots over the front of the key array: entry v is written at int64
               v, after cand[0..v] (int64 0 .. 4v+3) were read, before cand[v+1..] (4v+4 ..) */
            for (int64_t v = 0; v < nv; v++) victims[v] = cand[v].slot;
        }
        im_sort_i64(victims, nv, keys);
        for (int64_t v = 0; v < nv; v++) im_evict(m, victims[v], ev_slots, ev_ids, counts);
        if (k > m->n_free) k = m->n_free;
    }
    /* 5. assign slots */
    const int64_t base = m->n_free - k;
    for (int64_t j = 0; j < k; j++) {
        const int64_t s = m->free_stack[base + j];
        im_insert(m, miss[j], s);
        m->id_of[s] = miss[j];
        m->live[s] = 1;
        m->last[s] = step;
        m->hits[s] = cnt[j];
        mark[s] = 1;
        used[n_used++] = s;
        new_slots[j] = s;
        new_ids[j] = miss[j];
    }
    m->n_free = base;
    counts[IM_NEW] = k;
    counts[IM_ADMITTED] = k;
    /* 6. every occurrence's slot */
    for (int64_t i = 0; i < n; i++) {
        if (out[i] >= 0) continue;
        out[i] = im_find(m, ids[i]);
        if (out[i] < 0) {
            out[i] = miss_value;
            counts[IM_UNADMITTED]++;
        }
    }
    /* 7. used slots (to the tail of the lru list), freed slots, marks cleared */
    for (int64_t j = 0; j < n_used; j++) {
        const int64_t s = used[j];
        mark[s] = 0;
        if (m->nxt != NULL) {
            im_unlink(m, s);
            im_append(m, s);
        }
        if (pin_used && pins != NULL) pins[s]++;
        if (touched != NULL) touched[s] = 1;
    }
    counts[IM_USED] = n_used;
    int64_t n_freed = 0;
    for (int64_t e = 0; e < counts[IM_EV]; e++)
        if (!m->live[ev_slots[e]]) freed[n_freed++] = ev_slots[e];
    counts[IM_FREED] = n_freed;
    if (rows != NULL) { /* the freed rows zeroed, the new ones initialised; state zeroed */
        im_reset_rows(freed, NULL, n_freed, rows->w, rows->dim, rows->row_state, rows->st1,
                      rows->st2, rows->salt, rows->twob, rows->b);
        im_reset_rows(new_slots, new_ids, k, rows->w, rows->dim, rows->row_state, rows->st1,
                      rows->st2, rows->salt, rows->twob, rows->b);
    }
}
