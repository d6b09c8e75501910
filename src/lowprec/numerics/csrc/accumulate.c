/*
 * accumulate.c: sums of products in a given order and rounding: the GEMM with a rounded
 * accumulator (lp_gemm_acc, lowprec.numerics.accumulation) and the reference-order dot products
 * of torch's 16-bit CPU kernels (lp_dot4, lowprec.numerics.summation).
 *
 * GEMM with a rounded accumulator:
 * C[b,i,j] = sum_k A[b,i,k] * B[b,k,j] where every product and every partial sum is rounded onto
 * the accumulator format, in one of three orders:
 *   sequential  acc = p0; acc = R(acc + p_l) for l = 1..K-1
 *   pairwise    a tree of adjacent pairs, level by level; an odd last element moves up as is
 *   chunked     sequential inside chunks of `chunk` terms; chunk c is then added into a wide
 *               accumulator W = chunk_0; W = RN_wide(W + chunk_c) (the "promotion")
 * with p_l = R(A[i,l] * B[l,j]). Each operation is computed in float64 and then rounded once:
 * the product of two float32 values is exact in float64, the sum of two accumulator values is
 * exact or (exponents over 29 apart) within 2**-53 relative, and for nearest rounding rounding
 * that float64 sum equals rounding the exact sum (53 >= 2 * 24 + 2: double rounding is
 * innocuous). R is the accumulator's rounding (any mode); promotions round to nearest even.
 *
 * The rounding of a float64 value is quantize_one's integer algorithm widened to a 53-bit
 * significand and a 64-bit fraction: on a float32 input it gives quantize's bits (the tests
 * check both this and a float64 Python reference). Stochastic rounding uses 32 random bits from
 * a counter-based hash of (seed, output element index, step), the step numbering the roundings
 * of one output: product l is step l, the addition that brings in term l (sequential, chunked)
 * is step K + l - 1, the pairwise tree's additions are steps K, K+1, ... in level order.
 */

#include "lp_common.h"

/* memcpy, not a union: GCC turns it into a register move that the vectorizer understands */
LP_INLINE uint64_t d2u(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }
LP_INLINE double u2d(uint64_t u) { double d; memcpy(&d, &u, 8); return d; }

typedef struct {
    int32_t man;          /* mantissa bits (0 for fixed point) */
    int32_t emin;         /* unbiased exponent of the smallest normal (huge for fixed point) */
    int32_t qsub;         /* quantum exponent below the normal range */
    int32_t overflow;     /* OV_INF, OV_NAN, OV_SAT */
    int32_t signed_zero;
    int32_t rounding;     /* R_* (the accumulator's; promotions always round to nearest even) */
    float maxpos, maxneg; /* largest positive value, magnitude of the most negative */
    uint32_t rmask, k0, k1;
} lp_acc_fmt;

typedef struct {
    int64_t batch, M, N, K;
    int64_t sa_b, sa_m, sa_k; /* element strides of A (batch, row, reduction) */
    int64_t sb_b, sb_k, sb_n; /* element strides of B (batch, reduction, column); sb_n == 1 */
    int32_t order;            /* 0 sequential, 1 pairwise, 2 chunked */
    int32_t chunk;
} lp_acc_gemm;

/* Loop invariants of a format, every field 64 bits wide so that a lane is one uint64. */
typedef struct {
    int64_t man, emin, qsub;
    uint64_t maxpos, maxneg; /* float64 bits of the limits */
    uint64_t special;        /* float64 bits of what an overflow becomes (Inf, NaN) */
    uint64_t saturate, signed_zero, rmask; /* masks */
    /* the fast path (float formats, values in the normal range, no overflow): round the float64
     * pattern at bit fshift = 52 - man by an integer add and a mask, as quantize's fast path */
    int32_t fast;
    uint64_t fshift, fmask, fhalf, bemin;
    uint64_t fodd; /* 1 when man == 0: the kept significand is the implicit 1, always odd */
} lp_acc_inv;

LP_INLINE uint64_t m64(int c) { return (uint64_t)0 - (uint64_t)(c != 0); }
LP_INLINE uint64_t sel64(uint64_t m, uint64_t a, uint64_t b) { return (a & m) | (b & ~m); }

