/*
 * optimizer.c: the fused optimizer step (lp_opt_step) for low-precision storage: read the parameter, gradient and state in
 * their storage dtype (float32, bfloat16 or float16), do the update in float32, and write each
 * stored value back once, rounded onto its format with quantize_one. One pass instead of the ten
 * tensor operations of the torch path (lowprec/training/optim), and the same bits: both follow
 * the per-element definition written in lowprec/training/optim/sgd.py and adam.py. In it every
 * operation is one IEEE 754 float32 operation, correctly rounded: +, -, *, /, sqrt, and
 * fma(a, b, c) = a * b + c rounded once, which is what torch's CPU kernels compute for add with
 * alpha, lerp, addcmul (vec::fmadd). The build uses -ffp-contract=off so that the compiler adds
 * no fusion of its own; every fusion is an explicit fmaf(). The constants (1 - beta1, -lr, ...)
 * come from Python, computed in float64 and rounded to float32 as torch rounds a Python scalar.
 * The arithmetic loops are LP_OPT_CLONES (fmaf; see lp_common.h); rounding runs quantize.c's
 * tile loops.
 */
#include "lp_common.h"

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

typedef struct {
    int32_t kind; /* 0 SGD, 1 Adam */
    int32_t p_dtype, g_dtype, s_dtype;
    int32_t nesterov, first, decoupled, sqrt_storage, has_momentum;
    /* float32 constants, each the float32 rounding of a float64 value computed in Python */
    float neg_lr;     /* -lr (SGD) */
    float momentum;   /* SGD momentum */
    float damp_c;     /* 1 - dampening */
    float wd;         /* weight decay (L2 for SGD and Adam) */
    float decay;      /* 1 - lr * wd (AdamW) */
    float lerp_w;     /* 1 - beta1, the weight of torch.lerp */
    float beta2;
    float beta2_c;    /* 1 - beta2 */
    float eps;
    float neg_step;   /* -lr / (1 - beta1**step) */
    float bc2_sqrt;   /* sqrt(1 - beta2**step) */
    float grad_scale;
    int32_t p_is_bf16, s_is_bf16; /* the format is exactly IEEE bfloat16 (round by bit trick) */
    /* SGD: the update reads the new momentum before it is rounded for storage (a torch.optim.SGD
     * stepping float32 carriers, whose state FormatOptimizer rounds after the step); 0: the
     * stored, rounded one (lowprec's SGD, as a 16-bit buffer holds it) */
    int32_t raw_state;
    /* 1: SGD takes the tiles even where sgd_f32_fast applies (the tests compare the two) */
    int32_t tiles_only;
} lp_opt;

/* float16 <-> float32 by integer operations, so that every clone vectorizes (no AVX512-FP16 or
 * F16C needed). The store only ever sees values already on the float16 grid, so it is exact. */
LP_INLINE float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, mag = h & 0x7fffu;
    /* shifting the 15 magnitude bits into place and scaling by 2**112 is exact for normal and
     * subnormal values; the all-ones exponent maps to Inf/NaN */
    const uint32_t finite = f2u(u2f(mag << 13) * 0x1p112f);
    const uint32_t special = 0x7f800000u | ((mag & 0x3ffu) << 13);
    return u2f(sign | sel(mask_if(mag >= 0x7c00u), special, finite));
}

LP_INLINE uint16_t f32_to_f16_exact(uint32_t b) {
    const uint32_t sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
    const uint32_t normal = ((a >> 13) - (112u << 10)) & 0x7fffu;
    const uint32_t sub = (uint32_t)(int32_t)(u2f(a) * 0x1p24f); /* k of k * 2**-24 */
    const uint32_t special = 0x7c00u | ((a & 0x7fffffu) ? 0x200u : 0u);
    uint32_t h = sel(mask_if(a < 0x38800000u), sub, normal); /* below 2**-14: subnormal */
    h = sel(mask_if(a >= 0x7f800000u), special, h);
    h = sel(mask_if(a >= 0x477ff000u && a < 0x7f800000u), 0x7c00u, h); /* beyond fp16: Inf */
    return (uint16_t)(sign | h);
}

