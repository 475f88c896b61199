/* The experts of a mixture-of-experts layer in one call, float32 (models/moe.py):
 *
 *   out[t] = sum_k  w[t, k] * down_e( act(gate_e(x[t]), up_e(x[t])) ),   e = ids[t, k] - e0
 *
 *   x (T, H) row stride x_stride;  ids (T, K) int64 global expert ids, w (T, K) float32;
 *   w13 (E, 2I, H): expert e's gate rows 0..I-1 then its up rows I..2I-1;  w2 (E, H, I);
 *   b13 (E, 2I) and b2 (E, H): the projections' biases, or NULL (none);
 *   act 0: silu(g) * u;  act 1 (gpt-oss's swigluoai): g' = min(g, limit), u' = clamp(u, +-limit),
 *   (u' + 1) * g' * sigmoid(alpha * g');
 *   out (T, H) contiguous, overwritten. Pairs whose expert is not among the E held here
 *   (e outside 0..E-1: another rank's, under expert parallelism) add nothing.
 *
 * The (token, expert) pairs are grouped by expert with a counting sort (vLLM's
 * moe_align_block_size on the CPU), then two grouped matmul passes run over work items of
 * (expert, block of up to MB of its pairs, block of output columns), split across OpenMP threads
 * with no loop per expert on the Python side:
 *   1. act[p, j] = silu(x[t_p] . gate_e[j]) * (x[t_p] . up_e[j])     (P, I)
 *   2. y[p, h]   = act[p] . down_e[h]                                 (P, H)
 * and a combine pass sums each token's rows, weighted, in k order. Every dot product runs over
 * a contiguous weight row and a contiguous activation row; tiles of 4 pairs by 4 weight rows share
 * each row read. All arithmetic is float32 (the sums in another order than torch's matmul).
 *
 * fused_moe_bf16: the same with bfloat16 expert weights (the CPU's --dtype bfloat16), the rows
 * rounded to bfloat16 (nearest, ties even) as they enter each product, the products summed in
 * float32 (AVX512-BF16's dot product of pairs where the CPU has it, float32 FMAs otherwise): half
 * the weight bytes to read, twice the products an instruction. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MB 32      /* pairs per work item */
#define NB 16      /* output columns per work item */

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* s[r] = a_r . b for 4 rows at once (one pass over b). */
static inline void dot4(const float *restrict a0, const float *restrict a1, const float *restrict a2,
                        const float *restrict a3, const float *restrict b, int64_t n, float *s) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    #pragma omp simd reduction(+:s0, s1, s2, s3)
    for (int64_t i = 0; i < n; i++) {
        const float v = b[i];
        s0 += a0[i] * v;
        s1 += a1[i] * v;
        s2 += a2[i] * v;
        s3 += a3[i] * v;
    }
    s[0] = s0; s[1] = s1; s[2] = s2; s[3] = s3;
}

/* s[4 * r + c] = a_r . b_c for 4 rows and 4 weight rows at once: 16 sums, each load of a row
 * vector feeding 4 of them (twice dot4's products per load). */
static inline void dot4x4(const float *const *a, const float *restrict b0, const float *restrict b1,
                          const float *restrict b2, const float *restrict b3, int64_t n, float *s) {
    const float *restrict a0 = a[0], *restrict a1 = a[1], *restrict a2 = a[2], *restrict a3 = a[3];
    float s00 = 0.f, s01 = 0.f, s02 = 0.f, s03 = 0.f, s10 = 0.f, s11 = 0.f, s12 = 0.f, s13 = 0.f;
    float s20 = 0.f, s21 = 0.f, s22 = 0.f, s23 = 0.f, s30 = 0.f, s31 = 0.f, s32 = 0.f, s33 = 0.f;
    #pragma omp simd reduction(+:s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)
    for (int64_t i = 0; i < n; i++) {
        const float w0 = b0[i], w1 = b1[i], w2 = b2[i], w3 = b3[i];
        const float x0 = a0[i], x1 = a1[i], x2 = a2[i], x3 = a3[i];
        s00 += x0 * w0; s01 += x0 * w1; s02 += x0 * w2; s03 += x0 * w3;
        s10 += x1 * w0; s11 += x1 * w1; s12 += x1 * w2; s13 += x1 * w3;
        s20 += x2 * w0; s21 += x2 * w1; s22 += x2 * w2; s23 += x2 * w3;
        s30 += x3 * w0; s31 += x3 * w1; s32 += x3 * w2; s33 += x3 * w3;
    }
    s[0] = s00; s[1] = s01; s[2] = s02; s[3] = s03; s[4] = s10; s[5] = s11; s[6] = s12; s[7] = s13;
    s[8] = s20; s[9] = s21; s[10] = s22; s[11] = s23; s[12] = s30; s[13] = s31; s[14] = s32; s[15] = s33;
}

