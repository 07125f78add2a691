/* Table-batched embedding on the CPU: pooled forward and backward fused with the row optimizer.
 *
 * Plain C + OpenMP, no torch headers: compiled on first use by neorec/ops/cpu.py and called
 * through ctypes with raw pointers of contiguous tensors. Layout and semantics are those of
 * neorec/ops/tbe.py (ReferenceBackend) and neorec/ops/row_optim.py.
 *
 * Backward, in three passes over the batch:
 *   1. one 64-bit key per occurrence: global row (row_offsets[t] + id) in the high bits, and in
 *      the low bits a payload: the offset of its gradient row in grad_output (or, with per-sample
 *      weights, its position);
 *   2. a stable LSD radix sort on the row bits only (as many passes as the row count needs, not
 *      64 bits): each row's occurrences end up adjacent, still in (feature, batch position) order;
 *   3. each distinct row is summed in that order and updated by one thread, in place.
 * Scratch is O(occurrences), never O(rows), and there is no weight-sized gradient.
 *
 * Return codes of the entry points: TBE_OK, or one of the TBE_E* codes with details in err[]:
 *   TBE_EID      err[0] = first position p (into indices) whose id is outside its table
 *   TBE_EOFFSETS err[0] = first bag whose offsets decrease
 *   TBE_ENOMEM   the workspace passed in is smaller than tbe_backward_workspace() asked for
 * Nothing is written to weights or state unless the whole batch passed these checks.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TBE_OK 0
#define TBE_EID 1
#define TBE_EOFFSETS 2
#define TBE_ENOMEM 3

enum { OPT_SGD = 0, OPT_ROWWISE_ADAGRAD = 1, OPT_ADAM = 2 };

/* Lookahead of software prefetches, in occurrences (PF_DIST) and distinct rows (PF_ROWS): enough
 * to cover DRAM latency with a few rows of work in between. */
#ifndef PF_DIST
#define PF_DIST 12
#endif
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
/* Widest radix digit: 2^11 counters (16 KiB) stay in L1; 23-bit rows sort in 3 passes. */
#ifndef MAX_DIGIT_BITS
#define MAX_DIGIT_BITS 11
#endif
/* Work chunks per thread for dynamically scheduled loops (sort, update). */
#define CHUNKS_PER_THREAD 8

typedef struct {
    int64_t F, B, T, total_dim;
    const int64_t *feature_table, *rows, *dims, *elem_offsets, *row_offsets, *out_offsets;
} layout_t;

static inline void prefetch_row(const float *p, int64_t dim, int write) {
    const char *c = (const char *)p;
    for (int64_t off = 0; off < dim * (int64_t)sizeof(float); off += 64) {
        if (write)
            __builtin_prefetch(c + off, 1, 3);
        else
            __builtin_prefetch(c + off, 0, 3);
    }
}

