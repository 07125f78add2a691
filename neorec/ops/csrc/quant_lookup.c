/* Pooled lookup of serving tables' rows (neorec.ops.quant_lookup): fp32, fp16, or row-wise
 * int8 / int4 / int2 codes with a float16 scale and offset per row, decoded and pooled in one pass.
 * Compiled into the same library as tbe_cpu.c (neorec/ops/cpu.py). The specification is
 * neorec/serve/standalone.py's Table.rows(ids) (dequantized fp32 rows) followed by index_add
 * pooling; tests/test_quant_lookup.py compares the two.
 *
 * One table, many bags: bag i is ids[offsets[i] .. offsets[i + 1]). Row r starts at
 * data + r * row_bytes:
 *   fp32  dim floats;  fp16  dim halves;
 *   intB  ceil(dim * B / 8) bytes of codes (big-endian bits: int4 high nibble first, int2 the
 *         top two bits first), then the row's scale and offset as float16 (little-endian), in
 *         units of the table's s_unit / o_unit: value = code * (scale * s_unit) + offset * o_unit.
 * Each value is computed as the specification computes it: (float)code * scale, then + offset
 * (two roundings: no fused multiply-add, -ffp-contract=off), then * weight, then added to the
 * bag's sum in id order; mean divides the sum by the bag's length (an empty bag is zeros).
 *
 * Returns QL_OK, or QL_EID with err[0] = the first position whose id is outside [0, rows), or
 * QL_EOFFSETS with err[0] = the first bag whose offsets decrease or leave [0, nids].
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define QL_VECTOR 1
#endif

#define QL_OK 0
#define QL_EID 1
#define QL_EOFFSETS 2
enum { QL_FP32 = 32, QL_FP16 = 16, QL_INT8 = 8, QL_INT4 = 4, QL_INT2 = 2 };

/* How far ahead (in ids) rows are prefetched: a few rows' work covers a DRAM miss. */
#ifndef QL_PF_DIST
#define QL_PF_DIST 16
#endif

/* IEEE half -> float, exact (subnormals included): one instruction with F16C. */
static inline float ql_half(uint16_t h) {
#ifdef QL_VECTOR
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0) {
        float f = (float)m * 0x1p-24f; /* zero or subnormal: exact in float */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t ql_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Element d of a row (the generic path: any dim). */
static inline float ql_elem(const uint8_t *row, int kind, int64_t d, float s, float b) {
    switch (kind) {
    case QL_FP32: {
        float v;
        memcpy(&v, row + 4 * d, 4);
        return v;
    }
    case QL_FP16:
        return ql_half(ql_u16(row + 2 * d));
    case QL_INT8:
        return (float)row[d] * s + b;
    case QL_INT4:
        return (float)((row[d >> 1] >> ((~d & 1) * 4)) & 15) * s + b;
    default: /* QL_INT2 */
        return (float)((row[d >> 2] >> ((3 - (d & 3)) * 2)) & 3) * s + b;
    }
}

/* Every cache line of a row (into L2, as the TBE's forward): a 36-byte int4 row of dim 64
 * straddles two lines about half the time, a 256-byte fp32 row always spans four. */
static inline void ql_prefetch(const uint8_t *row, int64_t row_bytes) {
    const uintptr_t last = ((uintptr_t)row + (uintptr_t)row_bytes - 1) & ~(uintptr_t)63;
    for (uintptr_t a = (uintptr_t)row & ~(uintptr_t)63; a <= last; a += 64)
        __builtin_prefetch((const void *)a, 0, 2);
}

/* A row's scale and offset (integer kinds), in float. */
static inline void ql_scale(const uint8_t *row, int kind, int64_t dim, float s_unit, float o_unit,
                            float *s, float *b) {
    if (kind == QL_FP32 || kind == QL_FP16) return;
    const int64_t nb = (dim * kind + 7) / 8;
    *s = ql_half(ql_u16(row + nb)) * s_unit;
    *b = ql_half(ql_u16(row + nb + 2)) * o_unit;
}

typedef struct {
    const uint8_t *data;
    uint64_t rows;
    int64_t dim, row_bytes;
    int kind;
    float s_unit, o_unit;
} ql_table_t;

/* Any dim: the bag's sum accumulates in its output row. */
static void ql_bag_generic(const ql_table_t *T, const int64_t *ids, const float *w, int64_t lo,
                           int64_t hi, int64_t end, int mean, float *restrict o, int64_t *bad) {
    const int64_t D = T->dim;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t p = lo; p < hi; ++p) {
        if (p + QL_PF_DIST < end && (uint64_t)ids[p + QL_PF_DIST] < T->rows)
            ql_prefetch(T->data + ids[p + QL_PF_DIST] * T->row_bytes, T->row_bytes);
        const uint64_t id = (uint64_t)ids[p];
        if (id >= T->rows) { /* unsigned: negative ids too */
            if (p < *bad) *bad = p;
            continue;
        }
        const uint8_t *row = T->data + id * T->row_bytes;
        float s = 0.0f, b = 0.0f;
        ql_scale(row, T->kind, D, T->s_unit, T->o_unit, &s, &b);
        if (w) {
            const float x = w[p];
            for (int64_t d = 0; d < D; ++d) o[d] += ql_elem(row, T->kind, d, s, b) * x;
        } else {
            for (int64_t d = 0; d < D; ++d) o[d] += ql_elem(row, T->kind, d, s, b);
        }
    }
    if (mean && hi > lo) {
        const float n = (float)(hi - lo);
        for (int64_t d = 0; d < D; ++d) o[d] /= n;
    }
}