/* y[r * ldy + c - c0] = rows[r] . (w + c * n) for the block's rows and the columns c0..c1 of
 * one expert's weight (its row c at w + c * n): tiles of 4 rows by 4 columns, then 4 rows by
 * one column, then single rows. */
static void block_dots(const float *const *rows, int64_t nrows, const float *w, int64_t c0, int64_t c1,
                       int64_t n, float *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= nrows; r += 4) {
        int64_t c = c0;
        for (; c + 4 <= c1; c += 4) {
            float s[16];
            dot4x4(rows + r, w + c * n, w + (c + 1) * n, w + (c + 2) * n, w + (c + 3) * n, n, s);
            for (int q = 0; q < 4; q++)
                for (int j = 0; j < 4; j++)
                    y[(r + q) * ldy + c + j - c0] = s[4 * q + j];
        }
        for (; c < c1; c++) {
            float s[4];
            dot4(rows[r], rows[r + 1], rows[r + 2], rows[r + 3], w + c * n, n, s);
            for (int q = 0; q < 4; q++)
                y[(r + q) * ldy + c - c0] = s[q];
        }
    }
    for (; r < nrows; r++)
        for (int64_t c = c0; c < c1; c++)
            y[r * ldy + c - c0] = dot(rows[r], w + c * n, n);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {               /* nearest, ties even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* s[4 * r + c] = a_r . b_c over n bfloat16 values, for 4 rows and 4 weight rows (fewer where
 * nr / nc say; the rest of s untouched), summed in float32. Inlined with constant nr and nc (the
 * full 4 by 4 tile) its accumulators stay in registers. */
static inline __attribute__((always_inline)) void dots_bf16_tile(const uint16_t *const *a, const int nr,
                                                                 const uint16_t *const *b, const int nc, int64_t n,
                                                                 float *s) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        __m512i av[4], bv[4];
        for (int r = 0; r < nr; r++) av[r] = _mm512_loadu_si512(a[r] + i);
        for (int c = 0; c < nc; c++) bv[c] = _mm512_loadu_si512(b[c] + i);
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < nc; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)av[r], (__m512bh)bv[c]);
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) s[4 * r + c] = _mm512_reduce_add_ps(acc[r][c]);
#else
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) s[4 * r + c] = 0.f;
#endif
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) {
            float t = 0.f;
            #pragma omp simd reduction(+:t)
            for (int64_t j = i; j < n; j++) t += bf16_to_f32(a[r][j]) * bf16_to_f32(b[c][j]);
            s[4 * r + c] += t;
        }
}

/* block_dots over bfloat16 rows and weights. */
static void block_dots_bf16(const uint16_t *const *rows, int64_t nrows, const uint16_t *w, int64_t c0, int64_t c1,
                            int64_t n, float *y, int64_t ldy) {
    for (int64_t r = 0; r < nrows; r += 4) {
        const int nr = nrows - r < 4 ? (int)(nrows - r) : 4;
        for (int64_t c = c0; c < c1; c += 4) {
            const int nc = c1 - c < 4 ? (int)(c1 - c) : 4;
            const uint16_t *b[4] = {w + c * n, w + (c + 1 < c1 ? c + 1 : c) * n, w + (c + 2 < c1 ? c + 2 : c) * n,
                                    w + (c + 3 < c1 ? c + 3 : c) * n};
            float s[16];
            if (nr == 4 && nc == 4)
                dots_bf16_tile(rows + r, 4, b, 4, n, s);
            else
                dots_bf16_tile(rows + r, nr, b, nc, n, s);
            for (int q = 0; q < nr; q++)
                for (int j = 0; j < nc; j++)
                    y[(r + q) * ldy + c + j - c0] = s[4 * q + j];
        }
    }
}

/* Returns 0, or -1 when a work buffer cannot be allocated. ``bf16``: w13 and w2 hold bfloat16. */
static int fused_moe(const float *x, int64_t x_stride, const int64_t *ids, const float *w, int64_t T, int64_t K,
                     const void *w13, const void *w2, int64_t E, int64_t e0, int64_t H, int64_t I, float *out,
                     const float *b13, const float *b2, int act, float alpha, float limit, int bf16);

