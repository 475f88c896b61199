/* Few-row matrix multiplication on the CPU for decode steps:
 *
 *   y (M, N) = x (M, K) W^T          x, y float32 row-major; M small (decode batches)
 *
 * W is stored in panels of 32 output features, so that one step of the inner loop reads the
 * 32 weights of one input feature contiguously:
 *   float32  codes (P, K, 32) floats             w[32p + j, k] = codes[p, k, j]
 *   Q4_1     codes (P, K, 16) bytes; d, m (P, K / 32, 32) float16
 *            byte j of (p, k) holds j's nibble low, j + 16's high; w = d * q + m
 *   Q8_0     codes (P, K, 32) int8;  d (P, K / 32, 32) float16;  w = d * q
 * (P = ceil(N / 32); the last panel's missing rows are zero.) The GGUF formats are repacked from
 * their checkpoint blocks once at load (models/gguf_native.py), the float32 one from the weight.
 * The scales stay the checkpoint's float16 and are widened to float32 (exactly) as each block is
 * used: one row's multiply streams the weights from memory, and float32 scales would make a Q4_1
 * weight 0.75 bytes instead of 0.625.
 *
 * A quantized panel is dequantized once per call into a per-thread buffer (the same float32
 * values as dequantizing the checkpoint: d * q rounded, then + m rounded, no fused multiply-add)
 * and multiplied from there, so every row of x reuses it. The multiply is a register-blocked
 * kernel of up to 12 rows x 32 columns (24 AVX-512 accumulators; on AVX2 CPUs tiles of up to 6
 * rows x 16 columns, a panel's two halves in turn, or, for calls of at most 8 rows, whose
 * weights stream from memory, 3 rows x 32 columns reading the panel in order), each accumulator
 * summing its products in input-feature order in float32. Panels are split across OpenMP
 * threads; each is read from memory once per call, which is what bounds a decode step.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* fused.c: an activation (ACT_* codes: 0 none, 1 SiLU, 2 GELU, 3 GELU tanh, 4 ReLU) in place over a
 * tile, or gating the second half of a gate|up tile */
void act_rows_serial_f32(int act, float *y, int64_t ldy, int64_t rows, int64_t cols);
void gated_act_serial_f32(int act, const float *gate_up, int64_t in_stride, float *out, int64_t T, int64_t I);
enum { ACT_SILU = 1 };
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include "vec8.h"
#endif

#define NR 32
#define MAX_MR 12
#define QK 32

enum { W_F32 = 0, W_Q4_1 = 1, W_Q8_0 = 2, W_BF16 = 3 };

/* What a product's tiles get as they are written (panel_gemm_act): a bias (N values), a residual
 * (a matrix the shape of y, row-major), then an activation (ACT_*); NULL / 0: none. */
typedef struct {
    const float *bias, *res;
    int act;
} epilogue;

static int bf16_products(const uint32_t *codes, int64_t N, int64_t K, const float *x, const uint16_t *xh,
                         int64_t M, float *y, uint16_t *yh, int gated, const epilogue *epi, int act);

#ifdef __AVX512F__
/* 16 float16 values -> float32 */
static inline __m512 load_f16(const uint16_t *h) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

/* y[0:cols] = the first cols of the 32 lanes of (c0, c1) */
static inline void store_cols(float *y, __m512 c0, __m512 c1, int64_t cols) {
    const __mmask16 k0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols <= 16 ? 0 : cols >= 32 ? 0xFFFF : (__mmask16)((1u << (cols - 16)) - 1);
    _mm512_mask_storeu_ps(y, k0, c0);
    _mm512_mask_storeu_ps(y + 16, k1, c1);
}

/* Rows 0..MR of a register tile (c0: columns 0-15, c1: 16-31) into y, rows ldy apart. */
static inline __attribute__((always_inline)) void store_tile(const int MR, const __m512 *c0, const __m512 *c1,
                                                             float *y, int64_t ldy, int64_t cols) {
    if (cols == NR) {
        for (int r = 0; r < MR; r++) {
            _mm512_storeu_ps(y + r * ldy, c0[r]);
            _mm512_storeu_ps(y + r * ldy + 16, c1[r]);
        }
    } else {
        for (int r = 0; r < MR; r++) store_cols(y + r * ldy, c0[r], c1[r], cols);
    }
}
#else
/* One float16 value -> float32, exactly (no F16C / _Float16 needed). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (e == 0x1F) {
        bits = sign | 0x7F800000u | man << 13;                  /* infinity, NaN */
    } else if (e == 0) {
        const float v = (float)man * 0x1p-24f;                  /* zero, subnormal: man 2^-24 */
        return sign ? -v : v;
    } else {
        bits = sign | (e + 112) << 23 | man << 13;              /* rebias 15 -> 127 */
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* out[k * 32 + j] = w[32 p + j, k] for one quantized panel. */
__attribute__((optimize("fp-contract=off")))
static void dequant_panel(int kind, const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                          int64_t p, int64_t K, float *out) {
    const int64_t nb = K / QK;
    if (kind == W_Q4_1) {
        const uint8_t *c = codes + p * K * 16;
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *db = d + (p * nb + b) * NR, *mb = m + (p * nb + b) * NR;
#ifdef __AVX512F__
            const __m512 d0 = load_f16(db), d1 = load_f16(db + 16), m0 = load_f16(mb), m1 = load_f16(mb + 16);
            const __m128i low4 = _mm_set1_epi8(0x0F);
            for (int64_t k = b * QK; k < (b + 1) * QK; k++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(c + k * 16));
                const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4)));
                const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
                _mm512_storeu_ps(out + k * NR, _mm512_add_ps(_mm512_mul_ps(d0, q0), m0));
                _mm512_storeu_ps(out + k * NR + 16, _mm512_add_ps(_mm512_mul_ps(d1, q1), m1));
            }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            __m256 dv[4], mv[4];
            for (int j = 0; j < 4; j++) {
                dv[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + 8 * j)));
                mv[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mb + 8 * j)));
            }
            const __m128i low4 = _mm_set1_epi8(0x0F);
            for (int64_t k = b * QK; k < (b + 1) * QK; k++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(c + k * 16));
                const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
                const __m128i q8[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};   /* columns 8 j .. */
                for (int j = 0; j < 4; j++) {
                    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8[j]));
                    _mm256_storeu_ps(out + k * NR + 8 * j, _mm256_add_ps(_mm256_mul_ps(dv[j], q), mv[j]));
                }
            }
#else
            float ds[NR], ms[NR];
            for (int j = 0; j < NR; j++) { ds[j] = f16_to_f32(db[j]); ms[j] = f16_to_f32(mb[j]); }
            for (int64_t k = b * QK; k < (b + 1) * QK; k++) {
                const uint8_t *ck = c + k * 16;
                float *o = out + k * NR;
                for (int j = 0; j < 16; j++) {
                    const float lo = (float)(ck[j] & 0x0F), hi = (float)(ck[j] >> 4);
                    const float dl = ds[j] * lo, dh = ds[j + 16] * hi;
                    o[j] = dl + ms[j];
                    o[j + 16] = dh + ms[j + 16];
                }
            }
#endif
        }
    } else {                                           /* W_Q8_0 */
        const int8_t *c = (const int8_t *)codes + p * K * NR;
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *db = d + (p * nb + b) * NR;
#ifdef __AVX512F__
            const __m512 d0 = load_f16(db), d1 = load_f16(db + 16);
            for (int64_t k = b * QK; k < (b + 1) * QK; k++) {
                const int8_t *ck = c + k * NR;
                const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)ck)));
                const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ck + 16))));
                _mm512_storeu_ps(out + k * NR, _mm512_mul_ps(d0, q0));
                _mm512_storeu_ps(out + k * NR + 16, _mm512_mul_ps(d1, q1));
            }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            __m256 dv[4];
            for (int j = 0; j < 4; j++) dv[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + 8 * j)));
            for (int64_t k = b * QK; k < (b + 1) * QK; k++) {
                const int8_t *ck = c + k * NR;
                for (int j = 0; j < 4; j++) {
                    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(ck + 8 * j))));
                    _mm256_storeu_ps(out + k * NR + 8 * j, _mm256_mul_ps(dv[j], q));
                }
            }
#else
            float ds[NR];
            for (int j = 0; j < NR; j++) ds[j] = f16_to_f32(db[j]);
            for (int64_t k = b * QK; k < (b + 1) * QK; k++)
                for (int j = 0; j < NR; j++) out[k * NR + j] = ds[j] * (float)c[k * NR + j];
#endif
        }
    }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* Rows 0..MR of a 16-column tile (c0: columns 0-7, c1: 8-15) into half `half` of y's 32 columns,
 * the columns past cols left alone. */
static inline __attribute__((always_inline)) void store_half(const int MR, const __m256 *c0, const __m256 *c1,
                                                             float *y, int64_t ldy, int64_t cols, int half) {
    const int64_t n = cols - half * 16 < 16 ? cols - half * 16 : 16;
    for (int r = 0; r < MR; r++) {
        float *yr = y + r * ldy + half * 16;
        if (n == 16) {
            _mm256_storeu_ps(yr, c0[r]);
            _mm256_storeu_ps(yr + 8, c1[r]);
        } else {
            float t[16];
            _mm256_storeu_ps(t, c0[r]);
            _mm256_storeu_ps(t + 8, c1[r]);
            memcpy(yr, t, (size_t)n * sizeof(float));
        }
    }
}