/* Offsets must not decrease (else bag ranges would overlap or run backwards). */
static int check_offsets(const int64_t *offsets, int64_t nbags, int64_t *err) {
    for (int64_t i = 0; i < nbags; ++i) {
        if (offsets[i + 1] < offsets[i]) {
            err[0] = i;
            return TBE_EOFFSETS;
        }
    }
    return TBE_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                    */
/* ------------------------------------------------------------------------------------------ */

int tbe_forward(const layout_t *L, const float *weights, const int64_t *indices,
                const int64_t *offsets, const float *psw, int mean, float *out, int nthreads,
                int64_t *err) {
    const int64_t F = L->F, B = L->B;
    int rc = check_offsets(offsets, F * B, err);
    if (rc != TBE_OK) return rc;
    int64_t bad = INT64_MAX;
#pragma omp parallel num_threads(nthreads) reduction(min : bad)
    for (int64_t f = 0; f < F; ++f) {
        const int64_t t = L->feature_table[f];
        const int64_t D = L->dims[t];
        const uint64_t R = (uint64_t)L->rows[t];
        const float *W = weights + L->elem_offsets[t];
        const int64_t *off = offsets + f * B;
        const int64_t fend = off[B];
        /* Dynamic chunks (robust to a thread losing its core); no barrier needed between
         * features since bags write disjoint outputs. */
#pragma omp for schedule(dynamic, 64) nowait
        for (int64_t b = 0; b < B; ++b) {
            float *restrict o = out + b * L->total_dim + L->out_offsets[f];
            const int64_t lo = off[b], hi = off[b + 1];
            memset(o, 0, (size_t)D * sizeof(float));
            for (int64_t p = lo; p < hi; ++p) {
                if (p + PF_DIST < fend) {
                    const uint64_t q = (uint64_t)indices[p + PF_DIST];
                    if (q < R) prefetch_row(W + q * D, D, 0);
                }
                const uint64_t id = (uint64_t)indices[p];
                if (id >= R) { /* unsigned compare also catches negative ids */
                    if (p < bad) bad = p;
                    continue;
                }
                const float *restrict r = W + id * D;
                if (psw) {
                    const float s = psw[p];
                    for (int64_t d = 0; d < D; ++d) o[d] += r[d] * s;
                } else {
                    for (int64_t d = 0; d < D; ++d) o[d] += r[d];
                }
            }
            if (mean && hi > lo) {
                const float n = (float)(hi - lo);
                for (int64_t d = 0; d < D; ++d) o[d] /= n;
            }
        }
    }
    if (bad != INT64_MAX) {
        err[0] = bad;
        return TBE_EID;
    }
    return TBE_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Stable parallel LSD radix sort of 64-bit keys by bits [lo_bit, hi_bit), optionally carrying */
/* a 64-bit payload. Stability makes equal keys keep input order: the fixed summation order.  */
/* The input is cut into a fixed number of chunks handed out dynamically (a thread delayed by  */
/* another process does not hold the others up); each chunk has its own histogram, so the     */
/* result does not depend on which thread took which chunk. Call from inside a parallel       */
/* region, by all its threads.                                                                 */
/* ------------------------------------------------------------------------------------------ */

static void radix_sort(uint64_t **keys, uint64_t **tmp, uint64_t **vals, uint64_t **vtmp,
                       int64_t n, int lo_bit, int hi_bit, int64_t *hist /* [chunks][1<<digit] */,
                       int64_t chunks) {
    const int span = hi_bit - lo_bit;
    const int passes = span <= 0 ? 0 : (span + MAX_DIGIT_BITS - 1) / MAX_DIGIT_BITS;
    if (passes == 0) return;
    const int digit = (span + passes - 1) / passes;
    const int64_t nb = (int64_t)1 << digit;
    const uint64_t mask = (uint64_t)nb - 1;
    for (int pass = 0; pass < passes; ++pass) {
        const int shift = lo_bit + pass * digit;
        const uint64_t *restrict src = *keys;
        uint64_t *restrict dst = *tmp;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
            int64_t *h = hist + c * nb;
            memset(h, 0, (size_t)nb * sizeof(int64_t));
            for (int64_t i = n * c / chunks; i < n * (c + 1) / chunks; ++i)
                h[(src[i] >> shift) & mask]++;
        } /* implicit barrier */
#pragma omp single
        {
            /* Digit-major, chunk-minor exclusive prefix: earlier chunks' items of a digit first. */
            int64_t sum = 0;
            for (int64_t d = 0; d < nb; ++d) {
                for (int64_t c = 0; c < chunks; ++c) {
                    const int64_t cnt = hist[c * nb + d];
                    hist[c * nb + d] = sum;
                    sum += cnt;
                }
            }
        } /* implicit barrier */
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
            int64_t *h = hist + c * nb;
            const int64_t beg = n * c / chunks, end = n * (c + 1) / chunks;
            if (vals) {
                const uint64_t *restrict vs = *vals;
                uint64_t *restrict vd = *vtmp;
                for (int64_t i = beg; i < end; ++i) {
                    const int64_t at = h[(src[i] >> shift) & mask]++;
                    dst[at] = src[i];
                    vd[at] = vs[i];
                }
            } else {
                for (int64_t i = beg; i < end; ++i) dst[h[(src[i] >> shift) & mask]++] = src[i];
            }
        } /* implicit barrier */
#pragma omp single
        {
            uint64_t *x = *keys;
            *keys = *tmp;
            *tmp = x;
            if (vals) {
                x = *vals;
                *vals = *vtmp;
                *vtmp = x;
            }
        } /* implicit barrier */
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Fused backward + optimizer                                                                 */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    int kind;
    float lr, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay, bc1, bc2;
} optim_t;

static int bits_for(uint64_t x) { /* bits to represent values in [0, x] */
    int b = 0;
    while (b < 64 && (x >> b) != 0) ++b;
    return b;
}

static inline void apply_row(const optim_t *o, float *restrict w, float *restrict g, int64_t D,
                             float *m1, float *restrict m, float *restrict v) {
    if (o->weight_decay != 0.0f) {
        const float wd = o->weight_decay;
        for (int64_t d = 0; d < D; ++d) g[d] += wd * w[d];
    }
    if (o->kind == OPT_SGD) {
        const float lr = o->lr;
        for (int64_t d = 0; d < D; ++d) w[d] -= lr * g[d];
    } else if (o->kind == OPT_ROWWISE_ADAGRAD) {
        float ss = 0.0f;
        /* omp simd lets the compiler vectorize the reduction without -ffast-math; the order
         * is fixed by the binary, so it is still deterministic. */
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; ++d) ss += g[d] * g[d];
        const float s = *m1 + ss / (float)D;
        *m1 = s;
        const float mult = o->lr / (sqrtf(s) + o->eps);
        for (int64_t d = 0; d < D; ++d) w[d] -= g[d] * mult;
    } else {
        const float b1 = o->beta1, b2 = o->beta2, c1 = o->one_minus_beta1,
                    c2 = o->one_minus_beta2, bc1 = o->bc1, bc2 = o->bc2, lr = o->lr, eps = o->eps;
        for (int64_t d = 0; d < D; ++d) {
            const float md = m[d] * b1 + c1 * g[d];
            const float vd = v[d] * b2 + c2 * g[d] * g[d];
            m[d] = md;
            v[d] = vd;
            w[d] -= lr * (md / bc1) / (sqrtf(vd / bc2) + eps);
        }
    }
}

