/*
 * recurrent.c: the fused LSTM cell (lp_lstm_*), the 16-bit sum of two gradients
 * (lp_round_add2), one arrival at a 16-bit sum of gradients (lp_round_sum_delta), an
 * embedding's 16-bit gradient sums (lp_index_add_rounded) and a batch norm's output rounded
 * (lp_affine_round), every operation rounded by quantize.c's run_range.
 */
#include "lp_common.h"

/* The 16-bit sums below, tile by tile of LP_ADD_TILE values, the tiles over the threads: the
 * statements given last run with S the tile's first value and LEN its length. */
#define LP_ADD_TILE 2048
#define LP_OVER_TILES(N, NTHREADS, S, LEN, ...)                                                   \
    do {                                                                                          \
        const int nt_ = lp_threads_for(N, NTHREADS);                                              \
        const int64_t tiles_ = (N + LP_ADD_TILE - 1) / LP_ADD_TILE;                               \
        _Pragma("omp parallel for num_threads(nt_) schedule(static) if (nt_ > 1)")                \
        for (int64_t t_ = 0; t_ < tiles_; ++t_) {                                                 \
            const int64_t S = t_ * LP_ADD_TILE, LEN = N - S < LP_ADD_TILE ? N - S : LP_ADD_TILE;  \
            __VA_ARGS__                                                                           \
        }                                                                                         \
    } while (0)

/* out = rnd(rnd(a) + rnd(b)), rounded to `p` (a deterministic mode): one step of a 16-bit sum
 * of gradients (autograd adding a 16-bit tensor's uses in its dtype), in one pass. */
void lp_round_add2(const float *a, const float *b, float *out, int64_t n, const lp_params *p,
                   int nthreads) {
    LP_OVER_TILES(n, nthreads, s, len, {
        float u[LP_ADD_TILE], v[LP_ADD_TILE];
        run_range((const uint32_t *)(a + s), (uint32_t *)u, 0, len, p);
        run_range((const uint32_t *)(b + s), (uint32_t *)v, 0, len, p);
        for (int64_t k = 0; k < len; ++k) u[k] = u[k] + v[k];
        run_range((const uint32_t *)u, (uint32_t *)(out + s), 0, len, p);
    });
}

/* One arrival of a gradient at a 16-bit sum (autograd's input buffer adding a tensor's uses in its
 * dtype): u = rnd(g), s = rnd(v + u) with v the running sum (on the grid), delta = s - v (what
 * the engine hands autograd's fp32 sum, which then telescopes to s: GradSum.add in
 * lowprec/training/emulation/autograd_fns.py), s written to `sum` unless it is NULL. One pass
 * for the torch ops' four (round, add, round, subtract), the same float32 operations in their
 * order (v + u, s - v; where both operands are NaN, which one's payload comes out is the
 * compiler's choice here and in torch); `p` a deterministic mode (each tile's counters start at
 * 0), `sum` not `v`. */
void lp_round_sum_delta(const float *g, const float *v, float *delta, float *sum, int64_t n,
                        const lp_params *p, int nthreads) {
    LP_OVER_TILES(n, nthreads, s, len, {
        float u[LP_ADD_TILE];
        const float *vs = v + s;
        run_range((const uint32_t *)(g + s), (uint32_t *)u, 0, len, p);
        for (int64_t k = 0; k < len; ++k) u[k] = vs[k] + u[k];
        run_range((const uint32_t *)u, (uint32_t *)u, 0, len, p);
        if (sum != NULL)
            for (int64_t k = 0; k < len; ++k) sum[s + k] = u[k];
        for (int64_t k = 0; k < len; ++k) delta[s + k] = u[k] - vs[k];
    });
}

/* acc[ids[i]] = rnd(acc[ids[i]] + g[i]) for i = 0 .. n-1 in turn (rows of D values; `p` a
 * deterministic mode): the 16-bit index_add_ of embedding_dense_backward_cpu, each addition
 * rounded, a row's additions in the order of the indices. The columns go over the threads in
 * tiles (each column's additions stay in order); one pass for the torch ops' rank-by-rank loop
 * (lowprec/training/emulation/kernels.py, _embedding_backward). */
