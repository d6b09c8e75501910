/*
 * fexp.c: ATen's vectorised exp of the 16-bit CPU flash attention (lp_fexp_u20), and the
 * emulated attention's passes over rows of scores that surround it (lp_attn_*).
 */
#include "lp_common.h"

/* ATen's Vectorized<float>::fexp_u20 (vec256_float.h / vec512_float.h, after Malossi et al.),
 * lane by lane: the exp the 16-bit CPU flash attention takes on whole vectors of keys. A cubic
 * of the fractional part of x*log2(e) by fused multiply-adds, its bits assembled as
 * 2^23 * (src - poly) + 2^23 * 127 truncated to int32; 0 below ln(FLT_MIN), inf above
 * ln(FLT_MAX), 0 for NaN. lowprec.training.emulation.kernels.fexp_u20 is the same in torch ops
 * (its fp32 FMAs through float64) and the tests compare the two. */
static inline float lp_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float fexp_one(const float xi) {
    const float c0 = lp_bits_f32(0x38e077a1u), c1 = lp_bits_f32(0x3e9b69f0u),
                c2 = lp_bits_f32(0xbe65b8f5u), c3 = lp_bits_f32(0xbda235d5u);
    const float lo = lp_bits_f32(0xC2AEAC50u), hi = lp_bits_f32(0x42B17218u),
                log2e = lp_bits_f32(0x3FB8AA3Bu);
    const float src = xi * log2e;
    const float frac = src - floorf(src);
    const float poly = fmaf(frac, fmaf(frac, fmaf(frac, c3, c2), c1), c0);
    float t = fmaf(8388608.0f, src - poly, 1065353216.0f);
    t = t != t ? 0.0f : t;
    t = t > 2147483520.0f ? 2147483520.0f : t;
    t = t < 0.0f ? 0.0f : t;
    int32_t bits = (int32_t)t;
    bits = xi < lo ? 0 : bits;
    bits = xi > hi ? 0x7F800000 : bits;
    return lp_bits_f32((uint32_t)bits);
}

LP_OPT_CLONES static void fexp_range(const float *x, float *o, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) o[i] = fexp_one(x[i]);
}

void lp_fexp_u20(const float *x, float *out, int64_t n, int nthreads) {
    const int nt = lp_threads_for(n, nthreads);
    const int64_t per = (n + nt - 1) / nt;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int t = 0; t < nt; ++t) {
        const int64_t b = t * per < n ? t * per : n, e = (t + 1) * per < n ? (t + 1) * per : n;
        fexp_range(x, out, b, e);
    }
}

/* ---- the emulated flash attention's row passes ----------------------------------------------
 * Rows of n scores, `rows` of them, row r the query r % L of its [L, n] matrix. Causal: key j of
 * query i masked where j > i (torch's triu(1) of an [L, n] mask). Each pass is the torch ops
 * lowprec.training.emulation.kernels._FlashAttention otherwise runs, fused, the same fp32
 * operations in the same order (this file builds with -ffp-contract=off): the tests compare the
 * two on every instruction-set build. */

static inline int64_t attn_keep(int64_t r, int64_t n, int64_t L, int causal) {
    if (!causal) return n;
    const int64_t i = r % L;
    return i + 1 < n ? i + 1 : n;
}

/* NaN payloads follow torch's CPU kernels: a - b is b's NaN where both are NaN (in the vector
 * body and the scalar tail alike), a * b is b's in the vector body (the tail takes a's: the
 * one case where a NaN's sign or payload may differ from the torch ops, with NaN on both
 * sides of a product, and only in the last elements of a thread's chunk); torch's amax
 * gives the canonical NaN (NAN). */

/* One call's arguments: the rows' tensors (x, y, per-row z) and shape. */
typedef struct {
    float *x, *y, *z;
    int64_t n, nvec, L;
    float sc;
    int causal;
} attn_args;

/* The rows [0, rows) split among threads, each range run by `range`. */
static void attn_rows(void (*range)(const attn_args *, int64_t, int64_t), const attn_args *a,
                      int64_t rows, int nthreads) {
    const int nt = lp_threads_for(rows * a->n, nthreads);
    const int64_t per = (rows + nt - 1) / nt;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int t = 0; t < nt; ++t) {
        const int64_t b = t * per < rows ? t * per : rows;
        const int64_t e = (t + 1) * per < rows ? (t + 1) * per : rows;
        range(a, b, e);
    }
}

/* The max of n >= 1 values without NaN, in any order (the max of a set is the same): under
 * finite-math-only, x > m ? x : m becomes a vector max (on 64-key rows several times faster
 * than the loop GCC keeps scalar for NaN's sake: benchmarks/RESULTS.md, figure F44). No
 * infinity is a constant here, so nothing is folded on the assumption; the hardware's max
 * orders infinities as any value. */
LP_OPT_CLONES __attribute__((optimize("finite-math-only", "no-signed-zeros")))
static float finite_max(const float *x, int64_t n) {
    float m = x[0];
    for (int64_t j = 1; j < n; ++j) m = x[j] > m ? x[j] : m;
    return m;
}

