/*
 * lp_common.h: what every file of lowprec's compiled kernel shares (one shared library,
 * lowprec.numerics._qkernel, called through ctypes: lowprec/numerics/kernel/).
 *
 * Every target format (IEEE / OCP floats, fixed point, the elements of MX blocks) is described by
 * a handful of integers: a value whose float32 exponent field is >= bemin lies in the normal range
 * and keeps `man` mantissa bits (its quantum is 2**(E - man)); below it the quantum is fixed at
 * 2**qsub (subnormals: emin - man; no subnormals: emin; fixed point: -FL). Rounding works on the
 * 24-bit significand M of |x| = M * 2**(ef - 150): the low s bits are discarded, giving k (kept)
 * and a 32-bit fraction t of the quantum; the mode decides whether k becomes k + 1. The result
 * (k + up) * 2**qe is exact in float32 because every format here is a subset of float32. Overflow
 * (beyond maxpos / maxneg) follows IEEE 754-2019 section 7.4 for directed modes and the format's
 * overflow rule otherwise. The Python reference path (lowprec/numerics/reference.py) implements the
 * same integer algorithm with torch ops; the tests require identical bits.
 *
 * Stochastic rounding draws its bits from a counter-based hash of (element index, seed), so the
 * result depends only on the seed and the logical position of the element, never on the number
 * of threads or on a global generator state.
 *
 * The files, one job each (the binding mirrors them, module for module):
 *   lp_common.h   this header: the format parameters, bit helpers, loop invariants, the clone
 *                 macros, thread counts, and quantize.c's loops that the other files run
 *   quantize.c    elementwise rounding (quantize_one, one loop per mode, float16 / bfloat16
 *                 shortcuts, the batched transpose), the thread pool's use
 *   block.c       scaled casts: MX block scale exponents and blocked rounding, dynamic fixed
 *                 point's overflow counts
 *   accumulate.c  the GEMM with a rounded accumulator, reference-order dot products
 *   optimizer.c   the fused optimizer step (SGD, Adam) on low-precision storage
 *   recurrent.c   the LSTM cell of ATen's 16-bit CPU composite (a float16 / bfloat16 step in
 *                 one pass, its activations by table), the op-by-op LSTM step of any
 *                 elementwise format (stochastic rounding at each site), 16-bit sums of
 *                 gradients (two; one arrival; an embedding's rows in index order), a
 *                 batch norm's affine output rounded in the same pass
 *   fexp.c        ATen's vectorised exp (fexp_u20) of the 16-bit flash attention
 *   module.c      the CPython module shell (so that setuptools builds it) and the ABI version
 * Only the lp_* entry points are exported; what one file lends another is LP_INTERNAL (hidden).
 */
#ifndef LP_COMMON_H
#define LP_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Rounding codes: params.py's R_* names and values (rounding.RULES; what every quantization
 * path takes). */
enum { R_NEAREST_EVEN = 0, R_NEAREST_AWAY = 1, R_TOWARD_ZERO = 2, R_UP = 3, R_DOWN = 4,
       R_STOCHASTIC = 5,
       R_SRFX /* internal, last: quantize.c's loop for stochastic rounding to fixed point */ };
/* The deterministic modes, X(suffix, code) each: quantize.c and accumulate.c expand their
 * per-mode loops (one compiled loop a mode, its branches folded) and their dispatch from this
 * list, and lp_up32 / lp_up64 / lp_tz below hold each mode's rule, so a mode added here (with
 * its code above and its rule below) reaches every kernel. Stochastic rounding has loops of its
 * own (random words). */
#define LP_DETERMINISTIC_MODES(X) \
    X(ne, R_NEAREST_EVEN) X(na, R_NEAREST_AWAY) X(z, R_TOWARD_ZERO) X(up, R_UP) X(down, R_DOWN)
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

/* Each deterministic mode's rule, once for every kernel (quantize_one on float32 words,
 * round_f64 on float64 words; rounding.RULES is the Python side's table). lp_up32 / lp_up64:
 * whether the magnitude rounds up by one quantum (1) or not (0); t the discarded part as a
 * 0.32 / 0.64 fixed-point fraction of the quantum, k the kept significand (its parity), nz
 * whether anything was discarded, neg all ones for a negative value. Nearest even: the carry
 * out of t + 1/2 - 2**-W + lsb(k), i.e. t > 1/2, or t == 1/2 and k odd. */