/* What the row-update loop reads: sorted keys (+ payloads) and where gradients and rows live. */
typedef struct {
    const layout_t *L;
    float *weights, *momentum1, *exp_avg, *exp_avg_sq;
    const uint64_t *keys, *vals;
    const int64_t *gofs_of;
    const float *G, *psw;
    const optim_t *opt;
    int64_t base;
    int kshift;
    uint64_t vmask;
    int packed;
} update_t;

static inline uint64_t payload(const update_t *U, int64_t j) {
    return U->packed ? (U->keys[j] & U->vmask) : U->vals[j];
}

/* Offset in G of the gradient row of sorted occurrence j. */
static inline int64_t grad_offset(const update_t *U, int64_t j) {
    const uint64_t v = payload(U, j);
    return U->psw ? U->gofs_of[v] : (int64_t)v;
}

/* Sum and apply the rows whose occurrences are sorted positions [beg, end), whole rows only. */
static void update_rows(const update_t *U, int64_t beg, int64_t end, float *gacc) {
    const layout_t *L = U->L;
    const int ks = U->kshift;
    const uint64_t *keys = U->keys;
    /* Weight (and state) rows are prefetched PF_ROWS distinct rows ahead: with skewed ids a hot
     * row's occurrences would hide the next rows from an occurrence-distance lookahead. pf_i
     * scans ahead over whole rows, pf_t is its table. */
    int64_t t = 0, pf_t = 0, pf_i = beg, ahead = 0, i = beg;
    while (i < end) {
        const uint64_t row = keys[i] >> ks;
        while ((uint64_t)L->row_offsets[t + 1] <= row) ++t;
        for (; ahead < PF_ROWS && pf_i < end; ++ahead) {
            const uint64_t ra = keys[pf_i] >> ks;
            while ((uint64_t)L->row_offsets[pf_t + 1] <= ra) ++pf_t;
            const int64_t Da = L->dims[pf_t];
            const int64_t ea =
                L->elem_offsets[pf_t] + (int64_t)(ra - (uint64_t)L->row_offsets[pf_t]) * Da;
            prefetch_row(U->weights + ea, Da, 1);
            if (U->momentum1) __builtin_prefetch(U->momentum1 + ra, 1, 3);
            if (U->exp_avg) {
                prefetch_row(U->exp_avg + ea, Da, 1);
                prefetch_row(U->exp_avg_sq + ea, Da, 1);
            }
            while (pf_i < end && (keys[pf_i] >> ks) == ra) ++pf_i;
        }
        --ahead; /* this row is now being consumed */
        const int64_t D = L->dims[t];
        const int64_t eo = L->elem_offsets[t] + (int64_t)(row - (uint64_t)L->row_offsets[t]) * D;
        memset(gacc, 0, (size_t)D * sizeof(float));
        for (; i < end && (keys[i] >> ks) == row; ++i) {
            /* Gradient rows of upcoming occurrences are scattered over grad_output. */
            if (i + PF_DIST < end) {
                if (U->psw && i + 2 * PF_DIST < end)
                    __builtin_prefetch(U->gofs_of + payload(U, i + 2 * PF_DIST), 0, 3);
                prefetch_row(U->G + grad_offset(U, i + PF_DIST), D, 0);
            }
            const float *restrict g = U->G + grad_offset(U, i);
            if (U->psw) {
                const float s = U->psw[U->base + (int64_t)payload(U, i)];
                for (int64_t d = 0; d < D; ++d) gacc[d] += g[d] * s;
            } else {
                for (int64_t d = 0; d < D; ++d) gacc[d] += g[d];
            }
        }
        apply_row(U->opt, U->weights + eo, gacc, D, U->momentum1 ? U->momentum1 + row : NULL,
                  U->exp_avg ? U->exp_avg + eo : NULL, U->exp_avg_sq ? U->exp_avg_sq + eo : NULL);
    }
}

