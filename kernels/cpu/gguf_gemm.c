/* GGUF block formats multiplied natively by float32 activations on the CPU (AVX2 + FMA + F16C).
 *
 *   y[t, n] = sum_k x[t, k] * w[n, k]        w stored as GGUF blocks of 32 weights per row
 *
 * Q4_1 block (20 bytes): d (fp16), m (fp16), 16 bytes of nibbles; weight i < 16 is the low
 * nibble of byte i, weight i + 16 its high nibble; w = d * q + m.
 * Q8_0 block (34 bytes): d (fp16), 32 int8; w = d * q.
 *
 * Per block:  sum_i w_i x_i = d * sum_i q_i x_i + m * sum_i x_i, so the activation block sums
 * are computed once per row and the inner loop is 4 FMAs per 32 weights. Rows of x are taken
 * 8 at a time so each weight block is read from memory once per 8 rows. Output features are
 * split across OpenMP threads. Accumulation is float32 throughout.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define ROWS 8

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256 bytes_u8_to_ps(__m128i v) {   /* low 8 bytes, unsigned */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

static inline __m256 bytes_i8_to_ps(__m128i v) {   /* low 8 bytes, signed */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* xsum[t * nb + b] = sum of x[t, 32 b : 32 b + 32] */
static void block_sums(const float *x, int64_t T, int64_t K, float *xsum) {
    int64_t nb = K / QK;
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + t * K + b * QK;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            xsum[t * nb + b] = hsum(s);
        }
}

void q4_1_gemm(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t T, float *y) {
    const int64_t nb = K / QK;
    float *xsum = malloc(sizeof(float) * T * nb);
    block_sums(x, T, K, xsum);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * nb * 20;
        for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
            const int64_t rows = T - t0 < ROWS ? T - t0 : ROWS;
            __m256 acc[ROWS];
            float accm[ROWS];
            for (int r = 0; r < ROWS; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = 0.f; }
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * 20;
                const __m256 d = _mm256_set1_ps(fp16(blk));
                const float m = fp16(blk + 2);
                const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 4));
                const __m128i lo = _mm_and_si128(qs, low4);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
                const __m256 q0 = bytes_u8_to_ps(lo), q1 = bytes_u8_to_ps(_mm_srli_si128(lo, 8));
                const __m256 q2 = bytes_u8_to_ps(hi), q3 = bytes_u8_to_ps(_mm_srli_si128(hi, 8));
                for (int64_t r = 0; r < rows; r++) {
                    const float *xb = x + (t0 + r) * K + b * QK;
                    __m256 s = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
                    s = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), s);
                    s = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), s);
                    s = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), s);
                    acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
                    accm[r] += m * xsum[(t0 + r) * nb + b];
                }
            }
            for (int64_t r = 0; r < rows; r++) y[(t0 + r) * N + n] = hsum(acc[r]) + accm[r];
        }
    }
    free(xsum);
}

void q8_0_gemm(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t T, float *y) {
    const int64_t nb = K / QK;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * nb * 34;
        for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
            const int64_t rows = T - t0 < ROWS ? T - t0 : ROWS;
            __m256 acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * 34;
                const __m256 d = _mm256_set1_ps(fp16(blk));
                const __m128i qa = _mm_loadu_si128((const __m128i *)(blk + 2));
                const __m128i qb = _mm_loadu_si128((const __m128i *)(blk + 18));
                const __m256 q0 = bytes_i8_to_ps(qa), q1 = bytes_i8_to_ps(_mm_srli_si128(qa, 8));
                const __m256 q2 = bytes_i8_to_ps(qb), q3 = bytes_i8_to_ps(_mm_srli_si128(qb, 8));
                for (int64_t r = 0; r < rows; r++) {
                    const float *xb = x + (t0 + r) * K + b * QK;
                    __m256 s = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
                    s = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), s);
                    s = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), s);
                    s = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), s);
                    acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
                }
            }
            for (int64_t r = 0; r < rows; r++) y[(t0 + r) * N + n] = hsum(acc[r]);
        }
    }
}
