/* Sequence (non-pooled) lookup on the CPU: each id's row is an output row of its own.
 *
 * Compiled in the same translation unit as tbe_cpu.c (neorec/ops/cpu.py concatenates the
 * sources), so the backward reuses the pooled backward's machinery as it is: the radix sort by
 * global row (radix_sort, radix_prefix, count_pair), the row summation and the fused optimizer
 * (update_rows, update_rows_blocked, update_rows_mixed). A sequence lookup is the pooled one with
 * bags of length 1; what differs is only where an occurrence's gradient row lives: the output of
 * feature f is a [n_f, D_f] block at out_offsets[f] = sum_{g < f} n_g * D_g of one flat buffer,
 * so occurrence p of feature f reads its gradient at out_offsets[f] + (p - fpos[f]) * D_f, with
 * no regrouping copy (the flat gradient is already feature-major).
 *
 * Layout: layout_t with B = 1 and total_dim = the flat output's length; fpos[F + 1]: feature f's
 * ids are indices[fpos[f], fpos[f + 1]). Each distinct row's gradients are summed in (feature,
 * position) order by one thread and updated once: bitwise the same for any thread count, and
 * bitwise the pooled kernel's result for the same ids as bags of length 1.
 * Return codes: those of tbe_cpu.c (TBE_EID with err[0] = the first bad position).
 */

/* out[out_offsets[f] + (p - fpos[f]) * D ...] = table row of indices[p]. */
int seq_forward(const layout_t *L, const float *weights, const int64_t *indices,
                const int64_t *fpos, float *out, int nthreads, int64_t *err) {
    const int64_t F = L->F;
    int rc = check_offsets(fpos, F, err);
    if (rc != TBE_OK) return rc;
    const int64_t base = fpos[0], n = fpos[F] - base;
    int64_t bad = INT64_MAX;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(min : bad)
    {
        int64_t f = 0;
#pragma omp for schedule(dynamic, 256)
        for (int64_t q = 0; q < n; ++q) {
            const int64_t p = base + q;
            if (fpos[f] > p || fpos[f + 1] <= p) { /* positions ascend within a chunk */
                f = 0;
                while (fpos[f + 1] <= p) ++f;
            }
            const int64_t t = L->feature_table[f], D = L->dims[t];
            const uint64_t R = (uint64_t)L->rows[t];
            if (p + FWD_PF_DIST < fpos[f + 1]) {
                const uint64_t a = (uint64_t)indices[p + FWD_PF_DIST];
                if (a < R) prefetch_row(weights + L->elem_offsets[t] + a * D, D);
            }
            const uint64_t id = (uint64_t)indices[p];
            if (id >= R) { /* unsigned compare also catches negative ids */
                if (p < bad) bad = p;
                continue;
            }
            memcpy(out + L->out_offsets[f] + (p - fpos[f]) * D,
                   weights + L->elem_offsets[t] + (int64_t)id * D, (size_t)D * sizeof(float));
        }
    }
    if (bad != INT64_MAX) {
        err[0] = bad;
        return TBE_EID;
    }
    return TBE_OK;
}

static plan_t seq_plan(const layout_t *L, int64_t n, int nthreads, int force_pairs) {
    plan_t P;
    memset(&P, 0, sizeof(P));
    const int64_t T = L->T;
    int64_t max_dim = 1;
    for (int64_t t = 0; t < T; ++t)
        if (L->dims[t] > max_dim) max_dim = L->dims[t];
    P.n = n;
    P.rbits = bits_for((uint64_t)(L->row_offsets[T] > 0 ? L->row_offsets[T] - 1 : 0));
    P.vbits = bits_for((uint64_t)(L->total_dim > 0 ? L->total_dim - 1 : 0));
    P.packed = !force_pairs && P.rbits + P.vbits <= 64;
    int64_t at = 0;
    const int64_t words = align64(n * (int64_t)sizeof(uint64_t));
    P.keys = at, at += words;
    P.tmp = at, at += words;
    if (!P.packed) P.vals = at, at += words, P.vtmp = at, at += words;
    const int64_t max_chunks = max_sort_chunks(L->F, T, nthreads);
    P.hist = at, at += align64(max_chunks * ((int64_t)1 << MAX_DIGIT_BITS) * 8);
    P.segs = at, at += align64((L->F + T + 6 * max_chunks + 1) * 8);
    P.gbuf = at, at += align64((int64_t)nthreads * max_dim * (int64_t)sizeof(float));
    P.ecnt = at, at += align64((UPDATE_CHUNKS_PER_THREAD * (int64_t)nthreads + 1) * 8);
    P.total = at;
    return P;
}