/* Scratch layout of one backward call; the caller allocates it once and reuses it, so the
 * steady state takes no page faults. */
typedef struct {
    int64_t n;             /* occurrences */
    int rbits, vbits;      /* bits of the global row and of the payload */
    int packed;            /* payload packed below the row bits of one word */
    int64_t keys, tmp, vals, vtmp, gofs_of, hist, scaled, gbuf, total; /* byte offsets */
} plan_t;

static int64_t align64(int64_t x) { return (x + 63) & ~(int64_t)63; }

static plan_t make_plan(const layout_t *L, int64_t n, int has_psw, int mean, int nthreads,
                        int force_pairs) {
    plan_t P;
    memset(&P, 0, sizeof(P));
    const int64_t T = L->T, TD = L->total_dim, B = L->B;
    int64_t max_dim = 1;
    for (int64_t t = 0; t < T; ++t)
        if (L->dims[t] > max_dim) max_dim = L->dims[t];
    P.n = n;
    P.rbits = bits_for((uint64_t)(L->row_offsets[T] > 0 ? L->row_offsets[T] - 1 : 0));
    /* Payload: the offset of the occurrence's gradient row in grad_output, or (with per-sample
     * weights, which need the position) the position itself. */
    P.vbits = has_psw ? bits_for((uint64_t)(n > 0 ? n - 1 : 0))
                      : bits_for((uint64_t)(B * TD > 0 ? B * TD - 1 : 0));
    P.packed = !force_pairs && P.rbits + P.vbits <= 64;
    int64_t at = 0;
    const int64_t words = align64(n * (int64_t)sizeof(uint64_t));
    P.keys = at, at += words;
    P.tmp = at, at += words;
    if (!P.packed) P.vals = at, at += words, P.vtmp = at, at += words;
    if (has_psw) P.gofs_of = at, at += words;
    P.hist = at, at += align64(CHUNKS_PER_THREAD * (int64_t)nthreads * ((int64_t)1 << MAX_DIGIT_BITS) * 8);
    if (mean) P.scaled = at, at += align64(B * TD * (int64_t)sizeof(float));
    P.gbuf = at, at += align64((int64_t)nthreads * max_dim * (int64_t)sizeof(float));
    P.total = at;
    return P;
}

/* Bytes of scratch that tbe_backward_update needs for this batch. */
int64_t tbe_backward_workspace(const layout_t *L, const int64_t *offsets, int has_psw, int mean,
                               int nthreads, int force_pairs) {
    const int64_t n = offsets[L->F * L->B] - offsets[0];
    return make_plan(L, n, has_psw, mean, nthreads > 0 ? nthreads : 1, force_pairs).total;
}

