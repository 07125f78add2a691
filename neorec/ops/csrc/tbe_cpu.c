/* Table-batched embedding on the CPU: pooled forward and backward fused with the row optimizer.
 *
 * Plain C + OpenMP, no torch headers: compiled on first use by neorec/ops/cpu.py and called
 * through ctypes with raw pointers of contiguous tensors. Layout and semantics are those of
 * neorec/ops/tbe.py (ReferenceBackend) and neorec/ops/row_optim.py.
 *
 * Backward, in three passes over the batch:
 *   1. one 64-bit key per occurrence: global row (row_offsets[t] + id) in the high bits, and in
 *      the low bits a payload: the offset of its gradient row in the output gradient regrouped
 *      feature-major (or, with per-sample weights, its position); each key is built as the first
 *      radix pass scatters it, so the unsorted keys are never written out;
 *   2. the keys are grouped by table, and each table's segment gets a stable LSD radix
 *      sort on its local row bits only (as many passes as one table's row count needs, not 64
 *      bits): each row's occurrences end up adjacent, still in (feature, batch position) order;
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
#ifdef __AVX__
#include <immintrin.h>
#endif

#define TBE_OK 0
#define TBE_EID 1
#define TBE_EOFFSETS 2
#define TBE_ENOMEM 3

enum { OPT_SGD = 0, OPT_ROWWISE_ADAGRAD = 1, OPT_ADAM = 2 };

/* Lookahead of software prefetches, in occurrences (PF_DIST) and distinct rows (PF_ROWS): enough
 * to cover DRAM latency with a few rows of work in between. */
#ifndef PF_DIST
#define PF_DIST 16
#endif
/* The forward looks further ahead: with skewed ids most rows it reads are cache hits, so covering
 * as many DRAM misses takes more occurrences (8 x 1M x 64, batch 2048, pooling 100: forward
 * 12.0 -> 10.9 ms at Zipf 1.05, 20.8 -> 21.2 ms uniform). */
#ifndef FWD_PF_DIST
#define FWD_PF_DIST 32
#endif
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
/* Widest radix digit: 2^11 counters (16 KiB) stay in L1; 23-bit rows sort in 3 passes. */
#ifndef MAX_DIGIT_BITS
#define MAX_DIGIT_BITS 11
#endif
/* Work chunks per thread for the dynamically scheduled sort loops. */
#define CHUNKS_PER_THREAD 8
/* ... and for the row update: smaller pieces leave less idle time at the end of the loop when
 * chunks take unequal times (update phase -0.1 to -0.2 ms of ~13 at Zipf 1.05 on 8 x 1M x 64,
 * 2 threads, against 8 per thread). */
#define UPDATE_CHUNKS_PER_THREAD 32

typedef struct {
    int64_t F, B, T, total_dim;
    const int64_t *feature_table, *rows, *dims, *elem_offsets, *row_offsets, *out_offsets;
} layout_t;

/* Software prefetches are plain reads into L2 (prefetcht1), also for rows about to be written:
 * on this class of CPU the L1 has few miss buffers, and targeting L2 keeps many more row misses in
 * flight (random 256-byte row gathers measured ~25% faster than with prefetcht0 / prefetchw). A
 * line read while no other core holds it arrives exclusive, so the later store needs no upgrade. */
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif
static inline void prefetch_row(const float *p, int64_t dim) {
    const char *c = (const char *)p;
    for (int64_t off = 0; off < dim * (int64_t)sizeof(float); off += 64)
        __builtin_prefetch(c + off, 0, PF_LOCALITY);
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

/* Eight floats; unaligned, and allowed to alias float rows. */
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));

/* nv * 8 <= 64 columns of one bag (W and o point at the block's first column; rows are D
 * apart): the sum lives in nv vector registers and is stored once (no zeroing then
 * read-modify-write of the output). Same operations in the same order as
 * the generic loop (0 + r0 + r1 + ..., products rounded before the add), so bitwise the same. */
static inline __attribute__((always_inline)) void bag_vec(const float *W, uint64_t R, int64_t D,
                                                          const int64_t *indices, const float *psw,
                                                          int64_t lo, int64_t hi, int64_t fend,
                                                          int mean, float *o, int64_t *bad,
                                                          const int nv) {
    v8f acc[8];
    for (int k = 0; k < nv; ++k) acc[k] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t p = lo; p < hi; ++p) {
        if (p + FWD_PF_DIST < fend) {
            const uint64_t q = (uint64_t)indices[p + FWD_PF_DIST];
            if (q < R) { /* prefetch_row with a constant trip count: fully unrolled */
                const char *c = (const char *)(W + q * D);
                for (int k = 0; k < nv; k += 2) __builtin_prefetch(c + 32 * k, 0, PF_LOCALITY);
            }
        }
        const uint64_t id = (uint64_t)indices[p];
        if (id >= R) { /* unsigned compare also catches negative ids */
            if (p < *bad) *bad = p;
            continue;
        }
        const v8f *r = (const v8f *)(W + id * D);
        if (psw) {
            const float s = psw[p];
            for (int k = 0; k < nv; ++k) acc[k] += r[k] * s;
        } else {
            for (int k = 0; k < nv; ++k) acc[k] += r[k];
        }
    }
    if (mean && hi > lo) {
        const float n = (float)(hi - lo);
        for (int k = 0; k < nv; ++k) acc[k] /= n;
    }
    for (int k = 0; k < nv; ++k) ((v8f *)o)[k] = acc[k];
}