#ifdef QL_VECTOR
/* Eight values of columns [c, c + 8) of a row, decoded (c a multiple of 8). */
static inline __attribute__((always_inline)) __m256 ql_load8(const uint8_t *row, const int kind,
                                                             int64_t c, __m256 s, __m256 b) {
    __m256i v;
    switch (kind) {
    case QL_FP32:
        return _mm256_loadu_ps((const float *)row + c);
    case QL_FP16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * c)));
    case QL_INT8: {
        int64_t q;
        memcpy(&q, row + c, 8);
        v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(q));
        break;
    }
    case QL_INT4: { /* 4 bytes -> 8 nibbles, high first: each byte twice, shifted 4 then 0 */
        int32_t q;
        memcpy(&q, row + c / 2, 4);
        const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
        v = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(q), twice));
        v = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0)),
                             _mm256_set1_epi32(15));
        break;
    }
    default: { /* QL_INT2: 2 bytes -> 8 codes, top bits first */
        const int32_t q = ql_u16(row + c / 4);
        const __m128i four = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
        v = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(q), four));
        v = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(6, 4, 2, 0, 6, 4, 2, 0)),
                             _mm256_set1_epi32(3));
        break;
    }
    }
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), s), b);
}

/* nv * 8 <= 64 columns from c0 of one bag, summed in nv registers and stored once; every
 * column's operations as in ql_bag_generic (bitwise the same). */
static inline __attribute__((always_inline)) void ql_bag_vec(const ql_table_t *T, const int kind,
                                                             const int nv, int64_t c0,
                                                             const int64_t *ids, const float *w,
                                                             int64_t lo, int64_t hi, int64_t end,
                                                             int mean, float *o, int64_t *bad) {
    __m256 acc[8];
    for (int k = 0; k < nv; ++k) acc[k] = _mm256_setzero_ps();
    for (int64_t p = lo; p < hi; ++p) {
        if (p + QL_PF_DIST < end && (uint64_t)ids[p + QL_PF_DIST] < T->rows)
            ql_prefetch(T->data + ids[p + QL_PF_DIST] * T->row_bytes, T->row_bytes);
        const uint64_t id = (uint64_t)ids[p];
        if (id >= T->rows) {
            if (p < *bad) *bad = p;
            continue;
        }
        const uint8_t *row = T->data + id * T->row_bytes;
        float s = 0.0f, b = 0.0f;
        ql_scale(row, kind, T->dim, T->s_unit, T->o_unit, &s, &b);
        const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
        if (w) {
            const __m256 x = _mm256_set1_ps(w[p]);
            for (int k = 0; k < nv; ++k)
                acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(ql_load8(row, kind, c0 + 8 * k, vs, vb), x));
        } else {
            for (int k = 0; k < nv; ++k)
                acc[k] = _mm256_add_ps(acc[k], ql_load8(row, kind, c0 + 8 * k, vs, vb));
        }
    }
    if (mean && hi > lo) {
        const __m256 n = _mm256_set1_ps((float)(hi - lo));
        for (int k = 0; k < nv; ++k) acc[k] = _mm256_div_ps(acc[k], n);
    }
    for (int k = 0; k < nv; ++k) _mm256_storeu_ps(o + c0 + 8 * k, acc[k]);
}