LP_INLINE uint32_t lp_up32(const int mode, uint32_t t, uint32_t k, uint32_t nz, uint32_t neg) {
    if (mode == R_NEAREST_EVEN) {
        const uint32_t c = 0x7fffffffu + (k & 1u);
        return (uint32_t)((uint32_t)(t + c) < t);
    }
    if (mode == R_NEAREST_AWAY) return t >> 31;
    if (mode == R_UP) return nz & ~neg & 1u;
    if (mode == R_DOWN) return nz & neg & 1u;
    return 0u; /* R_TOWARD_ZERO */
}
LP_INLINE uint64_t lp_up64(const int mode, uint64_t t, uint64_t k, uint64_t nz, uint64_t neg) {
    if (mode == R_NEAREST_EVEN) {
        const uint64_t c = 0x7fffffffffffffffull + (k & 1ull);
        return (uint64_t)((t + c) < t);
    }
    if (mode == R_NEAREST_AWAY) return t >> 63;
    if (mode == R_UP) return nz & ~neg & 1ull;
    if (mode == R_DOWN) return nz & neg & 1ull;
    return 0ull; /* R_TOWARD_ZERO */
}
/* Whether a value beyond the largest finite one went toward zero (IEEE 754 section 7.4 then
 * gives the largest finite, not the overflow value): -1 (all ones) or 0, as a 0/1-per-bit mask
 * of the sign mask neg (all ones for a negative value). */
LP_INLINE int64_t lp_tz(const int mode, int64_t neg) {
    if (mode == R_TOWARD_ZERO) return -1;
    if (mode == R_UP) return neg;
    if (mode == R_DOWN) return ~neg;
    return 0; /* nearest, stochastic */
}
LP_INLINE int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }
LP_INLINE int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }

/* A function one file of the kernel lends another: not exported from the shared library. */
#define LP_INTERNAL __attribute__((visibility("hidden")))

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
                                   * float32 arithmetic (fixed_sr_one) */
    float srq, srm, srt;          /* fixed_sr: 2**qsub, 2**(qsub + 23), 2**(32 - qsub) */
    uint32_t cs;                  /* the 2-D tiles' (quantize.c) columns per memory row, log2 */
    const uint32_t *ctab;         /* ... or, for other column counts, each tile position's
                                   * counter offset (quantize.c, LP_CTR3) */
} lp_inv;

LP_INLINE lp_inv make_inv(const lp_params *p, int32_t sh) {
    lp_inv v;
    const float scale = u2f(pow2_bits(imin(imax(sh, -127), 127)));
    v.man = p->man;
    v.cs = 0;
    v.ctab = NULL;
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
    /* stochastic rounding to fixed point: fixed_sr_one. Its values are multiples of 2**qsub
     * >= 2**-94 (normal) or fractions below 2**qsub scaled by 2**(32 - qsub) <= 2**126; a
     * float32 subnormal there (an input, or a fraction below 2**-126) scales below 1 and so
     * truncates to 0 with or without denormals-are-zero: the same bits in any MXCSR mode. */
    v.fixed_sr = p->bemin + sh >= 255 && v.qsub >= -94 && v.qsub <= 100 &&
                 p->overflow == OV_SAT && p->signed_zero == 0; /* (every fixed format) */
    v.srq = v.fixed_sr ? u2f(pow2_bits(v.qsub)) : 0.0f;
    v.srm = v.fixed_sr ? u2f(pow2_bits(v.qsub + 23)) : 0.0f;
    v.srt = v.fixed_sr ? u2f(pow2_bits(32 - v.qsub)) : 0.0f;
    return v;
}

/* Each loop is compiled three times and the loader picks the clone this CPU runs (AVX-512,
 * AVX2, baseline x86-64). -DLP_NO_CLONES builds every file for the -march given instead:
 * the tests build one library per instruction set this CPU can execute and check each path
 * against the plain-torch one (tests/numerics/test_kernel_paths.py). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LP_NO_CLONES)
#define LP_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define LP_CLONES
#endif

/* The arithmetic loops use fmaf(): compiled for FMA hardware (the x86-64-v3 clone, AVX2 + FMA,
 * and x86-64-v4) it is one vfmadd instruction and vectorizes; the default clone (CPUs before
 * 2013) calls libm's fmaf, correctly rounded too, so every clone gives the same bits. GCC's
 * "avx2" target does not include FMA, hence x86-64-v3 here rather than LP_CLONES' avx2. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LP_NO_CLONES)
#define LP_OPT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LP_OPT_CLONES
#endif

#define LP_MAX_THREADS 64
/* 8,192: a stochastic rounding of 32,768 values (an LSTM step's hidden state at batch 256) costs
 * 26-36 us on one thread of an AMD EPYC with AVX512-BF16, more than an OpenMP fork; at 2**15 it
 * ran on one (benchmarks/RESULTS.md, "Issue 37, sixth session") */