LP_INLINE float load_as(const void *base, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)base)[i];
    if (dt == DT_BF16) return u2f((uint32_t)((const uint16_t *)base)[i] << 16);
    return f16_to_f32(((const uint16_t *)base)[i]);
}

/* vbits is already on the storage format's grid: the narrowing is exact. */
LP_INLINE void store_as(void *base, int64_t i, int dt, uint32_t vbits) {
    if (dt == DT_F32) ((uint32_t *)base)[i] = vbits;
    else if (dt == DT_BF16) ((uint16_t *)base)[i] = (uint16_t)(vbits >> 16);
    else ((uint16_t *)base)[i] = f32_to_f16_exact(vbits);
}

#ifdef LP_F16C_PATH
#include <immintrin.h>
/* float16 tiles widened and narrowed by F16C, eight values an instruction: the same bits as
 * f16_to_f32 and f32_to_f16_exact (exact conversions of values on the float16 grid) but for NaN,
 * which the instructions treat otherwise (a signalling NaN quieted; a float32 NaN's top payload
 * bits kept): eight values holding a NaN go through the integer functions. The integer
 * conversions were a third of a float16 SGD-with-momentum step. */
__attribute__((target("avx2,f16c"))) static void load_f16c(float *dst, const uint16_t *src,
                                                            int n) {
    int l = 0;
    for (; l + 8 <= n; l += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(src + l));
        const __m128i mag = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
        if (_mm_movemask_epi8(_mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7c00)))) {
            for (int k = l; k < l + 8; ++k) dst[k] = f16_to_f32(src[k]);
        } else {
            _mm256_storeu_ps(dst + l, _mm256_cvtph_ps(h));
        }
    }
    for (; l < n; ++l) dst[l] = f16_to_f32(src[l]);
}