/* fp32 / fp16 rows: the scale and offset of ql_load8 are unused (1, 0 would round nothing, but
 * the loads return before them). */
#define QL_NV_CASES(KIND)                                                                         \
    switch (nv) {                                                                                 \
    case 1: ql_bag_vec(T, KIND, 1, c0, ids, w, lo, hi, end, mean, o, bad); break;                 \
    case 2: ql_bag_vec(T, KIND, 2, c0, ids, w, lo, hi, end, mean, o, bad); break;                 \
    case 3: ql_bag_vec(T, KIND, 3, c0, ids, w, lo, hi, end, mean, o, bad); break;                 \
    case 4: ql_bag_vec(T, KIND, 4, c0, ids, w, lo, hi, end, mean, o, bad); break;                 \
    case 5: ql_bag_vec(T, KIND, 5, c0, ids, w, lo, hi, end, mean, o, bad); break;                 \
    case 6: ql_bag_vec(T, KIND, 6, c0, ids, w, lo, hi, end, mean, o, bad); break;                 \
    case 7: ql_bag_vec(T, KIND, 7, c0, ids, w, lo, hi, end, mean, o, bad); break;                 \
    default: ql_bag_vec(T, KIND, 8, c0, ids, w, lo, hi, end, mean, o, bad); break;                \
    }

static void ql_bag_vector(const ql_table_t *T, const int64_t *ids, const float *w, int64_t lo,
                          int64_t hi, int64_t end, int mean, float *o, int64_t *bad) {
    for (int64_t c0 = 0; c0 < T->dim; c0 += 64) { /* 64 columns a pass: 8 registers */
        const int nv = (int)((T->dim - c0 < 64 ? T->dim - c0 : 64) / 8);
        switch (T->kind) {
        case QL_FP32: QL_NV_CASES(QL_FP32) break;
        case QL_FP16: QL_NV_CASES(QL_FP16) break;
        case QL_INT8: QL_NV_CASES(QL_INT8) break;
        case QL_INT4: QL_NV_CASES(QL_INT4) break;
        default: QL_NV_CASES(QL_INT2) break;
        }
    }
}
#undef QL_NV_CASES
#endif

int ql_pool(const uint8_t *data, int64_t rows, int64_t dim, int64_t row_bytes, int kind,
            float s_unit, float o_unit, const int64_t *ids, int64_t nids, const int64_t *offsets,
            int64_t nbags, const float *w, int mean, float *out, int nthreads, int64_t *err) {
    for (int64_t i = 0; i < nbags; ++i) {
        if (offsets[i] < 0 || offsets[i + 1] < offsets[i] || offsets[i + 1] > nids) {
            err[0] = i;
            return QL_EOFFSETS;
        }
    }
    const ql_table_t T = {data, (uint64_t)rows, dim, row_bytes, kind, s_unit, o_unit};
    int vector = 0;
#ifdef QL_VECTOR
    vector = dim > 0 && dim % 8 == 0;
#endif
    const int64_t end = nbags ? offsets[nbags] : 0;
    int64_t bad = INT64_MAX;
    /* Bags write disjoint output rows; small batches stay on the calling thread. */
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && nbags >= 64) \
    schedule(dynamic, 32) reduction(min : bad)
    for (int64_t i = 0; i < nbags; ++i) {
        float *o = out + i * dim;
#ifdef QL_VECTOR
        if (vector) {
            ql_bag_vector(&T, ids, w, offsets[i], offsets[i + 1], end, mean, o, &bad);
            continue;
        }
#endif
        ql_bag_generic(&T, ids, w, offsets[i], offsets[i + 1], end, mean, o, &bad);
    }
    (void)vector;
    if (bad != INT64_MAX) {
        err[0] = bad;
        return QL_EID;
    }
    return QL_OK;
}