static lp_acc_inv acc_inv(const lp_acc_fmt *p) {
    lp_acc_inv v;
    v.man = p->man;
    v.emin = p->emin;
    v.qsub = p->qsub;
    v.maxpos = d2u((double)p->maxpos);
    v.maxneg = d2u((double)p->maxneg);
    v.special = p->overflow == OV_INF ? 0x7ff0000000000000ull : 0x7ff8000000000000ull;
    v.saturate = m64(p->overflow == OV_SAT);
    v.signed_zero = m64(p->signed_zero);
    v.rmask = p->rmask;
    v.fast = p->emin < (1 << 19); /* a float format (fixed point has a huge emin) */
    v.fshift = (uint64_t)(52 - p->man);
    v.fmask = (1ull << v.fshift) - 1ull;
    v.fhalf = (1ull << (v.fshift - 1)) - 1ull;
    v.bemin = (uint64_t)(int64_t)(v.fast ? p->emin + 1023 : 0);
    /* with no mantissa bit, bit fshift of the pattern is the exponent's lsb, not k's: a tie
     * must round up in magnitude, as round_f64 does (the e3m0 lesson of make_inv) */
    v.fodd = (uint64_t)(p->man == 0);
    return v;
}

/* x rounded onto the format: quantize_one for a float64 input (see the file comment), written
 * branch-free with 64-bit lanes so that the column loops vectorize (AVX2: vpsrlvq, vpsllvq). */
LP_INLINE double round_f64(double x, uint32_t r, const lp_acc_inv *p, const int mode) {
    const uint64_t u = d2u(x);
    const uint64_t sign = u & 0x8000000000000000ull;
    const uint64_t mneg = (uint64_t)((int64_t)u >> 63);
    const uint64_t a = u & 0x7fffffffffffffffull;
    const int64_t field = (int64_t)(a >> 52);
    const int64_t ef = field | (int64_t)(field == 0); /* 0 only for zero: M = 0 then */
    const int64_t qe = (int64_t)sel64(m64(field - 1023 >= p->emin), (uint64_t)(field - 1023 - p->man),
                                      (uint64_t)p->qsub);
    const int64_t s = qe - ef + 1075; /* bits of M below the target quantum */
    const uint64_t M = (a & 0xfffffffffffffull) | ((uint64_t)(field > 0) << 52);
    const int64_t sl = s < 1 ? 1 : (s > 63 ? 63 : s);
    const int64_t sb = s - 64 < 0 ? 0 : (s - 64 > 63 ? 63 : s - 64);
    const uint64_t mbig = m64(s >= 64);
    const uint64_t k = ~mbig & (M >> sl);
    const uint64_t rem = sel64(mbig, M, M - ((M >> sl) << sl)); /* not a (1 << sl) - 1 mask:
                                                          GCC narrows that shift and gives up */
    const uint64_t T = sel64(mbig, M >> sb, rem << (64 - sl)); /* fraction of the quantum, 0.64 */
    uint64_t up;
    if (mode == R_STOCHASTIC) { /* carry out of the 32-bit fraction plus the random bits, cut to r */
        const uint64_t tm = (T >> 32) & p->rmask, rm = (uint64_t)r & p->rmask;
        up = (tm + rm) >> 32;
    } else {
        up = lp_up64(mode, T, k, (uint64_t)(rem != 0), mneg);
    }
    /* (k + up) * 2**qe: k + up < 2**53, converted exactly by the 2**52 trick (AVX2 has no
     * int64 -> double conversion); 2**qe is a normal double (qe >= -149 - 23) */
    const double kd = u2d(0x4330000000000000ull | (k + up)) - 0x1p52;
    uint64_t v = d2u(kd * u2d((uint64_t)(qe + 1023) << 52));
    v = sel64(m64(s <= 0), a, v); /* already on the grid */
    const uint64_t lim = sel64(mneg, p->maxneg, p->maxpos);
    const uint64_t tz = (uint64_t)lp_tz(mode, (int64_t)mneg); /* went toward zero */
    const uint64_t special = sel64(p->saturate, lim, p->special);
    /* non-negative float64 patterns order as the values: a signed compare (vpcmpgtq) */
    v = sel64(m64((int64_t)v > (int64_t)lim), sel64(tz, lim, special), v);
    v = sel64(m64(a == 0x7ff0000000000000ull), special, v); /* +-Inf in */
    uint64_t res = v | sign;
    res &= ~(m64(v == 0) & ~p->signed_zero);
    return u2d(sel64(m64(a > 0x7ff0000000000000ull), u, res)); /* NaN passes through */
}

/* y = x rounded, for the nb lanes of a tile. Nearest-even and stochastic rounding first try the
 * fast path on every lane; if a lane is zero-adjacent (below the normal range), overflows, or is
 * not finite, the whole tile goes through round_f64 instead. Both give the same bits.
 * Stochastic: the carry of (top 32 fraction bits + r) is the carry of adding r, aligned to the
 * fraction's top, to the pattern (r's bits are multiples of the masked-off unit either way). */