int tbe_forward(const layout_t *L, const float *weights, const int64_t *indices,
                const int64_t *offsets, const float *psw, int mean, float *out, int nthreads,
                int64_t *err) {
    const int64_t F = L->F, B = L->B;
    int rc = check_offsets(offsets, F * B, err);
    if (rc != TBE_OK) return rc;
    int64_t bad = INT64_MAX;
    /* One loop over all bags, feature-major, in dynamic chunks (robust to a thread losing its
     * core); bags write disjoint outputs. */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 64) reduction(min : bad)
    for (int64_t i = 0; i < F * B; ++i) {
        const int64_t f = i / B, b = i - f * B;
        const int64_t t = L->feature_table[f];
        const int64_t D = L->dims[t];
        const uint64_t R = (uint64_t)L->rows[t];
        const float *W = weights + L->elem_offsets[t];
        const int64_t fend = offsets[(f + 1) * B];
        float *restrict o = out + b * L->total_dim + L->out_offsets[f];
        const int64_t lo = offsets[i], hi = offsets[i + 1];
        if (D > 0 && D % 8 == 0) {
            /* 64 columns at a time, each block summed in registers by bag_vec (every column's
             * operations as in the generic loop below, so bitwise the same) and stored once.
             * The generic loop reads and writes the output row once per id, and when the row is
             * not 64-byte aligned (the dims before it, or the row width, not multiples of 16)
             * every one of those accesses splits a cache line: a 1,836 x 8 table next to two
             * dim-128 tables made their forward ~15% slower that way. */
            for (int64_t c0 = 0; c0 < D; c0 += 64) {
                const int64_t w = D - c0 < 64 ? D - c0 : 64;
                switch (w / 8) { /* constant nv: each case is unrolled into registers */
#define BAG_CASE(k) \
    case k: bag_vec(W + c0, R, D, indices, psw, lo, hi, fend, mean, o + c0, &bad, k); break;
                    BAG_CASE(1) BAG_CASE(2) BAG_CASE(3) BAG_CASE(4)
                    BAG_CASE(5) BAG_CASE(6) BAG_CASE(7) BAG_CASE(8)
#undef BAG_CASE
                    default: break;
                }
            }
            continue;
        }
        memset(o, 0, (size_t)D * sizeof(float));
        for (int64_t p = lo; p < hi; ++p) {
            if (p + FWD_PF_DIST < fend) {
                const uint64_t q = (uint64_t)indices[p + FWD_PF_DIST];
                if (q < R) prefetch_row(W + q * D, D);
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
    if (bad != INT64_MAX) {
        err[0] = bad;
        return TBE_EID;
    }
    return TBE_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Stable parallel LSD radix sort of 64-bit keys, per table segment                           */
/* ------------------------------------------------------------------------------------------ */

/* The keys are grouped by table (one contiguous segment per table, each in feature then
 * position order), so each segment only needs sorting by its local row, (key >> kshift) -
 * row_offsets[t]: log2 of one table's rows, often one pass fewer than the global row (8 x 1M
 * rows: 2 passes of 10 bits instead of 3 of 8). All segments go through each pass together.
 * Stability keeps equal keys in input order: the fixed summation order. Segments are cut into a
 * fixed set of chunks handed out dynamically (a thread delayed by another process does not hold
 * the others up); each chunk has its own histogram, so the result does not depend on which
 * thread took which chunk. A chunk never spans two features: chunk c holds the occurrences at
 * input positions cpos[c] ... of feature cfeat[c], so the first pass can read ids straight from
 * the batch and build each key as it scatters it (see tbe_backward_update). */
typedef struct {
    int64_t nchunks;
    const int64_t *cbeg;     /* [nchunks + 1] chunk c covers key slots [cbeg[c], cbeg[c + 1]) */
    const uint64_t *csub;    /* [nchunks] row_offsets[t] << kshift of the chunk's table */
    const int64_t *cfirst;   /* [nchunks] first chunk of the chunk's segment */
    const int64_t *cfeat;    /* [nchunks] the chunk's feature */
    const int64_t *cpos;     /* [nchunks] input position of the chunk's first occurrence */
    const int64_t *cbag;     /* [nchunks] the bag holding cpos[c] (or before it: empty bags) */
    int kshift, lbits;       /* local row bits start at kshift, lbits of them */
} segs_t;

/* Passes and digit width for lbits local row bits: the fewest passes of at most
 * MAX_DIGIT_BITS bits. The first pass always runs (with 0 bits, one bucket: a plain copy). */
static void radix_geometry(int lbits, int *passes, int *digit) {
    *passes = lbits <= 0 ? 1 : (lbits + MAX_DIGIT_BITS - 1) / MAX_DIGIT_BITS;
    *digit = lbits <= 0 ? 0 : (lbits + *passes - 1) / *passes;
}

/* Per segment, digit-major, chunk-minor exclusive prefix from the segment's start: earlier
 * chunks' items of a digit first. */
static void radix_prefix(const segs_t *S, int64_t *hist, int64_t nb) {
    const int64_t chunks = S->nchunks;
    for (int64_t c0 = 0; c0 < chunks;) {
        int64_t c1 = c0 + 1;
        while (c1 < chunks && S->cfirst[c1] == c0) ++c1;
        int64_t sum = S->cbeg[c0];
        for (int64_t d = 0; d < nb; ++d) {
            for (int64_t c = c0; c < c1; ++c) {
                const int64_t cnt = hist[c * nb + d];
                hist[c * nb + d] = sum;
                sum += cnt;
            }
        }
        c0 = c1;
    }
}

/* Digit counts of two chunks, xa[0, na) into ha and xb[0, nb) into hb (zeroed here, 2^digit
 * counters each, ha and hb adjacent), digit ((x - sub) >> shift) & mask, in one interleaved loop:
 * two independent chains of counter updates, so a run of equal digits (a hot row, after the
 * first pass) does not serialize on one counter's store-to-load latency (measured: the second
 * pass's count 1.06 -> 0.76 ms under Zipf ids, unchanged for uniform). With check, returns
 * whether any x >= R (ids: an unsigned compare also catches negative ones). */
static inline __attribute__((always_inline)) uint64_t
count_pair(const uint64_t *restrict xa, int64_t na, const uint64_t *restrict xb, int64_t nb,
           uint64_t sub, int shift, uint64_t mask, int64_t *ha, const int check, uint64_t R) {
    int64_t *hb = ha + mask + 1;
    memset(ha, 0, 2 * (size_t)(mask + 1) * sizeof(int64_t));
    const int64_t m = na < nb ? na : nb;
    uint64_t any = 0;
    for (int64_t i = 0; i < m; ++i) {
        if (check) any |= (xa[i] >= R) | (xb[i] >= R);
        ha[((xa[i] - sub) >> shift) & mask]++;
        hb[((xb[i] - sub) >> shift) & mask]++;
    }
    for (int64_t i = m; i < na; ++i) {
        if (check) any |= xa[i] >= R;
        ha[((xa[i] - sub) >> shift) & mask]++;
    }
    for (int64_t i = m; i < nb; ++i) {
        if (check) any |= xb[i] >= R;
        hb[((xb[i] - sub) >> shift) & mask]++;
    }
    return any;
}

/* Digit of key x (its segment's row base sub removed). */
#define DIGIT(x) ((((x) - sub) >> shift) & mask)

/* Passes first_pass, ... of the sort (keys already in *keys, as left by the passes before).
 * Call from inside a parallel region, by all its threads. */
static void radix_sort(uint64_t **keys, uint64_t **tmp, uint64_t **vals, uint64_t **vtmp,
                       const segs_t *S, int64_t *hist /* [chunks][1<<digit] */,
                       int first_pass) {
    int passes, digit;
    radix_geometry(S->lbits, &passes, &digit);
    const int64_t nb = (int64_t)1 << digit;
    const uint64_t mask = (uint64_t)nb - 1;
    const int64_t chunks = S->nchunks; /* even: chunks 2j and 2j + 1 share a segment */
    const int64_t *cbeg = S->cbeg;
    for (int pass = first_pass; pass < passes; ++pass) {
        const int shift = S->kshift + pass * digit;
        const uint64_t *restrict src = *keys;
        uint64_t *restrict dst = *tmp;
        /* Each task counts a pair of chunks (see count_pair). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c += 2)
            count_pair(src + cbeg[c], cbeg[c + 1] - cbeg[c], src + cbeg[c + 1],
                       cbeg[c + 2] - cbeg[c + 1], S->csub[c], shift, mask, hist + c * nb, 0, 0);
        /* implicit barrier */
#pragma omp single
        radix_prefix(S, hist, nb); /* implicit barrier */
        /* The scatter goes chunk by chunk: two chunks at once would write to twice as many
         * destination streams as L1 holds lines, which measured slower. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
            int64_t *h = hist + c * nb;
            const uint64_t sub = S->csub[c];
            const int64_t beg = cbeg[c], end = cbeg[c + 1];
            if (vals) {
                const uint64_t *restrict vs = *vals;
                uint64_t *restrict vd = *vtmp;
                for (int64_t i = beg; i < end; ++i) {
                    const int64_t at = h[DIGIT(src[i])]++;
                    dst[at] = src[i];
                    vd[at] = vs[i];
                }
            } else {
                for (int64_t i = beg; i < end; ++i) dst[h[DIGIT(src[i])]++] = src[i];
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

#undef DIGIT

/* ------------------------------------------------------------------------------------------ */
/* Fused backward + optimizer                                                                 */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    int kind;
    float lr, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay, bc1, bc2;
    float clip_ratio, clip_bound; /* CowClip's r (0: off) and zeta */
    float qat_strength;           /* QAT's periodic regularizer (ops/qat.py) */
    int qat_bits, qat_shape;      /* its grid's bits (0: off); 0 sin, 1 hat */
} optim_t;

static int bits_for(uint64_t x) { /* bits to represent values in [0, x] */
    int b = 0;
    while (b < 64 && (x >> b) != 0) ++b;
    return b;
}

/* A row's sum of squares, in one fixed order for every caller: eight lanes (lane j sums
 * elements j, j + 8, ... in order), then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline float row_sumsq(const float *restrict g, int64_t D) {
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; ++j) l[j] += g[d + j] * g[d + j];
    for (int j = 0; d + j < D; ++j) l[j] += g[d + j] * g[d + j];
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* The vector loop of adam_row, N values of a WIDTH-bit register at a time (16 / 512, 8 / 256):
 * one body for both widths, token-pasted into the intrinsics' names. */
#define ADAM_VECTORS(N, WIDTH)                                                                   \
    {                                                                                          \
        const __m##WIDTH vb1 = _mm##WIDTH##_set1_ps(b1), vb2 = _mm##WIDTH##_set1_ps(b2),       \
                         vc1 = _mm##WIDTH##_set1_ps(c1), vc2 = _mm##WIDTH##_set1_ps(c2),       \
                         vbc1 = _mm##WIDTH##_set1_ps(bc1), vbc2 = _mm##WIDTH##_set1_ps(bc2),   \
                         vlr = _mm##WIDTH##_set1_ps(lr), veps = _mm##WIDTH##_set1_ps(eps);     \
        for (; d + (N) <= D; d += (N)) {                                                       \
            const __m##WIDTH gd = _mm##WIDTH##_loadu_ps(g + d);                                \
            const __m##WIDTH md = _mm##WIDTH##_add_ps(                                         \
                _mm##WIDTH##_mul_ps(_mm##WIDTH##_loadu_ps(m + d), vb1),                        \
                _mm##WIDTH##_mul_ps(vc1, gd));                                                 \
            const __m##WIDTH vd = _mm##WIDTH##_add_ps(                                         \
                _mm##WIDTH##_mul_ps(_mm##WIDTH##_loadu_ps(v + d), vb2),                        \
                _mm##WIDTH##_mul_ps(_mm##WIDTH##_mul_ps(vc2, gd), gd));                        \
            _mm##WIDTH##_storeu_ps(m + d, md);                                                 \
            _mm##WIDTH##_storeu_ps(v + d, vd);                                                 \
            const __m##WIDTH num = _mm##WIDTH##_mul_ps(vlr, _mm##WIDTH##_div_ps(md, vbc1));    \
            const __m##WIDTH den = _mm##WIDTH##_add_ps(                                        \
                _mm##WIDTH##_sqrt_ps(_mm##WIDTH##_div_ps(vd, vbc2)), veps);                    \
            _mm##WIDTH##_storeu_ps(                                                            \
                w + d, _mm##WIDTH##_sub_ps(_mm##WIDTH##_loadu_ps(w + d),                       \
                                           _mm##WIDTH##_div_ps(num, den)));                    \
        }                                                                                      \
    }

/* Adam on one row: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
 * w -= lr (m / bc1) / (sqrt(v / bc2) + eps). Eight (sixteen) values at a time: the vector
 * multiply, add, divide and square root round exactly as the scalar ones, and the operations
 * are the scalar loop's, in its order (no fused multiply-add: -ffp-contract=off), so the result
 * is bitwise the same. The scalar loop calls sqrtf, which keeps errno and so is neither
 * inlined into a vector square root nor vectorized: two divides and a square root a value made
 * Adam's update several times slower than the bytes it moves. */
static inline void adam_row(const optim_t *o, float *restrict w, const float *restrict g,
                            int64_t D, float *restrict m, float *restrict v) {
    const float b1 = o->beta1, b2 = o->beta2, c1 = o->one_minus_beta1, c2 = o->one_minus_beta2,
                bc1 = o->bc1, bc2 = o->bc2, lr = o->lr, eps = o->eps;
    int64_t d = 0;
#if defined(__AVX512F__)
    ADAM_VECTORS(16, 512)
#endif
#if defined(__AVX__)
    ADAM_VECTORS(8, 256)
#endif
    for (; d < D; ++d) {
        const float md = m[d] * b1 + c1 * g[d];
        const float vd = v[d] * b2 + c2 * g[d] * g[d];
        m[d] = md;
        v[d] = vd;
        w[d] -= lr * (md / bc1) / (sqrtf(vd / bc2) + eps);
    }
}

/* CowClip (row_optim.clip_row_grads): the row's gradient g clipped to the norm
 * cnt * max(r ||w||, zeta), cnt its occurrences in the batch. */
static inline void cowclip_row(const optim_t *o, const float *restrict w, float *restrict g,
                               int64_t D, int64_t cnt) {
    const float wn = sqrtf(row_sumsq(w, D)), gn = sqrtf(row_sumsq(g, D));
    const float thr = (float)cnt * fmaxf(o->clip_ratio * wn, o->clip_bound);
    if (gn > thr) {
        const float s = thr / gn;
        for (int64_t d = 0; d < D; ++d) g[d] *= s;
    }
}

/* QAT (qat.periodic_grad, the specification: the same operations in its order): the gradient of
 * the periodic penalty whose minima are the row's grid lo + k s, s = (max - min) / (2^bits - 1),
 * added to g; f = u - round(u) (half to even, as torch.round), u = (w - lo) / s. */
static inline void qat_row(const optim_t *o, const float *restrict w, float *restrict g,
                           int64_t D) {
    float lo = w[0], hi = w[0];
    for (int64_t d = 1; d < D; ++d) {
        lo = w[d] < lo ? w[d] : lo;
        hi = w[d] > hi ? w[d] : hi;
    }
    const float s = (hi - lo) / (float)((1 << o->qat_bits) - 1);
    if (!(s > 0.0f)) return;
    /* 2 pi and pi^2 as doubles (Python's 2 * math.pi, math.pi ** 2), rounded to float */
    const float two_pi = (float)6.283185307179586, pi2 = (float)9.869604401089358;
    if (o->qat_shape == 0) {
        const float coef = o->qat_strength * s / two_pi;
        for (int64_t d = 0; d < D; ++d) {
            const float u = (w[d] - lo) / s, f = u - nearbyintf(u);
            g[d] += coef * sinf(two_pi * f);
        }
    } else {
        const float coef = o->qat_strength * s / pi2;
        for (int64_t d = 0; d < D; ++d) {
            const float u = (w[d] - lo) / s, f = u - nearbyintf(u);
            g[d] += coef * (float)((f > 0.0f) - (f < 0.0f));
        }
    }
}

static inline void apply_row(const optim_t *o, float *restrict w, float *restrict g, int64_t D,
                             float *m1, float *restrict m, float *restrict v, int64_t cnt) {
    if (o->weight_decay != 0.0f) {
        const float wd = o->weight_decay;
        for (int64_t d = 0; d < D; ++d) g[d] += wd * w[d];
    }
    if (o->qat_bits != 0) qat_row(o, w, g, D);
    if (o->clip_ratio != 0.0f) cowclip_row(o, w, g, D, cnt);
    if (o->kind == OPT_SGD) {
        const float lr = o->lr;
        for (int64_t d = 0; d < D; ++d) w[d] -= lr * g[d];
    } else if (o->kind == OPT_ROWWISE_ADAGRAD) {
        const float s = *m1 + row_sumsq(g, D) / (float)D;
        *m1 = s;
        const float mult = o->lr / (sqrtf(s) + o->eps);
        for (int64_t d = 0; d < D; ++d) w[d] -= g[d] * mult;
    } else {
        adam_row(o, w, g, D, m, v);
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
    /* Tables with emit_table[t] set are not updated: each distinct row's summed gradient goes to
     * emit_grads[k * emit_stride ...] and its global row to emit_rows[k], k in sorted row order. */
    const uint8_t *emit_table;
    int64_t *emit_rows;
    float *emit_grads;
    int64_t emit_stride;
} update_t;

static inline uint64_t payload(const update_t *U, int64_t j) {
    return U->packed ? (U->keys[j] & U->vmask) : U->vals[j];
}

/* Offset in G of the gradient row of sorted occurrence j. */
static inline int64_t grad_offset(const update_t *U, int64_t j) {
    const uint64_t v = payload(U, j);
    return U->psw ? U->gofs_of[v] : (int64_t)v;
}

/* Sum the gradients of the row whose occurrences start at sorted position i into gacc (nv * 8
 * floats, nv <= 8), accumulating in registers: 0 + g0 + g1 + ..., the order and roundings of the
 * generic loop. With prefetch, gradient rows are prefetched PF_DIST occurrences ahead (before
 * end). Returns the position after the row's last occurrence. */
static inline __attribute__((always_inline)) int64_t accum_vec(const update_t *U, int64_t i,
                                                               int64_t end, uint64_t row,
                                                               int64_t D, float *gacc,
                                                               const int nv, const int prefetch) {
    const uint64_t *keys = U->keys;
    const int ks = U->kshift;
    v8f acc[8];
    for (int k = 0; k < nv; ++k) acc[k] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    for (; i < end && (keys[i] >> ks) == row; ++i) {
        /* Gradient rows of upcoming occurrences are scattered over the feature's block. */
        if (prefetch && i + PF_DIST < end) {
            if (U->psw && i + 2 * PF_DIST < end)
                __builtin_prefetch(U->gofs_of + payload(U, i + 2 * PF_DIST), 0, 3);
            prefetch_row(U->G + grad_offset(U, i + PF_DIST), D);
        }
        const v8f *g = (const v8f *)(U->G + grad_offset(U, i));
        if (U->psw) {
            const float s = U->psw[U->base + (int64_t)payload(U, i)];
            for (int k = 0; k < nv; ++k) acc[k] += g[k] * s;
        } else {
            for (int k = 0; k < nv; ++k) acc[k] += g[k];
        }
    }
    for (int k = 0; k < nv; ++k) ((v8f *)gacc)[k] = acc[k];
    return i;
}

/* Chunk c of `chunks` over the n sorted occurrences, moved to row boundaries. */
static inline void chunk_bounds(const uint64_t *keys, int kshift, int64_t n, int64_t c,
                                int64_t chunks, int64_t *beg_out, int64_t *end_out) {
    int64_t beg = n * c / chunks, end = n * (c + 1) / chunks;
    while (beg > 0 && beg < n && (keys[beg] >> kshift) == (keys[beg - 1] >> kshift)) ++beg;
    while (end > 0 && end < n && (keys[end] >> kshift) == (keys[end - 1] >> kshift)) ++end;
    *beg_out = beg;
    *end_out = end;
}

/* Distinct rows of emitted tables among sorted positions [beg, end) (whole rows). */
static int64_t count_emitted(const update_t *U, int64_t beg, int64_t end) {
    const layout_t *L = U->L;
    const int ks = U->kshift;
    int64_t t = 0, count = 0;
    for (int64_t i = beg; i < end;) {
        const uint64_t row = U->keys[i] >> ks;
        while ((uint64_t)L->row_offsets[t + 1] <= row) ++t;
        if (U->emit_table[t]) ++count;
        while (i < end && (U->keys[i] >> ks) == row) ++i;
    }
    return count;
}

/* Rows per block of update_rows_blocked. */
#define ROW_BLOCK 8

/* Prefetch what updating global row `row` touches: its weight row and optimizer state. *t
 * tracks the row's table (rows ascend). Plain reads into L2 like the rest, the row-wise state
 * word too (as a prefetchw into L1 it measured 0.5 ms slower in the update phase under Zipf
 * 1.05 ids, 8 x 1M x 64). */
static inline void prefetch_update(const update_t *U, uint64_t row, int64_t *t) {
    const layout_t *L = U->L;
    while ((uint64_t)L->row_offsets[*t + 1] <= row) ++*t;
    const int64_t D = L->dims[*t];
    const int64_t eo = L->elem_offsets[*t] + (int64_t)(row - (uint64_t)L->row_offsets[*t]) * D;
    prefetch_row(U->weights + eo, D);
    if (U->momentum1) __builtin_prefetch(U->momentum1 + row, 0, PF_LOCALITY);
    if (U->exp_avg) {
        prefetch_row(U->exp_avg + eo, D);
        prefetch_row(U->exp_avg_sq + eo, D);
    }
}

/* Horizontal sums of eight 8-lane vectors, each in row_sumsq's order:
 * out[r] = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) for x = l[r]. */
static inline void hsum8(const v8f *l, float *out) {
#ifdef __AVX__
    /* hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7], so two rounds give
     * each row's (x0+x1)+(x2+x3) and (x4+x5)+(x6+x7) in matching lanes of q (rows 0-3) and q2
     * (rows 4-7); one add of their 128-bit halves finishes all eight rows. */
    const __m256 h01 = _mm256_hadd_ps((__m256)l[0], (__m256)l[1]);
    const __m256 h23 = _mm256_hadd_ps((__m256)l[2], (__m256)l[3]);
    const __m256 h45 = _mm256_hadd_ps((__m256)l[4], (__m256)l[5]);
    const __m256 h67 = _mm256_hadd_ps((__m256)l[6], (__m256)l[7]);
    const __m256 q = _mm256_hadd_ps(h01, h23), q2 = _mm256_hadd_ps(h45, h67);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(q, q2, 0x20),
                                        _mm256_permute2f128_ps(q, q2, 0x31)));
#else
    for (int r = 0; r < 8; ++r) {
        const v8f x = l[r];
        out[r] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
    }
#endif
}

/* mult[r] = lr / (sqrtf(s[r]) + eps) for eight rows at once (vector square root and divide
 * round exactly as the scalar ones). */
static inline void adagrad_mult8(const float *s, float lr, float eps, float *mult) {
#ifdef __AVX__
    const __m256 x = _mm256_add_ps(_mm256_sqrt_ps(_mm256_loadu_ps(s)), _mm256_set1_ps(eps));
    _mm256_storeu_ps(mult, _mm256_div_ps(_mm256_set1_ps(lr), x));
#else
    for (int r = 0; r < 8; ++r) mult[r] = lr / (sqrtf(s[r]) + eps);
#endif
}

/* One block of nr <= ROW_BLOCK rows, all of dimension nv * 8 (a constant: everything unrolls
 * into registers): sum each row's gradients (occurrences ib[r] .. ie[r]) into gb, compute the
 * eight optimizer multipliers with vector operations, update the weights. The arithmetic of
 * apply_row, operation for operation. */
static inline __attribute__((always_inline)) void update_block(const update_t *U, int nr,
                                                               const int64_t *ib,
                                                               const int64_t *ie,
                                                               const uint64_t *rows,
                                                               const int64_t *eo, const int nv) {
    const int64_t D = 8 * nv;
    float gb[ROW_BLOCK][64] __attribute__((aligned(32)));
    float mult[ROW_BLOCK] __attribute__((aligned(32)));
    const float lr = U->opt->lr;
    /* No gradient-row prefetch here: the regrouped gradient of the table being updated mostly
     * stays in L2, and the prefetch instructions cost more than they hide (measured: update
     * phase -1.9 ms uniform, -1.15 ms Zipf 1.05 without them, on 8 x 1M x 64). */
    for (int r = 0; r < nr; ++r) accum_vec(U, ib[r], ie[r], rows[r], D, gb[r], nv, 0);
    if (U->opt->kind == OPT_ROWWISE_ADAGRAD) {
        v8f l[ROW_BLOCK];
        float ss[ROW_BLOCK], s[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; ++r) { /* row_sumsq's eight lanes */
            v8f a = {0, 0, 0, 0, 0, 0, 0, 0};
            if (r < nr)
                for (int k = 0; k < nv; ++k) {
                    const v8f g = ((const v8f *)gb[r])[k];
                    a += g * g;
                }
            l[r] = a;
        }
        hsum8(l, ss);
        for (int r = 0; r < ROW_BLOCK; ++r)
            s[r] = r < nr ? U->momentum1[rows[r]] + ss[r] / (float)D : 1.0f;
        for (int r = 0; r < nr; ++r) U->momentum1[rows[r]] = s[r];
        adagrad_mult8(s, lr, U->opt->eps, mult);
    } else {
        for (int r = 0; r < ROW_BLOCK; ++r) mult[r] = lr;
    }
    for (int r = 0; r < nr; ++r) {
        v8f *w = (v8f *)(U->weights + eo[r]);
        const v8f *g = (const v8f *)gb[r];
        const float m = mult[r];
        for (int k = 0; k < nv; ++k) w[k] -= g[k] * m;
    }
}

/* update_rows for SGD and row-wise Adagrad without weight decay or emitted tables, every dim a
 * multiple of 8 up to 64: the same arithmetic, reorganized. The distinct rows' starts are found
 * first (one branch-free pass over the chunk's keys into us, end - beg words of scratch); then
 * ROW_BLOCK rows at a time (update_block): all their gradients are summed (into L1), then their
 * optimizer multipliers computed together, then their weights updated, so the per-row
 * dependency chains (sum of squares, sqrt, divide) of a block run side by side rather than one
 * after another. */
static void update_rows_blocked(const update_t *U, int64_t beg, int64_t end, int64_t *us) {
    const layout_t *L = U->L;
    const int ks = U->kshift;
    const uint64_t *keys = U->keys;
    int64_t nu = 0;
    uint64_t prev = ~(uint64_t)0; /* no row: rows are below 2^(64 - ks) */
    for (int64_t i = beg; i < end; ++i) {
        const uint64_t r = keys[i] >> ks;
        us[nu] = i;
        nu += r != prev;
        prev = r;
    }
    int64_t ib[ROW_BLOCK], ie[ROW_BLOCK], eo[ROW_BLOCK];
    uint64_t rows[ROW_BLOCK];
    int64_t t = 0, pf_t = 0;
    for (int64_t j = 0; j < nu && j < PF_ROWS; ++j) prefetch_update(U, keys[us[j]] >> ks, &pf_t);
    for (int64_t j0 = 0; j0 < nu; j0 += ROW_BLOCK) {
        const int64_t j1 = j0 + ROW_BLOCK < nu ? j0 + ROW_BLOCK : nu;
        const int nr = (int)(j1 - j0);
        for (int64_t j = j0 + PF_ROWS; j < j1 + PF_ROWS && j < nu; ++j)
            prefetch_update(U, keys[us[j]] >> ks, &pf_t);
        int64_t D = -1; /* the block's common dim, or 0 if its rows' dims differ */
        for (int r = 0; r < nr; ++r) {
            ib[r] = us[j0 + r];
            ie[r] = j0 + r + 1 < nu ? us[j0 + r + 1] : end;
            const uint64_t row = keys[ib[r]] >> ks;
            while ((uint64_t)L->row_offsets[t + 1] <= row) ++t;
            rows[r] = row;
            eo[r] = L->elem_offsets[t] + (int64_t)(row - (uint64_t)L->row_offsets[t]) * L->dims[t];
            D = D < 0 || D == L->dims[t] ? L->dims[t] : 0;
        }
        if (D > 0) {
            switch (D / 8) {
#define BLOCK_CASE(k) \
    case k: update_block(U, nr, ib, ie, rows, eo, k); break;
                BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4)
                BLOCK_CASE(5) BLOCK_CASE(6) BLOCK_CASE(7) BLOCK_CASE(8)
#undef BLOCK_CASE
                default: break; /* excluded by the caller */
            }
            continue;
        }
        /* A block across tables of different dims (rare): one row at a time. */
        for (int r = 0; r < nr; ++r) {
            int64_t tr = 0;
            while ((uint64_t)L->row_offsets[tr + 1] <= rows[r]) ++tr;
            switch (L->dims[tr] / 8) {
#define BLOCK_CASE(k) \
    case k: update_block(U, 1, ib + r, ie + r, rows + r, eo + r, k); break;
                BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4)
                BLOCK_CASE(5) BLOCK_CASE(6) BLOCK_CASE(7) BLOCK_CASE(8)
#undef BLOCK_CASE
                default: break;
            }
        }
    }
}

static void update_rows(const update_t *U, int64_t beg, int64_t end, float *gacc,
                        int64_t emit_at);

/* A table update_rows_blocked can take: its dim a multiple of 8 up to 64. */
static inline int blockable_dim(int64_t D) { return D > 0 && D % 8 == 0 && D <= 64; }

/* update_rows_blocked for the rows of blockable tables, update_rows for the others, when a call
 * mixes both (SGD / row-wise Adagrad without weight decay or emitted tables): [beg, end) is cut
 * at the first row of each run of consecutive tables of one kind (sorted keys: a binary search).
 * Both paths do each row's arithmetic operation for operation alike, so which tables share a
 * call changes no bit of any row; before, one table of another dim sent the whole call through
 * the per-row loop. us: end - beg words of scratch. */
static void update_rows_mixed(const update_t *U, int64_t beg, int64_t end, int64_t *us,
                              float *gacc) {
    const layout_t *L = U->L;
    const int ks = U->kshift;
    const uint64_t *keys = U->keys;
    int64_t t = 0;
    for (int64_t i = beg; i < end;) {
        const uint64_t row = keys[i] >> ks;
        while ((uint64_t)L->row_offsets[t + 1] <= row) ++t;
        const int ok = blockable_dim(L->dims[t]);
        int64_t u = t + 1; /* the run: tables t .. u - 1, all blockable or none */
        while (u < L->T && blockable_dim(L->dims[u]) == ok) ++u;
        const uint64_t lim = (uint64_t)L->row_offsets[u];
        int64_t lo = i + 1, hi = end; /* the run's rows end at the first key at or above lim */
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if ((keys[mid] >> ks) < lim)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (ok)
            update_rows_blocked(U, i, lo, us + (i - beg));
        else
            update_rows(U, i, lo, gacc, 0);
        i = lo;
        t = u < L->T ? u : t;
    }
}

/* Sum and apply (or emit, from index emit_at) the rows whose occurrences are sorted positions
 * [beg, end), whole rows only. */
static void update_rows(const update_t *U, int64_t beg, int64_t end, float *gacc,
                        int64_t emit_at) {
    const layout_t *L = U->L;
    const int ks = U->kshift;
    const uint64_t *keys = U->keys;
    /* Weight (and state) rows are prefetched PF_ROWS distinct rows ahead: with skewed ids a hot
     * row's occurrences would hide the next rows from an occurrence-distance lookahead. pf_i
     * scans ahead over whole rows, pf_t is its table. */
    int64_t t = 0, pf_t = 0, pf_i = beg, ahead = 0, i = beg;
    while (i < end) {
        const uint64_t row = keys[i] >> ks;
        const int64_t first = i; /* the row's occurrences: [first, i) once summed */
        while ((uint64_t)L->row_offsets[t + 1] <= row) ++t;
        for (; ahead < PF_ROWS && pf_i < end; ++ahead) {
            const uint64_t ra = keys[pf_i] >> ks;
            prefetch_update(U, ra, &pf_t);
            while (pf_i < end && (keys[pf_i] >> ks) == ra) ++pf_i;
        }
        --ahead; /* this row is now being consumed */
        const int64_t D = L->dims[t];
        const int64_t eo = L->elem_offsets[t] + (int64_t)(row - (uint64_t)L->row_offsets[t]) * D;
        const int nv = (D % 8 == 0 && D <= 64) ? (int)(D / 8) : 0;
        switch (nv) { /* constant nv: the sum stays in registers, see accum_vec */
#define ACC_CASE(k) \
    case k: i = accum_vec(U, i, end, row, D, gacc, k, 1); break;
            ACC_CASE(1) ACC_CASE(2) ACC_CASE(3) ACC_CASE(4)
            ACC_CASE(5) ACC_CASE(6) ACC_CASE(7) ACC_CASE(8)
#undef ACC_CASE
            default:
                memset(gacc, 0, (size_t)D * sizeof(float));
                for (; i < end && (keys[i] >> ks) == row; ++i) {
                    if (i + PF_DIST < end) {
                        if (U->psw && i + 2 * PF_DIST < end)
                            __builtin_prefetch(U->gofs_of + payload(U, i + 2 * PF_DIST), 0, 3);
                        prefetch_row(U->G + grad_offset(U, i + PF_DIST), D);
                    }
                    const float *restrict g = U->G + grad_offset(U, i);
                    if (U->psw) {
                        const float s = U->psw[U->base + (int64_t)payload(U, i)];
                        for (int64_t d = 0; d < D; ++d) gacc[d] += g[d] * s;
                    } else {
                        for (int64_t d = 0; d < D; ++d) gacc[d] += g[d];
                    }
                }
        }
        if (U->emit_table && U->emit_table[t]) {
            U->emit_rows[emit_at] = (int64_t)row;
            memcpy(U->emit_grads + emit_at * U->emit_stride, gacc, (size_t)D * sizeof(float));
            ++emit_at;
            continue;
        }
        apply_row(U->opt, U->weights + eo, gacc, D, U->momentum1 ? U->momentum1 + row : NULL,
                  U->exp_avg ? U->exp_avg + eo : NULL, U->exp_avg_sq ? U->exp_avg_sq + eo : NULL,
                  i - first);
    }
}

/* Scratch layout of one backward call; the caller allocates it once and reuses it, so the
 * steady state takes no page faults. */
typedef struct {
    int64_t n;             /* occurrences */
    int rbits, vbits;      /* bits of the global row and of the payload */
    int packed;            /* payload packed below the row bits of one word */
    int64_t keys, tmp, vals, vtmp, gofs_of, hist, gc, gbuf, segs, ecnt, total; /* bytes */
} plan_t;

/* Sort chunks: about CHUNKS_PER_THREAD per thread, at least one per non-empty feature (a chunk
 * never spans two features) and an even number per table (the count pass takes them in pairs):
 * at most C + F + T. Each has a 2^digit histogram (16 KiB at 11 bits). */
static int64_t max_sort_chunks(int64_t F, int64_t T, int nthreads) {
    return CHUNKS_PER_THREAD * (int64_t)nthreads + F + T;
}

static int64_t align64(int64_t x) { return (x + 63) & ~(int64_t)63; }

static plan_t make_plan(const layout_t *L, int64_t n, int has_psw, int mean, int nthreads,
                        int force_pairs) {
    plan_t P;
    memset(&P, 0, sizeof(P));
    (void)mean; /* the regrouped gradient is built either way */
    const int64_t T = L->T, TD = L->total_dim, B = L->B;
    int64_t max_dim = 1;
    for (int64_t t = 0; t < T; ++t)
        if (L->dims[t] > max_dim) max_dim = L->dims[t];
    P.n = n;
    P.rbits = bits_for((uint64_t)(L->row_offsets[T] > 0 ? L->row_offsets[T] - 1 : 0));
    /* Payload: the offset of the occurrence's gradient row in the regrouped gradient, or (with
     * per-sample weights, which need the position) the position itself. */
    P.vbits = has_psw ? bits_for((uint64_t)(n > 0 ? n - 1 : 0))
                      : bits_for((uint64_t)(B * TD > 0 ? B * TD - 1 : 0));
    P.packed = !force_pairs && P.rbits + P.vbits <= 64;
    int64_t at = 0;
    const int64_t words = align64(n * (int64_t)sizeof(uint64_t));
    P.keys = at, at += words;
    P.tmp = at, at += words;
    if (!P.packed) P.vals = at, at += words, P.vtmp = at, at += words;
    if (has_psw) P.gofs_of = at, at += words;
    const int64_t max_chunks = max_sort_chunks(L->F, T, nthreads);
    P.hist = at, at += align64(max_chunks * ((int64_t)1 << MAX_DIGIT_BITS) * 8);
    /* fstart[F], tpos[T], cbeg[max_chunks + 1], csub, cfirst, cfeat, cpos, cbag[max_chunks] */
    P.segs = at, at += align64((L->F + T + 6 * max_chunks + 1) * 8);
    P.gc = at, at += align64(B * TD * (int64_t)sizeof(float));
    P.gbuf = at, at += align64((int64_t)nthreads * max_dim * (int64_t)sizeof(float));
    P.ecnt = at, at += align64((UPDATE_CHUNKS_PER_THREAD * (int64_t)nthreads + 1) * 8);
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
                        char *ws, int64_t ws_bytes, int64_t *err, const uint8_t *emit_table,
                        int64_t *emit_rows, float *emit_grads, int64_t emit_stride,
                        int64_t *emit_count) {
    const int64_t F = L->F, B = L->B, TD = L->total_dim, nbags = F * B;
    if (emit_count) *emit_count = 0;
    int rc = check_offsets(offsets, nbags, err);
    if (rc != TBE_OK) return rc;
    const int64_t base = offsets[0];
    const int64_t n = offsets[nbags] - base;
    if (n <= 0) return TBE_OK;
    const int nt_req = nthreads > 0 ? nthreads : 1;
    const plan_t P = make_plan(L, n, psw != NULL, mean, nt_req, force_pairs);
    if (ws_bytes < P.total) return TBE_ENOMEM;
    const int packed = P.packed;
    /* Sort key: global row (row_offsets[t] + id) above the payload bits, so sorted keys group
     * each row's occurrences; stability keeps (feature, batch position) order within a row. If
     * both do not fit 64 bits, the payload travels in its own array. */
    const int kshift = packed ? P.vbits : 0;
    const uint64_t vmask = packed ? (P.vbits >= 64 ? ~0ULL : ((1ULL << P.vbits) - 1)) : 0;
    uint64_t *keys = (uint64_t *)(ws + P.keys), *tmp = (uint64_t *)(ws + P.tmp);
    uint64_t *vals = packed ? NULL : (uint64_t *)(ws + P.vals);
    uint64_t *vtmp = packed ? NULL : (uint64_t *)(ws + P.vtmp);
    int64_t *gofs_of = psw ? (int64_t *)(ws + P.gofs_of) : NULL;
    int64_t *hist = (int64_t *)(ws + P.hist);
    /* The output gradient, regrouped feature-major: feature f's [B, D] block is contiguous at
     * B * out_offsets[f]. A row's occurrences are read in (feature, position) order, so each
     * table's gradients are then one compact block that stays in L2; in grad_output's layout
     * a feature's rows are total_dim floats apart and fold onto few cache sets. Mean pooling's
     * 1/len is applied in the same copy. */
    float *gc = (float *)(ws + P.gc);
    const float *G = gc;
    int64_t max_dim = 1;
    /* The blocked update (update_rows_blocked) for every table when all are blockable, for
     * those that are when some are (update_rows_mixed), with SGD / row-wise Adagrad only. */
    const int block_opt = !emit_table && opt->weight_decay == 0.0f && opt->clip_ratio == 0.0f &&
                          opt->qat_bits == 0 &&
                          (opt->kind == OPT_SGD || opt->kind == OPT_ROWWISE_ADAGRAD);
    int all_blk = 1, any_blk = 0;
    for (int64_t t = 0; t < L->T; ++t) {
        if (L->dims[t] > max_dim) max_dim = L->dims[t];
        if (blockable_dim(L->dims[t]))
            any_blk = 1;
        else
            all_blk = 0;
    }
    const int blocked = block_opt && all_blk, mixed = block_opt && any_blk && !all_blk;
    /* Keys are grouped by table, tables in order, each table's features in feature order
     * (fstart[f]: where feature f's occurrences start), so sorting each table's segment by local
     * row is a stable sort by global row. */
    const int64_t T = L->T, C = CHUNKS_PER_THREAD * (int64_t)nt_req;
    int64_t *fstart = (int64_t *)(ws + P.segs), *tpos = fstart + F, *cbeg = tpos + T;
    const int64_t MC = max_sort_chunks(F, T, nt_req);
    uint64_t *csub = (uint64_t *)(cbeg + MC + 1);
    int64_t *cfirst = (int64_t *)(csub + MC), *cfeat = cfirst + MC, *cpos = cfeat + MC,
            *cbag = cpos + MC;
    for (int64_t t = 0; t < T; ++t) tpos[t] = 0;
    for (int64_t f = 0; f < F; ++f)
        tpos[L->feature_table[f]] += offsets[(f + 1) * B] - offsets[f * B];
    for (int64_t t = 0, acc = 0; t < T; ++t) {
        const int64_t c = tpos[t];
        tpos[t] = acc;
        acc += c;
    }
    for (int64_t f = 0; f < F; ++f) {
        const int64_t t = L->feature_table[f];
        fstart[f] = tpos[t];
        tpos[t] += offsets[(f + 1) * B] - offsets[f * B];
    } /* now tpos[t] is the end of table t's segment */
    /* Chunks, table by table in segment order; within a table, feature by feature. */
    int64_t nchunks = 0;
    int lbits = 0;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t first = nchunks;
        int64_t longest = -1, longest_len = 0;
        for (int64_t f = 0; f < F; ++f) {
            const int64_t len = offsets[(f + 1) * B] - offsets[f * B];
            if (L->feature_table[f] != t || len <= 0) continue;
            int64_t k = len * C / n;
            if (k < 1) k = 1;
            if (len > longest_len) longest = f, longest_len = len;
            for (int64_t j = 0; j < k; ++j, ++nchunks) cfeat[nchunks] = f;
        }
        if (nchunks == first) continue;
        if ((nchunks - first) & 1) { /* even per table: one more chunk for the longest feature */
            int64_t at = first;
            while (cfeat[at] != longest) ++at;
            for (int64_t c = nchunks; c > at; --c) cfeat[c] = cfeat[c - 1];
            ++nchunks;
        }
        const int lb = bits_for((uint64_t)(L->rows[t] > 0 ? L->rows[t] - 1 : 0));
        if (lb > lbits) lbits = lb;
        for (int64_t c = first; c < nchunks;) { /* cut each feature's run of chunks evenly */
            const int64_t f = cfeat[c];
            int64_t k = 0;
            while (c + k < nchunks && cfeat[c + k] == f) ++k;
            const int64_t len = offsets[(f + 1) * B] - offsets[f * B];
            for (int64_t j = 0; j < k; ++j) {
                const int64_t p0 = offsets[f * B] + len * j / k;
                cbeg[c + j] = fstart[f] + len * j / k;
                csub[c + j] = (uint64_t)L->row_offsets[t] << kshift;
                cfirst[c + j] = first;
                cpos[c + j] = p0;
                /* the last bag of the feature starting at or before p0 */
                int64_t lo = f * B, hi = (f + 1) * B - 1;
                while (lo < hi) {
                    const int64_t mid = lo + (hi - lo + 1) / 2;
                    if (offsets[mid] <= p0) lo = mid;
                    else hi = mid - 1;
                }
                cbag[c + j] = lo;
            }
            c += k;
        }
    }
    cbeg[nchunks] = n;
    const segs_t S = {nchunks, cbeg, csub, cfirst, cfeat, cpos, cbag, kshift, lbits};
    int passes, digit;
    radix_geometry(lbits, &passes, &digit);
    const int64_t nb = (int64_t)1 << digit;
    const uint64_t dmask = (uint64_t)nb - 1;

    int64_t bad = INT64_MAX;
#pragma omp parallel num_threads(nt_req)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t my_bad = INT64_MAX;
        /* 1. The output gradient, regrouped feature-major (see gc above). */
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < nbags; ++i) {
            const int64_t f = i / B, b = i % B;
            const int64_t D = L->dims[L->feature_table[f]];
            const float *restrict src = grad_out + b * TD + L->out_offsets[f];
            float *restrict dst = gc + B * L->out_offsets[f] + b * D;
            if (mean) { /* d(out)/len once per bag, the same float division as the reference */
                const int64_t len = offsets[i + 1] - offsets[i];
                const float ln = (float)(len > 0 ? len : 1);
                for (int64_t d = 0; d < D; ++d) dst[d] = src[d] / ln;
            } else {
                memcpy(dst, src, (size_t)D * sizeof(float));
            }
        }
        /* 2. The first radix pass's digit counts, read straight from the ids (its digit is the
         * id's low bits), and the range check: ids are checked before anything is written to
         * weights or state. Chunks in pairs (count_pair). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < nchunks; c += 2) {
            const uint64_t R = (uint64_t)L->rows[L->feature_table[cfeat[c]]];
            const int64_t na = cbeg[c + 1] - cbeg[c], nbb = cbeg[c + 2] - cbeg[c + 1];
            const uint64_t *xa = (const uint64_t *)indices + cpos[c];
            const uint64_t *xb = (const uint64_t *)indices + cpos[c + 1];
            /* On a bad id, look again at this pair only: the first bad position of either. */
            if (count_pair(xa, na, xb, nbb, 0, 0, dmask, hist + c * nb, 1, R)) {
                for (int64_t i = 0; i < na; ++i)
                    if (xa[i] >= R) {
                        if (cpos[c] + i < my_bad) my_bad = cpos[c] + i;
                        break;
                    }
                for (int64_t i = 0; i < nbb; ++i)
                    if (xb[i] >= R) {
                        if (cpos[c + 1] + i < my_bad) my_bad = cpos[c + 1] + i;
                        break;
                    }
            }
        }