/* AVX2 (16 vector registers): a tile of up to 6 rows x 16 columns, one half of the panel
 * (12 accumulators, 2 panel vectors, 1 broadcast), the classic 6 x 16 kernel; each accumulator
 * sums its products in input-feature order with the same fused multiply-adds as the AVX-512
 * kernel, so both give the same float32 results. */
static inline __attribute__((always_inline)) void micro_half(const int MR, const float *x, int64_t ldx,
                                                             const float *pan, int64_t K, float *y,
                                                             int64_t ldy, int64_t cols, int half) {
    __m256 c0[6], c1[6];
    for (int r = 0; r < MR; r++) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
    const float *b = pan + half * 16;
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8);
        for (int r = 0; r < MR; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
        }
    }
    store_half(MR, c0, c1, y, ldy, cols, half);
}

/* y[r, 0:cols] for up to 3 rows over the whole panel at once (12 accumulators, the rows'
 * broadcasts, one panel vector at a time), reading the panel in order: a pass over each of its
 * 16-column halves would read every other cache line, and when a step is a stream of the
 * weights from memory that halves the memory's speed. */
static inline __attribute__((always_inline)) void micro_full(const int MR, const float *x, int64_t ldx,
                                                             const float *pan, int64_t K, float *y,
                                                             int64_t ldy, int64_t cols) {
    __m256 c[3][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 a[3];
        for (int r = 0; r < MR; r++) a[r] = _mm256_broadcast_ss(x + r * ldx + k);
        for (int j = 0; j < 4; j++) {
            const __m256 b = _mm256_loadu_ps(pan + k * NR + 8 * j);
            for (int r = 0; r < MR; r++) c[r][j] = _mm256_fmadd_ps(a[r], b, c[r][j]);
        }
    }
    for (int r = 0; r < MR; r++) {
        float t[NR];
        float *yr = cols == NR ? y + r * ldy : t;
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(yr + 8 * j, c[r][j]);
        if (cols != NR) memcpy(y + r * ldy, t, (size_t)cols * sizeof(float));
    }
}

/* Calls of up to STREAM_ROWS rows (decode steps: the weights stream from memory) take each chunk
 * of rows in groups of at most 3 over the whole panel, read in order; chunks of calls with more
 * rows (compute-bound: the panel is reused from the cache) take groups of at most 6, each over
 * both halves of the panel (the half past cols skipped), which makes the most of the 16
 * registers. The half tiles of a call of 9 to 40 rows read the panel from memory a cache line in
 * two, and such calls ran 1.2-1.7x longer than in whole-panel groups (3072 x 576 and 576 x 1536
 * float32 weights, 30 layers' worth); from about 48 rows the half tiles are as fast or faster. */
#define STREAM_ROWS 40

static inline __attribute__((always_inline)) void micro_avx2(const int MR, const float *x, int64_t ldx,
                                                             const float *pan, int64_t K, float *y,
                                                             int64_t ldy, int64_t cols, int64_t M) {
    if (MR <= 8 || M <= STREAM_ROWS) {
        for (int r0 = 0; r0 < MR; r0 += 3) {
            const int mr = MR - r0 < 3 ? MR - r0 : 3;
            const float *xr = x + r0 * ldx;
            float *yr = y + r0 * ldy;
            switch (mr) {
                case 1: micro_full(1, xr, ldx, pan, K, yr, ldy, cols); break;
                case 2: micro_full(2, xr, ldx, pan, K, yr, ldy, cols); break;
                default: micro_full(3, xr, ldx, pan, K, yr, ldy, cols); break;
            }
        }
        return;
    }
    for (int r0 = 0; r0 < MR; r0 += 6) {
        const int mr = MR - r0 < 6 ? MR - r0 : 6;
        for (int half = 0; half < 2 && half * 16 < cols; half++) {
            const float *xr = x + r0 * ldx;
            float *yr = y + r0 * ldy;
            switch (mr) {
                case 1: micro_half(1, xr, ldx, pan, K, yr, ldy, cols, half); break;
                case 2: micro_half(2, xr, ldx, pan, K, yr, ldy, cols, half); break;
                case 3: micro_half(3, xr, ldx, pan, K, yr, ldy, cols, half); break;
                case 4: micro_half(4, xr, ldx, pan, K, yr, ldy, cols, half); break;
                case 5: micro_half(5, xr, ldx, pan, K, yr, ldy, cols, half); break;
                default: micro_half(6, xr, ldx, pan, K, yr, ldy, cols, half); break;
            }
        }
    }
}
#endif

/* y[r, 0:cols] = sum_k x[r, k] * pan[k, 0:cols] for r < MR (MR a constant after inlining). */
static inline __attribute__((always_inline)) void micro(const int MR, const float *x, int64_t ldx,
                                                        const float *pan, int64_t K, float *y,
                                                        int64_t ldy, int64_t cols, int64_t M) {
#ifdef __AVX512F__
    __m512 c0[MAX_MR], c1[MAX_MR];
    for (int r = 0; r < MR; r++) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
    for (int64_t k = 0; k < K; k++) {
        const __m512 b0 = _mm512_loadu_ps(pan + k * NR), b1 = _mm512_loadu_ps(pan + k * NR + 16);
        for (int r = 0; r < MR; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
        }
    }
    store_tile(MR, c0, c1, y, ldy, cols);
#elif defined(__AVX2__) && defined(__FMA__)
    micro_avx2(MR, x, ldx, pan, K, y, ldy, cols, M);
#else
    float acc[MAX_MR][NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) acc[r][j] = 0.f;
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < MR; r++) {
            const float a = x[r * ldx + k];
            #pragma omp simd
            for (int j = 0; j < NR; j++) acc[r][j] += a * pan[k * NR + j];
        }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < cols; j++) y[r * ldy + j] = acc[r][j];
#endif
}

#ifdef __AVX512F__
#define DIRECT_ROWS 8
/* One or two rows straight from a quantized panel, dequantizing in registers (the same values
 * as dequant_panel): for so few rows, writing the panel out and reading it back costs more than
 * the multiply. */
__attribute__((optimize("fp-contract=off")))
static void quant_rows(int kind, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t p,
                       int64_t K, const float *x, int64_t M, float *y, int64_t ldy, int64_t cols) {
    const int64_t nb = K / QK;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m512 c0[DIRECT_ROWS], c1[DIRECT_ROWS];
    for (int r = 0; r < DIRECT_ROWS; r++) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        const uint16_t *db = d + (p * nb + b) * NR;
        const __m512 d0 = load_f16(db), d1 = load_f16(db + 16);
        __m512 m0 = d0, m1 = d1;
        if (kind == W_Q4_1) {
            m0 = load_f16(m + (p * nb + b) * NR);
            m1 = load_f16(m + (p * nb + b) * NR + 16);
        }
        for (int64_t k = b * QK; k < (b + 1) * QK; k++) {
            __m512 w0, w1;
            if (kind == W_Q4_1) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + (p * K + k) * 16));
                w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4)));
                w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
                w0 = _mm512_add_ps(_mm512_mul_ps(d0, w0), m0);
                w1 = _mm512_add_ps(_mm512_mul_ps(d1, w1), m1);
            } else {
                const int8_t *ck = (const int8_t *)codes + (p * K + k) * NR;
                w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)ck))));
                w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ck + 16)))));
            }
            for (int r = 0; r < DIRECT_ROWS; r++) {
                if (r >= M) break;
                const __m512 a = _mm512_set1_ps(x[r * K + k]);
                c0[r] = _mm512_fmadd_ps(a, w0, c0[r]);
                c1[r] = _mm512_fmadd_ps(a, w1, c1[r]);
            }
        }
    }
    for (int r = 0; r < M; r++) store_cols(y + r * ldy, c0[r], c1[r], cols);
}
#else
#define DIRECT_ROWS 0
#endif

static void panel_rows(const float *x, int64_t M, int64_t K, const float *pan, float *y, int64_t N,
                       int64_t cols) {
    /* rows in near-equal chunks of at most MAX_MR */
    const int64_t chunks = (M + MAX_MR - 1) / MAX_MR;
    int64_t r0 = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t mr = (M - r0) / (chunks - c) + ((M - r0) % (chunks - c) ? 1 : 0);
        const float *xr = x + r0 * K;
        float *yr = y + r0 * N;
        switch (mr) {
            case 1: micro(1, xr, K, pan, K, yr, N, cols, M); break;
            case 2: micro(2, xr, K, pan, K, yr, N, cols, M); break;
            case 3: micro(3, xr, K, pan, K, yr, N, cols, M); break;
            case 4: micro(4, xr, K, pan, K, yr, N, cols, M); break;
            case 5: micro(5, xr, K, pan, K, yr, N, cols, M); break;
            case 6: micro(6, xr, K, pan, K, yr, N, cols, M); break;
            case 7: micro(7, xr, K, pan, K, yr, N, cols, M); break;
            case 8: micro(8, xr, K, pan, K, yr, N, cols, M); break;
            case 9: micro(9, xr, K, pan, K, yr, N, cols, M); break;
            case 10: micro(10, xr, K, pan, K, yr, N, cols, M); break;
            case 11: micro(11, xr, K, pan, K, yr, N, cols, M); break;
            default: micro(12, xr, K, pan, K, yr, N, cols, M); break;
        }
        r0 += mr;
    }
}