/* The fast path for one value: nearest-even or stochastic rounding of a float64 value that is
 * zero or in the format's normal range and stays within range; *bad collects the lanes where
 * that does not hold (their result is then recomputed by round_f64). */
LP_INLINE double round_fast(double x, uint32_t r32, const lp_acc_inv *p, const int mode,
                            uint64_t *bad) {
    const uint64_t u = d2u(x);
    const uint64_t sign = u & 0x8000000000000000ull, a = u & 0x7fffffffffffffffull;
    const uint64_t fs = p->fshift;
    uint64_t add;
    if (mode == R_NEAREST_EVEN) {
        add = p->fhalf + (((a >> fs) | p->fodd) & 1ull);
    } else {
        const uint64_t r = (uint64_t)r32 & p->rmask;
        add = fs >= 32 ? r << (fs - 32) : r >> (32 - fs);
    }
    const uint64_t rf = (a + add) & ~p->fmask;
    const uint64_t lim = sign ? p->maxneg : p->maxpos;
    *bad |= (uint64_t)(((a >> 52) < p->bemin) & (a != 0)) | (uint64_t)((int64_t)rf > (int64_t)lim);
    uint64_t res = rf | sign;
    res &= ~(m64(rf == 0) & ~p->signed_zero);
    return u2d(res);
}

/* y = x rounded, for the nb lanes of a tile: the fast path on every lane first (nearest-even and
 * stochastic rounding of float formats), round_f64 for the whole tile if a lane left it. Both
 * give the same bits. Stochastic: the carry of (top 32 fraction bits + r) is the carry of adding
 * r, aligned to the fraction's top, to the pattern (r's bits are multiples of the masked-off
 * unit either way, so cutting both to the random bits changes nothing). */
LP_INLINE void round_tile(const double *x, double *y, const uint32_t *rnd, int64_t nb,
                          const lp_acc_inv *p, const int mode) {
    if ((mode == R_NEAREST_EVEN || mode == R_STOCHASTIC) && p->fast) {
        uint64_t bad = 0;
        for (int64_t j = 0; j < nb; ++j) y[j] = round_fast(x[j], rnd[j], p, mode, &bad);
        if (!bad) return;
    }
    for (int64_t j = 0; j < nb; ++j) y[j] = round_f64(x[j], rnd[j], p, mode);
}

LP_INLINE uint32_t acc_step_key(uint32_t step) { return mix32(step + 0x9e3779b9u); }

/* Column tile width: the lanes every rounding runs across. */
#define LP_ACC_NB 256

