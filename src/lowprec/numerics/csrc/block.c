/*
 * block.c: scaled casts. MX blocks: the scale exponent of every block (lp_block_shifts_f32) and
 * the rounding of each block with the format shifted by it (lp_quantize_blocks_f32, quantize.c's
 * tile loops); dynamic fixed point: the overflow counts that move its scale (lp_count_abs_ge).
 */
#include "lp_common.h"

/* Blocked variant: rows of `row_len` elements, each cut into blocks of `block` elements; block b
 * of row j uses shift shifts[j * nblocks + b] (the block's scale exponent). Blocks shorter than
 * LP_SHIFTED_BELOW values (an MX rounding along a channels-last activation of 6 channels: one
 * block of 6 a row), in a mode with a fast rule, go value by value with their block's shift
 * (quantize.c's shifted_of: no call per block). Otherwise consecutive blocks (along a row and
 * across rows, which lie one after the other) of one shift form one run, rounded by one call of
 * the mode's tile loop with the loop invariants of that shift, kept in a small table by shift
 * (make_inv once per shift, not per block). On 2 threads of an AMD EPYC with AVX512-BF16, in
 * ns a value (mxfp8_e4m3, nearest, random normal rows of 300,000 values): rows of 6, a call
 * per block (before) 3.9, runs 2.1, by value 0.76; rows of 16: runs 0.53, by value 0.49; rows
 * of 32: runs 0.30, by value 0.45. The random counter of each value is its flat index,
 * whichever way it is rounded, so the bits are the same. */
#define LP_INV_CACHE 64
#ifndef LP_SHIFTED_BELOW
#define LP_SHIFTED_BELOW 16
#endif

static const lp_inv *inv_of(lp_inv *cache, int32_t *tag, int32_t sh, const lp_params *p) {
    const int slot = (int)((uint32_t)sh % LP_INV_CACHE);
    if (tag[slot] != sh) {
        cache[slot] = make_inv(p, sh);
        tag[slot] = sh;
    }
    return &cache[slot];
}

/* The run [start, start + len) with the invariants *inv; the random counter as the plain loop's:
 * low word the index, high word in the key, split where the index crosses a multiple of 2**32. */
static void run_one(tile_fn t, const uint32_t *in, uint32_t *out, int64_t start, int64_t len,
                    const lp_inv *inv, const lp_params *p) {
    int64_t done = 0;
    while (done < len) {
        const uint64_t at = (uint64_t)(start + done);
        int64_t stop = (int64_t)((at | 0xffffffffULL) + 1ULL) - start;
        if (stop > len) stop = len;
        t(in + start + done, out + start + done, stop - done, (uint32_t)at, 1u, p->k0,
          p->k1 ^ mix32((uint32_t)(at >> 32)), inv);
        done = stop;
    }
}

static void run_blocks(const uint32_t *in, uint32_t *out, int64_t row_begin, int64_t row_end,
                       int64_t row_len, int64_t block, const int32_t *shifts, const lp_params *p) {
    const shifted_fn f = (block < row_len ? block : row_len) < LP_SHIFTED_BELOW ? shifted_of(p)
                                                                               : NULL;
    if (f != NULL) { /* short blocks with a fast rule: every value by its block's shift */
        int64_t a = row_begin * row_len;
        const int64_t e = row_end * row_len;
        while (a < e) {
            int64_t stop = (int64_t)(((uint64_t)a | 0xffffffffULL) + 1ULL);
            if (stop > e) stop = e;
            f(in, out, a, stop - a, row_len, block, shifts, p->k0,
              p->k1 ^ mix32((uint32_t)((uint64_t)a >> 32)), p);
            a = stop;
        }
        return;
    }
    const tile_fn t = tile_of(pick_loop(p->rounding));
    const int64_t nblocks = (row_len + block - 1) / block;
    lp_inv cache[LP_INV_CACHE];
    int32_t tag[LP_INV_CACHE];
    for (int i = 0; i < LP_INV_CACHE; ++i) tag[i] = LP_NAN_SHIFT; /* no shift's: all empty */
    int64_t run = row_begin * row_len, run_len = 0; /* the run of equal shifts not yet rounded */
    int32_t run_sh = LP_NAN_SHIFT;
    for (int64_t j = row_begin; j < row_end; ++j) {
        for (int64_t b = 0; b < nblocks; ++b) {
            const int64_t start = j * row_len + b * block;
            int64_t len = row_len - b * block;
            if (len > block) len = block;
            const int32_t sh = shifts[j * nblocks + b];
            if (sh == run_sh && sh != LP_NAN_SHIFT) { /* the run goes on (blocks are adjacent) */
                run_len += len;
                continue;
            }
            if (run_len) run_one(t, in, out, run, run_len, inv_of(cache, tag, run_sh, p), p);
            run = start;
            run_len = 0;
            run_sh = sh;
            if (sh == LP_NAN_SHIFT) { /* the block held a NaN or an Inf: its scale is NaN */
                for (int64_t i = 0; i < len; ++i) out[start + i] = 0x7fc00000u;
                continue;
            }
            run_len = len;
        }
    }
    if (run_len) run_one(t, in, out, run, run_len, inv_of(cache, tag, run_sh, p), p);
}

/* lp_quantize_blocks_f32's share of the rows */
static void run_blocks_job(const lp_job *j) {
    run_blocks(j->in, j->out, j->begin, j->end, j->row_len, j->block, j->shifts, j->p);
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
    lp_job base = {run_blocks_job, in, out, 0, rows, row_len, block, shifts, p};
    run_parallel(base, rows, row_len, nthreads);
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