static __thread float *scratch;
static __thread int64_t scratch_len;

/* This thread's buffer of at least n floats (NULL when it cannot be had). */
static float *thread_scratch(int64_t n) {
    if (scratch_len < n) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)(n * sizeof(float) + 63) / 64 * 64);
        scratch_len = scratch ? n : 0;
    }
    return scratch;
}

/* Rows of x per pass over the panels: x's rows stay in the cache while every panel is read. */
#define ROW_BLOCK_BYTES (4 << 20)

static int64_t row_block(int64_t K) {
    const int64_t rows = ROW_BLOCK_BYTES / (K * (int64_t)sizeof(float));
    return rows < 64 ? 64 : rows;
}

/* y's rows (ldy apart) plus a bias over cols columns: y + b rounded once, as a separate add would
 * round it, while the thread's tile is still in its cache. */
static inline void add_bias_cols(float *y, int64_t ldy, int64_t rows, const float *b, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        #pragma omp simd
        for (int64_t c = 0; c < cols; c++) yr[c] += b[c];
    }
}

/* A panel's tile of y just written (rows ldy apart, cols columns; its first element y's [r0, c0]):
 * + bias, + residual, then the activation, while it is in the thread's cache; the same bits as the
 * adds and the activation as passes of their own. */
static inline void tile_epilogue(float *y, int64_t ldy, int64_t rows, int64_t cols, const epilogue *e,
                                 int64_t r0, int64_t c0) {
    if (!e) return;
    if (e->bias) add_bias_cols(y, ldy, rows, e->bias + c0, cols);
    if (e->res) {
        const float *res = e->res + r0 * ldy + c0;
        for (int64_t r = 0; r < rows; r++) {
            float *yr = y + r * ldy;
            const float *rr = res + r * ldy;
            #pragma omp simd
            for (int64_t c = 0; c < cols; c++) yr[c] += rr[c];
        }
    }
    if (e->act) act_rows_serial_f32(e->act, y, ldy, rows, cols);
}

/* y (M, N) = x (M, K) W^T with W in panels of kind W_F32 / W_Q4_1 / W_Q8_0 (see the top) or W_BF16
 * (see bf16_products); each panel's columns get the epilogue (or NULL) as soon as they are written.
 * Returns 0 when a buffer could not be allocated (y is then incomplete). */
static int panel_products(int kind, const void *codes, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                          const float *x, int64_t M, float *y, const epilogue *epi) {
    if (kind == W_BF16) return bf16_products((const uint32_t *)codes, N, K, x, NULL, M, y, NULL, 0, epi, 0);
    const int64_t P = (N + NR - 1) / NR;
    const int64_t rows = row_block(K);
    int ok = 1;
    for (int64_t r0 = 0; r0 < M; r0 += rows) {
        const int64_t mb = M - r0 < rows ? M - r0 : rows;
        const float *xb = x + r0 * K;
        float *yb = y + r0 * N;
        #pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
            const float *pan;
#ifdef __AVX512F__
            if (kind != W_F32 && mb <= DIRECT_ROWS) {
                quant_rows(kind, (const uint8_t *)codes, d, m, p, K, xb, mb, yb + p * NR, N, cols);
                tile_epilogue(yb + p * NR, N, mb, cols, epi, r0, p * NR);
                continue;
            }
#endif
            if (kind == W_F32) {
                pan = (const float *)codes + p * K * NR;
            } else {
                float *buf = thread_scratch(K * NR);
                if (!buf) {
                    #pragma omp atomic write
                    ok = 0;
                    continue;
                }
                dequant_panel(kind, (const uint8_t *)codes, d, m, p, K, buf);
                pan = buf;
            }
            panel_rows(xb, mb, K, pan, yb + p * NR, N, cols);
            tile_epilogue(yb + p * NR, N, mb, cols, epi, r0, p * NR);
        }
    }
    return ok;
}

int panel_gemm(int kind, const void *codes, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
               const float *x, int64_t M, float *y) {
    return panel_products(kind, codes, d, m, N, K, x, M, y, NULL);
}

/* panel_gemm with a bias (N float32 values, or NULL), a residual (M x N float32 values, row-major,
 * or NULL) and an activation (ACT_*, 0: none), in that order: the same bits as the product
 * followed by the two adds and fused.c's act_f32. */
int panel_gemm_act(int kind, const void *codes, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                   const float *x, int64_t M, float *y, const float *bias, const float *res, int act) {
    const epilogue e = {bias, res, act};
    return panel_products(kind, codes, d, m, N, K, x, M, y, &e);
}

/* Rows of a gated call's tile: the gate and up products of this many rows stay in the L1 cache. */
#define GATED_ROWS 48

/* out (M, I) = act(x Wg^T) * (x Wu^T) for W (2I, K) = the gate rows then the up rows in panels of
 * kind W_F32 / W_Q4_1 / W_Q8_0 / W_BF16, I a multiple of 32: each gate panel with its up panel, a
 * tile of rows at a time, and fused.c's activation-and-multiply (ACT_SILU, ACT_GELU, ACT_GELU_TANH,
 * ACT_RELU) applied to that tile, so the (M, 2I) product is never written out and read back. The same
 * values as panel_gemm followed by gated_act_f32 (the products do not depend on how the rows are
 * grouped, and the row blocks and the few-row path are panel_gemm's). Returns 0 for another kind or
 * I, or when a buffer could not be allocated. */
int panel_gated_act_gemm(int act, int kind, const void *codes, const uint16_t *d, const uint16_t *m, int64_t N,
                         int64_t K, const float *x, int64_t M, float *out) {
    const int64_t I = N / 2, PI = I / NR;
    if (N % (2 * NR)) return 0;
    if (kind == W_BF16) return bf16_products((const uint32_t *)codes, N, K, x, NULL, M, out, NULL, 1, NULL, act);
    if (kind != W_F32 && kind != W_Q4_1 && kind != W_Q8_0) return 0;
    const int64_t rows = row_block(K);
    int ok = 1;
    for (int64_t r0 = 0; r0 < M; r0 += rows) {
        const int64_t mb = M - r0 < rows ? M - r0 : rows;
        const float *xb = x + r0 * K;
        #pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < PI; p++) {
            float gu[GATED_ROWS * 2 * NR] __attribute__((aligned(64)));   /* [row][gate 32 | up 32] */
            float prod[GATED_ROWS * NR] __attribute__((aligned(64)));
            const float *pg = NULL, *pu = NULL;
            int direct = 0;
#ifdef __AVX512F__
            direct = kind != W_F32 && mb <= DIRECT_ROWS;      /* as panel_gemm: DIRECT_ROWS <= GATED_ROWS */
#endif
            if (kind == W_F32) {
                pg = (const float *)codes + p * K * NR;
                pu = (const float *)codes + (p + PI) * K * NR;
            } else if (!direct) {
                float *buf = thread_scratch(2 * K * NR);
                if (!buf) {
                    #pragma omp atomic write
                    ok = 0;
                    continue;
                }
                dequant_panel(kind, (const uint8_t *)codes, d, m, p, K, buf);
                dequant_panel(kind, (const uint8_t *)codes, d, m, p + PI, K, buf + K * NR);
                pg = buf;
                pu = buf + K * NR;
            }
            for (int64_t t0 = 0; t0 < mb; t0 += GATED_ROWS) {
                const int64_t mr = mb - t0 < GATED_ROWS ? mb - t0 : GATED_ROWS;
                const float *xt = xb + t0 * K;
#ifdef __AVX512F__
                if (direct) {
                    quant_rows(kind, (const uint8_t *)codes, d, m, p, K, xt, mr, gu, 2 * NR, NR);
                    quant_rows(kind, (const uint8_t *)codes, d, m, p + PI, K, xt, mr, gu + NR, 2 * NR, NR);
                } else
#endif
                {
                    panel_rows(xt, mr, K, pg, gu, 2 * NR, NR);
                    panel_rows(xt, mr, K, pu, gu + NR, 2 * NR, NR);
                }
                gated_act_serial_f32(act, gu, 2 * NR, prod, mr, NR);
                for (int64_t r = 0; r < mr; r++)
                    memcpy(out + (r0 + t0 + r) * I + p * NR, prod + r * NR, sizeof(float) * NR);
            }
        }
    }
    return ok;
}

/* panel_gated_act_gemm with SiLU (a gated MLP's usual activation). */
int panel_gated_gemm(int kind, const void *codes, const uint16_t *d, const uint16_t *m, int64_t N,
                     int64_t K, const float *x, int64_t M, float *out) {
    return panel_gated_act_gemm(ACT_SILU, kind, codes, d, m, N, K, x, M, out);
}