/* Bytes of scratch that seq_backward_update needs for this batch. */
int64_t seq_backward_workspace(const layout_t *L, const int64_t *fpos, int nthreads,
                               int force_pairs) {
    return seq_plan(L, fpos[L->F] - fpos[0], nthreads > 0 ? nthreads : 1, force_pairs).total;
}

/* Chunks of the sort, table by table, each table's features in feature order (as the pooled
 * kernel cuts them): fills cfeat, cbeg, csub, cfirst, cpos; returns the count, *lbits the widest
 * table's local row bits. fstart[f]: where feature f's keys start. */
static int64_t seq_chunks(const layout_t *L, const int64_t *fpos, int64_t n, int64_t C,
                          int kshift, const int64_t *fstart, int64_t *cfeat, int64_t *cbeg,
                          uint64_t *csub, int64_t *cfirst, int64_t *cpos, int *lbits) {
    const int64_t F = L->F, T = L->T;
    int64_t nchunks = 0;
    *lbits = 0;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t first = nchunks;
        int64_t longest = -1, longest_len = 0;
        for (int64_t f = 0; f < F; ++f) {
            const int64_t len = fpos[f + 1] - fpos[f];
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
        if (lb > *lbits) *lbits = lb;
        for (int64_t c = first; c < nchunks;) { /* cut each feature's run of chunks evenly */
            const int64_t f = cfeat[c];
            int64_t k = 0;
            while (c + k < nchunks && cfeat[c + k] == f) ++k;
            const int64_t len = fpos[f + 1] - fpos[f];
            for (int64_t j = 0; j < k; ++j) {
                cbeg[c + j] = fstart[f] + len * j / k;
                csub[c + j] = (uint64_t)L->row_offsets[t] << kshift;
                cfirst[c + j] = first;
                cpos[c + j] = fpos[f] + len * j / k;
            }
            c += k;
        }
    }
    cbeg[nchunks] = n;
    return nchunks;
}

/* The fused backward of seq_forward: grad_out is the flat [total_dim] gradient of its output;
 * ws holds seq_backward_workspace() bytes. */
