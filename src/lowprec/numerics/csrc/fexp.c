/*
 * fexp.c: ATen's vectorised exp of the 16-bit CPU flash attention (lp_fexp_u20).
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

LP_OPT_CLONES static void fexp_range(const float *x, float *o, int64_t b, int64_t e) {
    const float c0 = lp_bits_f32(0x38e077a1u), c1 = lp_bits_f32(0x3e9b69f0u),
                c2 = lp_bits_f32(0xbe65b8f5u), c3 = lp_bits_f32(0xbda235d5u);
    const float lo = lp_bits_f32(0xC2AEAC50u), hi = lp_bits_f32(0x42B17218u),
                log2e = lp_bits_f32(0x3FB8AA3Bu);
    for (int64_t i = b; i < e; ++i) {
        const float xi = x[i];
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
        memcpy(o + i, &bits, 4);
    }
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
