/*
 * Row-cache bookkeeping and record copies for neorec.storage.cached (CachedEmbeddingBagCollection).
 *
 * Compiled into the same library as tbe_cpu.c (neorec/ops/cpu.py appends this file). The Python
 * module keeps a pure-torch path with the same decisions (same victims, same slots) for machines
 * without a C compiler; tests compare the two.
 *
 * Per table the cache state is: slot_of[rows] (int32, -1 = not resident), id_of[cap] (int64,
 * -1 = free), key[cap] (int64 eviction priority, smallest goes first; ties by slot), dirty[cap]
 * (uint8), pins[cap] (int32), and a stack free[cap] of free slots.
 */
#include <stdint.h>
#include <string.h>

#define RC_LFU_SHIFT 24
#define RC_TICK_MASK ((((int64_t)1) << RC_LFU_SHIFT) - 1)

/* LSD radix sort of n non-negative int64 (8-bit digits, only as many passes as max needs). */
static void rc_radix_sort(int64_t *a, int64_t *tmp, int64_t n) {
    if (n < 2) return;
    int64_t mx = 0;
    for (int64_t i = 0; i < n; i++) mx = a[i] > mx ? a[i] : mx;
    int64_t *src = a, *dst = tmp;
    for (int shift = 0; shift < 64 && (mx >> shift) > 0; shift += 8) {
        int64_t count[257];
        memset(count, 0, sizeof(count));
        for (int64_t i = 0; i < n; i++) count[((src[i] >> shift) & 255) + 1]++;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (int64_t i = 0; i < n; i++) dst[count[(src[i] >> shift) & 255]++] = src[i];
        int64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(int64_t));
}

/*
 * Classify the n ids of one table against the cache.
 * miss[] receives the distinct non-resident ids, sorted (tmp: n scratch int64).
 * With mark == NULL that is all (prefetch: nothing changes). Otherwise mark[slot] = 1 for each
 * distinct resident slot, hits[] receives those slots (first-use order), counts[0] = how many,
 * counts[1] = lookups that hit; and, when
 * the batch fits the cache (hits + misses <= cap), the hit slots are touched for the policy:
 * LRU key = tick; LFU key += 1 << 24 per lookup, low 24 bits = tick.
 * Returns the number of misses; -1 when the batch does not fit (keys untouched).
 */
int64_t rc_classify(const int64_t *ids, int64_t n, int32_t *slot_of, int64_t cap, uint8_t *mark,
                    int64_t *key, int64_t tick, int lfu, int64_t *miss, int64_t *hits,
                    int64_t *tmp, int64_t *counts) {
    int64_t n_miss = 0, n_hit = 0, lookup_hits = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + 16 < n) __builtin_prefetch(slot_of + ids[i + 16], 0, 0);
        const int64_t id = ids[i];
        const int32_t s = slot_of[id];
        if (s >= 0) {
            lookup_hits++;
            if (mark != NULL && !mark[s]) {
                mark[s] = 1;
                hits[n_hit++] = s;
            }
        } else if (s == -1) {
            slot_of[id] = -2; /* seen: later duplicates are not added again */
            miss[n_miss++] = id;
        }
    }
    for (int64_t j = 0; j < n_miss; j++) slot_of[miss[j]] = -1;
    if (mark != NULL) {
        counts[0] = n_hit;
        counts[1] = lookup_hits;
        if (n_hit + n_miss > cap) return -1;
        if (lfu) {
            for (int64_t i = 0; i < n; i++) {
                const int32_t s = slot_of[ids[i]];
                if (s >= 0) key[s] += ((int64_t)1) << RC_LFU_SHIFT;
            }
            for (int64_t j = 0; j < n_hit; j++) {
                const int64_t s = hits[j];
                key[s] = ((key[s] >> RC_LFU_SHIFT) << RC_LFU_SHIFT) | (tick & RC_TICK_MASK);
            }
        } else {
            for (int64_t j = 0; j < n_hit; j++) key[hits[j]] = tick;
        }
    }
    rc_radix_sort(miss, tmp, n_miss);
    return n_miss;
}

/* k-th smallest (0-based) of a[0..n) by quickselect; reorders a. */
static int64_t rc_select_kth(int64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        int64_t x = a[lo], y = a[mid], z = a[hi];
        const int64_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) {
                const int64_t t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return a[k];
    }
    return a[k];
}

/*
 * Choose victims: among evictable slots (not keep[s], pins[s] == 0, id_of[s] >= 0) the n with the
 * smallest (key, slot), n = min(max(need, chunk), evictable). out[] receives them in slot order.
 * Returns n, or -1 - evictable when fewer than need are evictable. tmp: cap scratch int64.
 */
