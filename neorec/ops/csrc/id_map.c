/*
 * Id -> slot map of a dynamic embedding table (neorec.ops.id_map.IdMap): raw 64-bit ids, any
 * value, map to one of `cap` slots without collisions. Compiled into the same library as
 * tbe_cpu.c (neorec/ops/cpu.py appends this file). neorec/ops/id_map.py has a NumPy version that
 * takes the same decisions; tests compare the two.
 *
 * State (arrays owned by Python): per slot id_of, live, last (step of the last use), hits (uses
 * since admission), a stack free[] of free slots; an open-addressing hash table hkey/hval (linear
 * probing, hval -1 = empty, deletion by backward shift, so probing stays correct); the count-min
 * sketch of the threshold admission (depth rows of width counters, int32, saturating).
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
 *     live slots not used by the batch and not pinned, smallest key first: lru (last, slot), lfu
 *     (hits, last, slot), ttl (last, slot). Admitted ids that still find no slot are unadmitted
 *     for this batch (the later ones in id order). Victims go on the free stack in slot order;
 *     the k admitted ids (id order) take free[n_free - k .. n_free) in order;
 *  5. every occurrence gets its slot, or -1 (counted as an unadmitted lookup).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t cap, hmask;
    int64_t *hkey, *hval;
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
} im_state;

enum { IM_ADMITTED, IM_EVICTED, IM_UNADMITTED, IM_NEW, IM_EV, IM_HITS, IM_NCOUNTS };

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
    while (m->hval[i] >= 0) {
        if (m->hkey[i] == id) return m->hval[i];
        i = (i + 1) & m->hmask;
    }
    return -1;
}

static void im_insert(im_state *m, int64_t id, int64_t slot) {
    int64_t i = im_home(m, id);
    while (m->hval[i] >= 0) i = (i + 1) & m->hmask;
    m->hkey[i] = id;
    m->hval[i] = slot;
}

/* Remove id (present) by backward shift: later entries of the probe run move up. */
static void im_erase(im_state *m, int64_t id) {
    int64_t i = im_home(m, id);
    while (m->hkey[i] != id || m->hval[i] < 0) i = (i + 1) & m->hmask;
    int64_t j = i;
    for (;;) {
        j = (j + 1) & m->hmask;
        if (m->hval[j] < 0) break;
        const int64_t k = im_home(m, m->hkey[j]);
        /* entry j may move to hole i unless its home lies cyclically in (i, j] */
        const int in_range = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!in_range) {
            m->hkey[i] = m->hkey[j];
            m->hval[i] = m->hval[j];
            i = j;
        }
    }
    m->hval[i] = -1;
}

static void im_evict(im_state *m, int64_t s, int64_t *ev_slots, int64_t *ev_ids, int64_t *counts) {
    im_erase(m, m->id_of[s]);
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

typedef struct {
    int64_t k1, k2, slot;
} im_key;

static int im_cmp_key(const void *a, const void *b) {
    const im_key *x = (const im_key *)a, *y = (const im_key *)b;
    if (x->k1 != y->k1) return x->k1 < y->k1 ? -1 : 1;
    if (x->k2 != y->k2) return x->k2 < y->k2 ? -1 : 1;
    return (x->slot > y->slot) - (x->slot < y->slot);
}

/* Partial quickselect: afterwards a[0..k) hold the k smallest of a[0..n) (any order); keys
   are distinct (the slot breaks ties), so the set is unique. 0 < k < n. */
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

/* Rebuild the hash table from id_of / live (after the state was loaded or edited). */
void im_rebuild(im_state *m) {
    for (int64_t i = 0; i <= m->hmask; i++) m->hval[i] = -1;
    for (int64_t s = 0; s < m->cap; s++)
        if (m->live[s]) im_insert(m, m->id_of[s], s);
}

/* Read-only: out[i] = slot of ids[i] or -1. */
void im_lookup(const im_state *m, const int64_t *ids, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = im_find(m, ids[i]);
}

/*
 * Map one batch (see the top of the file). pins: NULL or int32[cap] (> 0 = not evictable).
 * mark: uint8[cap] zeroed scratch. mset_key / mset_cnt: int64[mset_size] scratch, mset_size a
 * power of two >= 2 n; miss: int64[n] scratch; keys: im_key-sized scratch of cap entries
 * (3 * cap int64). Outputs: out[n]; new_slots / new_ids [<= n]; ev_slots / ev_ids [<= cap + n];
 * counts[IM_NCOUNTS].
 */
void im_map_batch(im_state *m, const int64_t *ids, int64_t n, int64_t step, const int32_t *pins,
                  uint8_t *mark, int64_t *mset_key, int64_t *mset_cnt, int64_t mset_size,
                  int64_t *miss, int64_t *keys, int64_t *out, int64_t *new_slots,
                  int64_t *new_ids, int64_t *ev_slots, int64_t *ev_ids, int64_t *counts) {
    memset(counts, 0, sizeof(int64_t) * IM_NCOUNTS);
    /* 1. ttl expiry */
    if (m->policy == 2) {
        for (int64_t s = 0; s < m->cap; s++)
            if (m->live[s] && (pins == NULL || pins[s] <= 0) && step - m->last[s] > m->ttl)
                im_evict(m, s, ev_slots, ev_ids, counts);
    }
    /* 2. lookups; distinct misses through a scratch set (mset_cnt 0 = empty) */
    const int64_t smask = mset_size - 1;
    memset(mset_cnt, 0, sizeof(int64_t) * (size_t)mset_size);
    int64_t n_miss = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        const int64_t s = im_find(m, id);
        if (s >= 0) {
            m->hits[s]++;
            m->last[s] = step;
            mark[s] = 1;
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
    qsort(miss, (size_t)n_miss, sizeof(int64_t), im_cmp_i64);
    /* occurrences of each miss, in sorted order (reuse out[] as scratch) */
    int64_t *cnt = out;
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
        im_key *cand = (im_key *)keys;
        int64_t e = 0;
        for (int64_t s = 0; s < m->cap; s++) {
            if (!m->live[s] || mark[s] || (pins != NULL && pins[s] > 0)) continue;
            cand[e].k1 = m->policy == 1 ? m->hits[s] : m->last[s];
            cand[e].k2 = m->policy == 1 ? m->last[s] : 0;
            cand[e++].slot = s;
        }
        const int64_t nv = need < e ? need : e;
        if (nv < e) im_select(cand, e, nv); /* cand[0..nv) = the nv smallest, any order */
        /* the victims' slots over the front of the key array: entry v is written at int64 v,
           after cand[0..v] (int64 0 .. 3v+2) were read, before cand[v+1..] (3v+3 ..) are */
        int64_t *victims = keys;
        for (int64_t v = 0; v < nv; v++) victims[v] = cand[v].slot;
        qsort(victims, (size_t)nv, sizeof(int64_t), im_cmp_i64);
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
        new_slots[j] = s;
        new_ids[j] = miss[j];
    }
    m->n_free = base;
    counts[IM_NEW] = k;
    counts[IM_ADMITTED] = k;
    /* 6. every occurrence's slot */
    for (int64_t i = 0; i < n; i++) {
        out[i] = im_find(m, ids[i]);
        if (out[i] < 0) counts[IM_UNADMITTED]++;
    }
}
