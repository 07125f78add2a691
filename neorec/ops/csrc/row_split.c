/*
 * Row-range split of one feature's bags (neorec.ops.row_split): the ids of a row-split table
 * (row-wise, table-row-wise) go to the shard whose rows hold them. Compiled into the same library
 * as tbe_cpu.c. neorec/ops/row_split.py has the torch version it must match bitwise (tests
 * compare the two).
 *
 * Input: n ids in bag order (b bags of lengths[i] ids), optional per-id weights, and the k
 * shards' first rows starts[0..k) in ascending order (starts[0] is the table's first row). An id
 * v goes to bucket j = the number of starts[1..k) <= v. Output, per bucket in order, its ids in
 * input order minus starts[j] (out), their weights (out_w), and counts[j * b + i], the ids of
 * bag i in bucket j. Two passes: count, then place (a stable counting sort by bucket).
 */
#include <stdint.h>

static inline int64_t rs_bucket(int64_t v, const int64_t *starts, int64_t k) {
    if (k <= 8) { /* branch-free: ids are random, a comparison's branch mispredicts half the time */
        int64_t j = 0;
        for (int64_t m = 1; m < k; m++) j += starts[m] <= v;
        return j;
    }
    int64_t lo = 0, hi = k - 1; /* the last j with starts[j] <= v (or 0) */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (starts[mid] <= v) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Returns 0; -1 when a length is negative or they do not add up to n (nothing read or written
 * past the buffers). */
int64_t rs_split(const int64_t *vals, const float *w, int64_t n, const int64_t *lengths, int64_t b,
                 const int64_t *starts, int64_t k, int64_t *out, float *out_w, int64_t *counts) {
    int64_t total = 0;
    for (int64_t i = 0; i < b; i++) {
        if (lengths[i] < 0) return -1;
        total += lengths[i];
    }
    if (total != n) return -1;
    for (int64_t j = 0; j < k * b; j++) counts[j] = 0;
    int64_t p = 0;
    for (int64_t i = 0; i < b; i++) {
        for (int64_t e = p + lengths[i]; p < e; p++) counts[rs_bucket(vals[p], starts, k) * b + i]++;
    }
    int64_t pos[k > 0 ? k : 1];
    int64_t acc = 0;
    for (int64_t j = 0; j < k; j++) {
        pos[j] = acc;
        for (int64_t i = 0; i < b; i++) acc += counts[j * b + i];
    }
    for (int64_t q = 0; q < n; q++) {
        int64_t j = rs_bucket(vals[q], starts, k);
        out[pos[j]] = vals[q] - starts[j];
        if (w) out_w[pos[j]] = w[q];
        pos[j]++;
    }
    return 0;
}