/* One tile of columns [j0, j0 + nb) of one output row. */
LP_INLINE void acc_tile(const float *arow, int64_t sa_k, const float *bcol, int64_t sb_k,
                        float *crow, int64_t nb, int64_t K, const lp_acc_gemm *g,
                        const lp_acc_inv *p, const lp_acc_inv *w, uint32_t k0, uint32_t k1,
                        uint64_t e0, double *buf, const int mode) {
    const lp_acc_inv P = *p, W = *w;
    double accb[LP_ACC_NB], wide[LP_ACC_NB], prodb[LP_ACC_NB], raw[LP_ACC_NB];
    double *acc = accb, *prod = prodb;
    uint32_t base[LP_ACC_NB], rnd[LP_ACC_NB], rnd2[LP_ACC_NB];
    uint64_t flag[LP_ACC_NB];
    if (mode == R_STOCHASTIC) {
        for (int64_t j = 0; j < nb; ++j) {
            const uint64_t e = e0 + (uint64_t)j;
            base[j] = mix32(mix32((uint32_t)e ^ k0) + (k1 ^ mix32((uint32_t)(e >> 32))));
        }
    }
    for (int64_t j = 0; j < nb; ++j) rnd[j] = rnd2[j] = 0;
    if (g->order == 1) { /* pairwise: all products, then the tree */
        for (int64_t l = 0; l < K; ++l) {
            const double al = (double)arow[l * sa_k];
            const float *bl = bcol + l * sb_k;
            double *pl = buf + l * LP_ACC_NB;
            if (mode == R_STOCHASTIC) {
                const uint32_t sk = acc_step_key((uint32_t)l);
                for (int64_t j = 0; j < nb; ++j) rnd[j] = mix32(base[j] ^ sk);
            }
            for (int64_t j = 0; j < nb; ++j) raw[j] = al * (double)bl[j];
            round_tile(raw, pl, rnd, nb, &P, mode);
        }
        int64_t n = K;
        uint32_t step = (uint32_t)K;
        while (n > 1) {
            for (int64_t i = 0; i < n / 2; ++i, ++step) {
                const double *x0 = buf + 2 * i * LP_ACC_NB, *x1 = x0 + LP_ACC_NB;
                double *y = buf + i * LP_ACC_NB;
                if (mode == R_STOCHASTIC) {
                    const uint32_t sk = acc_step_key(step);
                    for (int64_t j = 0; j < nb; ++j) rnd[j] = mix32(base[j] ^ sk);
                }
                for (int64_t j = 0; j < nb; ++j) raw[j] = x0[j] + x1[j];
                round_tile(raw, y, rnd, nb, &P, mode);
            }
            if (n & 1)
                for (int64_t j = 0; j < nb; ++j) buf[(n / 2) * LP_ACC_NB + j] = buf[(n - 1) * LP_ACC_NB + j];
            n = (n + 1) / 2;
        }
        for (int64_t j = 0; j < nb; ++j) crow[j] = (float)buf[j];
        return;
    }
    const int64_t chunk = g->order == 2 ? g->chunk : K;
    for (int64_t c0 = 0; c0 < K; c0 += chunk) {
        const int64_t c1 = c0 + chunk < K ? c0 + chunk : K;
        for (int64_t l = c0; l < c1; ++l) {
            const double al = (double)arow[l * sa_k];
            const float *bl = bcol + l * sb_k;
            uint32_t sa = 0;
            if (mode == R_STOCHASTIC) {
                const uint32_t sk = acc_step_key((uint32_t)l);
                sa = acc_step_key((uint32_t)(K + l - 1));
                for (int64_t j = 0; j < nb; ++j) rnd[j] = mix32(base[j] ^ sk);
            }
            if (l == c0) { /* a chunk starts at its first product */
                for (int64_t j = 0; j < nb; ++j) raw[j] = al * (double)bl[j];
                round_tile(raw, acc, rnd, nb, &P, mode);
                continue;
            }
            if (mode == R_STOCHASTIC)
                for (int64_t j = 0; j < nb; ++j) rnd2[j] = mix32(base[j] ^ sa);
            if ((mode == R_NEAREST_EVEN || mode == R_STOCHASTIC) && P.fast) {
                /* product and addition fused on the fast path, into prod; kept only when every
                 * lane stayed on it (else the step is redone below from acc) */
                uint64_t bad = 0;
                for (int64_t j = 0; j < nb; ++j) {
                    uint64_t lane = 0;
                    const double pj = round_fast(al * (double)bl[j], rnd[j], &P, mode, &lane);
                    prod[j] = round_fast(acc[j] + pj, rnd2[j], &P, mode, &lane);
                    flag[j] = lane;
                    bad |= lane;
                }
                if (bad) /* only the lanes that left the fast path, on the general path */
                    for (int64_t j = 0; j < nb; ++j)
                        if (flag[j]) {
                            const double pj = round_f64(al * (double)bl[j], rnd[j], &P, mode);
                            prod[j] = round_f64(acc[j] + pj, rnd2[j], &P, mode);
                        }
                double *t = acc;
                acc = prod;
                prod = t;
                continue;
            }
            for (int64_t j = 0; j < nb; ++j) prod[j] = round_f64(al * (double)bl[j], rnd[j], &P, mode);
            for (int64_t j = 0; j < nb; ++j) acc[j] = round_f64(acc[j] + prod[j], rnd2[j], &P, mode);
        }
        if (c0 == 0) {
            for (int64_t j = 0; j < nb; ++j) wide[j] = acc[j];
        } else {
            for (int64_t j = 0; j < nb; ++j) raw[j] = wide[j] + acc[j];
            round_tile(raw, wide, rnd, nb, &W, R_NEAREST_EVEN);
        }
    }
    for (int64_t j = 0; j < nb; ++j) crow[j] = (float)wide[j];
}

#define LP_ACC_DEFINE(NAME, MODE)                                                                 \
    LP_CLONES static void NAME(const float *A, const float *B, float *C, const lp_acc_gemm *g,     \
                               const lp_acc_fmt *p, const lp_acc_fmt *w, int64_t r0, int64_t r1,   \
                               double *buf) {                                                      \
        const lp_acc_inv pi = acc_inv(p), wi = acc_inv(w);                                         \
        for (int64_t r = r0; r < r1; ++r) {                                                        \
            const int64_t b = r / g->M, i = r % g->M;                                              \
            const float *arow = A + b * g->sa_b + i * g->sa_m;                                     \
            for (int64_t j0 = 0; j0 < g->N; j0 += LP_ACC_NB) {                                     \
                const int64_t nb = g->N - j0 < LP_ACC_NB ? g->N - j0 : LP_ACC_NB;                  \
                acc_tile(arow, g->sa_k, B + b * g->sb_b + j0, g->sb_k, C + r * g->N + j0, nb,      \
                         g->K, g, &pi, &wi, p->k0, p->k1, (uint64_t)r * (uint64_t)g->N + (uint64_t)j0, buf, MODE);   \
            }                                                                                      \
        }                                                                                          \
    }