int tbe_backward_update(const layout_t *L, float *weights, const int64_t *indices,
                        const int64_t *offsets, const float *psw, int mean,
                        const float *grad_out, const optim_t *opt, float *momentum1,
                        float *exp_avg, float *exp_avg_sq, int nthreads, int force_pairs,
                        char *ws, int64_t ws_bytes, int64_t *err) {
    const int64_t F = L->F, B = L->B, TD = L->total_dim, nbags = F * B;
    int rc = check_offsets(offsets, nbags, err);
    if (rc != TBE_OK) return rc;
    const int64_t base = offsets[0];
    const int64_t n = offsets[nbags] - base;
    if (n <= 0) return TBE_OK;
    const int nt_req = nthreads > 0 ? nthreads : 1;
    const plan_t P = make_plan(L, n, psw != NULL, mean, nt_req, force_pairs);
    if (ws_bytes < P.total) return TBE_ENOMEM;
    const int packed = P.packed;
    /* Sort key: global row (row_offsets[t] + id) above the payload bits, so one stable sort
     * groups every table's occurrences at once; stability keeps (feature, batch position)
     * order within a row. If both do not fit 64 bits, the payload travels in its own array. */
    const int kshift = packed ? P.vbits : 0;
    const uint64_t vmask = packed ? (P.vbits >= 64 ? ~0ULL : ((1ULL << P.vbits) - 1)) : 0;
    uint64_t *keys = (uint64_t *)(ws + P.keys), *tmp = (uint64_t *)(ws + P.tmp);
    uint64_t *vals = packed ? NULL : (uint64_t *)(ws + P.vals);
    uint64_t *vtmp = packed ? NULL : (uint64_t *)(ws + P.vtmp);
    int64_t *gofs_of = psw ? (int64_t *)(ws + P.gofs_of) : NULL;
    int64_t *hist = (int64_t *)(ws + P.hist);
    float *scaled = mean ? (float *)(ws + P.scaled) : NULL;
    const float *G = mean ? scaled : grad_out;
    int64_t max_dim = 1;
    for (int64_t t = 0; t < L->T; ++t)
        if (L->dims[t] > max_dim) max_dim = L->dims[t];

    int64_t bad = INT64_MAX;
#pragma omp parallel num_threads(nt_req)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t my_bad = INT64_MAX;
        /* 1. Keys; ids are range-checked before anything is written to weights or state. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nbags; ++i) {
            const int64_t f = i / B, b = i % B, t = L->feature_table[f];
            const uint64_t R = (uint64_t)L->rows[t], r0 = (uint64_t)L->row_offsets[t];
            const uint64_t gofs = (uint64_t)(b * TD + L->out_offsets[f]);
            for (int64_t p = offsets[i]; p < offsets[i + 1]; ++p) {
                const uint64_t id = (uint64_t)indices[p];
                const uint64_t q = (uint64_t)(p - base);
                if (id >= R) { /* unsigned compare also catches negative ids */
                    if (p < my_bad) my_bad = p;
                    continue;
                }
                const uint64_t v = psw ? q : gofs;
                if (psw) gofs_of[q] = (int64_t)gofs;
                if (packed) {
                    keys[q] = ((r0 + id) << kshift) | v;
                } else {
                    keys[q] = r0 + id;
                    vals[q] = v;
                }
            }
        }
        /* Mean pooling: d(out)/len once per bag, the same float division as the reference. */
        if (mean) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < nbags; ++i) {
                const int64_t f = i / B, b = i % B, D = L->dims[L->feature_table[f]];
                const int64_t len = offsets[i + 1] - offsets[i];
                const float ln = (float)(len > 0 ? len : 1);
                const int64_t o = b * TD + L->out_offsets[f];
                for (int64_t d = 0; d < D; ++d) scaled[o + d] = grad_out[o + d] / ln;
            }
        }
#pragma omp critical
        if (my_bad < bad) bad = my_bad;
#pragma omp barrier
        if (bad == INT64_MAX) {
            /* 2. Group occurrences by global row, keeping input order within a row. */
            radix_sort(&keys, &tmp, packed ? NULL : &vals, &vtmp, n, kshift, kshift + P.rbits,
                       hist, CHUNKS_PER_THREAD * (int64_t)nt_req);
            /* 3. The sorted occurrences are cut into chunks moved to row boundaries, so every
             * row is summed and updated by exactly one thread, in sorted order: bitwise the same
             * result for any thread count or schedule. */
            const update_t U = {L,        weights, momentum1, exp_avg, exp_avg_sq, keys,
                                vals,     gofs_of, G,         psw,     opt,        base,
                                kshift,   vmask,   packed};
            float *gacc = (float *)(ws + P.gbuf) + (int64_t)tid * max_dim;
            const int64_t chunks = CHUNKS_PER_THREAD * (int64_t)nt;
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < chunks; ++c) {
                int64_t beg = n * c / chunks, end = n * (c + 1) / chunks;
                while (beg > 0 && beg < n && (keys[beg] >> kshift) == (keys[beg - 1] >> kshift))
                    ++beg;
                while (end < n && (keys[end] >> kshift) == (keys[end - 1] >> kshift)) ++end;
                update_rows(&U, beg, end, gacc);
            }
        }
    }
    if (bad != INT64_MAX) {
        err[0] = bad;
        rc = TBE_EID;
    }
    return rc;
}