int64_t rc_select_victims(const int64_t *key, const int32_t *pins, const int64_t *id_of,
                          const uint8_t *keep, int64_t cap, int64_t need, int64_t chunk,
                          int64_t *out, int64_t *tmp) {
    /* out[0..m) collects the evictable slots (in slot order), tmp[0..m) their keys. */
    int64_t m = 0;
    for (int64_t s = 0; s < cap; s++) {
        if (!keep[s] && pins[s] == 0 && id_of[s] >= 0) {
            out[m] = s;
            tmp[m++] = key[s];
        }
    }
    if (m < need) return -1 - m;
    int64_t n = need > chunk ? need : chunk;
    if (n > m) n = m;
    if (n == m) return n;
    const int64_t t = rc_select_kth(tmp, m, n - 1); /* the n-th smallest key (tmp reordered) */
    int64_t less = 0;
    for (int64_t j = 0; j < m; j++) less += key[out[j]] < t;
    int64_t equal_left = n - less, k = 0;
    for (int64_t j = 0; j < m; j++) { /* compact in place: k <= j, slot order kept */
        const int64_t s = out[j], ks = key[s];
        if (ks < t || (ks == t && equal_left-- > 0)) out[k++] = s;
    }
    return k;
}

/* out[i] = slot_of[ids[i]] (every id resident). */
void rc_remap(const int64_t *ids, int64_t n, const int32_t *slot_of, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (i + 16 < n) __builtin_prefetch(slot_of + ids[i + 16], 0, 0);
        out[i] = slot_of[ids[i]];
    }
}

/* Forget the n victims (their write-back is done) and push them on the free stack. */
int64_t rc_evict_commit(const int64_t *victims, int64_t n, int64_t *id_of, int32_t *slot_of,
                        uint8_t *dirty, int64_t *free_stack, int64_t n_free) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t v = victims[i];
        slot_of[id_of[v]] = -1;
        id_of[v] = -1;
        dirty[v] = 0;
        free_stack[n_free + i] = v;
    }
    return n_free + n;
}

/* Rows ids[i] now live in slots[i]: map them, mark them used, clean, touched once at tick. */
void rc_fill_commit(const int64_t *slots, const int64_t *ids, int64_t n, int32_t *slot_of,
                    int64_t *id_of, uint8_t *dirty, int64_t *key, uint8_t *mark, int64_t tick,
                    int lfu) {
    const int64_t k = lfu ? ((((int64_t)1) << RC_LFU_SHIFT) | (tick & RC_TICK_MASK)) : tick;
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = slots[i];
        slot_of[ids[i]] = (int32_t)s;
        id_of[s] = ids[i];
        dirty[s] = 0;
        key[s] = k;
        mark[s] = 1;
    }
}

/* For sorted distinct a[na], b[nb]: pos[i] = j with b[j] == a[i] and (valid == NULL or valid[j]),
   else -1. Returns how many were found. */
int64_t rc_match_sorted(const int64_t *a, int64_t na, const int64_t *b, int64_t nb,
                        const uint8_t *valid, int64_t *pos) {
    int64_t j = 0, found = 0;
    for (int64_t i = 0; i < na; i++) {
        while (j < nb && b[j] < a[i]) j++;
        if (j < nb && b[j] == a[i] && (valid == NULL || valid[j])) {
            pos[i] = j;
            found++;
        } else {
            pos[i] = -1;
        }
    }
    return found;
}

/* valid[j] = 0 for each b[j] that appears in a (both sorted, distinct). */
void rc_invalidate_sorted(const int64_t *a, int64_t na, const int64_t *b, int64_t nb,
                          uint8_t *valid) {
    int64_t i = 0;
    for (int64_t j = 0; j < nb; j++) {
        while (i < na && a[i] < b[j]) i++;
        if (i < na && a[i] == b[j]) valid[j] = 0;
    }
}

/*
 * dst row (dst_idx ? dst_idx[i] : i) = src row (src_idx ? src_idx[i] : i) for i < n, row_bytes
 * each; a negative index skips the row. Rows are prefetched a few ahead (random rows of a large
 * table or a file mapping are latency bound).
 */
void rc_copy_rows(const char *src, int64_t src_stride, const int64_t *src_idx, char *dst,
                  int64_t dst_stride, const int64_t *dst_idx, int64_t n, int64_t row_bytes,
                  int threads) {
    const int64_t ahead = 8;
#pragma omp parallel for schedule(static) num_threads(threads) if (n > 4096 && threads > 1)
    for (int64_t i = 0; i < n; i++) {
        if (i + ahead < n) {
            const int64_t si = src_idx ? src_idx[i + ahead] : i + ahead;
            const int64_t di = dst_idx ? dst_idx[i + ahead] : i + ahead;
            if (si >= 0) __builtin_prefetch(src + si * src_stride, 0, 0);
            if (di >= 0) __builtin_prefetch(dst + di * dst_stride, 1, 0);
        }
        const int64_t si = src_idx ? src_idx[i] : i;
        const int64_t di = dst_idx ? dst_idx[i] : i;
        if (si < 0 || di < 0) continue;
        memcpy(dst + di * dst_stride, src + si * src_stride, (size_t)row_bytes);
    }
}