#define LP_ACC_OF(SUFFIX, MODE) LP_ACC_DEFINE(acc_rows_##SUFFIX, MODE)
LP_DETERMINISTIC_MODES(LP_ACC_OF)
LP_ACC_DEFINE(acc_rows_sr, R_STOCHASTIC)

/* ---- float32 lanes: nearest rounding onto a format of at most 11 significant bits ----------
 * When every element of A and B has at most 12 significant bits (the low 12 bits of its float32
 * pattern are zero: fp16 or bf16 values, say), a product is exact in float32; and the sum of two
 * values of a format with p <= 11 significant bits, rounded to float32 (24 >= 2p + 2) and then to
 * the format, is the correctly rounded sum: double rounding is innocuous (S. A. Figueroa, "When is
 * double rounding innocuous?", SIGNUM 1995). So nearest rounding can run on 8 float32 lanes with
 * the same bits as the float64 path. Lanes outside the format's normal range (zero excepted),
 * overflowing, or not finite, send the step back to the float64 path, as the fast path does. */
typedef struct {
    uint32_t fshift, fmask, fhalf, fodd;
    int32_t minb, hi; /* bits of the smallest normal; largest pattern that does not overflow */
} lp_acc_inv32;

static lp_acc_inv32 acc_inv32(const lp_acc_fmt *p) {
    lp_acc_inv32 v;
    v.fshift = (uint32_t)(23 - p->man);
    v.fmask = (1u << v.fshift) - 1u;
    v.fhalf = (1u << (v.fshift - 1)) - 1u;
    v.fodd = (uint32_t)(p->man == 0);
    v.minb = (int32_t)((uint32_t)(p->emin + 127) << 23);
    /* a rounds above lim iff a + fhalf + lsb(a) reaches lim + 2**fshift; in [lim, lim + 2**fshift)
     * a has lim's lsb, so: a >= lim + 2**(fshift-1) when that lsb is 1 (the tie goes up), else
     * a > lim + 2**(fshift-1) */
    const uint32_t lim = f2u(p->maxpos);
    const uint32_t lsb = ((lim >> v.fshift) | v.fodd) & 1u;
    v.hi = (int32_t)(lim + (1u << (v.fshift - 1)) - lsb);
    return v;
}

/* the conditions of the float32 lanes that depend on the format and the mode only */
static int acc_f32_format(const lp_acc_fmt *p, const lp_acc_gemm *g) {
    return p->rounding == R_NEAREST_EVEN && g->order != 1 && p->emin < (1 << 19) && p->man <= 10 &&
           p->signed_zero && p->emin >= -126 && p->maxpos == p->maxneg;
}

LP_INLINE float round_fast32(float x, const lp_acc_inv32 *p, uint32_t *bad) {
    const uint32_t u = f2u(x);
    const uint32_t sign = u & 0x80000000u, a = u & 0x7fffffffu;
    const uint32_t rf = (a + p->fhalf + (((a >> p->fshift) | p->fodd) & 1u)) & ~p->fmask;
    /* a < 2**31: signed compares; NaN and Inf patterns lie above hi */
    const int32_t sa = (int32_t)a;
    *bad |= (uint32_t)((sa < p->minb) & (sa != 0)) | (uint32_t)(sa > p->hi);
    return u2f(rf | sign);
}