/* ---- bfloat16 weights (--dtype bfloat16 on the CPU) -------------------------------------------
 *
 * codes (P, K2, 32) 32-bit words, K2 = ceil(K / 2): word j of (p, i) holds w[32 p + j, 2 i] in its
 * low 16 bits and w[32 p + j, 2 i + 1] in its high ones (bfloat16; zero past K and N). The rows of
 * x are rounded to bfloat16 (nearest even) once per call, in the same pairs, so that one
 * AVX512-BF16 dot product (vdpbf16ps) multiplies one pair of input features into 16 output
 * features, accumulating in float32: half the weight bytes of float32 and twice its multiplies
 * per instruction. Without those instructions the same bfloat16 values are widened and multiplied
 * with float32 FMAs (the sums can differ in the last bits: vdpbf16ps adds each pair's two
 * products before accumulating and flushes subnormal inputs to zero).
 */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);    /* NaN stays NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);                                            /* nearest, ties even */
    return (uint16_t)(u >> 16);
}

/* One row of K floats -> bfloat16 (K2 pairs). With AVX512-BF16, 16 at a time (vcvtneps2bf16: the
 * same nearest-even rounding; it flushes subnormal inputs to zero, which the dot products below
 * do to them anyway). */
static inline void round_row_to_bf16(const float *x, int64_t K, uint16_t *out) {
    int64_t k = 0;
#ifdef __AVX512BF16__
    for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256((__m256i *)(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
#endif
    for (; k < K; k++) out[k] = bf16_round(x[k]);
    if (K & 1) out[K] = 0;
}

void round_to_bf16(const float *x, int64_t M, int64_t K, uint16_t *out) {   /* out (M, 2 K2) */
    const int64_t K2 = (K + 1) / 2;
    #pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t r = 0; r < M; r++) round_row_to_bf16(x + r * K, K, out + r * 2 * K2);
}

static inline __attribute__((always_inline)) void bf16_micro(const int MR, const uint32_t *xa, int64_t K2,
                                                             const uint32_t *pan, float *y, int64_t ldy,
                                                             int64_t cols) {
#ifdef __AVX512F__
    __m512 c0[MAX_MR], c1[MAX_MR];
    for (int r = 0; r < MR; r++) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
    for (int64_t i = 0; i < K2; i++) {
        const __m512i b0 = _mm512_loadu_si512(pan + i * NR), b1 = _mm512_loadu_si512(pan + i * NR + 16);
#ifdef __AVX512BF16__
        for (int r = 0; r < MR; r++) {
            const __m512i a = _mm512_set1_epi32((int)xa[r * K2 + i]);
            c0[r] = _mm512_dpbf16_ps(c0[r], (__m512bh)a, (__m512bh)b0);
            c1[r] = _mm512_dpbf16_ps(c1[r], (__m512bh)a, (__m512bh)b1);
        }
#else
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
        const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(b0, 16)), o0 = _mm512_castsi512_ps(_mm512_and_si512(b0, hi));
        const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(b1, 16)), o1 = _mm512_castsi512_ps(_mm512_and_si512(b1, hi));
        for (int r = 0; r < MR; r++) {
            const uint32_t pair = xa[r * K2 + i];
            const uint32_t lo_bits = pair << 16, hi_bits = pair & 0xFFFF0000u;
            float lo, hv;
            memcpy(&lo, &lo_bits, 4);
            memcpy(&hv, &hi_bits, 4);
            const __m512 al = _mm512_set1_ps(lo), ah = _mm512_set1_ps(hv);
            c0[r] = _mm512_fmadd_ps(ah, o0, _mm512_fmadd_ps(al, e0, c0[r]));
            c1[r] = _mm512_fmadd_ps(ah, o1, _mm512_fmadd_ps(al, e1, c1[r]));
        }
#endif
    }
    store_tile(MR, c0, c1, y, ldy, cols);
#else
    float acc[MAX_MR][NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) acc[r][j] = 0.f;
    for (int64_t i = 0; i < K2; i++)
        for (int r = 0; r < MR; r++) {
            const uint32_t pair = xa[r * K2 + i], lo_bits = pair << 16, hi_bits = pair & 0xFFFF0000u;
            float lo, hv;
            memcpy(&lo, &lo_bits, 4);
            memcpy(&hv, &hi_bits, 4);
            for (int j = 0; j < NR; j++) {
                const uint32_t w = pan[i * NR + j], we = w << 16, wo = w & 0xFFFF0000u;
                float fe, fo;
                memcpy(&fe, &we, 4);
                memcpy(&fo, &wo, 4);
                acc[r][j] += lo * fe;
                acc[r][j] += hv * fo;
            }
        }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < cols; j++) y[r * ldy + j] = acc[r][j];
#endif
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX2 kernels for the two ends of the row counts (between them, the loop above, which the
 * compiler vectorizes and which widens each pair of the panel once for up to 12 rows, is the
 * fastest here): the rows come as float32 (their bfloat16-rounded values, 2 K2 a row) and each
 * word of the panel is widened in registers, its low half by one shift and its high half by two
 * (a mask would take a register), into the float32 values of input features 2 i and 2 i + 1.
 * Both make the same fused multiply-adds in the same input-feature order as that loop, so every
 * path gives the same bits. One row (a decode step of one request): the whole panel read in
 * order. More than STREAM_ROWS rows (a prefill): tiles of 6 rows x one 16-column half, as the
 * float32 kernel's; they ran 1.1-1.3x faster than the loop at 48-256 rows. */
#define BF16_REG_ROWS 1

static inline __m256 bf16_even(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 bf16_odd(__m256i w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w, 16), 16));
}

static void bf16_row_avx2(const float *xf, int64_t K2, const uint32_t *pan, float *y, int64_t cols) {
    __m256 c[4];
    for (int j = 0; j < 4; j++) c[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K2; i++) {
        const __m256 a = _mm256_broadcast_ss(xf + 2 * i), b = _mm256_broadcast_ss(xf + 2 * i + 1);
        for (int j = 0; j < 4; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(pan + i * NR + 8 * j));
            c[j] = _mm256_fmadd_ps(b, bf16_odd(w), _mm256_fmadd_ps(a, bf16_even(w), c[j]));
        }
    }
    float t[NR];
    float *yr = cols == NR ? y : t;
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(yr + 8 * j, c[j]);
    if (cols != NR) memcpy(y, t, (size_t)cols * sizeof(float));
}

static inline __attribute__((always_inline)) void bf16_half_avx2(const int MR, const float *xf, int64_t K2,
                                                                 const uint32_t *pan, float *y, int64_t ldy,
                                                                 int64_t cols, int half) {
    __m256 c0[6], c1[6];
    for (int r = 0; r < MR; r++) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
    const uint32_t *ph = pan + half * 16;
    for (int64_t i = 0; i < K2; i++) {
        const __m256 e0 = bf16_even(_mm256_loadu_si256((const __m256i *)(ph + i * NR)));
        const __m256 e1 = bf16_even(_mm256_loadu_si256((const __m256i *)(ph + i * NR + 8)));
        for (int r = 0; r < MR; r++) {
            const __m256 a = _mm256_broadcast_ss(xf + r * 2 * K2 + 2 * i);
            c0[r] = _mm256_fmadd_ps(a, e0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, e1, c1[r]);
        }
        /* the same words again, from L1: keeping them would spill accumulators */
        const __m256 o0 = bf16_odd(_mm256_loadu_si256((const __m256i *)(ph + i * NR)));
        const __m256 o1 = bf16_odd(_mm256_loadu_si256((const __m256i *)(ph + i * NR + 8)));
        for (int r = 0; r < MR; r++) {
            const __m256 a = _mm256_broadcast_ss(xf + r * 2 * K2 + 2 * i + 1);
            c0[r] = _mm256_fmadd_ps(a, o0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, o1, c1[r]);
        }
    }
    store_half(MR, c0, c1, y, ldy, cols, half);
}

/* All M rows (float32 form) against one panel: one row, or tiles of 6 rows x 16 columns. */
static void bf16_rows_avx2(const float *xf, int64_t M, int64_t K2, const uint32_t *pan, float *y, int64_t N,
                           int64_t cols) {
    if (M <= BF16_REG_ROWS) {
        for (int64_t r = 0; r < M; r++) bf16_row_avx2(xf + r * 2 * K2, K2, pan, y + r * N, cols);
        return;
    }
    for (int64_t r0 = 0; r0 < M; r0 += 6) {
        const int64_t mr = M - r0 < 6 ? M - r0 : 6;
        const float *xr = xf + r0 * 2 * K2;
        float *yr = y + r0 * N;
        for (int half = 0; half < 2 && half * 16 < cols; half++) {
            switch (mr) {
                case 1: bf16_half_avx2(1, xr, K2, pan, yr, N, cols, half); break;
                case 2: bf16_half_avx2(2, xr, K2, pan, yr, N, cols, half); break;
                case 3: bf16_half_avx2(3, xr, K2, pan, yr, N, cols, half); break;
                case 4: bf16_half_avx2(4, xr, K2, pan, yr, N, cols, half); break;
                case 5: bf16_half_avx2(5, xr, K2, pan, yr, N, cols, half); break;
                default: bf16_half_avx2(6, xr, K2, pan, yr, N, cols, half); break;
            }
        }
    }
}

