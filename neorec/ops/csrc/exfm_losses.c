/*
 * The losses of an ExFM student's step (neorec.train.distill, neorec.ops.exfm_losses) in one pass
 * over the batch, with their gradients: on a small student, torch's per-op cost for these few
 * hundred weights (~40 tensor ops and autograd nodes a step) outweighs their arithmetic.
 * Compiled into the same library as tbe_cpu.c (neorec/ops/cpu.py appends this file).
 *
 * Per sample i (z the serving logit, y the label, f the FM logit, T the temperature):
 *   serving  BCE(z, y)                                      d/dz  (s(z) - y) / B
 *   soft     T^2 BCE(z / T, s(f / T))                       d/dz  T (s(z / T) - s(f / T)) / B
 *   adapter  BCE(o, y), o = <a, x> + c + w2 . relu(W1 x + b1) + b2, x = [f, z, dense.., 1]
 *            (first = [[W1, b1], [a, c]] [A + 1, n + 1], second = [w2, b2] [A + 1])
 *   aux      T^2 BCE(h / T, s(t / T)), h = <hidden_i, w> + b, t = o (adapter) else f
 * BCE(z, y) = (1 - y) z - logsigmoid(z) (torch's formula); each loss is the batch mean, summed
 * in sample order in double. The forward writes the four losses, their weighted total and the
 * per-unit gradients; the backward scales them by the total's incoming gradient. No OpenMP:
 * one thread, a fixed order, so runs are deterministic.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* BCE(z, y) = (1 - y) z - logsigmoid(z) (torch's formula), and *sig = sigmoid(z), from one exp. */
static inline double ex_bce(float z, float y, float *sig) {
    const float e = expf(-fabsf(z));
    const float ls = fminf(z, 0.0f) - log1pf(e); /* logsigmoid(z) */
    *sig = z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    return (double)((1.0f - y) * z - ls);
}

