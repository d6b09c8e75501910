/*
 * lowprec's fused quantization kernel: float32 in, float32 out, one pass.
 *
 * Every target format (IEEE / OCP floats, fixed point, the elements of MX blocks) is described by
 * a handful of integers: a value whose float32 exponent field is >= bemin lies in the normal range
 * and keeps `man` mantissa bits (its quantum is 2**(E - man)); below it the quantum is fixed at
 * 2**qsub (subnormals: emin - man; no subnormals: emin; fixed point: -FL). Rounding works on the
 * 24-bit significand M of |x| = M * 2**(ef - 150): the low s bits are discarded, giving k (kept)
 * and a 32-bit fraction t of the quantum; the mode decides whether k becomes k + 1. The result
 * (k + up) * 2**qe is exact in float32 because every format here is a subset of float32. Overflow
 * (beyond maxpos / maxneg) follows IEEE 754-2019 section 7.4 for directed modes and the format's
 * overflow rule otherwise. The Python reference path (lowprec/_reference.py) implements the same
 * integer algorithm with torch ops; the tests require identical bits.
 *
 * Stochastic rounding draws its bits from a counter-based hash of (element index, seed), so the
 * result depends only on the seed and the logical position of the element, never on the number
 * of threads or on a global generator state.
 *
 * Built as a CPython extension module only so that setuptools compiles it at install time; it is
 * called through ctypes (the GIL is released during the call).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

/* Rounding codes: params.py's R_* names and values (what every quantization path takes); the
 * short names are the same values as the kernel spells them. */
enum { R_NEAREST_EVEN = 0, R_NEAREST_AWAY = 1, R_TOWARD_ZERO = 2, R_UP = 3, R_DOWN = 4,
       R_STOCHASTIC = 5,
       R_NE = R_NEAREST_EVEN, R_NA = R_NEAREST_AWAY, R_Z = R_TOWARD_ZERO, R_SR = R_STOCHASTIC };
enum { OV_INF = 0, OV_NAN = 1, OV_SAT = 2 };
#define LP_NAN_SHIFT 1000 /* per-block shift marking a block whose scale is NaN */

typedef struct {
    int32_t man;         /* mantissa bits kept in the normal range */
    int32_t bemin;       /* float32-biased exponent of the smallest normal (huge for fixed point) */
    int32_t qsub;        /* quantum exponent below the normal range */
    int32_t overflow;    /* OV_INF, OV_NAN, OV_SAT */
    int32_t signed_zero; /* 0: -0 becomes +0 (fixed point, fnuz) */
    int32_t rounding;    /* R_* */
    uint32_t maxpos;     /* float32 bits of the largest positive value */
    uint32_t maxneg;     /* float32 bits of the magnitude of the most negative value */
    uint32_t rmask;      /* stochastic: mask selecting the top r bits of a 32-bit word */
    uint32_t k0, k1;     /* stochastic: 64-bit key drawn from a torch.Generator */
} lp_params;

#define LP_INLINE static inline __attribute__((always_inline))

/* 32-bit integer hash "lowbias32" (C. Wellons, hash-prospector), a bijection on uint32. */
LP_INLINE uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

typedef union { uint32_t u; float f; } lp_pun;
LP_INLINE uint32_t f2u(float f) { lp_pun x; x.f = f; return x.u; }
LP_INLINE float u2f(uint32_t u) { lp_pun x; x.u = u; return x.f; }

/* 2**e as float32 bits, e in [-149, 127]. */
LP_INLINE uint32_t pow2_bits(int32_t e) {
    return e >= -126 ? (uint32_t)(e + 127) << 23 : 1u << ((e + 149) & 31);
}

/* Branch-free selection, so that the vectorizer sees straight-line code. */
LP_INLINE uint32_t mask_if(int c) { return (uint32_t)0 - (uint32_t)(c != 0); }
LP_INLINE uint32_t sel(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }
LP_INLINE int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }
LP_INLINE int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }

/* Loop invariants of one call (one block): the format shifted by the block's scale 2**sh. */
typedef struct {
    int32_t man, bemin, qsub, signed_zero;
    uint32_t maxpos, maxneg, special, rmask, saturate;
    int32_t fast;                 /* float format with 1..23 discarded bits: fast path usable */
    uint32_t fshift, fmask, fhalf; /* 23 - man, low-bit mask, 2**(fshift-1) - 1 */
    uint32_t fodd;                /* 1 when man == 0: the kept significand is the implicit 1 */
    int32_t fsub;                 /* below the normal range, nearest even by (|x| + msub) - msub */
    float msub;                   /* 2**(qsub + 23): its float32 ulp is the quantum 2**qsub */
    int32_t fixed_ne;             /* fixed point (no normal range), limits below msub: nearest
                                   * even by the fsub trick for every value */
    int32_t fixed_sr;             /* fixed point: stochastic rounding with 32 random bits by
                                   * the float path's trick at a per-element shift */
    uint32_t quantum;             /* float32 bits of 2**qsub (fixed_sr) */
} lp_inv;

LP_INLINE lp_inv make_inv(const lp_params *p, int32_t sh) {
    lp_inv v;
    const float scale = u2f(pow2_bits(imin(imax(sh, -127), 127)));
    v.man = p->man;
    v.bemin = p->bemin + sh;
    v.qsub = p->qsub + sh;
    v.signed_zero = p->signed_zero;
    /* exact: the limits have few significant bits and stay within float32 */
    v.maxpos = f2u(u2f(p->maxpos) * scale);
    v.maxneg = f2u(u2f(p->maxneg) * scale);
    v.special = p->overflow == OV_INF ? 0x7f800000u : 0x7fc00000u;
    v.saturate = mask_if(p->overflow == OV_SAT);
    v.rmask = p->rmask;
    v.fast = p->man < 23 && p->bemin + sh < 255 && p->bemin + sh > 0;
    v.fshift = (uint32_t)(23 - (p->man < 23 ? p->man : 22));
    v.fmask = (1u << v.fshift) - 1u;
    v.fhalf = (1u << (v.fshift - 1)) - 1u;
    /* With no mantissa bits the kept significand k is the implicit 1 (odd), as in quantize_one,
     * so a tie always rounds up in magnitude; bit 23 of the pattern is the exponent's lsb, not
     * k's, and must not decide the tie (a length-dependent e3m0 bug: 3.0 gave 2.0 in chunks). */
    v.fodd = (uint32_t)(p->man == 0);
    /* Below the normal range quantize_one rounds |x| to a multiple of 2**qsub. For |x| <
     * 2**emin < msub = 2**(qsub + 23) the sum |x| + msub lies in [msub, 2 msub), where float32's
     * own addition (round to nearest even, never flushed: no -ffast-math, and the caller leaves
     * MXCSR at its default) keeps exactly the multiples of 2**qsub, ties to the even one, and
     * the subtraction is exact: the same bits, with no per-chunk fallback for the gradients'
     * many subnormal values (benchmarks/RESULTS.md, figure F10). msub must be
     * a normal float32, and every float32 subnormal input rounds to zero (qsub >= -100), so a
     * denormals-are-zero mode could not change a result. */
    v.fsub = v.fast && v.qsub >= -100 && v.qsub + 23 <= 127;
    v.msub = v.fsub ? u2f(pow2_bits(v.qsub + 23)) : 0.0f;
    /* Fixed point has no normal range: every value rounds to a multiple of 2**qsub, which the
     * same addition does for |x| < msub. Every value it cannot take (beyond the limits, so
     * also |x| >= msub when the limits lie below msub; Inf; NaN) comes out above the limit,
     * which sends its chunk to quantize_one: the same bits, faster than quantize_one
     * (benchmarks/RESULTS.md, figure F11). */
    v.fixed_ne = p->bemin + sh >= 255 && v.qsub >= -100 && v.qsub + 23 <= 127 &&
                 v.maxpos < pow2_bits(v.qsub + 23) && v.maxneg < pow2_bits(v.qsub + 23);
    if (v.fixed_ne) {
        v.fsub = 1;
        v.msub = u2f(pow2_bits(v.qsub + 23));
    }
    /* stochastic rounding to fixed point: fixed_sr_one */
    v.fixed_sr = p->bemin + sh >= 255 && v.qsub >= -126 && v.qsub <= 100;
    v.quantum = v.fixed_sr ? pow2_bits(v.qsub) : 0u;
    return v;
}