#pragma omp critical
        if (my_bad < bad) bad = my_bad;
#pragma omp barrier
        if (bad == INT64_MAX) {
#pragma omp single
            radix_prefix(&S, hist, nb); /* implicit barrier */
            /* 3. Keys, built and scattered by the first digit in one go, chunk by chunk in input
             * order (stable); the payload is the occurrence's gradient-row offset in gc (or,
             * with per-sample weights, its position, and gofs_of maps it to the offset). */
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < nchunks; ++c) {
                const int64_t f = cfeat[c], t = L->feature_table[f];
                const uint64_t r0 = (uint64_t)L->row_offsets[t], hi = r0 << kshift;
                const int64_t D = L->dims[t];
                const uint64_t gbase = (uint64_t)(B * L->out_offsets[f]);
                int64_t *h = hist + c * nb;
                int64_t p = cpos[c], i = cbag[c];
                const int64_t pend = p + (cbeg[c + 1] - cbeg[c]);
                uint64_t *restrict dst = tmp, *restrict vd = vtmp;
                while (p < pend) {
                    while (offsets[i + 1] <= p) ++i; /* skips empty bags */
                    const int64_t e = offsets[i + 1] < pend ? offsets[i + 1] : pend;
                    const uint64_t gofs = gbase + (uint64_t)((i - f * B) * D);
                    if (packed && !psw) {
                        for (; p < e; ++p) {
                            const uint64_t id = (uint64_t)indices[p];
                            dst[h[id & dmask]++] = (hi + (id << kshift)) | gofs;
                        }
                        continue;
                    }
                    for (; p < e; ++p) {
                        const uint64_t id = (uint64_t)indices[p];
                        const uint64_t q = (uint64_t)(p - base);
                        const uint64_t v = psw ? q : gofs;
                        if (psw) gofs_of[q] = (int64_t)gofs;
                        const int64_t at = h[id & dmask]++;
                        if (packed) {
                            dst[at] = ((r0 + id) << kshift) | v;
                        } else {
                            dst[at] = r0 + id;
                            vd[at] = v;
                        }
                    }
                }
            } /* implicit barrier */