LP_INLINE void acc_tile_f32(const float *arow, int64_t sa_k, const float *bcol, int64_t sb_k,
                            float *crow, int64_t nb, int64_t K, int64_t chunk,
                            const lp_acc_inv *P, const lp_acc_inv32 *Q, const lp_acc_inv *W) {
    float accb[LP_ACC_NB], prodb[LP_ACC_NB];
    float *acc = accb, *prod = prodb;
    double wide[LP_ACC_NB], raw[LP_ACC_NB];
    uint32_t zero[LP_ACC_NB], flag[LP_ACC_NB];
    for (int64_t j = 0; j < nb; ++j) zero[j] = 0;
    for (int64_t c0 = 0; c0 < K; c0 += chunk) {
        const int64_t c1 = c0 + chunk < K ? c0 + chunk : K;
        for (int64_t l = c0; l < c1; ++l) {
            const float al = arow[l * sa_k];
            const float *bl = bcol + l * sb_k;
            uint32_t bad = 0;
            if (l == c0) {
                for (int64_t j = 0; j < nb; ++j) acc[j] = round_fast32(al * bl[j], Q, &bad);
                if (bad)
                    for (int64_t j = 0; j < nb; ++j)
                        acc[j] = (float)round_f64((double)al * (double)bl[j], 0, P, R_NEAREST_EVEN);
                continue;
            }
            for (int64_t j = 0; j < nb; ++j) {
                uint32_t lane = 0;
                const float pj = round_fast32(al * bl[j], Q, &lane);
                prod[j] = round_fast32(acc[j] + pj, Q, &lane);
                flag[j] = lane;
                bad |= lane;
            }
            if (bad) /* only the lanes that left the fast path, on the float64 path */
                for (int64_t j = 0; j < nb; ++j)
                    if (flag[j]) {
                        const double pj = round_f64((double)al * (double)bl[j], 0, P, R_NEAREST_EVEN);
                        prod[j] = (float)round_f64((double)acc[j] + pj, 0, P, R_NEAREST_EVEN);
                    }
            float *t = acc;
            acc = prod;
            prod = t;
        }
        if (c0 == 0) {
            for (int64_t j = 0; j < nb; ++j) wide[j] = (double)acc[j];
        } else {
            for (int64_t j = 0; j < nb; ++j) raw[j] = wide[j] + (double)acc[j];
            round_tile(raw, wide, zero, nb, W, R_NEAREST_EVEN);
        }
    }
    for (int64_t j = 0; j < nb; ++j) crow[j] = (float)wide[j];
}

LP_CLONES static void acc_rows_f32(const float *A, const float *B, float *C, const lp_acc_gemm *g,
                                   const lp_acc_fmt *p, const lp_acc_fmt *w, int64_t r0,
                                   int64_t r1, double *buf) {
    (void)buf;
    const lp_acc_inv pi = acc_inv(p), wi = acc_inv(w);
    const lp_acc_inv32 qi = acc_inv32(p);
    const int64_t chunk = g->order == 2 ? g->chunk : g->K;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / g->M, i = r % g->M;
        const float *arow = A + b * g->sa_b + i * g->sa_m;
        for (int64_t j0 = 0; j0 < g->N; j0 += LP_ACC_NB) {
            const int64_t nb = g->N - j0 < LP_ACC_NB ? g->N - j0 : LP_ACC_NB;
            acc_tile_f32(arow, g->sa_k, B + b * g->sb_b + j0, g->sb_k, C + r * g->N + j0, nb, g->K,
                         chunk, &pi, &qi, &wi);
        }
    }
}

/* every element's float32 pattern has its low 12 bits clear (at most 12 significant bits) */
static int acc_short_operands(const float *A, const float *B, const lp_acc_gemm *g) {
    uint32_t any = 0;
    for (int64_t b = 0; b < g->batch; ++b)
        for (int64_t i = 0; i < g->M; ++i)
            for (int64_t k = 0; k < g->K; ++k)
                any |= f2u(A[b * g->sa_b + i * g->sa_m + k * g->sa_k]);
    const float *end = B + g->batch * g->sb_b;
    for (const float *x = B; x < end; ++x) any |= f2u(*x);
    return (any & 0xfffu) == 0;
}

/* ---- plain float32: an IEEE fp32 accumulator with nearest rounding -----------------------------
 * A float32 multiplication is the product rounded once to float32, a float32 addition the sum
 * rounded once (gradual underflow, overflow to Inf), which is what round_f64 gives for the fp32
 * format (the float64 sum of two float32 values rounded again to float32 is correctly rounded:
 * 53 >= 2 * 24 + 2). So fp32 accumulation is the plain loop, mul then add (no FMA: the build
 * uses -ffp-contract=off). NaN payloads may differ from the float64 path; NaN stays NaN. */
static int acc_plain32(const lp_acc_fmt *p, const lp_acc_fmt *w, const lp_acc_gemm *g) {
    const int fp32 = p->man == 23 && p->emin == -126 && p->qsub == -149 && p->overflow == OV_INF &&
                     p->signed_zero;
    const int wide32 = w->man == 23 && w->emin == -126 && w->qsub == -149 &&
                       w->overflow == OV_INF && w->signed_zero;
    return fp32 && p->rounding == R_NEAREST_EVEN && g->order != 1 && (g->order == 0 || wide32);
}