#define LP_MIN_PER_THREAD (1 << 13)

/* Threads for n elements of work: one per LP_MIN_PER_THREAD, at most nthreads, at least one. */
static inline int lp_threads_for(int64_t n, int nthreads) {
    int64_t nt = n / LP_MIN_PER_THREAD;
    if (nt > nthreads) nt = nthreads;
    return nt < 1 ? 1 : (int)nt;
}

/* Threads for n elements of work split into `units` parallel units: at most one a unit. */
static inline int lp_threads_over(int64_t n, int64_t units, int nthreads) {
    const int nt = lp_threads_for(n, nthreads);
    return nt > units ? (units < 1 ? 1 : (int)units) : nt;
}

/* ---- quantize.c's loops, which the other files run ------------------------------------------
 * loop_fn rounds n elements whose logical index starts at `off`, the format shifted by 2**sh;
 * tile_fn rounds one tile with the invariants made (make_inv), random counters lo0, lo0 + st, ...
 * and the key (k0, k1). */
typedef void (*loop_fn)(const uint32_t *, uint32_t *, int64_t, uint64_t, int32_t, const lp_params *);
typedef void (*tile_fn)(const uint32_t *, uint32_t *, int64_t, uint32_t, uint32_t, uint32_t,
                        uint32_t, const lp_inv *);

/* The loop of a rounding mode (R_*), and its tile loop: tile_of(pick_loop(mode)). The loops are
 * static target clones (a clone resolver outside its file would be exported), so the other files
 * reach them through these pointers. */
LP_INTERNAL loop_fn pick_loop(int mode);
LP_INTERNAL tile_fn tile_of(loop_fn f);
/* Blocks with a scale exponent each (quantize.c's LP_DEFINE_SHIFTED): elements [e0, e0 + n) of
 * rows of row_len values in blocks of `block`, shifts[row * blocks a row + block] each; NULL
 * from shifted_of where the mode or the format has no fast rule (block.c's runs then). */
typedef void (*shifted_fn)(const uint32_t *, uint32_t *, int64_t, int64_t, int64_t, int64_t,
                           const int32_t *, uint32_t, uint32_t, const lp_params *);
LP_INTERNAL shifted_fn shifted_of(const lp_params *p);
/* F16C's float16 conversions (vcvtps2ph, vcvtph2ps), built where the clones are (the CPU is
 * asked at run time: lp_has_f16c) or where the -march has F16C (the per-ISA test builds:
 * x86-64-v3 and v4 test it, the baseline the integer loops). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    (!defined(LP_NO_CLONES) || defined(__F16C__))
#define LP_F16C_PATH 1
LP_INTERNAL int lp_has_f16c(void);
#endif
/* Whether run_at rounds to p by F16C's conversions (IEEE float16, nearest even, on a CPU with
 * F16C): faster than the tile loops, the same bits. */
LP_INTERNAL int lp_fp16_shortcut(const lp_params *p);
/* Elements [begin, end) of the logical tensor rounded by the loop (or shortcut) for p. */
LP_INTERNAL void run_range(const uint32_t *in, uint32_t *out, int64_t begin, int64_t end,
                           const lp_params *p);
/* n values from in to out, random counters off, off + 1, ...: a piece of a logical tensor (a
 * row) whose first value has logical index off. */
LP_INTERNAL void run_at(const uint32_t *in, uint32_t *out, int64_t n, uint64_t off,
                        const lp_params *p);

/* A share of a parallel job: units [begin, end) (elements, or rows of row_len in blocks of
 * `block` with their shifts), run by `run`. */
typedef struct lp_job {
    void (*run)(const struct lp_job *);
    const uint32_t *in;
    uint32_t *out;
    int64_t begin, end, row_len, block;
    const int32_t *shifts;
    const lp_params *p;
} lp_job;

/* `units` units of unit_elems elements each, split over at most nthreads threads. */
LP_INTERNAL void run_parallel(lp_job base, int64_t units, int64_t unit_elems, int nthreads);

#endif /* LP_COMMON_H */