LP_INLINE uint32_t quantize_one(uint32_t u, uint32_t r, const lp_inv *p, const int mode) {
    const uint32_t sign = u & 0x80000000u;
    const uint32_t msign = mask_if(sign != 0);
    const uint32_t a = u & 0x7fffffffu;
    const int32_t field = (int32_t)(a >> 23);
    const int32_t ef = imax(field, 1);
    int32_t qe = (int32_t)sel(mask_if(field >= p->bemin), (uint32_t)(field - 127 - p->man),
                              (uint32_t)p->qsub);
    qe = imin(imax(qe, -149), 127);
    const int32_t s = qe - ef + 150; /* bits of M below the target quantum */
    const uint32_t M = (a & 0x7fffffu) | ((uint32_t)(field > 0) << 23);
    const int32_t sl = imin(imax(s, 1), 31);
    const int32_t sb = imin(imax(s - 32, 0), 31);
    const uint32_t mbig = mask_if(s >= 32);
    const uint32_t k = ~mbig & (M >> sl);
    const uint32_t rem = sel(mbig, M, M & ((1u << sl) - 1u));
    const uint32_t t = sel(mbig, M >> sb, rem << (32 - sl)); /* fraction of the quantum, 0.32 */
    uint32_t up;
    if (mode == R_NE) {
        /* carry out of t + 0x7fffffff + lsb(k): up iff t > 1/2, or t == 1/2 and k is odd */
        const uint32_t c = 0x7fffffffu + (k & 1u);
        up = (uint32_t)((uint32_t)(t + c) < t);
    } else if (mode == R_NA) {
        up = t >> 31;
    } else if (mode == R_Z) {
        up = 0u;
    } else if (mode == R_UP) {
        up = (uint32_t)(rem != 0) & ~msign & 1u;
    } else if (mode == R_DOWN) {
        up = (uint32_t)(rem != 0) & msign & 1u;
    } else { /* R_SR: carry out of (fraction + random bits), both cut to r bits */
        const uint32_t tm = t & p->rmask, rm = r & p->rmask;
        up = (uint32_t)((uint32_t)(tm + rm) < tm);
    }
    const uint32_t pw = sel(mask_if(qe >= -126), (uint32_t)(qe + 127) << 23,
                            1u << ((qe + 149) & 31));
    uint32_t v = f2u((float)(int32_t)(k + up) * u2f(pw));
    v = sel(mask_if(s <= 0), a, v); /* already on the grid */
    const uint32_t lim = sel(msign, p->maxneg, p->maxpos);
    uint32_t tz; /* rounding went toward zero: IEEE 754 section 7.4 gives the largest finite */
    if (mode == R_Z) tz = ~0u;
    else if (mode == R_UP) tz = msign;
    else if (mode == R_DOWN) tz = ~msign;
    else tz = 0u;
    const uint32_t special = sel(p->saturate, lim, p->special);
    v = sel(mask_if(v > lim), sel(tz, lim, special), v);
    v = sel(mask_if(a == 0x7f800000u), special, v); /* +-Inf in */
    uint32_t res = v | sign;
    res &= ~mask_if((v == 0) & (p->signed_zero == 0));
    return sel(mask_if(a > 0x7f800000u), u, res); /* NaN passes through */
}

/* Each loop is compiled three times and the loader picks the clone this CPU runs (AVX-512,
 * AVX2, baseline x86-64). -DLP_NO_CLONES builds the whole file for the -march given instead:
 * the tests build one library per instruction set this CPU can execute and check each path
 * against the plain-torch one (tests/numerics/test_kernel_paths.py). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LP_NO_CLONES)
#define LP_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define LP_CLONES
#endif

/* The loop is compute-heavy, so the hardware prefetcher alone leaves memory idle: before each
 * tile of LP_TILE elements, ask for the input and output lines of the tile LP_AHEAD ahead. */
#ifndef LP_TILE
#define LP_TILE 256
#endif
#ifndef LP_AHEAD
#define LP_AHEAD 1024
#endif
LP_INLINE void lp_prefetch(const uint32_t *in, uint32_t *out, int64_t start, int64_t n) {
    int64_t stop = start + LP_TILE < n ? start + LP_TILE : n;
    for (int64_t j = start; j < stop; j += 16) {
        __builtin_prefetch(in + j, 0, 0);
        __builtin_prefetch(out + j, 1, 0);
    }
}

/* One loop per rounding mode, so that the mode is a constant and the loop vectorizes. */
/* The fast path: in the normal range, without overflow, rounding to nearest even is the classic
 * integer trick on the float32 pattern (add 2**(s-1) - 1 + lsb, clear the s low bits), and
 * stochastic rounding with 32 random bits is "add the top s random bits, clear the s low bits"
 * (the same carry as the general rule: (rem + R_hi) >= 2**s  <=>  t + R >= 2**32). A chunk of 16
 * values takes it when every nonzero value is normal and within range; otherwise the whole chunk
 * goes through quantize_one. Both give the same bits, so this is only a shortcut. */
#define LP_CHUNK 16

LP_INLINE uint32_t lp_rand(uint32_t idx, uint32_t k0, uint32_t k1) {
    return mix32(mix32(idx ^ k0) + k1);
}

/* Stochastic rounding to fixed point (the loop of mode R_SRFX, a variant of R_SR chosen by
 * run_range for fixed formats and 32 random bits): a value with s = qsub + 150 - max(field, 1)
 * bits of its significand below the quantum (1 <= s <= 23) rounds as the float path does,
 * adding the top s random bits to the pattern and clearing the s low bits (quantize_one's
 * carry rule, the exponent's carry included); one below the quantum (s >= 24) becomes the
 * quantum or 0 by the carry of its 32-bit fraction plus the random word. The loop sends s <= 0
 * (at least 2**(qsub + 24): beyond any fixed format's limit) and values beyond the limits to
 * quantize_one with their chunk. A mode of its own, so that each loop's branches fold at
 * compile time (a run-time branch inside the float loop stopped GCC vectorising it:
 * benchmarks/RESULTS.md, figure F12). */