LP_CLONES static void acc_rows_plain32(const float *A, const float *B, float *C,
                                       const lp_acc_gemm *g, const lp_acc_fmt *p,
                                       const lp_acc_fmt *w, int64_t r0, int64_t r1, double *buf) {
    (void)buf, (void)p, (void)w;
    const int64_t chunk = g->order == 2 ? g->chunk : g->K;
    float acc[LP_ACC_NB], wide[LP_ACC_NB];
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / g->M, i = r % g->M;
        const float *arow = A + b * g->sa_b + i * g->sa_m;
        for (int64_t j0 = 0; j0 < g->N; j0 += LP_ACC_NB) {
            const int64_t nb = g->N - j0 < LP_ACC_NB ? g->N - j0 : LP_ACC_NB;
            const float *bcol = B + b * g->sb_b + j0;
            for (int64_t c0 = 0; c0 < g->K; c0 += chunk) {
                const int64_t c1 = c0 + chunk < g->K ? c0 + chunk : g->K;
                const float a0 = arow[c0 * g->sa_k];
                for (int64_t j = 0; j < nb; ++j) acc[j] = a0 * bcol[c0 * g->sb_k + j];
                for (int64_t l = c0 + 1; l < c1; ++l) {
                    const float al = arow[l * g->sa_k];
                    const float *bl = bcol + l * g->sb_k;
                    for (int64_t j = 0; j < nb; ++j) acc[j] = acc[j] + al * bl[j];
                }
                if (c0 == 0)
                    for (int64_t j = 0; j < nb; ++j) wide[j] = acc[j];
                else
                    for (int64_t j = 0; j < nb; ++j) wide[j] = wide[j] + acc[j];
            }
            for (int64_t j = 0; j < nb; ++j) C[r * g->N + j0 + j] = wide[j];
        }
    }
}

typedef void (*acc_fn)(const float *, const float *, float *, const lp_acc_gemm *,
                       const lp_acc_fmt *, const lp_acc_fmt *, int64_t, int64_t, double *);

/* Returns 0, or -1 when the pairwise buffer cannot be allocated. */
int lp_gemm_acc(const float *A, const float *B, float *C, const lp_acc_gemm *g,
                const lp_acc_fmt *p, const lp_acc_fmt *w, int nthreads) {
    acc_fn f;
    switch (p->rounding) {
#define LP_ACC_CASE(SUFFIX, MODE) case MODE: f = acc_rows_##SUFFIX; break;
    LP_DETERMINISTIC_MODES(LP_ACC_CASE)
    default: f = acc_rows_sr; break;
    }
    if (acc_plain32(p, w, g)) f = acc_rows_plain32;
    else if (acc_f32_format(p, g) && acc_short_operands(A, B, g)) f = acc_rows_f32;
    const int64_t rows = g->batch * g->M;
    int nt = (int)(rows * g->N * g->K / LP_MIN_PER_THREAD);
    if (nt > nthreads) nt = nthreads;
    if (nt > rows) nt = (int)rows;
    if (nt < 1) nt = 1;
#ifndef _OPENMP
    nt = 1;
#endif
    const size_t bufsize = g->order == 1 ? (size_t)g->K * LP_ACC_NB * sizeof(double) : 0;
    int failed = 0;
    const int64_t per = (rows + nt - 1) / nt;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
#endif
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        const int64_t b = t * per < rows ? t * per : rows;
        const int64_t e = (t + 1) * per < rows ? (t + 1) * per : rows;
        double *buf = bufsize ? (double *)malloc(bufsize) : NULL;
        if (bufsize && !buf) failed = 1;
        else if (b < e) f(A, B, C, g, p, w, b, e, buf);
        free(buf);
    }
    return failed ? -1 : 0;
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

/* Per-channel sums of a (rows, C) float32 array in the order of ATen's channels-last batch-norm
 * statistics for a 16-bit input (batch_norm_cpu_collect_stats_channels_last_internal in
 * aten/src/ATen/native/cpu/batch_norm_kernel.cpp, the path N > threads): at::parallel_for over
 * `parts` threads gives chunk t the rows [t*ceil(rows/parts), ...); each chunk is summed row by
 * row into a float32 partial from zero, the partials then added in chunk order from zero. With
 * `mean`, the terms are the squared deviations, fmaf(d, d, partial) with d = x - mean[c]: the
 * kernel's `var += (x - mean) * (x - mean)` contracted to a fused multiply-add, as torch 2.13's
 * kernel computes it (measured on its fp32-statistics instantiation, AMD EPYC with
 * AVX512-BF16: 217 of 217 1/std with fmaf, 185 with a product and a sum). The chunks run on
 * up to `nthreads` threads; the order depends on `parts` only (parts >= 1; `buf` parts * C floats of
 * scratch for the partials). */
