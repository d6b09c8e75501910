/*
 * quantize.c: lowprec's fused quantization, float32 in, float32 out, one pass (the format
 * parameters and the rounding rule are described in lp_common.h). quantize_one rounds one value
 * by integer operations; one loop per rounding mode runs it, with a fast path for the common
 * cases and float16 / bfloat16 shortcuts that give the same bits. The other files round through
 * these loops (run_range, the tile loops), and run_parallel splits every job over the threads.
 */
#include <pthread.h>

#include "lp_common.h"

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
    if (mode == R_STOCHASTIC) { /* carry out of (fraction + random bits), both cut to r bits */
        const uint32_t tm = t & p->rmask, rm = r & p->rmask;
        up = (uint32_t)((uint32_t)(tm + rm) < tm);
    } else {
        up = lp_up32(mode, t, k, (uint32_t)(rem != 0), msign);
    }
    const uint32_t pw = sel(mask_if(qe >= -126), (uint32_t)(qe + 127) << 23,
                            1u << ((qe + 149) & 31));
    uint32_t v = f2u((float)(int32_t)(k + up) * u2f(pw));
    v = sel(mask_if(s <= 0), a, v); /* already on the grid */
    const uint32_t lim = sel(msign, p->maxneg, p->maxpos);
    const uint32_t tz = (uint32_t)lp_tz(mode, (int32_t)msign); /* went toward zero */
    const uint32_t special = sel(p->saturate, lim, p->special);
    v = sel(mask_if(v > lim), sel(tz, lim, special), v);
    v = sel(mask_if(a == 0x7f800000u), special, v); /* +-Inf in */
    uint32_t res = v | sign;
    res &= ~mask_if((v == 0) & (p->signed_zero == 0));
    return sel(mask_if(a > 0x7f800000u), u, res); /* NaN passes through */
}

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
 * goes through quantize_one. Both give the same bits, so this is only a shortcut. The chunks go
 * by blocks of LP_RBLK values: the block's random words in a loop of their own, then the rule for
 * all its values with one test of their flags (one horizontal reduction a block, not a chunk:
 * stochastic rounding 1.15-1.2x faster on one thread, AMD EPYC AVX512-BF16; benchmarks/RESULTS.md,
 * "Issue 37, sixth session"). */
#define LP_CHUNK 16
#ifndef LP_RBLK
#define LP_RBLK 64 /* a multiple of LP_CHUNK */
#endif

LP_INLINE uint32_t lp_rand(uint32_t idx, uint32_t k0, uint32_t k1) {
    return mix32(mix32(idx ^ k0) + k1);
}

/* Stochastic rounding to fixed point (the loop of mode R_SRFX, a variant of R_STOCHASTIC chosen by
 * run_range for fixed formats and 32 random bits), for |x| < 2**(qsub + 23) (the loop sends
 * larger values, beyond any fixed format's limit, and NaN to quantize_one with their chunk), in
 * float32 arithmetic: m = (|x| + 2**(qsub + 23)) - 2**(qsub + 23) is |x| rounded to a multiple
 * of the quantum q = 2**qsub (the sum's ulp is q; the subtraction is exact), f = m or m - q the
 * multiple below |x|, |x| - f (exact) its fraction of q, which times 2**(32 - qsub) truncates to
 * quantize_one's 32-bit fraction t; the result is f + q where t + r carries out of 32 bits, else
 * f (quantize_one's rule: for a value with s <= 23 bits below the quantum, the carry of its s
 * fraction bits plus the random word's top s bits, the same carry). About a third of the
 * integer rule's operations (per-element shifts and selects: benchmarks/RESULTS.md, figure
 * F41). A mode of its own, so that each loop's branches fold at compile time (a run-time branch
 * inside the float loop stopped GCC vectorising it: figure F12). */
LP_INLINE uint32_t fixed_sr_one(uint32_t a, uint32_t r, const lp_inv *p) {
    const float x = u2f(a);
    const float m = (x + p->srm) - p->srm;
    const float f = m > x ? m - p->srq : m;
    const uint32_t t = (uint32_t)((x - f) * p->srt);
    return f2u((uint32_t)(t + r) < t ? f + p->srq : f);
}