/* Whether a call (a row block) of M rows takes the AVX2 kernels, its rows in float32 form. */
static inline int bf16_float_rows(int64_t M) { return M <= BF16_REG_ROWS || M > STREAM_ROWS; }
#else
static inline int bf16_float_rows(int64_t M) { (void)M; return 0; }
#endif

/* The rows (bfloat16 pairs, K2 words a row) in near-equal chunks of at most MAX_MR, as panel_rows. */
static void bf16_rows(const uint32_t *xa, int64_t M, int64_t K2, const uint32_t *pan, float *y, int64_t N,
                      int64_t cols) {
    const int64_t chunks = (M + MAX_MR - 1) / MAX_MR;
    int64_t r0 = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t mr = (M - r0) / (chunks - c) + ((M - r0) % (chunks - c) ? 1 : 0);
        const uint32_t *xr = xa + r0 * K2;
        float *yr = y + r0 * N;
        switch (mr) {
            case 1: bf16_micro(1, xr, K2, pan, yr, N, cols); break;
            case 2: bf16_micro(2, xr, K2, pan, yr, N, cols); break;
            case 3: bf16_micro(3, xr, K2, pan, yr, N, cols); break;
            case 4: bf16_micro(4, xr, K2, pan, yr, N, cols); break;
            case 5: bf16_micro(5, xr, K2, pan, yr, N, cols); break;
            case 6: bf16_micro(6, xr, K2, pan, yr, N, cols); break;
            case 7: bf16_micro(7, xr, K2, pan, yr, N, cols); break;
            case 8: bf16_micro(8, xr, K2, pan, yr, N, cols); break;
            case 9: bf16_micro(9, xr, K2, pan, yr, N, cols); break;
            case 10: bf16_micro(10, xr, K2, pan, yr, N, cols); break;
            case 11: bf16_micro(11, xr, K2, pan, yr, N, cols); break;
            default: bf16_micro(12, xr, K2, pan, yr, N, cols); break;
        }
        r0 += mr;
    }
}

/* This thread's rows of x in a kernel's form: bfloat16 pairs, or float32 values (4 bytes each). */
static __thread uint32_t *bf16_x;
static __thread size_t bf16_x_len;

int bf16_available(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* The row block of a bfloat16 call (rows of K features): at least 64, within ROW_BLOCK_BYTES. */
static int64_t bf16_row_block(int64_t K) {
    const int64_t K2 = (K + 1) / 2, rows = ROW_BLOCK_BYTES / (K2 * (int64_t)sizeof(uint32_t));
    return rows < 64 ? 64 : rows;
}

/* This thread's bf16_x with room for a row block of M rows (the float32 form); 0 when it could
 * not be allocated. */
static int bf16_x_room(int64_t M, int64_t K) {
    const int64_t rows = bf16_row_block(K), mb_max = M < rows ? M : rows;
    const size_t need = (size_t)(mb_max * 2 * ((K + 1) / 2));
    if (bf16_x_len < need) {
        free(bf16_x);
        bf16_x = malloc(sizeof(uint32_t) * need);
        bf16_x_len = bf16_x ? need : 0;
    }
    return bf16_x != NULL;
}

/* Rows [r0, r0 + mb) of x into bf16_x in the form the kernels take for mb rows: bfloat16 pairs,
 * or (as_float) their rounded values as float32. */
static void bf16_load_rows(const float *x, int64_t mb, int64_t K, int as_float) {
    const int64_t K2 = (K + 1) / 2;
    if (!as_float) {
        round_to_bf16(x, mb, K, (uint16_t *)bf16_x);
        return;
    }
    for (int64_t r = 0; r < mb; r++) {
        const float *xr = x + r * K;
        uint32_t *o = bf16_x + r * 2 * K2;
        for (int64_t k = 0; k < K; k++) o[k] = (uint32_t)bf16_round(xr[k]) << 16;
        if (K & 1) o[K] = 0;
    }
}

/* mr rows of the block in bf16_x form (from row t0) times one panel, into y (ldy, cols). */
static inline void bf16_tile(const uint32_t *xa, int as_float, int64_t t0, int64_t mr, int64_t K2,
                             const uint32_t *pan, float *y, int64_t ldy, int64_t cols) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (as_float) {
        bf16_rows_avx2((const float *)xa + t0 * 2 * K2, mr, K2, pan, y, ldy, cols);
        return;
    }
#else
    (void)as_float;
#endif
    bf16_rows(xa + t0 * K2, mr, K2, pan, y, ldy, cols);
}

/* One gate panel p with its up panel (PI panels later) over a row block's mb rows, GATED_ROWS at
 * a time, their activation-and-multiply (act) taken in the L1 cache: out's columns 32 p .. 32 p + 31. */
static void bf16_gated_panel(const uint32_t *codes, const uint32_t *xa, int as_float, int64_t mb, int64_t K2,
                             int64_t p, int64_t PI, float *out, uint16_t *outh, int64_t I, int act) {
    float gu[GATED_ROWS * 2 * NR] __attribute__((aligned(64)));   /* [row][gate 32 | up 32] */
    float prod[GATED_ROWS * NR] __attribute__((aligned(64)));
    const uint32_t *pg = codes + p * K2 * NR, *pu = codes + (p + PI) * K2 * NR;
    for (int64_t t0 = 0; t0 < mb; t0 += GATED_ROWS) {
        const int64_t mr = mb - t0 < GATED_ROWS ? mb - t0 : GATED_ROWS;
        bf16_tile(xa, as_float, t0, mr, K2, pg, gu, 2 * NR, NR);
        bf16_tile(xa, as_float, t0, mr, K2, pu, gu + NR, 2 * NR, NR);
        gated_act_serial_f32(act, gu, 2 * NR, prod, mr, NR);
        for (int64_t r = 0; r < mr; r++) {
            if (outh) round_row_to_bf16(prod + r * NR, NR, outh + (t0 + r) * I + p * NR);
            else memcpy(out + (t0 + r) * I + p * NR, prod + r * NR, sizeof(float) * NR);
        }
    }
}

/* y (M, N) = x W^T for bfloat16 panels, each tile with the epilogue (as panel_products'), or
 * (gated: N = 2 I, I a multiple of 32) out (M, I) = act(x Wg^T) * (x Wu^T), each gate panel with its
 * up panel, so the (M, 2 I) product is never written out; the same bits as the product followed by
 * gated_act_f32 (a row's products do not depend on the rows beside it). xh (or NULL): the rows
 * already as bfloat16 (K even: M rows of K values), taken as they are instead of rounding x; yh (or
 * NULL; its width even, no residual in the epilogue): the result written as bfloat16 instead of y,
 * each tile rounded as the next bfloat16 product would round it (round_row_to_bf16). */
static int bf16_products(const uint32_t *codes, int64_t N, int64_t K, const float *x, const uint16_t *xh,
                         int64_t M, float *y, uint16_t *yh, int gated, const epilogue *epi, int act) {
    const int64_t K2 = (K + 1) / 2, rows = bf16_row_block(K), width = gated ? N / 2 : N;
    const int64_t P = gated ? width / NR : (N + NR - 1) / NR;
    if (!bf16_x_room(M, K)) return 0;
    int ok = 1;
    for (int64_t r0 = 0; r0 < M; r0 += rows) {
        const int64_t mb = M - r0 < rows ? M - r0 : rows;
        const int as_float = bf16_float_rows(mb);
        const uint32_t *xa = bf16_x;
        if (!xh)
            bf16_load_rows(x + r0 * K, mb, K, as_float);
        else if (!as_float)
            xa = (const uint32_t *)(xh + r0 * K);
        else                                              /* the AVX2 kernels' float32 form */
            for (int64_t i = 0; i < mb * K; i++) bf16_x[i] = (uint32_t)xh[r0 * K + i] << 16;
        float *yb = yh ? NULL : y + r0 * width;
        uint16_t *yhb = yh ? yh + r0 * width : NULL;
        #pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            if (gated) {
                bf16_gated_panel(codes, xa, as_float, mb, K2, p, P, yb, yhb, width, act);
                continue;
            }
            const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
            if (!yh) {
                bf16_tile(xa, as_float, 0, mb, K2, codes + p * K2 * NR, yb + p * NR, N, cols);
                tile_epilogue(yb + p * NR, N, mb, cols, epi, r0, p * NR);
                continue;
            }
            float *t = thread_scratch(mb * NR);           /* the tile in float32, then rounded */
            if (!t) {
                #pragma omp atomic write
                ok = 0;
                continue;
            }
            bf16_tile(xa, as_float, 0, mb, K2, codes + p * K2 * NR, t, NR, cols);
            tile_epilogue(t, NR, mb, cols, epi, 0, p * NR);
            for (int64_t r = 0; r < mb; r++) round_row_to_bf16(t + r * NR, cols, yhb + r * N + p * NR);
        }
    }
    return ok;
}

/* The bfloat16 panels' product (gated or not) with bfloat16 rows in (xh) and / or a bfloat16 result
 * out (yh), as bf16_products says; a bias, a residual (not with yh) and an activation as
 * panel_gemm_act's. Returns 0 for an odd K with xh, an odd width or a residual with yh, or when a
 * buffer could not be allocated. */