LP_OPT_CLONES static int has_nan(const float *x, int64_t n) {
    int any = 0;
    for (int64_t j = 0; j < n; ++j) any |= x[j] != x[j];
    return any;
}

/* torch's amax of a row: NaN if it holds one. */
static inline float row_max(const float *x, int64_t n) {
    return has_nan(x, n) ? NAN : finite_max(x, n);
}

/* Forward, in place on the scores x: x = x * sc, masked -inf; m = the row's max (NaN if it
 * holds one; 0 where infinite); x = fexp_u20(x - m) on the row's first nvec keys (whole
 * vectors), x - m on the rest (the caller takes torch's exp of them). m to z[r]. */
LP_OPT_CLONES static void attn_fwd_range(const attn_args *a, int64_t b, int64_t e) {
    const int64_t n = a->n;
    for (int64_t r = b; r < e; ++r) {
        float *x = a->x + r * n;
        const int64_t keep = attn_keep(r, n, a->L, a->causal);
        for (int64_t j = 0; j < keep; ++j) x[j] = x[j] * a->sc;
        for (int64_t j = keep; j < n; ++j) x[j] = -INFINITY;
        float m = row_max(x, keep);
        m = isinf(m) ? 0.0f : m;
        a->z[r] = m;
        if (m != m) /* a row with a NaN: x - m is m's NaN throughout */
            for (int64_t j = 0; j < n; ++j) x[j] = m;
        else
            for (int64_t j = 0; j < n; ++j) x[j] = x[j] - m;
        fexp_range(x, x, 0, a->nvec);
    }
}

void lp_attn_fwd_rows(float *s, float *rowmax, int64_t rows, int64_t n, int64_t nvec, int64_t L,
                      float sc, int causal, int nthreads) {
    const attn_args a = {s, NULL, rowmax, n, nvec < n ? nvec : n, L, sc, causal};
    attn_rows(attn_fwd_range, &a, rows, nthreads);
}

/* Backward, before torch's exp, in place on the scores x: x = x * sc - lse[r] (z) where kept;
 * where masked, the value exp would make 0 is stored as 0 (ATen's exp of -inf is slow: F44)
 * and a NaN as that NaN (-inf - lse with lse -inf or NaN); lp_attn_bwd_ds zeroes what exp
 * made of the zeros. */
LP_OPT_CLONES static void attn_bwd_p_range(const attn_args *a, int64_t b, int64_t e) {
    const int64_t n = a->n;
    for (int64_t r = b; r < e; ++r) {
        float *x = a->x + r * n;
        const float l = a->z[r];
        const int64_t keep = attn_keep(r, n, a->L, a->causal);
        if (l != l) { /* x * sc - lse is lse's NaN throughout, masked keys too */
            for (int64_t j = 0; j < n; ++j) x[j] = l;
            continue;
        }
        for (int64_t j = 0; j < keep; ++j) x[j] = x[j] * a->sc - l;
        const float masked = -INFINITY - l; /* NaN where lse is -inf */
        for (int64_t j = keep; j < n; ++j) x[j] = masked != masked ? masked : 0.0f;
    }
}

void lp_attn_bwd_p(float *s, const float *lse, int64_t rows, int64_t n, int64_t L, float sc,
                   int causal, int nthreads) {
    const attn_args a = {s, NULL, (float *)lse, n, n, L, sc, causal};
    attn_rows(attn_bwd_p_range, &a, rows, nthreads);
}

/* Backward, after torch's exp: p (y) = 0 where masked (NaN kept), and dp (x) = (dp - dsum[r])
 * * p, dsum in z. */
LP_OPT_CLONES static void attn_bwd_ds_range(const attn_args *a, int64_t b, int64_t e) {
    const int64_t n = a->n;
    for (int64_t r = b; r < e; ++r) {
        float *d = a->x + r * n, *p = a->y + r * n;
        const float sum = a->z[r];
        const int64_t keep = attn_keep(r, n, a->L, a->causal);
        for (int64_t j = keep; j < n; ++j) p[j] = p[j] != p[j] ? p[j] : 0.0f;
        if (sum != sum) { /* dp - dsum is dsum's NaN; times p, p's where p is NaN */
            for (int64_t j = 0; j < n; ++j) d[j] = p[j] != p[j] ? p[j] : sum;
            continue;
        }
        for (int64_t j = 0; j < n; ++j) {
            const float t = d[j] - sum, v = p[j];
            d[j] = t != t && v != v ? v : t * v;
        }
    }
}

void lp_attn_bwd_ds(float *dp, float *p, const float *dsum, int64_t rows, int64_t n, int64_t L,
                    int causal, int nthreads) {
    const attn_args a = {dp, p, (float *)dsum, n, n, L, 1.0f, causal};
    attn_rows(attn_bwd_ds_range, &a, rows, nthreads);
}