LP_INLINE uint32_t fixed_sr_one(uint32_t a, int32_t field, uint32_t r, const lp_inv *p) {
    const int32_t s = p->qsub + 150 - imax(field, 1);
    const int32_t sc = imin(imax(s, 1), 23);
    const uint32_t near = (a + (r >> (32 - sc))) & ~((1u << sc) - 1u);
    const uint32_t M = (a & 0x7fffffu) | ((uint32_t)(field > 0) << 23);
    const uint32_t t = sel(mask_if(s >= 32), M >> imin(imax(s - 32, 0), 31),
                           M << imin(imax(32 - s, 0), 31));
    const uint32_t tiny = sel(mask_if((uint32_t)(t + r) < t), p->quantum, 0u);
    return sel(mask_if(s >= 24), tiny, near);
}

#define R_SRFX 6
#define LP_BASE(MODE) ((MODE) == R_SRFX ? R_SR : (MODE))
/* the random counter of element j of a tile: logical indices lo0, lo0 + st, ... */
#define LP_CTR(j) (lo0 + (uint32_t)(j) * st)

#define LP_DEFINE_LOOP(NAME, MODE)                                                               \
    LP_CLONES static void NAME##_tile(const uint32_t *in, uint32_t *out, int64_t n, uint32_t lo0, \
                                      uint32_t st, uint32_t k0, uint32_t k1,                     \
                                      const lp_inv *pp) {                                        \
        const lp_inv p = *pp;                                                                     \
        int64_t i = 0;                                                                            \
        const int fast = (MODE == R_NE && (p.fast || p.fixed_ne)) ||                            \
                         (MODE == R_SR && p.rmask == 0xffffffffu && p.fast) ||                    \
                         (MODE == R_SRFX && p.rmask == 0xffffffffu && p.fixed_sr);               \
        if (fast) {                                                                        \
            for (; i < n; i += LP_CHUNK) {                                                       \
                /* a last, shorter chunk is padded with zeros (each rounds to itself and         \
                 * flags nothing): short MX blocks (14 values) take this path too */             \
                const int64_t cnt = n - i < LP_CHUNK ? n - i : LP_CHUNK;                         \
                uint32_t pad[LP_CHUNK];                                                          \
                const uint32_t *src = in + i;                                                    \
                if (cnt < LP_CHUNK) {                                                            \
                    for (int l = 0; l < LP_CHUNK; ++l) pad[l] = l < cnt ? in[i + l] : 0u;        \
                    src = pad;                                                                   \
                }                                                                                \
                uint32_t tmp[LP_CHUNK];                                                          \
                uint32_t bad = 0;                                                                \
                for (int l = 0; l < LP_CHUNK; ++l) {                                             \
                    const uint32_t u = src[l], sign = u & 0x80000000u, a = u & 0x7fffffffu;      \
                    const int32_t field = (int32_t)(a >> 23);                                     \
                    uint32_t add, rf;                                                             \
                    if (MODE == R_SRFX) {                                                         \
                        rf = fixed_sr_one(a, field, lp_rand(LP_CTR(i + l), k0, k1), &p);         \
                    } else {                                                                      \
                        if (MODE == R_NE) add = p.fhalf + (((a >> p.fshift) | p.fodd) & 1u);      \
                        else add = lp_rand(LP_CTR(i + l), k0, k1) >> (32 - p.fshift);            \
                        rf = (a + add) & ~p.fmask;                                                \
                    }                                                                             \
                    const uint32_t lim = sel(mask_if(sign != 0), p.maxneg, p.maxpos);             \
                    if (MODE == R_SRFX) {                                                         \
                        bad |= (uint32_t)(p.qsub + 150 - imax(field, 1) <= 0);                    \
                    } else if (MODE == R_NE && p.fsub) {                                          \
                        const uint32_t fs = f2u((u2f(a) + p.msub) - p.msub);                      \
                        rf = sel(mask_if(field < p.bemin), fs, rf);                               \
                    } else {                                                                      \
                        bad |= (uint32_t)((field < p.bemin) & (a != 0));                          \
                    }                                                                             \
                    bad |= (uint32_t)(rf > lim);                                                  \
                    uint32_t res = rf | sign;                                                     \
                    res &= ~mask_if((rf == 0) & (p.signed_zero == 0));                            \
                    tmp[l] = res;                                                                 \
                }                                                                                 \
                if (bad) {                                                                       \
                    for (int l = 0; l < cnt; ++l) {                                              \
                        uint32_t r = 0;                                                          \
                        if (LP_BASE(MODE) == R_SR) r = lp_rand(LP_CTR(i + l), k0, k1);           \
                        out[i + l] = quantize_one(in[i + l], r, &p, LP_BASE(MODE));              \
                    }                                                                            \
                } else if (cnt == LP_CHUNK) {                                                    \
                    for (int l = 0; l < LP_CHUNK; ++l) out[i + l] = tmp[l];                      \
                } else {                                                                         \
                    for (int l = 0; l < cnt; ++l) out[i + l] = tmp[l];                           \
                }                                                                                \
            }                                                                                     \
        }                                                                                         \
        for (; i < n; ++i) {                                                                      \
            uint32_t r = 0;                                                                       \
            if (LP_BASE(MODE) == R_SR) r = lp_rand(LP_CTR(i), k0, k1);                           \
            out[i] = quantize_one(in[i], r, &p, LP_BASE(MODE));                                   \
        }                                                                                         \
    }                                                                                             \
    static void NAME(const uint32_t *in, uint32_t *out, int64_t n, uint64_t off, int32_t sh,      \
                     const lp_params *pp) {                                                       \
        const lp_inv p = make_inv(pp, sh);                                                        \
        const uint32_t k0 = pp->k0, k1 = pp->k1 ^ mix32((uint32_t)(off >> 32));                   \
        for (int64_t t0 = 0; t0 < n; t0 += LP_TILE) {                                             \
            const int64_t len = n - t0 < LP_TILE ? n - t0 : LP_TILE;                              \
            if (t0 + LP_AHEAD < n) lp_prefetch(in, out, t0 + LP_AHEAD, n);                        \
            NAME##_tile(in + t0, out + t0, len, (uint32_t)off + (uint32_t)t0, 1u, k0, k1, &p);    \
        }                                                                                         \
    }

LP_DEFINE_LOOP(loop_ne, R_NE)
LP_DEFINE_LOOP(loop_na, R_NA)
LP_DEFINE_LOOP(loop_z, R_Z)
LP_DEFINE_LOOP(loop_up, R_UP)
LP_DEFINE_LOOP(loop_down, R_DOWN)
LP_DEFINE_LOOP(loop_sr, R_SR)
LP_DEFINE_LOOP(loop_sr_fixed, R_SRFX)

typedef void (*loop_fn)(const uint32_t *, uint32_t *, int64_t, uint64_t, int32_t, const lp_params *);

static loop_fn pick_loop(int mode) {
    switch (mode) {
    case R_NE: return loop_ne;
    case R_NA: return loop_na;
    case R_Z: return loop_z;
    case R_UP: return loop_up;
    case R_DOWN: return loop_down;
    default: return loop_sr;
    }
}