#define LP_EMB_COLS 64
void lp_index_add_rounded(float *acc, const int64_t *ids, const float *g, int64_t n, int64_t D,
                          const lp_params *p, int nthreads) {
    const int64_t tiles = (D + LP_EMB_COLS - 1) / LP_EMB_COLS;
    const int nt = lp_threads_over(n * D, tiles, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t c0 = t * LP_EMB_COLS, len = D - c0 < LP_EMB_COLS ? D - c0 : LP_EMB_COLS;
        float u[LP_EMB_COLS];
        for (int64_t i = 0; i < n; ++i) {
            float *a = acc + ids[i] * D + c0;
            const float *x = g + i * D + c0;
            for (int64_t k = 0; k < len; ++k) u[k] = a[k] + x[k];
            run_range((const uint32_t *)u, (uint32_t *)a, 0, len, p);
        }
    }
}

/* ---- A batch norm's output rounded (lp_affine_round) ------------------------------------------
 * y = x * a[c] + b[c] over x's n values in memory order, the channel of value i being
 * (i / inner) % C (inner: the channel dimension's stride of a dense layout: H * W contiguous, 1
 * channels-last or (N, C)), as ATen's CPU addcmul(b, x, a) computes it (its multiply and add
 * contracted to one fused multiply-add: fmaf, one rounding), then rounded to `p` while in
 * cache: the engine's batch-norm replay and its output's rounding in one pass instead of two
 * over a large activation. Stochastic rounding's counters are the memory indices, logical ones
 * where x is contiguous; a channels-last x takes lp_affine_round_bt (quantize.c). */
LP_OPT_CLONES static void affine_tile(const float *x, const float *a, const float *b, float *u,
                                      int64_t s, int64_t len, int64_t C, int64_t inner) {
    int64_t k = 0;
    if (inner == 1) { /* channels-last: runs of channels */
        int64_t c = s % C;
        while (k < len) {
            const int64_t m = C - c < len - k ? C - c : len - k;
            for (int64_t j = 0; j < m; ++j) u[k + j] = fmaf(x[k + j], a[c + j], b[c + j]);
            k += m;
            c = 0;
        }
        return;
    }
    int64_t c = (s / inner) % C, r = s % inner; /* runs of one channel's plane */
    while (k < len) {
        const int64_t m = inner - r < len - k ? inner - r : len - k;
        const float av = a[c], bv = b[c];
        for (int64_t j = 0; j < m; ++j) u[k + j] = fmaf(x[k + j], av, bv);
        k += m;
        r = 0;
        if (++c == C) c = 0;
    }
}