int seq_backward_update(const layout_t *L, float *weights, const int64_t *indices,
                        const int64_t *fpos, const float *grad_out, const optim_t *opt,
                        float *momentum1, float *exp_avg, float *exp_avg_sq, int nthreads,
                        int force_pairs, char *ws, int64_t ws_bytes, int64_t *err) {
    const int64_t F = L->F, T = L->T;
    int rc = check_offsets(fpos, F, err);
    if (rc != TBE_OK) return rc;
    const int64_t n = fpos[F] - fpos[0];
    if (n <= 0) return TBE_OK;
    const int nt_req = nthreads > 0 ? nthreads : 1;
    const plan_t P = seq_plan(L, n, nt_req, force_pairs);
    if (ws_bytes < P.total) return TBE_ENOMEM;
    const int packed = P.packed;
    const int kshift = packed ? P.vbits : 0;
    const uint64_t vmask = packed ? (P.vbits >= 64 ? ~0ULL : ((1ULL << P.vbits) - 1)) : 0;
    uint64_t *keys = (uint64_t *)(ws + P.keys), *tmp = (uint64_t *)(ws + P.tmp);
    uint64_t *vals = packed ? NULL : (uint64_t *)(ws + P.vals);
    uint64_t *vtmp = packed ? NULL : (uint64_t *)(ws + P.vtmp);
    int64_t *hist = (int64_t *)(ws + P.hist);
    int64_t max_dim = 1;
    const int block_opt = opt->weight_decay == 0.0f && opt->clip_ratio == 0.0f &&
                          (opt->kind == OPT_SGD || opt->kind == OPT_ROWWISE_ADAGRAD);
    int all_blk = 1, any_blk = 0;
    for (int64_t t = 0; t < T; ++t) {
        if (L->dims[t] > max_dim) max_dim = L->dims[t];
        if (blockable_dim(L->dims[t]))
            any_blk = 1;
        else
            all_blk = 0;
    }
    const int blocked = block_opt && all_blk, mixed = block_opt && any_blk && !all_blk;
    const int64_t C = CHUNKS_PER_THREAD * (int64_t)nt_req, MC = max_sort_chunks(F, T, nt_req);
    int64_t *fstart = (int64_t *)(ws + P.segs), *tpos = fstart + F, *cbeg = tpos + T;
    uint64_t *csub = (uint64_t *)(cbeg + MC + 1);
    int64_t *cfirst = (int64_t *)(csub + MC), *cfeat = cfirst + MC, *cpos = cfeat + MC,
            *cbag = cpos + MC;
    for (int64_t t = 0; t < T; ++t) tpos[t] = 0;
    for (int64_t f = 0; f < F; ++f) tpos[L->feature_table[f]] += fpos[f + 1] - fpos[f];
    for (int64_t t = 0, acc = 0; t < T; ++t) {
        const int64_t c = tpos[t];
        tpos[t] = acc;
        acc += c;
    }
    for (int64_t f = 0; f < F; ++f) {
        fstart[f] = tpos[L->feature_table[f]];
        tpos[L->feature_table[f]] += fpos[f + 1] - fpos[f];
    }
    int lbits = 0;
    const int64_t nchunks =
        seq_chunks(L, fpos, n, C, kshift, fstart, cfeat, cbeg, csub, cfirst, cpos, &lbits);
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
        /* 1. The first radix pass's digit counts from the ids, and the range check (nothing is
         * written to weights or state before every id passed). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < nchunks; c += 2) {
            const uint64_t R = (uint64_t)L->rows[L->feature_table[cfeat[c]]];
            const int64_t na = cbeg[c + 1] - cbeg[c], nbb = cbeg[c + 2] - cbeg[c + 1];
            const uint64_t *xa = (const uint64_t *)indices + cpos[c];
            const uint64_t *xb = (const uint64_t *)indices + cpos[c + 1];
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
            /* 2. Keys built and scattered by the first digit; the payload is the occurrence's
             * gradient-row offset in the flat gradient. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < nchunks; ++c) {
                const int64_t f = cfeat[c], t = L->feature_table[f], D = L->dims[t];
                const uint64_t r0 = (uint64_t)L->row_offsets[t], hi = r0 << kshift;
                int64_t *h = hist + c * nb;
                const int64_t p0 = cpos[c], pend = p0 + (cbeg[c + 1] - cbeg[c]);
                const uint64_t g0 = (uint64_t)(L->out_offsets[f] - fpos[f] * D);
                for (int64_t p = p0; p < pend; ++p) {
                    const uint64_t id = (uint64_t)indices[p];
                    const uint64_t gofs = g0 + (uint64_t)(p * D);
                    const int64_t at = h[id & dmask]++;
                    if (packed) {
                        keys[at] = (hi + (id << kshift)) | gofs;
                    } else {
                        keys[at] = r0 + id;
                        vals[at] = gofs;
                    }
                }
            } /* implicit barrier */
            /* 3. The remaining passes (keys already hold the first pass's order). */
            radix_sort(&keys, &tmp, packed ? NULL : &vals, &vtmp, &S, hist, 1);
            /* 4. Each distinct row summed and updated by one thread, in sorted order. */
            const update_t U = {L,     weights, momentum1, exp_avg, exp_avg_sq, keys,
                                vals,  NULL,    grad_out,  NULL,    opt,        0,
                                kshift, vmask,  packed,    NULL,    NULL,       NULL,
                                0};
            float *gacc = (float *)(ws + P.gbuf) + (int64_t)tid * max_dim;
            const int64_t chunks = UPDATE_CHUNKS_PER_THREAD * (int64_t)nt;
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < chunks; ++c) {
                int64_t beg, end;
                chunk_bounds(keys, kshift, n, c, chunks, &beg, &end);
                if (blocked)
                    update_rows_blocked(&U, beg, end, (int64_t *)tmp + beg);
                else if (mixed)
                    update_rows_mixed(&U, beg, end, (int64_t *)tmp + beg, gacc);
                else
                    update_rows(&U, beg, end, gacc, 0);
            }
        }
    }
    if (bad != INT64_MAX) {
        err[0] = bad;
        rc = TBE_EID;
    }
    return rc;
}