/* IEEE binary16 rounded to nearest even, by the CPU's own conversion (F16C's vcvtps2ph with
 * the rounding in the instruction, then vcvtph2ps back): the same bits as loop_ne for that
 * format (subnormals, overflow to Inf, -0) in two instructions a vector; NaN keeps its input
 * bits, as quantize_one keeps them. Faster than the integer loop (benchmarks/RESULTS.md,
 * figure F13). Built where the clones are (the CPU is asked at run time) or where the
 * -march has F16C (the per-ISA test builds: x86-64-v3 and v4 test it, the baseline the loop). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    (!defined(LP_NO_CLONES) || defined(__F16C__))
#include <immintrin.h>
#define LP_F16C_PATH 1
__attribute__((target("avx2,f16c"))) static void fp16_ne_f16c(const uint32_t *in,
                                                               uint32_t *out, int64_t n,
                                                               const lp_params *p) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps((const float *)(in + i));
        const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 y = _mm256_cvtph_ps(h);
        const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
        _mm256_storeu_ps((float *)(out + i), _mm256_blendv_ps(y, x, nan));
    }
    if (i < n) loop_ne(in + i, out + i, n - i, 0, 0, p); /* the tail: the integer loop */
}

static int lp_has_f16c(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return known;
}

LP_INLINE int lp_is_fp16_ne(const lp_params *p) {
    return p->rounding == R_NE && p->man == 10 && p->bemin == 113 && p->qsub == -24 &&
           p->overflow == OV_INF && p->signed_zero == 1 && p->maxpos == 0x477fe000u &&
           p->maxneg == 0x477fe000u;
}
#endif

/* IEEE bfloat16 rounded to nearest even by the integer trick on the float32 pattern: add
 * 0x7fff plus the kept part's lowest bit, clear the 16 low bits. It holds over the whole range,
 * as bfloat16 keeps float32's exponent range: subnormals round at the same bit, a carry out of
 * the largest finite value gives the Inf pattern, Inf stays Inf, -0 stays -0; NaN keeps its
 * input bits (quantize_one keeps them). The same bits as loop_ne for that format, in four
 * operations per element: faster than loop_ne, whose range checks per chunk are the cost
 * (benchmarks/RESULTS.md, figure F14). */
LP_INLINE int lp_is_bf16_ne(const lp_params *p) {
    return p->rounding == R_NE && p->man == 7 && p->bemin == 1 && p->qsub == -133 &&
           p->overflow == OV_INF && p->signed_zero == 1 && p->maxpos == 0x7f7f0000u &&
           p->maxneg == 0x7f7f0000u;
}

LP_CLONES static void bf16_ne(const uint32_t *in, uint32_t *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t b = in[i];
        const uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
        out[i] = sel(mask_if((b & 0x7fffffffu) > 0x7f800000u), b, r);
    }
}

/* The loop run_range uses for these parameters (no float16/bfloat16 shortcut). */
static loop_fn loop_for(const lp_params *p) {
    if (p->rounding == R_SR && p->rmask == 0xffffffffu && p->bemin >= 255 && p->qsub >= -126 &&
        p->qsub <= 100)
        return loop_sr_fixed;
    return pick_loop(p->rounding);
}

/* Elements [begin, end) of the logical tensor; the random counter's high word changes only at
 * 2**32 boundaries, so a range is split there. */
static void run_range(const uint32_t *in, uint32_t *out, int64_t begin, int64_t end,
                      const lp_params *p) {
#ifdef LP_F16C_PATH
    if (lp_is_fp16_ne(p) && lp_has_f16c()) {
        fp16_ne_f16c(in + begin, out + begin, end - begin, p);
        return;
    }
#endif
    if (lp_is_bf16_ne(p)) {
        bf16_ne(in + begin, out + begin, end - begin);
        return;
    }
    loop_fn f = loop_for(p); /* fixed point with 32 random bits: fixed_sr_one's loop */
    while (begin < end) {
        int64_t stop = (int64_t)(((uint64_t)begin | 0xffffffffULL) + 1ULL);
        if (stop > end) stop = end;
        f(in + begin, out + begin, stop - begin, (uint64_t)begin, 0, p);
        begin = stop;
    }
}

typedef void (*tile_fn)(const uint32_t *, uint32_t *, int64_t, uint32_t, uint32_t, uint32_t,
                        uint32_t, const lp_inv *);

static tile_fn tile_of(loop_fn f) {
    if (f == loop_ne) return loop_ne_tile;
    if (f == loop_na) return loop_na_tile;
    if (f == loop_z) return loop_z_tile;
    if (f == loop_up) return loop_up_tile;
    if (f == loop_down) return loop_down_tile;
    if (f == loop_sr_fixed) return loop_sr_fixed_tile;
    return loop_sr_tile;
}

/* Blocked variant: rows of `row_len` elements, each cut into blocks of `block` elements; block b
 * of row j uses shift shifts[j * nblocks + b] (the block's scale exponent). The mode's tile loop
 * runs on each block with the loop invariants of its shift, made once per change of shift. */
static void run_blocks(const uint32_t *in, uint32_t *out, int64_t row_begin, int64_t row_end,
                       int64_t row_len, int64_t block, const int32_t *shifts, const lp_params *p) {
    const tile_fn t = tile_of(pick_loop(p->rounding));
    const int64_t nblocks = (row_len + block - 1) / block;
    lp_inv inv;
    int32_t have = LP_NAN_SHIFT;
    for (int64_t j = row_begin; j < row_end; ++j) {
        for (int64_t b = 0; b < nblocks; ++b) {
            const int64_t start = j * row_len + b * block;
            int64_t len = row_len - b * block;
            if (len > block) len = block;
            const int32_t sh = shifts[j * nblocks + b];
            if (sh == LP_NAN_SHIFT) { /* the block held a NaN or an Inf: its scale is NaN */
                for (int64_t i = 0; i < len; ++i) out[start + i] = 0x7fc00000u;
                continue;
            }
            if (sh != have) {
                inv = make_inv(p, sh);
                have = sh;
            }
            /* the random counter as the plain loop's: low word the index, high word in the key,
             * split where the index crosses a multiple of 2**32 */
            int64_t done = 0;
            while (done < len) {
                const uint64_t at = (uint64_t)(start + done);
                int64_t stop = (int64_t)((at | 0xffffffffULL) + 1ULL) - start;
                if (stop > len) stop = len;
                t(in + start + done, out + start + done, stop - done, (uint32_t)at, 1u, p->k0,
                  p->k1 ^ mix32((uint32_t)(at >> 32)), &inv);
                done = stop;
            }
        }
    }
}

typedef struct {
    const uint32_t *in;
    uint32_t *out;
    int64_t begin, end, row_len, block;
    const int32_t *shifts;
    const lp_params *p;
} lp_job;

static void *run_job(void *arg) {
    lp_job *j = (lp_job *)arg;
    if (j->shifts)
        run_blocks(j->in, j->out, j->begin, j->end, j->row_len, j->block, j->shifts, j->p);
    else
        run_range(j->in, j->out, j->begin, j->end, j->p);
    return NULL;
}

#define LP_MAX_THREADS 64
#define LP_MIN_PER_THREAD (1 << 15)

/* Threads for n elements of work: one per LP_MIN_PER_THREAD, at most nthreads, at least one. */
static int lp_threads_for(int64_t n, int nthreads) {
    int64_t nt = n / LP_MIN_PER_THREAD;
    if (nt > nthreads) nt = nthreads;
    return nt < 1 ? 1 : (int)nt;
}

/* Threads for n elements of work split into `units` parallel units: at most one a unit. */
static int lp_threads_over(int64_t n, int64_t units, int nthreads) {
    const int nt = lp_threads_for(n, nthreads);
    return nt > units ? (units < 1 ? 1 : (int)units) : nt;
}