__attribute__((target("avx2,f16c"))) static void store_f16c(uint16_t *dst, const uint32_t *src,
                                                             int n) {
    int l = 0;
    for (; l + 8 <= n; l += 8) {
        const __m256 x = _mm256_loadu_ps((const float *)(src + l));
        if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) {
            for (int k = l; k < l + 8; ++k) dst[k] = f32_to_f16_exact(src[k]);
        } else {
            _mm_storeu_si128((__m128i *)(dst + l),
                             _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
    for (; l < n; ++l) dst[l] = f32_to_f16_exact(src[l]);
}
#endif

typedef struct {
    void *p;
    const void *g;
    void *s1, *s2;
    const lp_opt *o;
    const lp_params *pq, *sq;
} lp_opt_job;

/* A tile pipeline: each stage is a plain loop over LP_OT elements in L1 (load and widen, the
 * fp32 arithmetic of one state, rounding with the quantize tile loop, narrow and store), so every
 * stage vectorizes and rounding takes the fast path of quantize. */
#define LP_OT 256

/* The lines of the tile LP_PF tiles ahead, asked for while this one is computed: the stages
 * between two loads leave the hardware prefetcher behind (quantize.c's lp_prefetch likewise). */
#define LP_PF 4

static inline void prefetch_tile(const void *base, int dt, int64_t off) {
    const int64_t size = dt == DT_F32 ? 4 : 2;
    const char *b = (const char *)base + off * size;
    for (int64_t k = 0; k < LP_OT * size; k += 64) __builtin_prefetch(b + k, 1, 3);
}

/* f16c: the CPU has F16C (float16 tiles by load_f16c and store_f16c) */
LP_CLONES static void load_tile(float *dst, const void *src, int dt, int64_t off, int n,
                                int f16c) {
#ifdef LP_F16C_PATH
    if (dt == DT_F16 && f16c) {
        load_f16c(dst, (const uint16_t *)src + off, n);
        return;
    }
#else
    (void)f16c;
#endif
    if (dt == DT_F32) {
        for (int l = 0; l < n; ++l) dst[l] = ((const float *)src)[off + l];
    } else if (dt == DT_BF16) {
        for (int l = 0; l < n; ++l) dst[l] = u2f((uint32_t)((const uint16_t *)src)[off + l] << 16);
    } else {
        for (int l = 0; l < n; ++l) dst[l] = f16_to_f32(((const uint16_t *)src)[off + l]);
    }
}

LP_CLONES static void store_tile(void *dst, const uint32_t *src, int dt, int64_t off, int n,
                                 int f16c) {
#ifdef LP_F16C_PATH
    if (dt == DT_F16 && f16c) {
        store_f16c((uint16_t *)dst + off, src, n);
        return;
    }
#else
    (void)f16c;
#endif
    if (dt == DT_F32) {
        for (int l = 0; l < n; ++l) ((uint32_t *)dst)[off + l] = src[l];
    } else if (dt == DT_BF16) {
        for (int l = 0; l < n; ++l) ((uint16_t *)dst)[off + l] = (uint16_t)(src[l] >> 16);
    } else {
        for (int l = 0; l < n; ++l) ((uint16_t *)dst)[off + l] = f32_to_f16_exact(src[l]);
    }
}

/* Round to nearest even onto bfloat16 (IEEE: subnormals, overflow to Inf) by the integer trick;
 * NaN stays NaN. The same bits as quantize_one with the bf16 format, in four operations. */
LP_CLONES static void round_tile_bf16(const uint32_t *a, uint32_t *q, int n) {
    for (int l = 0; l < n; ++l) {
        const uint32_t b = a[l];
        const uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
        q[l] = sel(mask_if((b & 0x7fffffffu) > 0x7f800000u), b | 0x00400000u, r);
    }
}

/* ne: quantize.c's nearest-even tile loop; fast: rounding to IEEE float16 (the format p) by
 * quantize.c's F16C shortcut instead, the same bits (two conversions a vector instead of the
 * general rule's range checks: a float16 SGD step 1.3-1.6x faster on an Intel Xeon,
 * benchmarks/RESULTS.md, "Issue 37, twelfth session"). bfloat16 keeps round_tile_bf16, which quiets a NaN so that
 * store_tile's narrowing cannot turn it into an infinity. */
static void round_state(const uint32_t *a, uint32_t *q, int n, const lp_inv *si, int is_bf16,
                        tile_fn ne, int fast, const lp_params *p) {
    if (fast) run_at(a, q, n, 0, p);
    else if (is_bf16) round_tile_bf16(a, q, n);
    else ne(a, q, n, 0, 1u, 0, 0, si);
}

#ifdef LP_F16C_PATH
/* SGD's step of float32 carriers whose parameter (and momentum state) formats are IEEE float16 or
 * bfloat16 rounded to nearest even, eight values a vector in one loop: the operations of
 * opt_range's SGD branch in its order (the same fused multiply-adds), rounded as its tiles
 * round (float16: fp16_ne_f16c's conversions, a NaN kept as it is; bfloat16: round_tile_bf16's
 * integer trick, a NaN quieted), with no tile buffers between the stages: the kernel 1.9-2.1x
 * faster than the tiles, a whole step 1.3-2.8x, on an AMD EPYC with AVX2 (benchmarks/RESULTS.md,
 * "Issue 37, twentieth session").
 * [begin, end) a multiple of 8 values; p16 / s16: the parameter's / state's format is float16
 * (else bfloat16); the momentum loaded and stored in its tensor's dtype as load_tile and
 * store_tile do. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 sgd_round(__m256 x, int f16) {
    if (f16) {
        const __m256 y = _mm256_cvtph_ps(
            _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb),
        _mm256_set1_epi32((int)0xffff0000u));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x00400000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, quiet, nan));
}

/* Eight momentum values of dtype dt (DT_F32, DT_F16, DT_BF16) at s + i, widened as load_tile
 * widens them: float16 by F16C, but eight values holding a NaN by the integer conversion (whose
 * multiplication by 2**112 flushes a subnormal to zero under denormals-are-zero, which F16C does
 * not: torch.set_flush_denormal(True)). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 sgd_load_state(const void *s,
                                                                             int64_t i, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)s + i);
    const uint16_t *h16 = (const uint16_t *)s + i;
    const __m128i h = _mm_loadu_si128((const __m128i *)h16);
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    if (_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)),
                                          _mm_set1_epi16(0x7c00)))) {
        float t[8];
        for (int k = 0; k < 8; ++k) t[k] = f16_to_f32(h16[k]);
        return _mm256_loadu_ps(t);
    }
    return _mm256_cvtph_ps(h);
}

/* Eight rounded momentum values q stored at s + i in dtype dt, narrowed as store_tile narrows
 * them (float16 holding a NaN: the integer conversion). This and sgd_load_state repeat
 * load_f16c's and store_f16c's tests in registers: calling those two on eight values through a
 * stack buffer made lowprec's SGD with a float16 momentum 2.4x slower (a 784x512 weight's step
 * 338 -> 825 us, one thread, AMD EPYC with AVX2). */
__attribute__((target("avx2,fma,f16c"))) static inline void sgd_store_state(void *s, int64_t i,
                                                                            int dt, __m256 q) {
    if (dt == DT_F32) {
        _mm256_storeu_ps((float *)s + i, q);
        return;
    }
    uint16_t *h16 = (uint16_t *)s + i;
    if (dt == DT_BF16) {
        const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(q), 16);
        _mm_storeu_si128((__m128i *)h16, _mm_packus_epi32(_mm256_castsi256_si128(hi),
                                                          _mm256_extracti128_si256(hi, 1)));
    } else if (_mm256_movemask_ps(_mm256_cmp_ps(q, q, _CMP_UNORD_Q))) {
        uint32_t t[8];
        _mm256_storeu_ps((float *)t, q);
        for (int k = 0; k < 8; ++k) h16[k] = f32_to_f16_exact(t[k]);
    } else {
        _mm_storeu_si128((__m128i *)h16,
                         _mm256_cvtps_ph(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

__attribute__((target("avx2,fma,f16c"))) static void sgd_f32_fast(const lp_opt_job *j,
                                                                   const lp_opt *o, int64_t begin,
                                                                   int64_t end, int p16, int s16) {
    float *P = (float *)j->p;
    void *S = j->s1;
    const int sdt = o->s_dtype;
    const float *G = (const float *)j->g;
    const __m256 gs = _mm256_set1_ps(o->grad_scale), wd = _mm256_set1_ps(o->wd);
    const __m256 dc = _mm256_set1_ps(o->damp_c), mo = _mm256_set1_ps(o->momentum);
    const __m256 nl = _mm256_set1_ps(o->neg_lr);
    const int scaled = o->grad_scale != 1.0f, decays = o->wd != 0.0f;
    for (int64_t i = begin; i < end; i += 8) {
        const __m256 w = _mm256_loadu_ps(P + i);
        __m256 g = _mm256_loadu_ps(G + i);
        if (scaled) g = _mm256_mul_ps(g, gs);
        if (decays) g = _mm256_fmadd_ps(w, wd, g);
        if (o->has_momentum) {
            const __m256 a = o->first ? g
                : _mm256_fmadd_ps(g, dc, _mm256_mul_ps(sgd_load_state(S, i, sdt), mo));
            const __m256 q = sgd_round(a, s16);
            sgd_store_state(S, i, sdt, q);
            const __m256 b = o->raw_state ? a : q;
            g = o->nesterov ? _mm256_fmadd_ps(b, mo, g) : b;
        }
        _mm256_storeu_ps(P + i, sgd_round(_mm256_fmadd_ps(g, nl, w), p16));
    }
}

/* Whether sgd_f32_fast computes this step: SGD, float32 parameter and gradient tensors,
 * formats float16 (F16C's shortcut) or bfloat16 rounded to nearest, the momentum held in float32
 * or in its format's own dtype; a CPU with AVX2, FMA, F16C. */
static int sgd_fast_applies(const lp_opt *o, int pfast, int sfast) {
    const int state_ok = (sfast && (o->s_dtype == DT_F32 || o->s_dtype == DT_F16)) ||
                         (o->s_is_bf16 && (o->s_dtype == DT_F32 || o->s_dtype == DT_BF16));
    return !o->tiles_only && o->kind == 0 && o->p_dtype == DT_F32 && o->g_dtype == DT_F32 &&
           (pfast || o->p_is_bf16) && (!o->has_momentum || state_ok) &&
           lp_has_f16c() && __builtin_cpu_supports("fma");
}
#endif

LP_OPT_CLONES static void opt_range(const lp_opt_job *j, int64_t begin, int64_t end) {
    const lp_opt o = *j->o;
    const lp_inv pi = make_inv(j->pq, 0), si = make_inv(j->sq, 0);
    const uint32_t k0 = j->pq->k0, k1 = j->pq->k1;
    const int sr = j->pq->rounding == R_STOCHASTIC;
    const tile_fn ne = tile_of(pick_loop(R_NEAREST_EVEN)), sr_tile = tile_of(pick_loop(R_STOCHASTIC));
    const lp_params *pq = j->pq, *sq = j->sq;
    const int pfast = !sr && lp_fp16_shortcut(pq), sfast = lp_fp16_shortcut(sq);
#ifdef LP_F16C_PATH
    const int f16c = lp_has_f16c();
#else
    const int f16c = 0;
#endif
    /* torch.lerp (ATen Lerp.h / LerpKernel.cpp): weight w with |w| < 0.5 gives
     * fma(w, end - self, self), otherwise fma(w - 1, end - self, end) */
    const int lerp_small = fabsf(o.lerp_w) < 0.5f;
    const float lerp_c = lerp_small ? o.lerp_w : o.lerp_w - 1.0f;
    float w[LP_OT], g[LP_OT], s1[LP_OT], s2[LP_OT];
    uint32_t a[LP_OT], q1[LP_OT], q2[LP_OT];
    const int s1_read = o.kind == 1 || (o.has_momentum && !o.first);
#ifdef LP_F16C_PATH
    if (!sr && sgd_fast_applies(&o, pfast, sfast)) { /* whole vectors; the rest by the tiles */
        const int64_t stop = begin + ((end - begin) & ~(int64_t)7);
        sgd_f32_fast(j, &o, begin, stop, pfast, sfast);
        begin = stop;
    }
#endif
    for (int64_t t0 = begin; t0 < end; t0 += LP_OT) {
        const int n = (int)(end - t0 < LP_OT ? end - t0 : LP_OT);
        if (t0 + (LP_PF + 1) * LP_OT <= end) {
            const int64_t ahead = t0 + LP_PF * LP_OT;
            prefetch_tile(j->p, o.p_dtype, ahead);
            prefetch_tile(j->g, o.g_dtype, ahead);
            if (s1_read) prefetch_tile(j->s1, o.s_dtype, ahead);
            if (o.kind == 1) prefetch_tile(j->s2, o.s_dtype, ahead);
        }
        load_tile(w, j->p, o.p_dtype, t0, n, f16c);
        load_tile(g, j->g, o.g_dtype, t0, n, f16c);
        if (o.grad_scale != 1.0f) /* g * 1 is exact: skipping it changes no bit */
            for (int l = 0; l < n; ++l) g[l] = g[l] * o.grad_scale;
        if (o.kind == 0) { /* SGD: see lowprec/training/optim/sgd.py */
            if (o.wd != 0.0f)
                for (int l = 0; l < n; ++l) g[l] = fmaf(w[l], o.wd, g[l]);
            if (o.has_momentum) {
                if (o.first) {
                    for (int l = 0; l < n; ++l) a[l] = f2u(g[l]);
                } else {
                    load_tile(s1, j->s1, o.s_dtype, t0, n, f16c);
                    for (int l = 0; l < n; ++l) a[l] = f2u(fmaf(g[l], o.damp_c, s1[l] * o.momentum));
                }
                round_state(a, q1, n, &si, o.s_is_bf16, ne, sfast, sq);
                store_tile(j->s1, q1, o.s_dtype, t0, n, f16c);
                const uint32_t *b = o.raw_state ? a : q1; /* the momentum the update reads */
                if (o.nesterov) {
                    for (int l = 0; l < n; ++l) g[l] = fmaf(u2f(b[l]), o.momentum, g[l]);
                } else {
                    for (int l = 0; l < n; ++l) g[l] = u2f(b[l]);
                }
            }
            for (int l = 0; l < n; ++l) a[l] = f2u(fmaf(g[l], o.neg_lr, w[l]));
        } else { /* Adam / AdamW: see lowprec/training/optim/adam.py */
            if (o.wd != 0.0f) {
                if (o.decoupled) {
                    for (int l = 0; l < n; ++l) w[l] = w[l] * o.decay;
                } else {
                    for (int l = 0; l < n; ++l) g[l] = fmaf(w[l], o.wd, g[l]);
                }
            }
            load_tile(s1, j->s1, o.s_dtype, t0, n, f16c);
            if (lerp_small) {
                for (int l = 0; l < n; ++l) a[l] = f2u(fmaf(lerp_c, g[l] - s1[l], s1[l]));
            } else {
                for (int l = 0; l < n; ++l) a[l] = f2u(fmaf(lerp_c, g[l] - s1[l], g[l]));
            }
            round_state(a, q1, n, &si, o.s_is_bf16, ne, sfast, sq);
            store_tile(j->s1, q1, o.s_dtype, t0, n, f16c);
            load_tile(s2, j->s2, o.s_dtype, t0, n, f16c);
            if (o.sqrt_storage) { /* sqrt(v) is stored: square it, update, store its root */
                for (int l = 0; l < n; ++l)
                    a[l] = f2u(sqrtf(fmaf(o.beta2_c * g[l], g[l], (s2[l] * s2[l]) * o.beta2)));
                round_state(a, q2, n, &si, o.s_is_bf16, ne, sfast, sq);
                for (int l = 0; l < n; ++l) s2[l] = u2f(q2[l]);
            } else {
                for (int l = 0; l < n; ++l)
                    a[l] = f2u(fmaf(o.beta2_c * g[l], g[l], s2[l] * o.beta2));
                round_state(a, q2, n, &si, o.s_is_bf16, ne, sfast, sq);
                for (int l = 0; l < n; ++l) s2[l] = sqrtf(u2f(q2[l]));
            }
            store_tile(j->s2, q2, o.s_dtype, t0, n, f16c);
            /* torch.addcdiv: self + (value * t1) / t2, no fusion possible around the division */
            for (int l = 0; l < n; ++l)
                a[l] = f2u(w[l] + (o.neg_step * u2f(q1[l])) / (s2[l] / o.bc2_sqrt + o.eps));
        }
        if (sr)
            sr_tile(a, q1, n, (uint32_t)t0, 1u, k0, k1, &pi);
        else
            round_state(a, q1, n, &pi, o.p_is_bf16, ne, pfast, pq);
        store_tile(j->p, q1, o.p_dtype, t0, n, f16c);
    }
}

void lp_opt_step(void *p, const void *g, void *s1, void *s2, int64_t n, const lp_opt *o,
                 const lp_params *pq, const lp_params *sq, int nthreads) {
    lp_opt_job j = {p, g, s1, s2, o, pq, sq};
    const int nt = lp_threads_for(n, nthreads);
#ifdef _OPENMP
    /* thread shares aligned to tiles, so that a tile never straddles two threads */
    const int64_t per = ((n + nt - 1) / nt + LP_OT - 1) / LP_OT * LP_OT;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = omp_get_thread_num();
        const int64_t b = t * per < n ? t * per : n, e = (t + 1) * per < n ? (t + 1) * per : n;
        if (b < e) opt_range(&j, b, e);
    }
#else
    opt_range(&j, 0, n);
#endif
}