#pragma omp single
            {
                uint64_t *x = keys;
                keys = tmp;
                tmp = x;
                if (!packed) {
                    x = vals;
                    vals = vtmp;
                    vtmp = x;
                }
            } /* implicit barrier */
            /* 4. The remaining passes group occurrences by global row, keeping input order
             * within a row. */
            radix_sort(&keys, &tmp, packed ? NULL : &vals, &vtmp, &S, hist, 1);
            /* 5. The sorted occurrences are cut into chunks moved to row boundaries, so every
             * row is summed and updated by exactly one thread, in sorted order: bitwise the same
             * result for any thread count or schedule. */
            const update_t U = {L,        weights,    momentum1, exp_avg,    exp_avg_sq,
                                keys,     vals,       gofs_of,   G,          psw,
                                opt,      base,       kshift,    vmask,      packed,
                                emit_table, emit_rows, emit_grads, emit_stride};
            float *gacc = (float *)(ws + P.gbuf) + (int64_t)tid * max_dim;
            const int64_t chunks = UPDATE_CHUNKS_PER_THREAD * (int64_t)nt;
            int64_t *ecnt = (int64_t *)(ws + P.ecnt); /* [chunks + 1]: first emit index */
            if (emit_table) {
                /* Emitted rows keep sorted row order: count per chunk, then prefix. */
#pragma omp for schedule(dynamic, 1)
                for (int64_t c = 0; c < chunks; ++c) {
                    int64_t beg, end;
                    chunk_bounds(keys, kshift, n, c, chunks, &beg, &end);
                    ecnt[c + 1] = count_emitted(&U, beg, end);
                } /* implicit barrier */
#pragma omp single
                {
                    ecnt[0] = 0;
                    for (int64_t c = 0; c < chunks; ++c) ecnt[c + 1] += ecnt[c];
                    *emit_count = ecnt[chunks];
                } /* implicit barrier */
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < chunks; ++c) {
                int64_t beg, end;
                chunk_bounds(keys, kshift, n, c, chunks, &beg, &end);
                if (blocked)
                    update_rows_blocked(&U, beg, end, (int64_t *)tmp + beg);
                else if (mixed)
                    update_rows_mixed(&U, beg, end, (int64_t *)tmp + beg, gacc);
                else
                    update_rows(&U, beg, end, gacc, emit_table ? ecnt[c] : 0);
            }
        }
    }
    if (bad != INT64_MAX) {
        err[0] = bad;
        rc = TBE_EID;
    }
    return rc;
}