#ifdef _OPENMP
#include <omp.h>
/* OpenMP, so that the kernel shares torch's thread pool: the library is linked by its soname
 * libgomp.so.1, which the dynamic loader resolves to the copy torch already loaded. Separate
 * pthreads would compete with torch's spinning OpenMP workers for the same cores. */
static void run_parallel(lp_job base, int64_t units, int64_t unit_elems, int nthreads) {
    int64_t by_size = (units * unit_elems) / LP_MIN_PER_THREAD;
    if (by_size < nthreads) nthreads = by_size < 1 ? 1 : (int)by_size;
    if (nthreads > units) nthreads = units < 1 ? 1 : (int)units;
    if (nthreads <= 1) {
        base.begin = 0;
        base.end = units;
        run_job(&base);
        return;
    }
    const int64_t per = (units + nthreads - 1) / nthreads;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num();
        lp_job job = base;
        job.begin = t * per < units ? t * per : units;
        job.end = (t + 1) * per < units ? (t + 1) * per : units;
        if (job.begin < job.end) run_job(&job);
    }
}
#else
static void run_parallel(lp_job base, int64_t units, int64_t unit_elems, int nthreads) {
    if (nthreads > LP_MAX_THREADS) nthreads = LP_MAX_THREADS;
    int64_t by_size = (units * unit_elems) / LP_MIN_PER_THREAD;
    if (by_size < nthreads) nthreads = by_size < 1 ? 1 : (int)by_size;
    if (nthreads > units) nthreads = units < 1 ? 1 : (int)units;
    lp_job jobs[LP_MAX_THREADS];
    pthread_t tids[LP_MAX_THREADS];
    int started[LP_MAX_THREADS];
    const int64_t per = (units + nthreads - 1) / nthreads;
    for (int t = 0; t < nthreads; ++t) {
        jobs[t] = base;
        jobs[t].begin = t * per < units ? t * per : units;
        jobs[t].end = (t + 1) * per < units ? (t + 1) * per : units;
        started[t] = 0;
    }
    for (int t = 1; t < nthreads; ++t)
        started[t] = pthread_create(&tids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < nthreads; ++t) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            run_job(&jobs[t]); /* could not start a thread: do its share here */
    }
}
#endif

/* A batched transpose: the memory holds (batch, rows, cols) row-major, the logical tensor is
 * (batch, cols, rows) (a channels-last activation: rows = H*W, cols = C; a transposed matrix:
 * batch 1). Every element is rounded with the random word of its LOGICAL index
 * n*cols*rows + c*rows + r, as the row-major copy would be, in memory order and with no copy:
 * each memory row (the C values of one position) is one run of the mode's tile whose random
 * counter starts at its first value's logical index and steps by `rows`. The caller keeps the
 * logical size below 2**32 (one high word of the counter). */
/* Below LP_BT_RUNS channels a run is too short for a tile call: tiles of LP_BT_C columns x
 * LP_BT_R rows are gathered into logical order on the stack instead, each logical row rounded
 * with its own indices, then scattered back; from LP_BT_RUNS channels on, runs are faster
 * (benchmarks/RESULTS.md, figure F15). */
#ifndef LP_BT_RUNS
#define LP_BT_RUNS 16
#endif
#define LP_BT_R 512
#define LP_BT_C 16
static void bt_unit(const uint32_t *in, uint32_t *out, int64_t rows, int64_t cols, int64_t n,
                    int64_t r0, const lp_params *p, loop_fn f) {
    uint32_t tin[LP_BT_C][LP_BT_R], tout[LP_BT_C][LP_BT_R];
    const int64_t rn = rows - r0 < LP_BT_R ? rows - r0 : LP_BT_R;
    const uint32_t *src = in + (n * rows + r0) * cols;
    uint32_t *dst = out + (n * rows + r0) * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += LP_BT_C) {
        const int64_t cn = cols - c0 < LP_BT_C ? cols - c0 : LP_BT_C;
        for (int64_t r = 0; r < rn; ++r)
            for (int64_t c = 0; c < cn; ++c) tin[c][r] = src[r * cols + c0 + c];
        for (int64_t c = 0; c < cn; ++c)
            f(tin[c], tout[c], rn, (uint64_t)((n * cols + c0 + c) * rows + r0), 0, p);
        for (int64_t r = 0; r < rn; ++r)
            for (int64_t c = 0; c < cn; ++c) dst[r * cols + c0 + c] = tout[c][r];
    }
}