int bf16_gemm_io(const void *codes, int64_t N, int64_t K, const float *x, const uint16_t *xh, int64_t M, float *y,
                 uint16_t *yh, const float *bias, const float *res, int act, int gated) {
    if ((xh && K % 2) || (yh && ((gated ? N / 2 : N) % 2 || res)) || (gated && N % (2 * NR))) return 0;
    const epilogue e = {bias, res, act};
    return bf16_products((const uint32_t *)codes, N, K, x, xh, M, y, yh, gated, gated ? NULL : &e, act);
}


/* Float32 weight (N, K) row-major -> panels (P, K, 32), zero-padded. */
void pack_f32_panels(const float *w, int64_t N, int64_t K, float *out) {
    const int64_t P = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                out[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.f;
            }
}

/* ---- Q4_1 / Q8_0 weights times int8 activations in two parts (AVX512-VNNI, or AVX2) ------------
 *
 * The opt-in "gguf-i8" mode: each block of 32 activations is split into two int8 parts,
 * x ~= s1 q1 + s2 q2 (the second quantizes what the first missed, so about 14 bits survive), and
 * multiplied by the Q4_1 nibbles with integer dot products (vpdpbusd: unsigned weight bytes x
 * signed activation bytes, exact int32 sums); per block,
 *     y += d * (s1 * (q . q1) + s2 * (q . q2)) + m * sum(x)          (sum(x) exact, float32)
 * Layout of a panel: (K / 4, 64) bytes, byte 4 j + i of group g holding q[n = j, k = 4 g + i] in
 * its low nibble and q[n = 16 + j, same k] in its high one, so one 64-byte load feeds 16
 * output features x 4 input features for each half of the panel. Rows go 3 at a time.
 *
 * Without AVX512-VNNI, AVX2 computes the same integer sums in two instructions: vpmaddubsw
 * (unsigned x signed bytes, adjacent pairs summed into int16) and vpmaddwd by ones (int16 pairs
 * into int32), each 32-byte half of a group feeding 8 features x 4 input features. Every sum is
 * exact (a Q4_1 pair is at most 2 x 15 x 127, and a block's eight of them, 30,480, still fit an
 * int16; Q8_0 takes the magnitude of the weight and moves its sign onto the activation, a pair
 * at most 2 x 128 x 127), and the float arithmetic is the VNNI kernels' lane for lane (the block
 * sums of x added in the same order). Per 32-byte load the AVX2 kernels do twice the work of
 * VNNI's: decode steps, which stream the weights, gain most (2-4x the float32-activation path
 * for one row); batches of a hundred rows and more run at about 0.7x of it.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define I8X2 1
#define I8_MR 3      /* 12 int32 + 6 float accumulators: more rows spill registers */

/* Activation rows -> two int8 parts per block of 32: x ~= s1 q1 + s2 q2, plus exact block sums.
 * q1, q2 (M, K) int8; s1, s2, xsum (M, K / 32) float32. */
static void split_i8x2(const float *x, int64_t M, int64_t K, int8_t *q1, int8_t *q2, float *s1,
                       float *s2, float *xsum) {
    const int64_t nb = K / QK;
    #pragma omp parallel for schedule(static) if (M > 4)   /* a few rows: not worth waking a thread */
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * K + b * QK;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float sa = amax / 127.f, ia = amax > 0.f ? 127.f / amax : 0.f;
            const __m512i a0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(ia)));
            const __m512i a1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(ia)));
            const __m512 r0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_set1_ps(sa), v0);
            const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_set1_ps(sa), v1);
            const float rmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(r0), _mm512_abs_ps(r1)));
            const float sb = rmax / 127.f, ib = rmax > 0.f ? 127.f / rmax : 0.f;
            const __m512i b0 = _mm512_cvtps_epi32(_mm512_mul_ps(r0, _mm512_set1_ps(ib)));
            const __m512i b1 = _mm512_cvtps_epi32(_mm512_mul_ps(r1, _mm512_set1_ps(ib)));
            _mm_storeu_si128((__m128i *)(q1 + r * K + b * QK), _mm512_cvtsepi32_epi8(a0));
            _mm_storeu_si128((__m128i *)(q1 + r * K + b * QK + 16), _mm512_cvtsepi32_epi8(a1));
            _mm_storeu_si128((__m128i *)(q2 + r * K + b * QK), _mm512_cvtsepi32_epi8(b0));
            _mm_storeu_si128((__m128i *)(q2 + r * K + b * QK + 16), _mm512_cvtsepi32_epi8(b1));
            s1[r * nb + b] = sa;
            s2[r * nb + b] = sb;
            xsum[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        }
    }
}

/* Rows r < MR of one panel. codes (K / 4, 64) bytes for this panel: byte 4 j + i of group g is
 * q[n = j, k = 4 g + i] (low nibble) and q[n = 16 + j, same k] (high nibble). */
static inline __attribute__((always_inline)) void i8_micro(
    const int MR, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t K,
    const int8_t *q1, const int8_t *q2, const float *s1, const float *s2, const float *xsum,
    float *y, int64_t ldy, int64_t cols) {
    const int64_t nb = K / QK;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 f0[I8_MR], f1[I8_MR];
    for (int r = 0; r < MR; r++) { f0[r] = _mm512_setzero_ps(); f1[r] = _mm512_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        __m512i i00[I8_MR], i01[I8_MR], i10[I8_MR], i11[I8_MR];   /* [half][part] */
        for (int r = 0; r < MR; r++) {
            i00[r] = _mm512_setzero_si512(); i01[r] = _mm512_setzero_si512();
            i10[r] = _mm512_setzero_si512(); i11[r] = _mm512_setzero_si512();
        }
        for (int g = 0; g < QK / 4; g++) {
            const __m512i v = _mm512_loadu_si512(codes + (b * (QK / 4) + g) * 64);
            const __m512i w0 = _mm512_and_si512(v, low4);
            const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int r = 0; r < MR; r++) {
                int32_t a, c;
                memcpy(&a, q1 + r * K + b * QK + 4 * g, 4);
                memcpy(&c, q2 + r * K + b * QK + 4 * g, 4);
                const __m512i va = _mm512_set1_epi32(a), vc = _mm512_set1_epi32(c);
                i00[r] = _mm512_dpbusd_epi32(i00[r], w0, va);
                i10[r] = _mm512_dpbusd_epi32(i10[r], w1, va);
                i01[r] = _mm512_dpbusd_epi32(i01[r], w0, vc);
                i11[r] = _mm512_dpbusd_epi32(i11[r], w1, vc);
            }
        }
        const __m512 d0 = load_f16(d + b * NR), d1 = load_f16(d + b * NR + 16);
        const __m512 m0 = load_f16(m + b * NR), m1 = load_f16(m + b * NR + 16);
        for (int r = 0; r < MR; r++) {
            const __m512 sa = _mm512_set1_ps(s1[r * nb + b]), sb = _mm512_set1_ps(s2[r * nb + b]);
            const __m512 xs = _mm512_set1_ps(xsum[r * nb + b]);
            const __m512 t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i01[r]), sb, _mm512_mul_ps(_mm512_cvtepi32_ps(i00[r]), sa));
            const __m512 t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i11[r]), sb, _mm512_mul_ps(_mm512_cvtepi32_ps(i10[r]), sa));
            f0[r] = _mm512_fmadd_ps(m0, xs, _mm512_fmadd_ps(t0, d0, f0[r]));
            f1[r] = _mm512_fmadd_ps(m1, xs, _mm512_fmadd_ps(t1, d1, f1[r]));
        }
    }
    for (int r = 0; r < MR; r++) store_cols(y + r * ldy, f0[r], f1[r], cols);
}

/* The same for Q8_0 weights, signed: the activation bytes become the unsigned operand by adding
 * 128 (q ^ 0x80), and 128 * sum(w) per block (``wsum``: sum(w), int16, precomputed) is taken back.
 * codes (K / 4, 128) bytes for this panel: 64 bytes for features 0-15 (byte 4 j + i: q[j, 4 g + i]),
 * then 64 for features 16-31. */