/* fixed_sr_one with what fast_one's rule adds, for a format whose fixed_sr holds (saturating,
 * no negative zero: make_inv): the result clamped to the limit of its sign, a zero unsigned; for
 * |x| below srm (the loop tests that apart: beyond it, Inf and NaN included, the chunk goes to
 * quantize_one). The same bits as fast_one in about two thirds of its operations: its general
 * overflow rule (a select by the saturate flag, the flag of an overflow to Inf, a NaN test) is
 * one unsigned minimum here, and the test of the chunk one comparison a value in a pass of its
 * own, with no arrays of results and flags (q6.10 of an 8M-value channels-last tensor 1.49 ->
 * 1.15 ns a value, one thread, AMD EPYC with AVX2: benchmarks/RESULTS.md, "Issue 37,
 * nineteenth session"). */
LP_INLINE uint32_t fixed_sr_fast(uint32_t u, uint32_t r, const lp_inv *p) {
    const uint32_t a = u & 0x7fffffffu, sign = u ^ a;
    uint32_t rf = fixed_sr_one(a, r, p);
    const uint32_t lim = sel(mask_if(sign != 0), p->maxneg, p->maxpos);
    rf = rf < lim ? rf : lim;
    return sel(mask_if(rf == 0), 0u, rf | sign);
}

#define LP_BASE(MODE) ((MODE) == R_SRFX ? R_STOCHASTIC : (MODE))

/* The fast path's rule for one value (u its pattern, r its random word): the rounded pattern,
 * *bad set where the value needs quantize_one instead (beyond the fast rule's range). */
LP_INLINE uint32_t fast_one(uint32_t u, uint32_t r, const lp_inv *p, const int mode,
                            uint32_t *bad) {
    const uint32_t sign = u & 0x80000000u, a = u & 0x7fffffffu;
    const int32_t field = (int32_t)(a >> 23);
    uint32_t rf, b;
    if (mode == R_SRFX) {
        rf = fixed_sr_one(a, r, p);
        b = (uint32_t)(a >= f2u(p->srm));
    } else {
        const uint32_t add = mode == R_NEAREST_EVEN ? p->fhalf + (((a >> p->fshift) | p->fodd) & 1u)
                                                    : r >> (32 - p->fshift);
        rf = (a + add) & ~p->fmask;
        if (mode == R_NEAREST_EVEN && p->fsub) {
            const uint32_t fs = f2u((u2f(a) + p->msub) - p->msub);
            rf = sel(mask_if(field < p->bemin), fs, rf);
            b = 0u;
        } else {
            b = (uint32_t)((field < p->bemin) & (a != 0));
        }
    }
    const uint32_t lim = sel(mask_if(sign != 0), p->maxneg, p->maxpos);
    /* beyond the limit: a saturating format takes it (quantize_one's rule for nearest and
     * stochastic rounding, +-Inf included: MX elements, fixed point), so only a NaN goes to
     * quantize_one; other formats send every such value there */
    const uint32_t over = mask_if(rf > lim);
    rf = sel(over & p->saturate, lim, rf);
    *bad = b | (over & ~p->saturate & 1u) | (uint32_t)(a > 0x7f800000u);
    uint32_t res = rf | sign;
    res &= ~mask_if((rf == 0) & (p->signed_zero == 0));
    return res;
}

/* the random counter of element j of a tile: logical indices lo0, lo0 + st, ... */
#define LP_CTR(j) (lo0 + (uint32_t)(j) * st)
/* ... of a 2-D tile (lp_quantize_f32_bt): memory rows of 2**p.cs values, each value of a row a
 * column whose logical index steps by st, each next row by 1 */
#define LP_CTR2(j) (lo0 + ((uint32_t)(j) >> p.cs) + ((uint32_t)(j) & ((1u << p.cs) - 1u)) * st)
/* ... of a 2-D tile of any other column count cols: position j's offset j / cols + (j % cols) *
 * rows from the call's table p.ctab (st unused: it is in the table) */
#define LP_CTR3(j) (lo0 + p.ctab[j] + 0u * st)