void lp_quantize_f32_bt(const uint32_t *in, uint32_t *out, int64_t batch, int64_t rows,
                        int64_t cols, const lp_params *p, int nthreads) {
    if (cols < LP_BT_RUNS) {
        const loop_fn f = loop_for(p);
        const int64_t rblocks = (rows + LP_BT_R - 1) / LP_BT_R, units = batch * rblocks;
        const int nt = lp_threads_over(batch * rows * cols, units, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
        for (int64_t u = 0; u < units; ++u)
            bt_unit(in, out, rows, cols, u / rblocks, (u % rblocks) * LP_BT_R, p, f);
        return;
    }
    const tile_fn t = tile_of(loop_for(p));
    const lp_inv inv = make_inv(p, 0);
    const uint32_t k0 = p->k0, k1 = p->k1; /* high word 0: the key's mix32(0) is 0 */
    const int64_t units = batch * rows;
    const int nt = lp_threads_over(units * cols, units, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
    for (int64_t u = 0; u < units; ++u) {
        const int64_t n = u / rows, r = u % rows;
        const uint32_t lo = (uint32_t)(n * cols * rows + r);
        for (int64_t c0 = 0; c0 < cols; c0 += LP_TILE) {
            const int64_t len = cols - c0 < LP_TILE ? cols - c0 : LP_TILE;
            t(in + u * cols + c0, out + u * cols + c0, len, lo + (uint32_t)(c0 * rows),
              (uint32_t)rows, k0, k1, &inv);
        }
    }
}

/* Public entry points (called through ctypes). in may equal out. */
void lp_quantize_f32(const uint32_t *in, uint32_t *out, int64_t n, const lp_params *p,
                     int nthreads) {
    lp_job base = {in, out, 0, n, 0, 0, NULL, p};
    run_parallel(base, n, 1, nthreads);
}

/* The scale exponent of every block of rows of `row_len` float32 values (blocks of `block`,
 * the last of a row shorter): floor(log2(amax)) - emax clamped to [smin, smax], smin for an
 * all-zero block, LP_NAN_SHIFT for a block holding a NaN or an Inf (the MX rule, as
 * numerics.quantize.block_shifts computes it in torch ops). amax is the largest magnitude
 * pattern: float32 magnitudes order as their bit patterns. */
void lp_block_shifts_f32(const uint32_t *in, int32_t *shifts, int64_t rows, int64_t row_len,
                         int64_t block, int32_t emax, int32_t smin, int32_t smax,
                         int nthreads) {
    const int64_t nblocks = (row_len + block - 1) / block;
    const int nt = lp_threads_over(rows * row_len, rows, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
    for (int64_t j = 0; j < rows; ++j) {
        for (int64_t b = 0; b < nblocks; ++b) {
            const uint32_t *x = in + j * row_len + b * block;
            int64_t len = row_len - b * block;
            if (len > block) len = block;
            uint32_t m = 0;
            for (int64_t i = 0; i < len; ++i) {
                const uint32_t a = x[i] & 0x7fffffffu;
                m = a > m ? a : m;
            }
            int32_t sh;
            if (m >= 0x7f800000u) {
                sh = LP_NAN_SHIFT;
            } else if (m == 0) {
                sh = smin;
            } else {
                const int32_t field = (int32_t)(m >> 23);
                const int32_t lg = field ? field - 127 : (31 - __builtin_clz(m)) - 149;
                sh = imin(imax(lg - emax, smin), smax);
            }
            shifts[j * nblocks + b] = sh;
        }
    }
}

void lp_quantize_blocks_f32(const uint32_t *in, uint32_t *out, int64_t rows, int64_t row_len,
                            int64_t block, const int32_t *shifts, const lp_params *p,
                            int nthreads) {
    lp_job base = {in, out, 0, rows, row_len, block, shifts, p};
    run_parallel(base, rows, row_len, nthreads);
}

/* ---------------------------------------------------------------------------------------
 * Fused optimizer step for low-precision storage: read the parameter, gradient and state in
 * their storage dtype (float32, bfloat16 or float16), do the update in float32, and write each
 * stored value back once, rounded onto its format with quantize_one. One pass instead of the ten
 * tensor operations of the torch path (lowprec/training/optim), and the same bits: both follow
 * the per-element definition written in lowprec/training/optim/sgd.py and adam.py. In it every
 * operation is one IEEE 754 float32 operation, correctly rounded: +, -, *, /, sqrt, and
 * fma(a, b, c) = a * b + c rounded once, which is what torch's CPU kernels compute for add with
 * alpha, lerp, addcmul (vec::fmadd). The build uses -ffp-contract=off so that the compiler adds
 * no fusion of its own; every fusion is an explicit fmaf(). The constants (1 - beta1, -lr, ...)
 * come from Python, computed in float64 and rounded to float32 as torch rounds a Python scalar.
 */
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

LP_CLONES static void load_tile(float *dst, const void *src, int dt, int64_t off, int n) {
    if (dt == DT_F32) {
        for (int l = 0; l < n; ++l) dst[l] = ((const float *)src)[off + l];
    } else if (dt == DT_BF16) {
        for (int l = 0; l < n; ++l) dst[l] = u2f((uint32_t)((const uint16_t *)src)[off + l] << 16);
    } else {
        for (int l = 0; l < n; ++l) dst[l] = f16_to_f32(((const uint16_t *)src)[off + l]);
    }
}

LP_CLONES static void store_tile(void *dst, const uint32_t *src, int dt, int64_t off, int n) {
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

static void round_state(const uint32_t *a, uint32_t *q, int n, const lp_inv *si, int is_bf16) {
    if (is_bf16) round_tile_bf16(a, q, n);
    else loop_ne_tile(a, q, n, 0, 1u, 0, 0, si);
}

/* The arithmetic loops use fmaf(): compiled for FMA hardware (the x86-64-v3 clone, AVX2 + FMA,
 * and x86-64-v4) it is one vfmadd instruction and vectorizes; the default clone (CPUs before
 * 2013) calls libm's fmaf, correctly rounded too, so every clone gives the same bits. GCC's
 * "avx2" target does not include FMA, hence x86-64-v3 here rather than LP_CLONES' avx2. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LP_NO_CLONES)
#define LP_OPT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LP_OPT_CLONES
#endif
LP_OPT_CLONES static void opt_range(const lp_opt_job *j, int64_t begin, int64_t end) {
    const lp_opt o = *j->o;
    const lp_inv pi = make_inv(j->pq, 0), si = make_inv(j->sq, 0);
    const uint32_t k0 = j->pq->k0, k1 = j->pq->k1;
    const int sr = j->pq->rounding == R_SR;
    /* torch.lerp (ATen Lerp.h / LerpKernel.cpp): weight w with |w| < 0.5 gives
     * fma(w, end - self, self), otherwise fma(w - 1, end - self, end) */
    const int lerp_small = fabsf(o.lerp_w) < 0.5f;
    const float lerp_c = lerp_small ? o.lerp_w : o.lerp_w - 1.0f;
    float w[LP_OT], g[LP_OT], s1[LP_OT], s2[LP_OT];
    uint32_t a[LP_OT], q1[LP_OT], q2[LP_OT];
    for (int64_t t0 = begin; t0 < end; t0 += LP_OT) {
        const int n = (int)(end - t0 < LP_OT ? end - t0 : LP_OT);
        load_tile(w, j->p, o.p_dtype, t0, n);
        load_tile(g, j->g, o.g_dtype, t0, n);
        if (o.grad_scale != 1.0f) /* g * 1 is exact: skipping it changes no bit */
            for (int l = 0; l < n; ++l) g[l] = g[l] * o.grad_scale;
        if (o.kind == 0) { /* SGD: see lowprec/training/optim/sgd.py */
            if (o.wd != 0.0f)
                for (int l = 0; l < n; ++l) g[l] = fmaf(w[l], o.wd, g[l]);
            if (o.has_momentum) {
                if (o.first) {
                    for (int l = 0; l < n; ++l) a[l] = f2u(g[l]);
                } else {
                    load_tile(s1, j->s1, o.s_dtype, t0, n);
                    for (int l = 0; l < n; ++l) a[l] = f2u(fmaf(g[l], o.damp_c, s1[l] * o.momentum));
                }
                round_state(a, q1, n, &si, o.s_is_bf16);
                store_tile(j->s1, q1, o.s_dtype, t0, n);
                if (o.nesterov) {
                    for (int l = 0; l < n; ++l) g[l] = fmaf(u2f(q1[l]), o.momentum, g[l]);
                } else {
                    for (int l = 0; l < n; ++l) g[l] = u2f(q1[l]);
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
            load_tile(s1, j->s1, o.s_dtype, t0, n);
            if (lerp_small) {
                for (int l = 0; l < n; ++l) a[l] = f2u(fmaf(lerp_c, g[l] - s1[l], s1[l]));
            } else {
                for (int l = 0; l < n; ++l) a[l] = f2u(fmaf(lerp_c, g[l] - s1[l], g[l]));
            }
            round_state(a, q1, n, &si, o.s_is_bf16);
            store_tile(j->s1, q1, o.s_dtype, t0, n);
            load_tile(s2, j->s2, o.s_dtype, t0, n);
            if (o.sqrt_storage) { /* sqrt(v) is stored: square it, update, store its root */
                for (int l = 0; l < n; ++l)
                    a[l] = f2u(sqrtf(fmaf(o.beta2_c * g[l], g[l], (s2[l] * s2[l]) * o.beta2)));
                round_state(a, q2, n, &si, o.s_is_bf16);
                for (int l = 0; l < n; ++l) s2[l] = u2f(q2[l]);
            } else {
                for (int l = 0; l < n; ++l)
                    a[l] = f2u(fmaf(o.beta2_c * g[l], g[l], s2[l] * o.beta2));
                round_state(a, q2, n, &si, o.s_is_bf16);
                for (int l = 0; l < n; ++l) s2[l] = sqrtf(u2f(q2[l]));
            }
            store_tile(j->s2, q2, o.s_dtype, t0, n);
            /* torch.addcdiv: self + (value * t1) / t2, no fusion possible around the division */
            for (int l = 0; l < n; ++l)
                a[l] = f2u(w[l] + (o.neg_step * u2f(q1[l])) / (s2[l] / o.bc2_sqrt + o.eps));
        }
        if (sr)
            loop_sr_tile(a, q1, n, (uint32_t)t0, 1u, k0, k1, &pi);
        else
            round_state(a, q1, n, &pi, o.p_is_bf16);
        store_tile(j->p, q1, o.p_dtype, t0, n);
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

/* Counts of |x| >= t1 and |x| >= t2 (the overflow counts of dynamic fixed point), one pass. */
LP_CLONES static void count_range(const float *x, int64_t b, int64_t e, float t1, float t2,
                                  int64_t *c1, int64_t *c2) {
    int64_t n1 = 0, n2 = 0;
    for (int64_t i = b; i < e; ++i) {
        const float a = fabsf(x[i]);
        n1 += a >= t1;
        n2 += a >= t2;
    }
    *c1 = n1;
    *c2 = n2;
}

void lp_count_abs_ge(const float *x, int64_t n, float t1, float t2, int64_t *out, int nthreads) {
    int nt = lp_threads_for(n, nthreads);
    if (nt > LP_MAX_THREADS) nt = LP_MAX_THREADS;
    int64_t c1[LP_MAX_THREADS], c2[LP_MAX_THREADS];
    const int64_t per = (n + nt - 1) / nt;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        for (int t = 0; t < nt; ++t)
#endif
        {
            const int64_t b = t * per < n ? t * per : n, e = (t + 1) * per < n ? (t + 1) * per : n;
            count_range(x, b, e, t1, t2, &c1[t], &c2[t]);
        }
    }
    out[0] = out[1] = 0;
    for (int t = 0; t < nt; ++t) {
        out[0] += c1[t];
        out[1] += c2[t];
    }
}

/* Dot products in the order of torch's reference CPU kernel for 16-bit types: the `sum` of
 * aten/src/ATen/native/cpu/BlasKernel.cpp, which slow_conv2d's gemm (and addmm without a bias)
 * runs when oneDNN has no 16-bit path (CPUs without AVX512-FP16 for float16). Term l goes to
 * fp32 partial sum l % 4 while four terms remain, the rest to partial 0; the result is
 * ((s0 + s1) + s2) + s3. Products of 16-bit values are exact in fp32, so mul-then-add equals
 * the reference's possible FMA. Vectorised across output positions only: each lane runs the
 * reference's sequence.
 * cols: N x (G*K) x L, w: (G*Cog) x K, out: N x (G*Cog) x L, all contiguous float32. */
LP_CLONES static void dot4_row(const float *a, const float *w, float *o, int64_t K, int64_t L) {
    enum { B = 256 };
    float s0[B], s1[B], s2[B], s3[B];
    for (int64_t p = 0; p < L; p += B) {
        const int64_t nb = L - p < B ? L - p : B;
        for (int64_t j = 0; j < nb; ++j) s0[j] = s1[j] = s2[j] = s3[j] = 0.0f;
        int64_t l = 0;
        for (; l + 4 <= K; l += 4) {
            const float w0 = w[l], w1 = w[l + 1], w2 = w[l + 2], w3 = w[l + 3];
            const float *a0 = a + l * L + p, *a1 = a0 + L, *a2 = a1 + L, *a3 = a2 + L;
            for (int64_t j = 0; j < nb; ++j) {
                s0[j] += w0 * a0[j];
                s1[j] += w1 * a1[j];
                s2[j] += w2 * a2[j];
                s3[j] += w3 * a3[j];
            }
        }
        for (; l < K; ++l) {
            const float wl = w[l];
            const float *al = a + l * L + p;
            for (int64_t j = 0; j < nb; ++j) s0[j] += wl * al[j];
        }
        for (int64_t j = 0; j < nb; ++j) o[p + j] = ((s0[j] + s1[j]) + s2[j]) + s3[j];
    }
}

void lp_dot4(const float *cols, const float *w, float *out, int64_t N, int64_t G, int64_t K,
             int64_t L, int64_t Cog, int nthreads) {
    const int64_t units = N * G * Cog;
    int nt = (int)(units * K * L / LP_MIN_PER_THREAD);
    if (nt > nthreads) nt = nthreads;
    if (nt < 1) nt = 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t u = 0; u < units; ++u) {
        const int64_t n = u / (G * Cog), co = u % (G * Cog), g = co / Cog;
        dot4_row(cols + (n * G + g) * K * L, w + co * K, out + u * L, K, L);
    }
}

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

/* out = rnd(rnd(a) + rnd(b)), rounded to `p` (a deterministic mode): one step of a 16-bit sum
 * of gradients (autograd adding a 16-bit tensor's uses in its dtype), in one pass. */
#define LP_ADD_TILE 2048
void lp_round_add2(const float *a, const float *b, float *out, int64_t n, const lp_params *p,
                   int nthreads) {
    const int nt = lp_threads_for(n, nthreads);
    const int64_t tiles = (n + LP_ADD_TILE - 1) / LP_ADD_TILE;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t s = t * LP_ADD_TILE, len = n - s < LP_ADD_TILE ? n - s : LP_ADD_TILE;
        float u[LP_ADD_TILE], v[LP_ADD_TILE];
        run_range((const uint32_t *)(a + s), (uint32_t *)u, 0, len, p);
        run_range((const uint32_t *)(b + s), (uint32_t *)v, 0, len, p);
        for (int64_t k = 0; k < len; ++k) u[k] = u[k] + v[k];
        run_range((const uint32_t *)u, (uint32_t *)(out + s), 0, len, p);
    }
}

/* ---- The LSTM cell of ATen's CPU composite run in a 16-bit dtype (RNN.cpp's LSTMCell), each
 * op's output rounded: what lowprec/training/emulation/recurrent_kernels.py replays op by op,
 * fused into four calls a step for IEEE-style formats rounded to nearest (`pc` the compute
 * format, `pg` the gradients'). sigmoid and tanh are not here: torch computes them (its own
 * float32 kernels, as the op-by-op replay does) and these functions round and combine. Every
 * operation is one float32 operation rounded by run_range, in the order of the op-by-op replay
 * (no contraction: -ffp-contract=off), so the bits are the replay's; the tests compare them.
 * Rows are independent; a row is processed in pieces of LP_CELL_COLS columns on the stack. */
#define LP_CELL_COLS 256

static void lp_round_row(float *x, int64_t n, const lp_params *p) {
    run_range((const uint32_t *)x, (uint32_t *)x, 0, n, p);
}

static int lp_cell_threads(int64_t rows, int64_t work, int nthreads) {
    const int nt = lp_threads_for(work, nthreads);
    return nt > rows ? (rows < 1 ? 1 : (int)rows) : nt;
}

/* G = rc(rc(lin) + xw): linear_hh(hx) rounded, then .add_(input) rounded; B rows of N. */
void lp_lstm_gates(const float *lin, const float *xw, int64_t xw_rs, float *G, int64_t B,
                   int64_t N, const lp_params *pc, int nthreads) {
    const int nt = lp_cell_threads(B, B * N, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < B; ++b) {
        float *g = G + b * N;
        const float *x = xw + b * xw_rs;
        memcpy(g, lin + b * N, (size_t)N * sizeof(float));
        lp_round_row(g, N, pc);
        for (int64_t k = 0; k < N; ++k) g[k] = g[k] + x[k];
        lp_round_row(g, N, pc);
    }
}

/* From torch's sigmoid(i), sigmoid(f), tanh(g), sigmoid(o) (rows of H, row stride a_rs) and
 * the cell state c (row stride c_rs): acts = the four rounded (B x 4H: i, f, g, o), and
 * cn = rc(rc(f * c) + rc(i * g)). */
void lp_lstm_fwd(const float *si, const float *sf, const float *tg, const float *so,
                 int64_t a_rs, const float *c, int64_t c_rs, float *acts, float *cn, int64_t B,
                 int64_t H, const lp_params *pc, int nthreads) {
    const int nt = lp_cell_threads(B, 4 * B * H, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < B; ++b) {
        float *A = acts + b * 4 * H, *out = cn + b * H;
        const float *cr = c + b * c_rs;
        memcpy(A, si + b * a_rs, (size_t)H * sizeof(float));
        memcpy(A + H, sf + b * a_rs, (size_t)H * sizeof(float));
        memcpy(A + 2 * H, tg + b * a_rs, (size_t)H * sizeof(float));
        memcpy(A + 3 * H, so + b * a_rs, (size_t)H * sizeof(float));
        lp_round_row(A, 4 * H, pc);
        for (int64_t j = 0; j < H; j += LP_CELL_COLS) {
            const int64_t n = H - j < LP_CELL_COLS ? H - j : LP_CELL_COLS;
            float fc[LP_CELL_COLS], ig[LP_CELL_COLS];
            for (int64_t k = 0; k < n; ++k) fc[k] = A[H + j + k] * cr[j + k];
            lp_round_row(fc, n, pc);
            for (int64_t k = 0; k < n; ++k) ig[k] = A[j + k] * A[2 * H + j + k];
            lp_round_row(ig, n, pc);
            for (int64_t k = 0; k < n; ++k) out[j + k] = fc[k] + ig[k];
            lp_round_row(out + j, n, pc);
        }
    }
}

/* tc = rc(tanh(cn)) in place (torch's tanh given), h = rc(o * tc). */
void lp_lstm_fwd2(float *tc, const float *acts, float *h, int64_t B, int64_t H,
                  const lp_params *pc, int nthreads) {
    const int nt = lp_cell_threads(B, 2 * B * H, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < B; ++b) {
        float *t = tc + b * H, *hr = h + b * H;
        const float *o = acts + b * 4 * H + 3 * H;
        lp_round_row(t, H, pc);
        for (int64_t k = 0; k < H; ++k) hr[k] = o[k] * t[k];
        lp_round_row(hr, H, pc);
    }
}

/* sigmoid's backward from its rounded output y, dy = rg(raw): fp16 in c10::Half arithmetic,
 * rg(rg(dy * rg(1 - y)) * y); other formats in float32, rg(dy * (1 - y) * y). In place. */
static void lp_sigmoid_bwd(float *d, const float *y, int64_t n, int half, const lp_params *pg) {
    lp_round_row(d, n, pg);
    if (half) {
        float t[LP_CELL_COLS];
        for (int64_t k = 0; k < n; ++k) t[k] = 1.0f - y[k];
        lp_round_row(t, n, pg);
        for (int64_t k = 0; k < n; ++k) d[k] = d[k] * t[k];
        lp_round_row(d, n, pg);
        for (int64_t k = 0; k < n; ++k) d[k] = d[k] * y[k];
    } else {
        for (int64_t k = 0; k < n; ++k) d[k] = (d[k] * (1.0f - y[k])) * y[k];
    }
    lp_round_row(d, n, pg);
}

/* tanh's backward from its rounded output y: rg(rg(raw) * (1 - y * y)). In place. */
static void lp_tanh_bwd(float *d, const float *y, int64_t n, const lp_params *pg) {
    lp_round_row(d, n, pg);
    for (int64_t k = 0; k < n; ++k) d[k] = d[k] * (1.0f - y[k] * y[k]);
    lp_round_row(d, n, pg);
}

/* The backward of lp_lstm_gates .. lp_lstm_fwd2 as the op-by-op replay's autograd runs it:
 * dh the gradient reaching h (row stride dh_rs), dcn the one reaching the next step's use of
 * cn (NULL: none); dG (B x 4H) the gates' gradient (that of lin and of xw alike), dcp the raw
 * float32 gradient of c (its use's rounding is the caller's). */
void lp_lstm_bwd(const float *dh, int64_t dh_rs, const float *dcn, int64_t dcn_rs,
                 const float *acts, const float *tc, const float *c, int64_t c_rs, float *dG,
                 float *dcp, int64_t B, int64_t H, const lp_params *pg, int half, int nthreads) {
    const int nt = lp_cell_threads(B, 4 * B * H, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < B; ++b) {
        const float *A = acts + b * 4 * H, *t = tc + b * H, *cr = c + b * c_rs;
        const float *dhr = dh + b * dh_rs;
        float *D = dG + b * 4 * H, *dc = dcp + b * H;
        for (int64_t j = 0; j < H; j += LP_CELL_COLS) {
            const int64_t n = H - j < LP_CELL_COLS ? H - j : LP_CELL_COLS;
            const float *i = A + j, *f = A + H + j, *g = A + 2 * H + j, *o = A + 3 * H + j;
            float d[LP_CELL_COLS], dt[LP_CELL_COLS], tot[LP_CELL_COLS];
            for (int64_t k = 0; k < n; ++k) d[k] = dhr[j + k];
            lp_round_row(d, n, pg); /* h's rounding: the gradient reaching it */
            float *Do = D + 3 * H + j, *Di = D + j, *Df = D + H + j, *Dg = D + 2 * H + j;
            for (int64_t k = 0; k < n; ++k) Do[k] = d[k] * t[j + k];
            for (int64_t k = 0; k < n; ++k) dt[k] = d[k] * o[k];
            lp_tanh_bwd(dt, t + j, n, pg); /* the gradient of the cell state's tanh use */
            memcpy(tot, dt, (size_t)n * sizeof(float));
            if (dcn) { /* its other use, then their 16-bit sum */
                float u[LP_CELL_COLS];
                const float *dr = dcn + b * dcn_rs + j;
                for (int64_t k = 0; k < n; ++k) u[k] = dr[k];
                lp_round_row(u, n, pg);
                for (int64_t k = 0; k < n; ++k) tot[k] = tot[k] + u[k];
                lp_round_row(tot, n, pg);
            }
            for (int64_t k = 0; k < n; ++k) {
                Df[k] = tot[k] * cr[j + k];
                dc[j + k] = tot[k] * f[k];
                Di[k] = tot[k] * g[k];
                Dg[k] = tot[k] * i[k];
            }
            lp_sigmoid_bwd(Di, i, n, half, pg);
            lp_sigmoid_bwd(Df, f, n, half, pg);
            lp_tanh_bwd(Dg, g, n, pg);
            lp_sigmoid_bwd(Do, o, n, half, pg);
        }
    }
}

/* the GEMM with a rounded accumulator (lowprec.numerics.accumulation) */
#include "_qkernel_acc.c"

int lp_abi_version(void) { return 5; }

static struct PyModuleDef lp_module = {PyModuleDef_HEAD_INIT, "_qkernel",
                                       "lowprec quantization kernel (called through ctypes)", -1,
                                       NULL};

PyMODINIT_FUNC PyInit__qkernel(void) { return PyModule_Create(&lp_module); }