LP_OPT_CLONES static void channel_chunk(const float *x, int64_t r0, int64_t r1, int64_t C,
                                        const float *mean, float *acc) {
    for (int64_t c = 0; c < C; ++c) acc[c] = 0.0f;
    if (mean == NULL) {
        for (int64_t i = r0; i < r1; ++i) {
            const float *row = x + i * C;
            for (int64_t c = 0; c < C; ++c) acc[c] = acc[c] + row[c];
        }
    } else {
        for (int64_t i = r0; i < r1; ++i) {
            const float *row = x + i * C;
            for (int64_t c = 0; c < C; ++c) {
                const float d = row[c] - mean[c];
                acc[c] = fmaf(d, d, acc[c]);
            }
        }
    }
}

void lp_channel_sums(const float *x, int64_t rows, int64_t C, const float *mean, int64_t parts,
                     float *buf, float *out, int nthreads) {
    /* buf: parts * C floats of scratch, the chunks' partials */
    const int64_t chunk = (rows + parts - 1) / parts;
    const int nt = lp_threads_over(rows * C, parts, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t t = 0; t < parts; ++t) {
        const int64_t r0 = t * chunk < rows ? t * chunk : rows;
        const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
        channel_chunk(x, r0, r1, C, mean, buf + t * C);
    }
    for (int64_t c = 0; c < C; ++c) {
        float s = 0.0f;
        for (int64_t t = 0; t < parts; ++t) s = s + buf[t * C + c];
        out[c] = s;
    }
}

/* Per-channel sums of a contiguous (batch, C, HW) float32 array in the order of ATen's
 * contiguous batch-norm statistics for a 16-bit input (batch_norm_cpu_collect_stats_
 * contiguous_internal): for each sample, each run of 2 * lanes values of the channel's plane
 * goes into `lanes` float32 partials (its first `lanes` values, then its next `lanes`), the
 * plane's last HW % (2 * lanes) values into a scalar sum, sample after sample; the scalar sum
 * then adds the partials folded in lane order ((p0 + p1) + p2 ...). `lanes`: the kernel's
 * Vectorized<float> width (8: measured, lowprec/training/emulation/kernels.py _plane_sums).
 * With `mean`, the terms are (x - mean[c]) squared, each added as a product and a sum (not
 * contracted: measured too). Channels over up to `nthreads` threads. */
LP_OPT_CLONES static void plane_sum(const float *x, int64_t batch, int64_t C, int64_t hw,
                                    int64_t c, int lanes, const float *mean, float *out) {
    float acc[32] = {0.0f}; /* lanes <= 32 (lp_plane_sums) */
    float s = 0.0f;
    const int64_t step = 2 * (int64_t)lanes, body = hw - hw % step;
    const float m = mean == NULL ? 0.0f : mean[c];
    for (int64_t n = 0; n < batch; ++n) {
        const float *p = x + (n * C + c) * hw;
        if (mean == NULL) {
            for (int64_t d = 0; d < body; d += step) {
                for (int l = 0; l < lanes; ++l) acc[l] = acc[l] + p[d + l];
                for (int l = 0; l < lanes; ++l) acc[l] = acc[l] + p[d + lanes + l];
            }
            for (int64_t d = body; d < hw; ++d) s = s + p[d];
        } else {
            for (int64_t d = 0; d < body; d += step) {
                for (int l = 0; l < lanes; ++l) {
                    const float v = p[d + l] - m;
                    acc[l] = acc[l] + v * v;
                }
                for (int l = 0; l < lanes; ++l) {
                    const float v = p[d + lanes + l] - m;
                    acc[l] = acc[l] + v * v;
                }
            }
            for (int64_t d = body; d < hw; ++d) {
                const float v = p[d] - m;
                s = s + v * v;
            }
        }
    }
    float r = acc[0];
    for (int l = 1; l < lanes; ++l) r = r + acc[l];
    out[c] = s + r;
}

void lp_plane_sums(const float *x, int64_t batch, int64_t C, int64_t hw, int lanes,
                   const float *mean, float *out, int nthreads) {
    if (lanes < 1) lanes = 1;
    if (lanes > 32) lanes = 32;
    const int nt = lp_threads_over(batch * C * hw, C, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t c = 0; c < C; ++c) plane_sum(x, batch, C, hw, c, lanes, mean, out);
}