#define LP_DEFINE_LOOP(NAME, MODE)                                                               \
    LP_DEFINE_TILE(NAME##_tile, MODE, LP_CTR)                                                    \
    LP_DEFINE_RANGE(NAME, MODE)

/* A tile: n values rounded with the invariants *pp, element j's random counter CTR(j). */
#define LP_DEFINE_TILE(TNAME, MODE, LP_CTR)                                                      \
    LP_CLONES static void TNAME(const uint32_t *in, uint32_t *out, int64_t n, uint32_t lo0,      \
                                uint32_t st, uint32_t k0, uint32_t k1, const lp_inv *pp) {       \
        const lp_inv p = *pp;                                                                     \
        int64_t i = 0;                                                                            \
        const int fast = (MODE == R_NEAREST_EVEN && (p.fast || p.fixed_ne)) ||                            \
                         (MODE == R_STOCHASTIC && p.rmask == 0xffffffffu && p.fast) ||                    \
                         (MODE == R_SRFX && p.rmask == 0xffffffffu && p.fixed_sr);               \
        if (fast && MODE == R_SRFX) {                                                             \
            /* by blocks of LP_RBLK values: their random words, then whether any value is      \
             * beyond the fast rule, then the rule; where some are, the chunks of LP_CHUNK       \
             * values holding them are rounded by quantize_one */                                \
            const uint32_t srmb = f2u(p.srm);                                                     \
            for (; i < n; i += LP_RBLK) {                                                         \
                const int64_t m = n - i < LP_RBLK ? n - i : LP_RBLK;                              \
                uint32_t rnd[LP_RBLK];                                                            \
                for (int64_t l = 0; l < m; ++l) rnd[l] = lp_rand(LP_CTR(i + l), k0, k1);          \
                if (m == LP_RBLK) {                                                               \
                    uint32_t any = 0;                                                             \
                    for (int l = 0; l < LP_RBLK; ++l)                                             \
                        any |= mask_if((in[i + l] & 0x7fffffffu) >= srmb);                        \
                    if (!any) {                                                                   \
                        for (int l = 0; l < LP_RBLK; ++l)                                         \
                            out[i + l] = fixed_sr_fast(in[i + l], rnd[l], &p);                    \
                        continue;                                                                 \
                    }                                                                             \
                }                                                                                 \
                for (int64_t c = 0; c < m; c += LP_CHUNK) {                                       \
                    const int64_t cnt = m - c < LP_CHUNK ? m - c : LP_CHUNK;                      \
                    uint32_t bad = 0;                                                             \
                    for (int64_t l = c; l < c + cnt; ++l)                                         \
                        bad |= mask_if((in[i + l] & 0x7fffffffu) >= srmb);                        \
                    for (int64_t l = c; l < c + cnt; ++l)                                         \
                        out[i + l] = bad ? quantize_one(in[i + l], rnd[l], &p, R_STOCHASTIC)      \
                                         : fixed_sr_fast(in[i + l], rnd[l], &p);                  \
                }                                                                                 \
            }                                                                                     \
        } else if (fast) {                                                                        \
            /* by blocks of LP_RBLK values: their random words first, in a loop of their own;    \
             * then the fast rule for all, with one test of the flags in the common case (no    \
             * value beyond the rule's range); where some are, the chunks of LP_CHUNK values    \
             * holding them are rounded again by quantize_one */                                 \
            for (; i < n; i += LP_RBLK) {                                                         \
                const int64_t m = n - i < LP_RBLK ? n - i : LP_RBLK;                              \
                uint32_t rnd[LP_RBLK], tmp[LP_RBLK], flag[LP_RBLK];                               \
                if (LP_BASE(MODE) == R_STOCHASTIC)                                                \
                    for (int64_t l = 0; l < m; ++l) rnd[l] = lp_rand(LP_CTR(i + l), k0, k1);      \
                else                                                                              \
                    for (int64_t l = 0; l < m; ++l) rnd[l] = 0u;                                  \
                if (m == LP_RBLK) {                                                               \
                    uint32_t any = 0;                                                             \
                    for (int l = 0; l < LP_RBLK; ++l) {                                           \
                        tmp[l] = fast_one(in[i + l], rnd[l], &p, MODE, &flag[l]);                 \
                        any |= flag[l];                                                           \
                    }                                                                             \
                    if (!any) {                                                                   \
                        for (int l = 0; l < LP_RBLK; ++l) out[i + l] = tmp[l];                    \
                        continue;                                                                 \
                    }                                                                             \
                } else {                                                                          \
                    for (int64_t l = 0; l < m; ++l)                                               \
                        tmp[l] = fast_one(in[i + l], rnd[l], &p, MODE, &flag[l]);                 \
                }                                                                                 \
                for (int64_t c = 0; c < m; c += LP_CHUNK) {                                       \
                    const int64_t cnt = m - c < LP_CHUNK ? m - c : LP_CHUNK;                      \
                    uint32_t bad = 0;                                                             \
                    for (int64_t l = c; l < c + cnt; ++l) bad |= flag[l];                         \
                    if (bad) {                                                                    \
                        for (int64_t l = c; l < c + cnt; ++l)                                     \
                            out[i + l] = quantize_one(in[i + l], rnd[l], &p, LP_BASE(MODE));      \
                    } else {                                                                      \
                        for (int64_t l = c; l < c + cnt; ++l) out[i + l] = tmp[l];                \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (; i < n; ++i) {                                                                      \
            uint32_t r = 0;                                                                       \
            if (LP_BASE(MODE) == R_STOCHASTIC) r = lp_rand(LP_CTR(i), k0, k1);                           \
            out[i] = quantize_one(in[i], r, &p, LP_BASE(MODE));                                   \
        }                                                                                         \
    }

#define LP_DEFINE_RANGE(NAME, MODE)                                                              \
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

#define LP_LOOP_OF(SUFFIX, MODE) LP_DEFINE_LOOP(loop_##SUFFIX, MODE)
LP_DETERMINISTIC_MODES(LP_LOOP_OF)
LP_DEFINE_LOOP(loop_sr, R_STOCHASTIC)
LP_DEFINE_LOOP(loop_sr_fixed, R_SRFX)
LP_DEFINE_TILE(loop_sr_tile2, R_STOCHASTIC, LP_CTR2)
LP_DEFINE_TILE(loop_sr_fixed_tile2, R_SRFX, LP_CTR2)
LP_DEFINE_TILE(loop_sr_tile3, R_STOCHASTIC, LP_CTR3)
LP_DEFINE_TILE(loop_sr_fixed_tile3, R_SRFX, LP_CTR3)

/* Blocks of a scale each (MX), the format shifted by the block's scale exponent sh, rounded by
 * the fast rule of the unshifted format: x * 2**-sh is x's pattern with sh taken from its exponent
 * field, exact while that field stays normal, and the rounding commutes with the exact scaling
 * (every bound of the shifted format is the unshifted one's times 2**sh; stochastic rounding's
 * fraction of the quantum is the same), so (round(x * 2**-sh)) * 2**sh, the result's field moved
 * back, is the shifted format's result. A value whose fields would leave the normal range (a
 * float32 subnormal, a block scale beyond the exponent range, an overflow's special value), a
 * block whose scale is NaN and the fast rule's own flags go to quantize_one with that block's
 * invariants, by LP_CHUNK values as the tile loops do: the same bits. Each value's shift is read
 * per value, so a block of any length costs no call of its own (run_blocks' runs of equal shifts
 * did: an MX rounding along a 6-channel channels-last activation, one block of 6 a row, cost
 * 3.9 ns a value on 2 threads of an AMD EPYC with AVX512-BF16). Elements [e0, e0 + n) of rows
 * of row_len values in blocks of `block`; random counter = the index's low word, the high word
 * in k1 (the caller splits at 2**32). */
#define LP_DEFINE_SHIFTED(NAME, MODE)                                                            \
    LP_CLONES static void NAME(const uint32_t *in, uint32_t *out, int64_t e0, int64_t n,          \
                               int64_t row_len, int64_t block, const int32_t *shifts,             \
                               uint32_t k0, uint32_t k1, const lp_params *pp) {                   \
        const lp_inv p = make_inv(pp, 0);                                                         \
        const int64_t nblocks = (row_len + block - 1) / block;                                    \
        int64_t j = e0 / row_len, c = e0 % row_len; /* row and column of the next value */       \
        lp_inv finv = p;                            /* quantize_one's invariants, of shift fsh */ \
        int32_t fsh = 0;                                                                          \
        for (int64_t i = 0; i < n; i += LP_RBLK) {                                                \
            const int64_t m = n - i < LP_RBLK ? n - i : LP_RBLK;                                  \
            int32_t es[LP_RBLK];                                                                  \
            uint32_t rnd[LP_RBLK], tmp[LP_RBLK], flag[LP_RBLK], any = 0;                          \
            for (int64_t l = 0; l < m;) { /* each value's shift, a block at a time */             \
                const int64_t b = c / block, end = (b + 1) * block < row_len ? (b + 1) * block    \
                                                                              : row_len;          \
                const int64_t len = end - c < m - l ? end - c : m - l;                            \
                const int32_t sh = shifts[j * nblocks + b];                                       \
                for (int64_t q = 0; q < len; ++q) es[l + q] = sh;                                 \
                l += len;                                                                         \
                c += len;                                                                         \
                if (c == row_len) {                                                               \
                    c = 0;                                                                        \
                    ++j;                                                                          \
                }                                                                                 \
            }                                                                                     \
            for (int64_t l = 0; l < m; ++l)                                                       \
                rnd[l] = MODE == R_STOCHASTIC ? lp_rand((uint32_t)(e0 + i + l), k0, k1) : 0u;     \
            for (int64_t l = 0; l < m; ++l) {                                                     \
                const uint32_t u = in[e0 + i + l], a = u & 0x7fffffffu;                           \
                const int32_t sh = es[l], field = (int32_t)(a >> 23), nf = field - sh;            \
                const uint32_t sb = (uint32_t)sh << 23, zero = mask_if(a == 0);                   \
                const uint32_t bin = ~zero & (uint32_t)((field == 0) | (nf < 1) | (nf > 254));    \
                uint32_t fb;                                                                      \
                const uint32_t r = fast_one(sel(zero, u, u - sb), rnd[l], &p, MODE, &fb);         \
                const uint32_t ra = r & 0x7fffffffu, rz = mask_if(ra == 0);                       \
                const int32_t rfield = (int32_t)(ra >> 23), nr = rfield + sh;                     \
                const uint32_t bout = ~rz & (uint32_t)((rfield == 255) | (nr < 1) | (nr > 254));  \
                tmp[l] = sel(rz, r, r + sb);                                                      \
                flag[l] = fb | (bin & 1u) | (bout & 1u) | (uint32_t)(sh == LP_NAN_SHIFT);         \
                any |= flag[l];                                                                   \
            }                                                                                     \
            if (!any) {                                                                           \
                for (int64_t l = 0; l < m; ++l) out[e0 + i + l] = tmp[l];                         \
                continue;                                                                         \
            }                                                                                     \
            for (int64_t c0 = 0; c0 < m; c0 += LP_CHUNK) {                                        \
                const int64_t cnt = m - c0 < LP_CHUNK ? m - c0 : LP_CHUNK;                        \
                uint32_t bad = 0;                                                                 \
                for (int64_t l = c0; l < c0 + cnt; ++l) bad |= flag[l];                           \
                for (int64_t l = c0; l < c0 + cnt; ++l) {                                         \
                    if (!bad) {                                                                   \
                        out[e0 + i + l] = tmp[l];                                                 \
                    } else if (es[l] == LP_NAN_SHIFT) { /* a NaN or an Inf in the block */        \
                        out[e0 + i + l] = 0x7fc00000u;                                            \
                    } else {                                                                      \
                        if (es[l] != fsh) {                                                       \
                            finv = make_inv(pp, es[l]);                                           \
                            fsh = es[l];                                                          \
                        }                                                                         \
                        out[e0 + i + l] = quantize_one(in[e0 + i + l], rnd[l], &finv, MODE);      \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

LP_DEFINE_SHIFTED(shifted_ne, R_NEAREST_EVEN)
LP_DEFINE_SHIFTED(shifted_sr, R_STOCHASTIC)

shifted_fn shifted_of(const lp_params *p) {
    const lp_inv v = make_inv(p, 0);
    if (!v.fast) return NULL; /* fixed-point elements, or no bits discarded */
    if (p->rounding == R_NEAREST_EVEN) return shifted_ne;
    if (p->rounding == R_STOCHASTIC && p->rmask == 0xffffffffu) return shifted_sr;
    return NULL;
}

loop_fn pick_loop(int mode) {
#define LP_LOOP_CASE(SUFFIX, MODE) case MODE: return loop_##SUFFIX;
    switch (mode) {
    LP_DETERMINISTIC_MODES(LP_LOOP_CASE)
    default: return loop_sr;
    }
}

/* IEEE binary16 rounded to nearest even, by the CPU's own conversion (F16C's vcvtps2ph with
 * the rounding in the instruction, then vcvtph2ps back): the same bits as loop_ne for that
 * format (subnormals, overflow to Inf, -0) in two instructions a vector; NaN keeps its input
 * bits, as quantize_one keeps them. Faster than the integer loop (benchmarks/RESULTS.md,
 * figure F13). Built where the clones are (the CPU is asked at run time) or where the
 * -march has F16C (the per-ISA test builds: x86-64-v3 and v4 test it, the baseline the loop). */
#ifdef LP_F16C_PATH
#include <immintrin.h>
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

/* No cache: the answer is read from libgcc's CPU model, which its constructor filled when the
 * library loaded (__builtin_cpu_init is needed only before constructors run), so the threads of
 * a parallel region may ask at once. */
int lp_has_f16c(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

LP_INLINE int lp_is_fp16_ne(const lp_params *p) {
    return p->rounding == R_NEAREST_EVEN && p->man == 10 && p->bemin == 113 && p->qsub == -24 &&
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
    return p->rounding == R_NEAREST_EVEN && p->man == 7 && p->bemin == 1 && p->qsub == -133 &&
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
    if (p->rounding == R_STOCHASTIC && p->rmask == 0xffffffffu && p->bemin >= 255 && p->qsub >= -126 &&
        p->qsub <= 100)
        return loop_sr_fixed;
    return pick_loop(p->rounding);
}

int lp_fp16_shortcut(const lp_params *p) {
#ifdef LP_F16C_PATH
    return lp_is_fp16_ne(p) && lp_has_f16c();
#else
    (void)p;
    return 0;
#endif
}

/* n values rounded, their random counters off, off + 1, ...: a piece of a logical tensor (a
 * row) whose first value has index off, in and out pointing at that value; the counter's high
 * word changes only at 2**32 boundaries, so the piece is split there. */
void run_at(const uint32_t *in, uint32_t *out, int64_t n, uint64_t off, const lp_params *p) {
#ifdef LP_F16C_PATH
    if (lp_is_fp16_ne(p) && lp_has_f16c()) {
        fp16_ne_f16c(in, out, n, p);
        return;
    }
#endif
    if (lp_is_bf16_ne(p)) {
        bf16_ne(in, out, n);
        return;
    }
    loop_fn f = loop_for(p); /* fixed point with 32 random bits: fixed_sr_one's loop */
    int64_t done = 0;
    while (done < n) {
        const uint64_t at = off + (uint64_t)done;
        int64_t stop = (int64_t)(((at | 0xffffffffULL) + 1ULL) - off);
        if (stop > n) stop = n;
        f(in + done, out + done, stop - done, at, 0, p);
        done = stop;
    }
}

/* Elements [begin, end) of the logical tensor. */
void run_range(const uint32_t *in, uint32_t *out, int64_t begin, int64_t end,
               const lp_params *p) {
    run_at(in + begin, out + begin, end - begin, (uint64_t)begin, p);
}

tile_fn tile_of(loop_fn f) {
#define LP_TILE_OF(SUFFIX, MODE) if (f == loop_##SUFFIX) return loop_##SUFFIX##_tile;
    LP_DETERMINISTIC_MODES(LP_TILE_OF)
    if (f == loop_sr_fixed) return loop_sr_fixed_tile;
    return loop_sr_tile;
}

/* lp_quantize_f32's share of the elements */
static void run_range_job(const lp_job *j) { run_range(j->in, j->out, j->begin, j->end, j->p); }

static void *run_job(void *arg) {
    const lp_job *j = (const lp_job *)arg;
    j->run(j);
    return NULL;
}

#ifdef _OPENMP
/* OpenMP, so that the kernel shares torch's thread pool: the library is linked by its soname
 * libgomp.so.1, which the dynamic loader resolves to the copy torch already loaded. Separate
 * pthreads would compete with torch's spinning OpenMP workers for the same cores. */
void run_parallel(lp_job base, int64_t units, int64_t unit_elems, int nthreads) {
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
void run_parallel(lp_job base, int64_t units, int64_t unit_elems, int nthreads) {
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
/* Stochastic rounding with fewer columns than LP_TILE (the channels of most CNNs) takes 2-D
 * tiles: one tile call rounds LP_TILE / cols whole memory rows in memory order, the counter of a
 * value stepping by rows along its memory row and by 1 to the next: computed from the position
 * for a power of two of columns (LP_CTR2), read from a table of the tile's offsets, built once a
 * call, for other counts (LP_CTR3). On an AMD EPYC with AVX512-BF16, at 16 channels the
 * power-of-two tiles were 1.03-1.05x the contiguous rounding, where a call per memory row cost
 * 1.38x and the gathered tiles below 1.92x; at 8, 4 and 2 channels 1.02-1.15x against the
 * gathered tiles' 1.52-2.08x (benchmarks/RESULTS.md, "Issue 37, fifth session"); the table's
 * figures: "Issue 37, fourteenth session".
 * A deterministic rounding (no counters: lowprec rounds it in memory order, never here) gathers
 * tiles of LP_BT_C columns x LP_BT_R rows into logical order on the stack below LP_BT_RUNS columns, each
 * logical row rounded with its own indices, then scattered back; from LP_BT_RUNS columns on,
 * runs of a memory row are faster (benchmarks/RESULTS.md, figure F15). */
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

/* y = x * a[c] + b[c] contracted to one fused multiply-add (fmaf, as ATen's CPU addcmul computes
 * it: lp_affine_round in recurrent.c) over nrows memory rows of cols values, channel c the
 * value's place in its row, into u. */
LP_OPT_CLONES static void affine_rows(const float *x, const float *a, const float *b, float *u,
                                      int64_t nrows, int64_t cols) {
    for (int64_t i = 0; i < nrows; ++i)
        for (int64_t c = 0; c < cols; ++c) u[i * cols + c] = fmaf(x[i * cols + c], a[c], b[c]);
}

/* lp_quantize_f32_bt's rounding; where a is not NULL, of x * a[c] + b[c] (affine_rows), each
 * tile computed on the stack before it is rounded (lp_affine_round_bt). */
static void bt_tiles(const uint32_t *in, uint32_t *out, int64_t batch, int64_t rows,
                     int64_t cols, const lp_params *p, int nthreads, const float *a,
                     const float *b) {
    const loop_fn lf = loop_for(p);
    const int pow2 = cols > 0 && (cols & (cols - 1)) == 0;
    const tile_fn t2 = lf == loop_sr       ? (pow2 ? loop_sr_tile2 : loop_sr_tile3)
                       : lf == loop_sr_fixed ? (pow2 ? loop_sr_fixed_tile2 : loop_sr_fixed_tile3)
                                             : NULL;
    if (cols < LP_BT_RUNS && t2 == NULL) { /* (a is NULL: lp_affine_round_bt takes no such mode) */
        const loop_fn f = lf;
        const int64_t rblocks = (rows + LP_BT_R - 1) / LP_BT_R, units = batch * rblocks;
        const int nt = lp_threads_over(batch * rows * cols, units, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
        for (int64_t u = 0; u < units; ++u)
            bt_unit(in, out, rows, cols, u / rblocks, (u % rblocks) * LP_BT_R, p, f);
        return;
    }
    const tile_fn t = tile_of(lf);
    lp_inv inv = make_inv(p, 0);
    const uint32_t k0 = p->k0, k1 = p->k1; /* high word 0: the key's mix32(0) is 0 */
    if (t2 != NULL && cols > 0 && cols < LP_TILE) {
        /* fewer columns than a tile: 2-D tiles of whole memory rows (above) */
        const int64_t per = LP_TILE / cols;
        uint32_t ctab[LP_TILE];
        if (pow2) {
            inv.cs = (uint32_t)__builtin_ctzll((unsigned long long)cols);
        } else {
            for (int64_t j = 0; j < per * cols; ++j)
                ctab[j] = (uint32_t)(j / cols) + (uint32_t)(j % cols) * (uint32_t)rows;
            inv.ctab = ctab;
        }
        int64_t rb = LP_BT_R; /* rows a parallel unit; fewer where the batch is small */
        if (nthreads > 1 && batch * ((rows + rb - 1) / rb) < nthreads) {
            rb = (rows + nthreads - 1) / nthreads;
            rb = (rb + per - 1) / per * per;
        }
        const int64_t rblocks = (rows + rb - 1) / rb, units2 = batch * rblocks;
        const int nt2 = lp_threads_over(batch * rows * cols, units2, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt2) schedule(static)
#endif
        for (int64_t u = 0; u < units2; ++u) {
            const int64_t n = u / rblocks, r0 = (u % rblocks) * rb;
            const int64_t r1 = r0 + rb < rows ? r0 + rb : rows;
            float y[LP_TILE];
            for (int64_t r = r0; r < r1; r += per) {
                const int64_t rn = r1 - r < per ? r1 - r : per;
                const int64_t at = (n * rows + r) * cols;
                const uint32_t *src = in + at;
                if (a != NULL) {
                    affine_rows((const float *)src, a, b, y, rn, cols);
                    src = (const uint32_t *)y;
                }
                t2(src, out + at, rn * cols, (uint32_t)(n * cols * rows + r), (uint32_t)rows, k0,
                   k1, &inv);
            }
        }
        return;
    }
    const int64_t units = batch * rows;
    const int nt = lp_threads_over(units * cols, units, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
    for (int64_t u = 0; u < units; ++u) {
        const int64_t n = u / rows, r = u % rows;
        const uint32_t lo = (uint32_t)(n * cols * rows + r);
        float y[LP_TILE];
        for (int64_t c0 = 0; c0 < cols; c0 += LP_TILE) {
            const int64_t len = cols - c0 < LP_TILE ? cols - c0 : LP_TILE;
            const uint32_t *src = in + u * cols + c0;
            if (a != NULL) {
                affine_rows((const float *)src, a + c0, b + c0, y, 1, len);
                src = (const uint32_t *)y;
            }
            t(src, out + u * cols + c0, len, lo + (uint32_t)(c0 * rows), (uint32_t)rows, k0, k1,
              &inv);
        }
    }
}

void lp_quantize_f32_bt(const uint32_t *in, uint32_t *out, int64_t batch, int64_t rows,
                        int64_t cols, const lp_params *p, int nthreads) {
    bt_tiles(in, out, batch, rows, cols, p, nthreads, NULL, NULL);
}

/* A batch norm's channels-last output rounded stochastically as it is computed: y = x * a[c] +
 * b[c] (lp_affine_round's fused multiply-add) over x laid out as lp_quantize_f32_bt's input
 * (batch, rows = H * W, cols = C), rounded with each value's logical counter, tile by tile in
 * cache: lp_quantize_f32_bt's bits for addcmul's output, in one pass instead of two. Stochastic
 * rounding only (returns -1, writing nothing, for another mode: a deterministic rounding needs
 * no logical order and takes lp_affine_round). */
int lp_affine_round_bt(const float *x, const float *a, const float *b, float *out, int64_t batch,
                       int64_t rows, int64_t cols, const lp_params *p, int nthreads) {
    const loop_fn lf = loop_for(p);
    if (lf != loop_sr && lf != loop_sr_fixed)
        return -1;
    bt_tiles((const uint32_t *)x, (uint32_t *)out, batch, rows, cols, p, nthreads, a, b);
    return 0;
}

/* lp_quantize_f32 and the count of non-finite values (Inf, NaN) it wrote: chunks of
 * LP_NF_CHUNK values rounded, then scanned while they are in L1. One pass over memory where
 * rounding a step's gradients and torch's fused check (_amp_foreach_non_finite_check_and_unscale_)
 * took two (the emulated step's gradient check, training/precision.py). */
#define LP_NF_CHUNK 2048
LP_CLONES static int64_t count_nonfinite(const uint32_t *x, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i) c += (x[i] & 0x7f800000u) == 0x7f800000u;
    return c;
}

int64_t lp_quantize_f32_nonfinite(const uint32_t *in, uint32_t *out, int64_t n,
                                  const lp_params *p, int nthreads) {
    const int nt = lp_threads_for(n, nthreads);
    /* thread shares in whole chunks; each chunk's random counters are its logical indices */
    const int64_t per = ((n + nt - 1) / nt + LP_NF_CHUNK - 1) / LP_NF_CHUNK * LP_NF_CHUNK;
    int64_t total = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : total) if (nt > 1)
#endif
    for (int t = 0; t < nt; ++t) {
        const int64_t b = t * per < n ? t * per : n, e = (t + 1) * per < n ? (t + 1) * per : n;
        for (int64_t c0 = b; c0 < e; c0 += LP_NF_CHUNK) {
            const int64_t len = e - c0 < LP_NF_CHUNK ? e - c0 : LP_NF_CHUNK;
            run_at(in + c0, out + c0, len, (uint64_t)c0, p);
            total += count_nonfinite(out + c0, len);
        }
    }
    return total;
}

/* Public entry points (called through ctypes). in may equal out. */
void lp_quantize_f32(const uint32_t *in, uint32_t *out, int64_t n, const lp_params *p,
                     int nthreads) {
    lp_job base = {run_range_job, in, out, 0, n, 0, 0, NULL, p};
    run_parallel(base, n, 1, nthreads);
}