void lp_affine_round(const float *x, const float *a, const float *b, float *out, int64_t n,
                     int64_t C, int64_t inner, const lp_params *p, int nthreads) {
    LP_OVER_TILES(n, nthreads, s, len, {
        float u[LP_ADD_TILE];
        affine_tile(x + s, a, b, u, s, len, C, inner);
        run_at((const uint32_t *)u, (uint32_t *)(out + s), len, (uint64_t)s, p);
    });
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

/* A row's new cell state from its rounded activations A (i, f, g, o) and cell state c:
 * out = rc(rc(f * c) + rc(i * g)). */
LP_INLINE void lp_cell_state(const float *A, const float *cr, float *out, int64_t H,
                          const lp_params *pc) {
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

/* a + b; where both are NaN, the first one's payload (quiet) whatever order the compiler gives
 * the operands: GCC's x86-64-v3 scalar epilogue of the loops below took b's in one and a's in
 * the other, so the step's two forms differed (27 of 262,184 gates on an AMD EPYC). Which NaN
 * survives is each binary's choice: torch's own float32 add took b's on that CPU. */
LP_INLINE float lp_add_nan_first(float a, float b) {
    return a != a ? u2f(f2u(a) | 0x400000u) : a + b;
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
        for (int64_t k = 0; k < N; ++k) g[k] = lp_add_nan_first(g[k], x[k]);
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
        lp_cell_state(A, cr, out, H, pc);
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

/* ---- The whole forward step in one pass, for float16 and bfloat16 ----------------------------
 * sigmoid and tanh of a 16-bit value take one of 65,536 inputs: `tsig` and `ttanh` hold their
 * results for every input (float32 values on the 16-bit grid, indexed by the input's 16 bits),
 * as the caller computes them with torch's own kernels (recurrent_kernels.py: torch's float32
 * sigmoid and tanh rounded once, which equal its native float16 / bfloat16 kernels' on every
 * input). A step is then lp_lstm_gates, the four activations, lp_lstm_fwd and lp_lstm_fwd2 in
 * one pass over each row, in cache: the same bits as those calls with torch's activations.
 * kind 1: float16 (the value's IEEE half bits), 2: bfloat16 (its float32 bits' high half). */

/* The float16 bits of x, a value of the float16 grid (infinities and NaN included). */
LP_INLINE uint32_t lp_half_bits(float x) {
    const uint32_t u = f2u(x), a = u & 0x7fffffffu;
    const uint32_t nrm = (a - (112u << 23)) >> 13;                      /* exponent >= -14 */
    const float small = u2f(a) < 6.103515625e-05f ? u2f(a) : 6.103515625e-05f;
    const uint32_t sub = (uint32_t)(small * 16777216.0f);               /* |x| / 2**-24 */
    const uint32_t inf = 0x7c00u | ((a & 0x7fffffu) ? 0x200u : 0u);     /* inf, NaN */
    uint32_t r = a >= (113u << 23) ? nrm : sub;
    r = a >= 0x7f800000u ? inf : r;
    return ((u >> 16) & 0x8000u) | r;
}

/* x = tab[x's 16 bits], a NaN excepted: it keeps its payload, quiet, as torch's float32 sigmoid
 * (its sign flipped: `flip` the sign bit) and tanh return it. GCC vectorises the index but not
 * the loads (its generic tuning avoids gather instructions), so the AVX2 and AVX-512 versions
 * are written with them (the float16 index by the hardware conversion, exact on the grid):
 * 0.9 -> 0.3 ns a value on an Intel Xeon. */
static void lp_lookup_plain(float *restrict x, int64_t n, const float *restrict tab, int kind,
                            uint32_t flip) {
    for (int64_t k = 0; k < n; ++k) {
        const float v = x[k], y = tab[kind == 1 ? lp_half_bits(v) : f2u(v) >> 16];
        x[k] = v != v ? u2f((f2u(v) ^ flip) | 0x400000u) : y;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LP_GATHER 1

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")))
static void lp_lookup_avx512(float *restrict x, int64_t n, const float *restrict tab, int kind,
                             uint32_t flip) {
    const __m512i quiet = _mm512_set1_epi32(0x400000), fl = _mm512_set1_epi32((int)flip);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m512 v = _mm512_loadu_ps(x + k);
        const __m512i idx = kind == 1
            ? _mm512_cvtepu16_epi32(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
            : _mm512_srli_epi32(_mm512_castps_si512(v), 16);
        const __m512 y = _mm512_i32gather_ps(idx, tab, 4);
        const __m512i nv = _mm512_or_si512(_mm512_xor_si512(_mm512_castps_si512(v), fl), quiet);
        _mm512_storeu_ps(x + k, _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                                   _mm512_castsi512_ps(nv)));
    }
    lp_lookup_plain(x + k, n - k, tab, kind, flip);
}

__attribute__((target("avx2,f16c,fma")))
static void lp_lookup_avx2(float *restrict x, int64_t n, const float *restrict tab, int kind,
                           uint32_t flip) {
    const __m256i quiet = _mm256_set1_epi32(0x400000), fl = _mm256_set1_epi32((int)flip);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        const __m256i idx = kind == 1
            ? _mm256_cvtepu16_epi32(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
            : _mm256_srli_epi32(_mm256_castps_si256(v), 16);
        const __m256 y = _mm256_i32gather_ps(tab, idx, 4);
        const __m256i nv = _mm256_or_si256(_mm256_xor_si256(_mm256_castps_si256(v), fl), quiet);
        _mm256_storeu_ps(x + k, _mm256_blendv_ps(y, _mm256_castsi256_ps(nv),
                                                 _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
    lp_lookup_plain(x + k, n - k, tab, kind, flip);
}
#endif

/* 2: AVX-512, 1: AVX2 (+ F16C), 0: plain C. A -DLP_NO_CLONES build takes what its -march
 * gives (the tests' per-instruction-set builds), others ask the CPU. */
static int lp_lookup_level(void) {
#if !defined(LP_GATHER)
    return 0;
#elif defined(LP_NO_CLONES)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    return 2;
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
#else
    static int level = -1; /* (two threads racing here store the same value) */
    if (level < 0)
        level = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") ? 2
                : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                  __builtin_cpu_supports("fma") ? 1 : 0;
    return level;
#endif
}

static void lp_lookup(float *restrict x, int64_t n, const float *restrict tab, int kind,
                      uint32_t flip) {
#if defined(LP_GATHER)
    const int level = lp_lookup_level();
    if (level == 2) {
        lp_lookup_avx512(x, n, tab, kind, flip);
        return;
    }
    if (level == 1) {
        lp_lookup_avx2(x, n, tab, kind, flip);
        return;
    }
#endif
    lp_lookup_plain(x, n, tab, kind, flip);
}

/* From linear_hh's output `lin` (B x 4H, not rounded), the step's input projection xw (row
 * stride xw_rs) and the cell state c (row stride c_rs): acts = the rounded activations (i, f,
 * g, o), cn = rc(rc(f * c) + rc(i * g)), tc = tanh(cn) (rounded) and h = rc(o * tc). */
LP_OPT_CLONES static void lp_lstm_step_row(const float *lin, const float *x, const float *cr,
                                           const float *tsig, const float *ttanh, int kind,
                                           float *A, float *out, float *t, float *hr, int64_t H,
                                           const lp_params *pc) {
    memcpy(A, lin, (size_t)(4 * H) * sizeof(float));
    lp_round_row(A, 4 * H, pc);
    for (int64_t k = 0; k < 4 * H; ++k) A[k] = lp_add_nan_first(A[k], x[k]);
    lp_round_row(A, 4 * H, pc);
    lp_lookup(A, 2 * H, tsig, kind, 0x80000000u);
    lp_lookup(A + 2 * H, H, ttanh, kind, 0);
    lp_lookup(A + 3 * H, H, tsig, kind, 0x80000000u);
    lp_cell_state(A, cr, out, H, pc);
    memcpy(t, out, (size_t)H * sizeof(float));
    lp_lookup(t, H, ttanh, kind, 0);
    for (int64_t k = 0; k < H; ++k) hr[k] = A[3 * H + k] * t[k];
    lp_round_row(hr, H, pc);
}

void lp_lstm_step_tab(const float *lin, const float *xw, int64_t xw_rs, const float *c,
                      int64_t c_rs, const float *tsig, const float *ttanh, int kind, float *acts,
                      float *cn, float *tc, float *h, int64_t B, int64_t H, const lp_params *pc,
                      int nthreads) {
    const int nt = lp_cell_threads(B, 6 * B * H, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < B; ++b)
        lp_lstm_step_row(lin + b * 4 * H, xw + b * xw_rs, c + b * c_rs, tsig, ttanh, kind,
                         acts + b * 4 * H, cn + b * H, tc + b * H, h + b * H, H, pc);
}

/* The backward of lp_lstm_gates .. lp_lstm_fwd2 as the op-by-op replay's autograd runs it:
 * dh the gradient reaching h (row stride dh_rs), dcn the one reaching the next step's use of
 * cn (NULL: none); dG (B x 4H) the gates' gradient (that of lin and of xw alike), dcp the raw
 * float32 gradient of c (its use's rounding is the caller's). */
/* One row of it, in pieces of LP_CELL_COLS columns: the four gates' gradients of a piece side by
 * side in G (i, f, g, o), so that each rounding of theirs is one call: sigmoid's backward
 * rg(rg(rg(dy) * rg(1 - y)) * y) (float16: c10::Half arithmetic) or rg(rg(dy) * (1 - y) * y),
 * tanh's rg(rg(dy) * (1 - y * y)), its last rounding repeated with the sigmoids' (on the grid
 * already: no change). */
LP_OPT_CLONES static void lp_lstm_bwd_row(const float *A, const float *t, const float *cr,
                                          const float *dhr, const float *dr, float *D, float *dc,
                                          int64_t H, const lp_params *pg, int half) {
    for (int64_t j = 0; j < H; j += LP_CELL_COLS) {
        const int64_t n = H - j < LP_CELL_COLS ? H - j : LP_CELL_COLS;
        const float *i = A + j, *f = A + H + j, *g = A + 2 * H + j, *o = A + 3 * H + j;
        float d[LP_CELL_COLS], dt[LP_CELL_COLS], G[4 * LP_CELL_COLS], Y[4 * LP_CELL_COLS];
        for (int64_t k = 0; k < n; ++k) d[k] = dhr[j + k];
        lp_round_row(d, n, pg); /* h's rounding: the gradient reaching it */
        for (int64_t k = 0; k < n; ++k) G[3 * n + k] = d[k] * t[j + k];
        for (int64_t k = 0; k < n; ++k) dt[k] = d[k] * o[k];
        /* the gradient of the cell state's tanh use: tanh's backward */
        lp_round_row(dt, n, pg);
        for (int64_t k = 0; k < n; ++k) dt[k] = dt[k] * (1.0f - t[j + k] * t[j + k]);
        lp_round_row(dt, n, pg);
        if (dr) { /* its other use, then their 16-bit sum */
            float u[LP_CELL_COLS];
            for (int64_t k = 0; k < n; ++k) u[k] = dr[j + k];
            lp_round_row(u, n, pg);
            for (int64_t k = 0; k < n; ++k) dt[k] = dt[k] + u[k];
            lp_round_row(dt, n, pg);
        }
        for (int64_t k = 0; k < n; ++k) {
            G[n + k] = dt[k] * cr[j + k];
            dc[j + k] = dt[k] * f[k];
            G[k] = dt[k] * g[k];
            G[2 * n + k] = dt[k] * i[k];
        }
        memcpy(Y, i, (size_t)n * sizeof(float));
        memcpy(Y + n, f, (size_t)n * sizeof(float));
        memcpy(Y + 2 * n, g, (size_t)n * sizeof(float));
        memcpy(Y + 3 * n, o, (size_t)n * sizeof(float));
        lp_round_row(G, 4 * n, pg);
        float *Gg = G + 2 * n;
        const float *Yg = Y + 2 * n;
        if (half) {
            float T[4 * LP_CELL_COLS];
            for (int64_t k = 0; k < 4 * n; ++k) T[k] = 1.0f - Y[k];
            lp_round_row(T, 4 * n, pg);
            for (int64_t k = 0; k < 2 * n; ++k) G[k] = G[k] * T[k];
            for (int64_t k = 3 * n; k < 4 * n; ++k) G[k] = G[k] * T[k];
            for (int64_t k = 0; k < n; ++k) Gg[k] = Gg[k] * (1.0f - Yg[k] * Yg[k]);
            lp_round_row(G, 4 * n, pg);
            for (int64_t k = 0; k < 2 * n; ++k) G[k] = G[k] * Y[k];
            for (int64_t k = 3 * n; k < 4 * n; ++k) G[k] = G[k] * Y[k];
        } else {
            for (int64_t k = 0; k < 2 * n; ++k) G[k] = (G[k] * (1.0f - Y[k])) * Y[k];
            for (int64_t k = 3 * n; k < 4 * n; ++k) G[k] = (G[k] * (1.0f - Y[k])) * Y[k];
            for (int64_t k = 0; k < n; ++k) Gg[k] = Gg[k] * (1.0f - Yg[k] * Yg[k]);
        }
        lp_round_row(G, 4 * n, pg);
        for (int64_t q = 0; q < 4; ++q) memcpy(D + q * H + j, G + q * n, (size_t)n * sizeof(float));
    }
}

void lp_lstm_bwd(const float *dh, int64_t dh_rs, const float *dcn, int64_t dcn_rs,
                 const float *acts, const float *tc, const float *c, int64_t c_rs, float *dG,
                 float *dcp, int64_t B, int64_t H, const lp_params *pg, int half, int nthreads) {
    const int nt = lp_cell_threads(B, 4 * B * H, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < B; ++b)
        lp_lstm_bwd_row(acts + b * 4 * H, tc + b * H, c + b * c_rs, dh + b * dh_rs,
                        dcn ? dcn + b * dcn_rs : NULL, dG + b * 4 * H, dcp + b * H, H, pg, half);
}


/* ---- The op-by-op LSTM step of any elementwise format and mode (stochastic rounding included),
 * as lowprec/training/emulation/recurrent_kernels.py's _Replay.cell runs it for formats that
 * are not a 16-bit kernel's: every op's output rounded to the compute format with the keys of
 * its own rounding site, and the gradient reaching it rounded to the gradient format with the
 * keys of that site's next rounding (the caller's pb); between the roundings autograd's
 * float32 backward of each op (mul, add, sigmoid_backward (dy * (1 - y)) * y and
 * tanh_backward dy * (1 - y * y) from the unrounded activations torch computed). `pf` holds the forward's parameters of the
 * step's eleven sites (in the op-by-op order: linear_hh, gates, sigmoid i, sigmoid f, tanh g,
 * sigmoid o, f * c, i * g, the cell state, its tanh, h), `pb` the backward's. A value's random
 * counter is its index in the op's (B x 4H or B x H) output, as quantize gives it.
 *
 * The work goes by tiles of whole rows (LP_SR_TILE values at most; a row wider than that in
 * pieces of it), each tile's values of one op rounded by one call over consecutive counters.
 * A tile's buffers are on the thread's stack: up to 11 x LP_SR_TILE floats (90 KB, the
 * backward), within glibc's and libgomp's default thread stacks (8 MB, 2-4 MB). */
#define LP_SR_TILE 2048

typedef struct { int64_t b0, rows, j, n, m; uint64_t off; } lp_tile;

/* Tile u of a (B x W) op (rows_per rows a tile, or pieces of a row when W > LP_SR_TILE). */
static lp_tile lp_tile_of(int64_t u, int64_t B, int64_t W) {
    lp_tile t;
    const int64_t pieces = W > LP_SR_TILE ? (W + LP_SR_TILE - 1) / LP_SR_TILE : 1;
    const int64_t rp = W > LP_SR_TILE ? 1 : LP_SR_TILE / W;
    t.b0 = (u / pieces) * rp;
    t.rows = B - t.b0 < rp ? B - t.b0 : rp;
    t.j = (u % pieces) * LP_SR_TILE;
    t.n = W - t.j < LP_SR_TILE ? W - t.j : LP_SR_TILE;
    t.m = t.rows * t.n;
    t.off = (uint64_t)(t.b0 * W + t.j);
    return t;
}

static int64_t lp_tiles(int64_t B, int64_t W) {
    const int64_t pieces = W > LP_SR_TILE ? (W + LP_SR_TILE - 1) / LP_SR_TILE : 1;
    const int64_t rp = W > LP_SR_TILE ? 1 : LP_SR_TILE / W;
    return ((B + rp - 1) / rp) * pieces;
}

/* The statements given last for each tile T of a (B x W) op, the tiles over the threads by the
 * op's WORK (values touched). */
#define LP_OVER_ROW_TILES(B, W, WORK, NTHREADS, T, ...)                                           \
    do {                                                                                          \
        const int64_t tiles_ = lp_tiles(B, W);                                                    \
        const int nt_ = lp_cell_threads(tiles_, WORK, NTHREADS);                                  \
        _Pragma("omp parallel for num_threads(nt_) schedule(static) if (nt_ > 1)")                \
        for (int64_t u_ = 0; u_ < tiles_; ++u_) {                                                 \
            const lp_tile T = lp_tile_of(u_, B, W);                                               \
            __VA_ARGS__                                                                           \
        }                                                                                         \
    } while (0)

/* dst[r * n + k] = src[(b0 + r) * rs + j + k] for the tile's rows r and columns k */
static void lp_gather(float *dst, const float *src, int64_t rs, const lp_tile *t) {
    for (int64_t r = 0; r < t->rows; ++r)
        memcpy(dst + r * t->n, src + (t->b0 + r) * rs + t->j, (size_t)t->n * sizeof(float));
}

static void lp_scatter(float *dst, int64_t rs, const float *src, const lp_tile *t) {
    for (int64_t r = 0; r < t->rows; ++r)
        memcpy(dst + (t->b0 + r) * rs + t->j, src + r * t->n, (size_t)t->n * sizeof(float));
}

static void lp_tile_round(float *x, const lp_tile *t, const lp_params *p) {
    run_at((const uint32_t *)x, (uint32_t *)x, t->m, t->off, p);
}

/* G = r1(r0(lin) + xw) (rows of N, lin and G contiguous; xw row stride xw_rs). */
void lp_lstm_op_gates(const float *lin, const float *xw, int64_t xw_rs, float *G, int64_t B,
                      int64_t N, const lp_params *pf, int nthreads) {
    LP_OVER_ROW_TILES(B, N, B * N, nthreads, t, {
        float x[LP_SR_TILE];
        lp_gather(x, lin, N, &t);
        lp_tile_round(x, &t, &pf[0]);
        for (int64_t r = 0; r < t.rows; ++r) {
            const float *xr = xw + (t.b0 + r) * xw_rs + t.j;
            float *v = x + r * t.n;
            for (int64_t k = 0; k < t.n; ++k) v[k] = v[k] + xr[k];
        }
        lp_tile_round(x, &t, &pf[1]);
        lp_scatter(G, N, x, &t);
    });
}

/* From torch's sigmoid(i), sigmoid(f), tanh(g), sigmoid(o) (B x H, contiguous) and the cell
 * state c (row stride c_rs): acts (B x 4H: i, f, g, o) each rounded at its site, and
 * cn = r8(r6(f * c) + r7(i * g)) (contiguous). */
void lp_lstm_op_cell(const float *si, const float *sf, const float *tg, const float *so,
                     const float *c, int64_t c_rs, float *acts, float *cn, int64_t B, int64_t H,
                     const lp_params *pf, int nthreads) {
    LP_OVER_ROW_TILES(B, H, 4 * B * H, nthreads, t, {
        float a[4][LP_SR_TILE], x[LP_SR_TILE], y[LP_SR_TILE];
        const float *raw[4] = {si, sf, tg, so};
        for (int q = 0; q < 4; ++q) {
            lp_gather(a[q], raw[q], H, &t);
            lp_tile_round(a[q], &t, &pf[2 + q]);
            lp_scatter(acts + q * H, 4 * H, a[q], &t);
        }
        lp_gather(x, c, c_rs, &t);
        for (int64_t k = 0; k < t.m; ++k) x[k] = a[1][k] * x[k]; /* f * c */
        lp_tile_round(x, &t, &pf[6]);
        for (int64_t k = 0; k < t.m; ++k) y[k] = a[0][k] * a[2][k]; /* i * g */
        lp_tile_round(y, &t, &pf[7]);
        for (int64_t k = 0; k < t.m; ++k) x[k] = x[k] + y[k];
        lp_tile_round(x, &t, &pf[8]);
        lp_scatter(cn, H, x, &t);
    });
}

/* T = r9(tanh(cn)) (torch's tanh given in tcu, contiguous), h = r10(o * T). */
void lp_lstm_op_out(const float *tcu, const float *acts, float *T, float *h, int64_t B,
                    int64_t H, const lp_params *pf, int nthreads) {
    LP_OVER_ROW_TILES(B, H, 2 * B * H, nthreads, t, {
        float x[LP_SR_TILE], o[LP_SR_TILE];
        lp_gather(x, tcu, H, &t);
        lp_tile_round(x, &t, &pf[9]);
        lp_scatter(T, H, x, &t);
        lp_gather(o, acts + 3 * H, 4 * H, &t);
        for (int64_t k = 0; k < t.m; ++k) x[k] = o[k] * x[k];
        lp_tile_round(x, &t, &pf[10]);
        lp_scatter(h, H, x, &t);
    });
}

/* The step's backward as autograd runs the op-by-op chain: dh_a, dh_b the gradients reaching h
 * from its two uses (the output, the next step's linear_hh or the final state; NULL: unused),
 * dc_a, dc_b those reaching the new cell state from its uses besides this step's tanh (the
 * next step's f * c or the final state; NULL: none), each B x H contiguous; acts the rounded
 * activations, si .. so the unrounded ones (B x H each, as torch gave them), tcu the unrounded
 * tanh of the cell state, T its rounding, c the previous cell state (row stride c_rs). Writes
 * dG (B x 4H: the gates' gradient, rounded at the gates' site: that of linear_hh and of the
 * input projection) and dcp (B x H: the raw float32 gradient of the previous cell state, from
 * f * c). */
void lp_lstm_op_bwd(const float *dh_a, const float *dh_b, const float *dc_a, const float *dc_b,
                    const float *acts, const float *si, const float *sf, const float *tg,
                    const float *so, const float *tcu, const float *T,
                    const float *c, int64_t c_rs, float *dG, float *dcp, int64_t B, int64_t H,
                    const lp_params *pb, int nthreads) {
    LP_OVER_ROW_TILES(B, H, 4 * B * H, nthreads, t, {
        const int64_t m = t.m;
        float a[4][LP_SR_TILE], d[4][LP_SR_TILE], x[LP_SR_TILE], y[LP_SR_TILE], z[LP_SR_TILE];
        for (int q = 0; q < 4; ++q) lp_gather(a[q], acts + q * H, 4 * H, &t);
        int have_c = 0; /* whether a gradient reached the new cell state */
        if (dh_a || dh_b) {
            /* h's gradient: its uses' float32 sum, rounded at h's site */
            if (dh_a) lp_gather(x, dh_a, H, &t);
            if (dh_b) lp_gather(dh_a ? y : x, dh_b, H, &t);
            if (dh_a && dh_b)
                for (int64_t k = 0; k < m; ++k) x[k] = x[k] + y[k];
            lp_tile_round(x, &t, &pb[10]);
            lp_gather(y, T, H, &t);
            for (int64_t k = 0; k < m; ++k) {
                d[3][k] = x[k] * y[k];    /* mul's backward: d o = dh * T */
                z[k] = x[k] * a[3][k];    /* d T = dh * o */
            }
            lp_tile_round(z, &t, &pb[9]);
            lp_gather(y, tcu, H, &t);
            for (int64_t k = 0; k < m; ++k) x[k] = z[k] * (1.0f - y[k] * y[k]);
            have_c = 1;
        } else { /* no gradient reached h: none reaches o (zeros in chunk's backward) */
            for (int64_t k = 0; k < m; ++k) d[3][k] = 0.0f;
        }
        /* the cell state's other uses, added in float32, then its site's rounding */
        for (int w = 0; w < 2; ++w) {
            const float *dcu = w ? dc_b : dc_a;
            if (!dcu) continue;
            lp_gather(y, dcu, H, &t);
            for (int64_t k = 0; k < m; ++k) x[k] = have_c ? x[k] + y[k] : y[k];
            have_c = 1;
        }
        if (!have_c)
            for (int64_t k = 0; k < m; ++k) x[k] = 0.0f;
        lp_tile_round(x, &t, &pb[8]);
        /* the add passes it to f * c and i * g, on their grid already (their sites' roundings
         * leave it as it is) */
        lp_gather(y, c, c_rs, &t);
        for (int64_t k = 0; k < m; ++k) {
            d[1][k] = x[k] * y[k];      /* d f = dcn * c */
            z[k] = x[k] * a[1][k];      /* d c = dcn * f */
            d[0][k] = x[k] * a[2][k];   /* d i = dcn * g */
            d[2][k] = x[k] * a[0][k];   /* d g = dcn * i */
        }
        lp_scatter(dcp, H, z, &t);
        const float *raw[4] = {si, sf, tg, so};
        for (int q = 0; q < 4; ++q) {
            lp_tile_round(d[q], &t, &pb[2 + q]);
            lp_gather(y, raw[q], H, &t);
            if (q == 2)
                for (int64_t k = 0; k < m; ++k) d[q][k] = d[q][k] * (1.0f - y[k] * y[k]);
            else
                for (int64_t k = 0; k < m; ++k) d[q][k] = (d[q][k] * (1.0f - y[k])) * y[k];
            lp_scatter(dG + q * H, 4 * H, d[q], &t);
        }
    });
    /* the gates' gradient (chunk's backward: i, f, g, o side by side), rounded at the gates'
     * site; linear_hh's rounding leaves it as it is */
    LP_OVER_ROW_TILES(B, 4 * H, 4 * B * H, nthreads, t, {
        float x[LP_SR_TILE];
        lp_gather(x, dG, 4 * H, &t);
        lp_tile_round(x, &t, &pb[1]);
        lp_scatter(dG, 4 * H, x, &t);
    });
}