static inline float ex_sigmoid(float z) {
    const float e = expf(-fabsf(z));
    return z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

/*
 * Returns -1, or the index of the first sample whose FM logit is not finite (nothing written
 * but what came before it; the caller raises). H = 0: no aux head; A = 0: no adapter.
 * out: [B, ostride] (column 0 the serving logit, columns 1..H the top MLP's penultimate layer).
 * coef [4]: weights of (serving, soft, aux, adapter) in the total. losses [4]: serving, soft,
 * aux, adapter; total [1]: their weighted sum. unit [B, 1 + H]: d total / d out per unit of
 * incoming gradient; dhead [H + 1]: d aux / d (w, b); dfirst [A + 1, n + 1],
 * dsecond [A + 1]: d adapter / d (first, second) (unscaled by coef). adapted [B]: o (A > 0).
 */
int64_t exfm_losses_forward(int64_t B, const float *out, int64_t ostride, const float *labels,
                            const float *fm, const float *coef, float T, int64_t H,
                            const float *w, const float *b, int64_t A, int64_t n,
                            const float *dense, const float *first, const float *second,
                            float *losses, float *total, float *unit, float *dhead, float *dfirst,
                            float *dsecond, float *adapted, float *scratch) {
    const int64_t nx = n + 1, cols = 1 + H, nd = n - 2, na = A + 1;
    double l_serv = 0, l_soft = 0, l_aux = 0, l_ad = 0;
    const float inv_b = 1.0f / (float)B, tt = T * T;
    const int soft = coef[1] != 0.0f || H == 0; /* (plain distillation reports it at weight 0) */
    float *x = scratch, *pre = scratch + nx, *ft = scratch + nx + na; /* [n+1], [A+1], [n+1, A+1] */
    if (H) memset(dhead, 0, sizeof(float) * (size_t)(H + 1));
    if (A) {
        memset(dfirst, 0, sizeof(float) * (size_t)(na * nx));
        memset(dsecond, 0, sizeof(float) * (size_t)na);
        /* first transposed: the hidden units' sums run side by side (vectorized over j), each
           still summed in k order */
        for (int64_t j = 0; j < na; j++)
            for (int64_t k = 0; k < nx; k++) ft[k * na + j] = first[j * nx + k];
    }
    for (int64_t i = 0; i < B; i++) {
        const float z = out[i * ostride], y = labels[i], f = fm[i];
        if (!isfinite(f)) return i;
        float *u = unit + i * cols;
        float sz;
        l_serv += ex_bce(z, y, &sz);
        float dz = coef[0] * ((sz - y) * inv_b);
        const float q = (soft || !A) ? ex_sigmoid(f / T) : 0.0f; /* the FM's soft label */
        if (soft) {
            float szt = sz;
            l_soft += tt * (T == 1.0f ? ex_bce(z, q, &szt) : ex_bce(z / T, q, &szt));
            dz += coef[1] * (T * (szt - q) * inv_b);
        }
        u[0] = dz;
        float target_q = q;
        if (A) {
            x[0] = f;
            x[1] = z;
            for (int64_t k = 0; k < nd; k++) x[2 + k] = dense[i * nd + k];
            x[n] = 1.0f;
            for (int64_t j = 0; j < na; j++) pre[j] = 0.0f;
            for (int64_t k = 0; k < nx; k++) {
                const float xk = x[k], *col = ft + k * na;
                for (int64_t j = 0; j < na; j++) pre[j] += col[j] * xk;
            }
            float o = pre[A] + second[A];
            for (int64_t j = 0; j < A; j++) o += (pre[j] > 0.0f ? pre[j] : 0.0f) * second[j];
            adapted[i] = o;
            float so;
            l_ad += ex_bce(o, y, &so);
            const float g = (so - y) * inv_b;
            for (int64_t j = 0; j < A; j++) {
                if (pre[j] > 0.0f) {
                    const float gj = g * second[j];
                    float *drow = dfirst + j * nx;
                    for (int64_t k = 0; k < nx; k++) drow[k] += gj * x[k];
                    dsecond[j] += pre[j] * g;
                }
            }
            float *dlin = dfirst + A * nx;
            for (int64_t k = 0; k < nx; k++) dlin[k] += g * x[k];
            dsecond[A] += g;
            target_q = T == 1.0f ? so : ex_sigmoid(o / T);
        }
        if (H) {
            const float *h = out + i * ostride + 1;
            float a = b[0];
            for (int64_t k = 0; k < H; k++) a += h[k] * w[k];
            float sa;
            l_aux += tt * (T == 1.0f ? ex_bce(a, target_q, &sa) : ex_bce(a / T, target_q, &sa));
            const float ga = T * (sa - target_q) * inv_b;
            const float gu = coef[2] * ga;
            for (int64_t k = 0; k < H; k++) {
                dhead[k] += ga * h[k];
                u[1 + k] = gu * w[k];
            }
            dhead[H] += ga;
        }
    }
    losses[0] = (float)(l_serv / (double)B);
    losses[1] = (float)(l_soft / (double)B);
    losses[2] = (float)(l_aux / (double)B);
    losses[3] = (float)(l_ad / (double)B);
    total[0] = coef[0] * losses[0] + coef[1] * losses[1] + coef[2] * losses[2] +
                coef[3] * losses[3];
    return -1;
}

/* In place: unit *= g, dhead *= g coef[2], dfirst and dsecond *= g coef[3] (g = *grad). */
void exfm_losses_backward(int64_t B, int64_t H, int64_t A, int64_t n, const float *grad,
                          const float *coef, float *unit, float *dhead, float *dfirst,
                          float *dsecond) {
    const float g = grad[0], ga = g * coef[2], gd = g * coef[3];
    const int64_t cu = B * (1 + H);
    if (g != 1.0f)
        for (int64_t k = 0; k < cu; k++) unit[k] *= g;
    if (H)
        for (int64_t k = 0; k <= H; k++) dhead[k] *= ga;
    if (A) {
        for (int64_t k = 0; k < (A + 1) * (n + 1); k++) dfirst[k] *= gd;
        for (int64_t k = 0; k <= A; k++) dsecond[k] *= gd;
    }
}