static inline __attribute__((always_inline)) void i8_micro_q8(
    const int MR, const int8_t *codes, const uint16_t *d, const int16_t *wsum, int64_t K,
    const int8_t *q1, const int8_t *q2, const float *s1, const float *s2,
    float *y, int64_t ldy, int64_t cols) {
    const int64_t nb = K / QK;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 f0[I8_MR], f1[I8_MR];
    for (int r = 0; r < MR; r++) { f0[r] = _mm512_setzero_ps(); f1[r] = _mm512_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        __m512i i00[I8_MR], i01[I8_MR], i10[I8_MR], i11[I8_MR];   /* [half][part] */
        for (int r = 0; r < MR; r++) {
            i00[r] = _mm512_setzero_si512(); i01[r] = _mm512_setzero_si512();
            i10[r] = _mm512_setzero_si512(); i11[r] = _mm512_setzero_si512();
        }
        for (int g = 0; g < QK / 4; g++) {
            const __m512i w0 = _mm512_loadu_si512(codes + (b * (QK / 4) + g) * 128);
            const __m512i w1 = _mm512_loadu_si512(codes + (b * (QK / 4) + g) * 128 + 64);
            for (int r = 0; r < MR; r++) {
                int32_t a, c;
                memcpy(&a, q1 + r * K + b * QK + 4 * g, 4);
                memcpy(&c, q2 + r * K + b * QK + 4 * g, 4);
                const __m512i va = _mm512_xor_si512(_mm512_set1_epi32(a), flip);
                const __m512i vc = _mm512_xor_si512(_mm512_set1_epi32(c), flip);
                i00[r] = _mm512_dpbusd_epi32(i00[r], va, w0);
                i10[r] = _mm512_dpbusd_epi32(i10[r], va, w1);
                i01[r] = _mm512_dpbusd_epi32(i01[r], vc, w0);
                i11[r] = _mm512_dpbusd_epi32(i11[r], vc, w1);
            }
        }
        const __m512 d0 = load_f16(d + b * NR), d1 = load_f16(d + b * NR + 16);
        /* 128 * sum(w): the int16 sums widened, shifted left by 7 */
        const __m512i c0 = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(wsum + b * NR))), 7);
        const __m512i c1 = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(wsum + b * NR + 16))), 7);
        for (int r = 0; r < MR; r++) {
            const __m512 sa = _mm512_set1_ps(s1[r * nb + b]), sb = _mm512_set1_ps(s2[r * nb + b]);
            const __m512 t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i01[r], c0)), sb,
                                              _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i00[r], c0)), sa));
            const __m512 t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i11[r], c1)), sb,
                                              _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i10[r], c1)), sa));
            f0[r] = _mm512_fmadd_ps(t0, d0, f0[r]);
            f1[r] = _mm512_fmadd_ps(t1, d1, f1[r]);
        }
    }
    for (int r = 0; r < MR; r++) store_cols(y + r * ldy, f0[r], f1[r], cols);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define I8X2 1
#define I8_MR 2      /* 8 integer accumulators a pass for two rows: more spill registers */

/* 32 int32 values (a[0..3], in order) -> 32 int8, saturated, in order */
static inline __m256i i8_pack32(const __m256i *a) {
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
    return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* As the VNNI split above: x ~= s1 q1 + s2 q2 per block of 32, the same roundings. */
static void split_i8x2(const float *x, int64_t M, int64_t K, int8_t *q1, int8_t *q2, float *s1,
                       float *s2, float *xsum) {
    const int64_t nb = K / QK;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    #pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * K + b * QK;
            __m256 v[4], res[4];
            __m256i a[4], c[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
            __m256 m = _mm256_and_ps(v[0], absmask);
            for (int i = 1; i < 4; i++) m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
            const float am = hmax8(m);
            const float sa = am / 127.f, ia = am > 0.f ? 127.f / am : 0.f;
            for (int i = 0; i < 4; i++) {
                a[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(ia)));
                res[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(a[i]), _mm256_set1_ps(sa), v[i]);
            }
            m = _mm256_and_ps(res[0], absmask);
            for (int i = 1; i < 4; i++) m = _mm256_max_ps(m, _mm256_and_ps(res[i], absmask));
            const float rm = hmax8(m);
            const float sb = rm / 127.f, ib = rm > 0.f ? 127.f / rm : 0.f;
            for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(res[i], _mm256_set1_ps(ib)));
            _mm256_storeu_si256((__m256i *)(q1 + r * K + b * QK), i8_pack32(a));
            _mm256_storeu_si256((__m256i *)(q2 + r * K + b * QK), i8_pack32(c));
            s1[r * nb + b] = sa;
            s2[r * nb + b] = sb;
            /* x[i] + x[16 + i], + x[8 + i] + x[24 + i], then halves: the order of the VNNI split's sum */
            xsum[r * nb + b] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3])));
        }
    }
}

/* 8 float16 values -> float32 */
static inline __m256 i8_f16x8(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }

/* the first cols of 32 lanes (f[0..3], 8 each) into y */
static inline void i8_store32(float *y, const __m256 *f, int64_t cols) {
    if (cols == NR) {
        for (int o = 0; o < 4; o++) _mm256_storeu_ps(y + 8 * o, f[o]);
        return;
    }
    float t[NR] __attribute__((aligned(32)));
    for (int o = 0; o < 4; o++) _mm256_store_ps(t + 8 * o, f[o]);
    memcpy(y, t, sizeof(float) * cols);
}

/* va[r], vc[r] = the 4 activation bytes at a + r K, c + r K (both parts) in every 32-bit lane */
static inline __attribute__((always_inline)) void i8_broadcast(const int MR, const int8_t *a, const int8_t *c,
                                                               int64_t K, __m256i *va, __m256i *vc) {
    for (int r = 0; r < MR; r++) {
        int32_t a4, c4;
        memcpy(&a4, a + r * K, 4);
        memcpy(&c4, c + r * K, 4);
        va[r] = _mm256_set1_epi32(a4);
        vc[r] = _mm256_set1_epi32(c4);
    }
}

/* Rows r < MR of one Q4_1 panel (the layout above). Several rows go in two passes over the
 * panel: pass h reads the 32-byte half h of each group, whose low nibbles are features 8 h ..
 * 8 h + 7 (octet h) and high ones 16 + 8 h .. (octet 2 + h), so a row holds four integer
 * accumulators (two octets x two parts: int16 through a block, int32 at its end) and two rows
 * fit the 16 registers; the panel (K / 4 x 64 bytes) is still in the cache for the second pass.
 * One row (a decode step, whose time is reading the weights from memory) reads both halves in
 * one pass, each cache line once, with its eight accumulators. */
static inline __attribute__((always_inline)) void i8_micro(
    const int MR, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t K,
    const int8_t *q1, const int8_t *q2, const float *s1, const float *s2, const float *xsum,
    float *y, int64_t ldy, int64_t cols) {
    const int64_t nb = K / QK;
    const int HP = MR == 1 ? 2 : 1;                        /* halves of each group a pass reads */
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 f[I8_MR][4];
    for (int r = 0; r < MR; r++)
        for (int o = 0; o < 4; o++) f[r][o] = _mm256_setzero_ps();
    for (int pass = 0; pass < 2 / HP; pass++) {
        for (int64_t b = 0; b < nb; b++) {
            __m256i al[I8_MR][2], ah[I8_MR][2], cl[I8_MR][2], ch[I8_MR][2];   /* [row][half]: part 1 / 2, octet lo / hi */
            for (int r = 0; r < MR; r++)
                for (int j = 0; j < HP; j++) {
                    al[r][j] = _mm256_setzero_si256(); ah[r][j] = _mm256_setzero_si256();
                    cl[r][j] = _mm256_setzero_si256(); ch[r][j] = _mm256_setzero_si256();
                }
            const uint8_t *cb = codes + b * (QK / 4) * 64 + 32 * pass;
            #pragma GCC unroll 1      /* unrolled, GCC keeps every product of the block live and spills them */
            for (int g = 0; g < QK / 4; g++) {
                __m256i va[I8_MR], vc[I8_MR];
                i8_broadcast(MR, q1 + b * QK + 4 * g, q2 + b * QK + 4 * g, K, va, vc);
                for (int j = 0; j < HP; j++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(cb + g * 64 + 32 * j));
                    const __m256i wl = _mm256_and_si256(v, low4);
                    const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    for (int r = 0; r < MR; r++) {
                        al[r][j] = _mm256_add_epi16(al[r][j], _mm256_maddubs_epi16(wl, va[r]));
                        ah[r][j] = _mm256_add_epi16(ah[r][j], _mm256_maddubs_epi16(wh, va[r]));
                        cl[r][j] = _mm256_add_epi16(cl[r][j], _mm256_maddubs_epi16(wl, vc[r]));
                        ch[r][j] = _mm256_add_epi16(ch[r][j], _mm256_maddubs_epi16(wh, vc[r]));
                    }
                }
            }
            for (int j = 0; j < HP; j++) {
                const int lo = pass + j, hi = 2 + pass + j;        /* the half read: pass (or j) */
                const __m256 dl = i8_f16x8(d + b * NR + 8 * lo), dh = i8_f16x8(d + b * NR + 8 * hi);
                const __m256 ml = i8_f16x8(m + b * NR + 8 * lo), mh = i8_f16x8(m + b * NR + 8 * hi);
                for (int r = 0; r < MR; r++) {
                    const __m256 sa = _mm256_set1_ps(s1[r * nb + b]), sb = _mm256_set1_ps(s2[r * nb + b]);
                    const __m256 xs = _mm256_set1_ps(xsum[r * nb + b]);
                    const __m256 tl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(cl[r][j], ones)), sb,
                                                      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(al[r][j], ones)), sa));
                    const __m256 th = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(ch[r][j], ones)), sb,
                                                      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(ah[r][j], ones)), sa));
                    f[r][lo] = _mm256_fmadd_ps(ml, xs, _mm256_fmadd_ps(tl, dl, f[r][lo]));
                    f[r][hi] = _mm256_fmadd_ps(mh, xs, _mm256_fmadd_ps(th, dh, f[r][hi]));
                }
            }
        }
    }
    for (int r = 0; r < MR; r++) i8_store32(y + r * ldy, f[r], cols);
}

