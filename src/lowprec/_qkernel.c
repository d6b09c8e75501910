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
#include <string.h>

enum { R_NE = 0, R_NA = 1, R_Z = 2, R_UP = 3, R_DOWN = 4, R_SR = 5 };
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

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
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
#define LP_DEFINE_LOOP(NAME, MODE)                                                               \
    LP_CLONES static void NAME##_tile(const uint32_t *in, uint32_t *out, int64_t n, uint32_t lo0, \
                                      uint32_t k0, uint32_t k1, const lp_inv *pp) {              \
        const lp_inv p = *pp;                                                                     \
        for (int64_t i = 0; i < n; ++i) {                                                         \
            uint32_t r = 0;                                                                       \
            if (MODE == R_SR) r = mix32(mix32((lo0 + (uint32_t)i) ^ k0) + k1);                    \
            out[i] = quantize_one(in[i], r, &p, MODE);                                            \
        }                                                                                         \
    }                                                                                             \
    static void NAME(const uint32_t *in, uint32_t *out, int64_t n, uint64_t off, int32_t sh,      \
                     const lp_params *pp) {                                                       \
        const lp_inv p = make_inv(pp, sh);                                                        \
        const uint32_t k0 = pp->k0, k1 = pp->k1 ^ mix32((uint32_t)(off >> 32));                   \
        for (int64_t t0 = 0; t0 < n; t0 += LP_TILE) {                                             \
            const int64_t len = n - t0 < LP_TILE ? n - t0 : LP_TILE;                              \
            if (t0 + LP_AHEAD < n) lp_prefetch(in, out, t0 + LP_AHEAD, n);                        \
            NAME##_tile(in + t0, out + t0, len, (uint32_t)off + (uint32_t)t0, k0, k1, &p);        \
        }                                                                                         \
    }

LP_DEFINE_LOOP(loop_ne, R_NE)
LP_DEFINE_LOOP(loop_na, R_NA)
LP_DEFINE_LOOP(loop_z, R_Z)
LP_DEFINE_LOOP(loop_up, R_UP)
LP_DEFINE_LOOP(loop_down, R_DOWN)
LP_DEFINE_LOOP(loop_sr, R_SR)

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

/* Elements [begin, end) of the logical tensor; the random counter's high word changes only at
 * 2**32 boundaries, so a range is split there. */
static void run_range(const uint32_t *in, uint32_t *out, int64_t begin, int64_t end,
                      const lp_params *p) {
    loop_fn f = pick_loop(p->rounding);
    while (begin < end) {
        int64_t stop = (int64_t)(((uint64_t)begin | 0xffffffffULL) + 1ULL);
        if (stop > end) stop = end;
        f(in + begin, out + begin, stop - begin, (uint64_t)begin, 0, p);
        begin = stop;
    }
}

/* Blocked variant: rows of `row_len` elements, each cut into blocks of `block` elements; block b
 * of row j uses shift shifts[j * nblocks + b] (the block's scale exponent). */
static void run_blocks(const uint32_t *in, uint32_t *out, int64_t row_begin, int64_t row_end,
                       int64_t row_len, int64_t block, const int32_t *shifts, const lp_params *p) {
    loop_fn f = pick_loop(p->rounding);
    const int64_t nblocks = (row_len + block - 1) / block;
    for (int64_t j = row_begin; j < row_end; ++j) {
        for (int64_t b = 0; b < nblocks; ++b) {
            const int64_t start = j * row_len + b * block;
            int64_t len = row_len - b * block;
            if (len > block) len = block;
            const int32_t sh = shifts[j * nblocks + b];
            if (sh == LP_NAN_SHIFT) { /* the block held a NaN or an Inf: its scale is NaN */
                for (int64_t i = 0; i < len; ++i) out[start + i] = 0x7fc00000u;
            } else {
                f(in + start, out + start, len, (uint64_t)start, sh, p);
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
#define LP_MIN_PER_THREAD (1 << 16)

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

/* Public entry points (called through ctypes). in may equal out. */
void lp_quantize_f32(const uint32_t *in, uint32_t *out, int64_t n, const lp_params *p,
                     int nthreads) {
    lp_job base = {in, out, 0, n, 0, 0, NULL, p};
    run_parallel(base, n, 1, nthreads);
}

void lp_quantize_blocks_f32(const uint32_t *in, uint32_t *out, int64_t rows, int64_t row_len,
                            int64_t block, const int32_t *shifts, const lp_params *p,
                            int nthreads) {
    lp_job base = {in, out, 0, rows, row_len, block, shifts, p};
    run_parallel(base, rows, row_len, nthreads);
}

int lp_abi_version(void) { return 1; }

static struct PyModuleDef lp_module = {PyModuleDef_HEAD_INIT, "_qkernel",
                                       "lowprec quantization kernel (called through ctypes)", -1,
                                       NULL};

PyMODINIT_FUNC PyInit__qkernel(void) { return PyModule_Create(&lp_module); }