int fused_moe_f32(const float *x, int64_t x_stride, const int64_t *ids, const float *w, int64_t T, int64_t K,
                  const float *w13, const float *w2, int64_t E, int64_t e0, int64_t H, int64_t I, float *out,
                  const float *b13, const float *b2, int act, float alpha, float limit) {
    return fused_moe(x, x_stride, ids, w, T, K, w13, w2, E, e0, H, I, out, b13, b2, act, alpha, limit, 0);
}

int fused_moe_bf16(const float *x, int64_t x_stride, const int64_t *ids, const float *w, int64_t T, int64_t K,
                   const uint16_t *w13, const uint16_t *w2, int64_t E, int64_t e0, int64_t H, int64_t I, float *out,
                   const float *b13, const float *b2, int act, float alpha, float limit) {
    return fused_moe(x, x_stride, ids, w, T, K, w13, w2, E, e0, H, I, out, b13, b2, act, alpha, limit, 1);
}

static int fused_moe(const float *x, int64_t x_stride, const int64_t *ids, const float *w, int64_t T, int64_t K,
                     const void *w13, const void *w2, int64_t E, int64_t e0, int64_t H, int64_t I, float *out,
                     const float *b13, const float *b2, int act, float alpha, float limit, int bf16) {
    const int64_t TK = T * K;
    int64_t *start = calloc((size_t)E + 1, sizeof *start);
    int64_t *pair = malloc((size_t)(TK ? TK : 1) * sizeof *pair);       /* sorted pair -> t * K + k */
    int64_t *slot = malloc((size_t)(TK ? TK : 1) * sizeof *slot);       /* t * K + k -> sorted pair, -1 */
    if (!start || !pair || !slot) {
        free(start); free(pair); free(slot);
        return -1;
    }
    for (int64_t i = 0; i < TK; i++) {          /* counting sort, stable: token order per expert */
        const int64_t e = ids[i] - e0;
        if (e >= 0 && e < E)
            start[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++)
        start[e + 1] += start[e];
    const int64_t P = start[E];
    {
        int64_t *fill = malloc((size_t)(E ? E : 1) * sizeof *fill);
        if (!fill) {
            free(start); free(pair); free(slot);
            return -1;
        }
        memcpy(fill, start, (size_t)E * sizeof *fill);
        for (int64_t i = 0; i < TK; i++) {
            const int64_t e = ids[i] - e0;
            slot[i] = -1;
            if (e >= 0 && e < E) {
                slot[i] = fill[e];
                pair[fill[e]++] = i;
            }
        }
        free(fill);
    }
    float *act_rows = malloc((size_t)(P ? P : 1) * (size_t)I * sizeof *act_rows);
    float *y = malloc((size_t)(P ? P : 1) * (size_t)H * sizeof *y);
    /* bfloat16: the rows as the products read them (x's, then the activations') */
    uint16_t *xh = bf16 ? malloc((size_t)(T ? T : 1) * (size_t)H * sizeof *xh) : NULL;
    uint16_t *acth = bf16 ? malloc((size_t)(P ? P : 1) * (size_t)I * sizeof *acth) : NULL;
    if (bf16 && (!xh || !acth)) {
        free(start); free(pair); free(slot); free(act_rows); free(y); free(xh); free(acth);
        return -1;
    }
    /* work items: (expert, first pair of its block); column blocks are the inner parallel index */
    int64_t nblocks = 0;
    for (int64_t e = 0; e < E; e++)
        nblocks += (start[e + 1] - start[e] + MB - 1) / MB;
    int64_t *blk = malloc((size_t)(nblocks ? nblocks : 1) * 2 * sizeof *blk);
    if (!act_rows || !y || !blk) {
        free(start); free(pair); free(slot); free(act_rows); free(y); free(blk); free(xh); free(acth);
        return -1;
    }
    nblocks = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t p = start[e]; p < start[e + 1]; p += MB) {
            blk[2 * nblocks] = e;
            blk[2 * nblocks + 1] = p;
            nblocks++;
        }
    const int64_t ncol1 = (I + NB - 1) / NB, ncol2 = (H + NB - 1) / NB;
    const int64_t flops = P * 3 * I * H;
    #pragma omp parallel if (flops >= 262144)
    {
        if (bf16) {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                for (int64_t h = 0; h < H; h++) xh[t * H + h] = f32_to_bf16(x[t * x_stride + h]);
        }
        /* pass 1: gate and up rows (plus their biases), then the activation */
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < nblocks; b++)
            for (int64_t cb = 0; cb < ncol1; cb++) {
                const int64_t e = blk[2 * b], p0 = blk[2 * b + 1];
                const int64_t n = (start[e + 1] - p0) < MB ? (start[e + 1] - p0) : MB;
                const int64_t c0 = cb * NB, c1 = (c0 + NB) < I ? (c0 + NB) : I;
                float g[MB * NB], u[MB * NB];
                if (bf16) {
                    const uint16_t *rows[MB];
                    for (int64_t r = 0; r < n; r++)
                        rows[r] = xh + (pair[p0 + r] / K) * H;
                    const uint16_t *we = (const uint16_t *)w13 + e * 2 * I * H;
                    block_dots_bf16(rows, n, we, c0, c1, H, g, NB);
                    block_dots_bf16(rows, n, we + I * H, c0, c1, H, u, NB);
                } else {
                    const float *rows[MB];
                    for (int64_t r = 0; r < n; r++)
                        rows[r] = x + (pair[p0 + r] / K) * x_stride;
                    const float *we = (const float *)w13 + e * 2 * I * H;
                    block_dots(rows, n, we, c0, c1, H, g, NB);              /* gate rows c0..c1 */
                    block_dots(rows, n, we + I * H, c0, c1, H, u, NB);      /* up rows I+c0..I+c1 */
                }
                const float *bg = b13 ? b13 + e * 2 * I : NULL, *bu = b13 ? b13 + e * 2 * I + I : NULL;
                for (int64_t r = 0; r < n; r++)
                    for (int64_t c = c0; c < c1; c++) {
                        float gv = g[r * NB + c - c0], uv = u[r * NB + c - c0];
                        if (bg) {
                            gv += bg[c];
                            uv += bu[c];
                        }
                        if (act == 1) {
                            gv = gv < limit ? gv : limit;
                            uv = uv < -limit ? -limit : (uv > limit ? limit : uv);
                            act_rows[(p0 + r) * I + c] = (uv + 1.f) * (gv / (1.f + expf(-alpha * gv)));
                        } else {
                            act_rows[(p0 + r) * I + c] = gv / (1.f + expf(-gv)) * uv;
                        }
                        if (bf16)
                            acth[(p0 + r) * I + c] = f32_to_bf16(act_rows[(p0 + r) * I + c]);
                    }
            }
        /* pass 2: down rows */
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < nblocks; b++)
            for (int64_t cb = 0; cb < ncol2; cb++) {
                const int64_t e = blk[2 * b], p0 = blk[2 * b + 1];
                const int64_t n = (start[e + 1] - p0) < MB ? (start[e + 1] - p0) : MB;
                const int64_t c0 = cb * NB, c1 = (c0 + NB) < H ? (c0 + NB) : H;
                if (bf16) {
                    const uint16_t *rows[MB];
                    for (int64_t r = 0; r < n; r++)
                        rows[r] = acth + (p0 + r) * I;
                    block_dots_bf16(rows, n, (const uint16_t *)w2 + e * H * I, c0, c1, I, y + p0 * H + c0, H);
                } else {
                    const float *rows[MB];
                    for (int64_t r = 0; r < n; r++)
                        rows[r] = act_rows + (p0 + r) * I;
                    block_dots(rows, n, (const float *)w2 + e * H * I, c0, c1, I, y + p0 * H + c0, H);
                }
                if (b2)
                    for (int64_t r = 0; r < n; r++)
                        for (int64_t c = c0; c < c1; c++)
                            y[(p0 + r) * H + c] += b2[e * H + c];
            }
        /* combine: each token's rows, weighted, in k order */
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * H;
            memset(o, 0, (size_t)H * sizeof *o);
            for (int64_t k = 0; k < K; k++) {
                const int64_t s = slot[t * K + k];
                if (s < 0)
                    continue;
                const float wk = w[t * K + k], *ys = y + s * H;
                #pragma omp simd
                for (int64_t h = 0; h < H; h++)
                    o[h] += ys[h] * wk;
            }
        }
    }
    free(start); free(pair); free(slot); free(act_rows); free(y); free(blk); free(xh); free(acth);
    return 0;
}