/* The same for Q8_0 weights (signed; the panel's 128 bytes per group: features 0-15, then
 * 16-31, so its four 32-byte quarters are the octets in order), several rows in two passes
 * (pass h: octets 2 h and 2 h + 1), one row in one: |w| x (the activation with w's sign), pairs
 * summed into int16, then into int32 at once (two pairs may exceed an int16). The block sums of
 * the codes the VNNI kernel takes back are not needed. */
static inline __attribute__((always_inline)) void i8_micro_q8(
    const int MR, const int8_t *codes, const uint16_t *d, const int16_t *wsum, int64_t K,
    const int8_t *q1, const int8_t *q2, const float *s1, const float *s2,
    float *y, int64_t ldy, int64_t cols) {
    (void)wsum;
    const int64_t nb = K / QK;
    const int OP = MR == 1 ? 4 : 2;                        /* octets a pass reads */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f[I8_MR][4];
    for (int r = 0; r < MR; r++)
        for (int o = 0; o < 4; o++) f[r][o] = _mm256_setzero_ps();
    for (int pass = 0; pass < 4 / OP; pass++) {
        for (int64_t b = 0; b < nb; b++) {
            __m256i ia[I8_MR][4], ic[I8_MR][4];                   /* [row][octet of the pass]: part 1 / 2 */
            for (int r = 0; r < MR; r++)
                for (int j = 0; j < OP; j++) { ia[r][j] = _mm256_setzero_si256(); ic[r][j] = _mm256_setzero_si256(); }
            const int8_t *cb = codes + b * (QK / 4) * 128 + 32 * OP * pass;
            #pragma GCC unroll 1
            for (int g = 0; g < QK / 4; g++) {
                __m256i va[I8_MR], vc[I8_MR];
                i8_broadcast(MR, q1 + b * QK + 4 * g, q2 + b * QK + 4 * g, K, va, vc);
                for (int j = 0; j < OP; j++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(cb + g * 128 + 32 * j));
                    const __m256i u = _mm256_abs_epi8(w);
                    for (int r = 0; r < MR; r++) {
                        ia[r][j] = _mm256_add_epi32(ia[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(va[r], w)), ones));
                        ic[r][j] = _mm256_add_epi32(ic[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(vc[r], w)), ones));
                    }
                }
            }
            for (int j = 0; j < OP; j++) {
                const int o = OP * pass + j;
                const __m256 dv = i8_f16x8(d + b * NR + 8 * o);
                for (int r = 0; r < MR; r++) {
                    const __m256 sa = _mm256_set1_ps(s1[r * nb + b]), sb = _mm256_set1_ps(s2[r * nb + b]);
                    const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ic[r][j]), sb, _mm256_mul_ps(_mm256_cvtepi32_ps(ia[r][j]), sa));
                    f[r][o] = _mm256_fmadd_ps(t, dv, f[r][o]);
                }
            }
        }
    }
    for (int r = 0; r < MR; r++) i8_store32(y + r * ldy, f[r], cols);
}
#endif

#ifdef I8X2
static __thread void *abuf;
static __thread size_t abuf_len;

int i8x2_available(void) { return 1; }

/* y (M, N) = x (M, K) W^T, W Q4_1 (d, m: float16 scales, minimums) or Q8_0 (d: float16 scales,
 * m: block sums of the codes, int16) in the layouts above, x split into two int8 parts. Returns 0
 * when the activation buffer could not be allocated. */
/* The int8 activation parts of x (M, K), in the thread's buffer: NULL when it could not grow. */
typedef struct { int8_t *q1, *q2; float *s1, *s2, *xsum; } i8_acts;

static int i8_split(const float *x, int64_t M, int64_t K, i8_acts *A) {
    const int64_t nb = K / QK;
    const size_t need = (size_t)M * K * 2 + (size_t)M * nb * 3 * sizeof(float) + 64;
    if (abuf_len < need) {
        free(abuf);
        abuf = malloc(need);
        abuf_len = abuf ? need : 0;
        if (!abuf) return 0;
    }
    A->s1 = (float *)abuf;
    A->s2 = A->s1 + M * nb;
    A->xsum = A->s2 + M * nb;
    A->q1 = (int8_t *)(A->xsum + M * nb);
    A->q2 = A->q1 + M * K;
    split_i8x2(x, M, K, A->q1, A->q2, A->s1, A->s2, A->xsum);
    return 1;
}

/* Rows r0 .. r0 + mr (mr <= I8_MR) of panel p into yr (rows ys apart, cols columns). Kept out of
 * line: inlined into the gated loop, GCC scheduled the AVX2 kernels at half their speed. */
static __attribute__((noinline)) void i8_panel_rows(int kind, const uint8_t *codes, const uint16_t *d, const void *m, int64_t K,
                                 int64_t p, const i8_acts *A, int64_t r0, int64_t mr, float *yr, int64_t ys,
                                 int64_t cols) {
    const int64_t nb = K / QK;
    const uint16_t *pd = d + p * nb * NR;
    const int8_t *a = A->q1 + r0 * K, *c = A->q2 + r0 * K;
    const float *sa = A->s1 + r0 * nb, *sb = A->s2 + r0 * nb, *xs = A->xsum + r0 * nb;
    if (kind == W_Q8_0) {
        const int8_t *pc = (const int8_t *)codes + p * (K / 4) * 128;
        const int16_t *pw = (const int16_t *)m + p * nb * NR;
        switch (mr) {
            case 1: i8_micro_q8(1, pc, pd, pw, K, a, c, sa, sb, yr, ys, cols); break;
            case 2: i8_micro_q8(2, pc, pd, pw, K, a, c, sa, sb, yr, ys, cols); break;
            default: i8_micro_q8(I8_MR, pc, pd, pw, K, a, c, sa, sb, yr, ys, cols); break;
        }
        return;
    }
    const uint8_t *pc = codes + p * (K / 4) * 64;
    const uint16_t *pm = (const uint16_t *)m + p * nb * NR;
    switch (mr) {
        case 1: i8_micro(1, pc, pd, pm, K, a, c, sa, sb, xs, yr, ys, cols); break;
        case 2: i8_micro(2, pc, pd, pm, K, a, c, sa, sb, xs, yr, ys, cols); break;
        default: i8_micro(I8_MR, pc, pd, pm, K, a, c, sa, sb, xs, yr, ys, cols); break;
    }
}

int i8x2_gemm(int kind, const uint8_t *codes, const uint16_t *d, const void *m, int64_t N, int64_t K,
              const float *x, int64_t M, float *y) {
    const int64_t P = (N + NR - 1) / NR;
    i8_acts A;
    if (!i8_split(x, M, K, &A)) return 0;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
        for (int64_t r0 = 0; r0 < M; r0 += I8_MR) {
            const int64_t mr = M - r0 < I8_MR ? M - r0 : I8_MR;
            i8_panel_rows(kind, codes, d, m, K, p, &A, r0, mr, y + r0 * N + p * NR, N, cols);
        }
    }
    return 1;
}

/* out (M, I) = silu(x Wg^T) * (x Wu^T) for W (2I, K) = the gate rows then the up rows, I a
 * multiple of 32: each gate panel is computed with its up panel, a few rows at a time, and
 * fused.c's SiLU-and-multiply applied to that tile, so the (M, 2I) product is never stored. The
 * same values as i8x2_gemm followed by silu_and_mul_f32. */
int i8x2_gated_gemm(int kind, const uint8_t *codes, const uint16_t *d, const void *m, int64_t N, int64_t K,
                    const float *x, int64_t M, float *out) {
    const int64_t I = N / 2, PI = I / NR;
    if (N % (2 * NR)) return 0;
    i8_acts A;
    if (!i8_split(x, M, K, &A)) return 0;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < PI; p++) {
        float gu[I8_MR * 2 * NR] __attribute__((aligned(64)));   /* [row][gate 32 | up 32] */
        float act[I8_MR * NR] __attribute__((aligned(64)));
        for (int64_t r0 = 0; r0 < M; r0 += I8_MR) {
            const int64_t mr = M - r0 < I8_MR ? M - r0 : I8_MR;
            i8_panel_rows(kind, codes, d, m, K, p, &A, r0, mr, gu, 2 * NR, NR);
            i8_panel_rows(kind, codes, d, m, K, p + PI, &A, r0, mr, gu + NR, 2 * NR, NR);
            gated_act_serial_f32(ACT_SILU, gu, 2 * NR, act, mr, NR);
            for (int64_t r = 0; r < mr; r++) memcpy(out + (r0 + r) * I + p * NR, act + r * NR, sizeof(float) * NR);
        }
    }
    return 1;
}
#else
int i8x2_available(void) { return 0; }
int i8x2_gemm(int kind, const uint8_t *codes, const uint16_t *d, const void *m, int64_t N, int64_t K,
              const float *x, int64_t M, float *y) {
    (void)kind; (void)codes; (void)d; (void)m; (void)N; (void)K; (void)x; (void)M; (void)y;
    return 0;
}
int i8x2_gated_gemm(int kind, const uint8_t *codes, const uint16_t *d, const void *m, int64_t N, int64_t K,
                    const float *x, int64_t M, float *out) {
    (void)kind; (void)codes; (void)d; (void)m; (void)N; (void)K; (void)x; (void)M; (void)out;
    return 0;
}
#endif
