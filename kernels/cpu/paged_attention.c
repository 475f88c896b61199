/* Paged attention for decode on the CPU: one query token per request, its keys and values read
 * in place through the block table (no gather copy), grouped-query heads sharing each K/V load.
 *
 *   q       (B, H, D)                       float32
 *   kv      (2, num_blocks, BS, KVH, D)     float32, float16, bfloat16 or an 8-bit float (kt:
 *                                           PA_F32, PA_F16, PA_BF16, PA_FP8E4M3, PA_FP8E5M2),
 *                                           [0] keys, [1] values; narrower rows are widened to
 *                                           float32 as they are loaded
 *   k_scale, v_scale                        8-bit caches only (NULL: 1): a stored key is
 *                                           fp8(key / k_scale), read as fp8 * k_scale; the
 *                                           scales are applied once per score and per output,
 *                                           not per element (vLLM's k_scale / v_scale)
 *   table   (B, max_blocks)                 int32 block ids
 *   seq_lens(B,)                            int32: tokens in the cache, the query's included
 *   out     (B, H, D)                       float32
 *   window  0 = full attention; W: keys at positions > p - W only (p = seq_len - 1)
 *
 * Work: a request's visible positions are cut into chunks of whole blocks (only when the batch
 * is too small to keep every thread busy; otherwise one chunk per request), and the (request,
 * chunk) items are shared among the OpenMP threads. An item walks its positions a tile at a
 * time (at most 16 consecutive positions inside one block) and, per KV head and per group of
 * up to 4 of its query heads:
 *   1. scores of every head x token of the tile: per token, the D-long products are summed into
 *      one 16-lane vector per head, and the tile's 16 vectors are transposed-and-added into one
 *      vector of 16 scores (no per-token horizontal sum);
 *   2. one running-max update and rescale per head per tile, exp of the 16 scores at once;
 *   3. the values weighted by those probabilities added into accumulators held in registers.
 * While a KV head's rows of one tile are read, the same head's rows of the next tile are
 * prefetched into L2, a few lines per token (blocks are scattered, so the hardware prefetchers
 * lose the stream at every block; spread out, the prefetches overlap the arithmetic).
 * A request cut into several chunks has its partial (max, sum, accumulator) merged by their
 * log-sum-exps at the end.
 * The tile is written for AVX-512 (16-lane vectors, head sizes a multiple of 16) and for AVX2
 * (pa_tile256: two 8-lane vectors of scores per tile, head sizes a multiple of 8); other head
 * sizes and CPUs take a portable tile in plain C.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#include "vec8.h"
#endif

#define PA_MAX_HEADS 64
#define PA_MAX_D 256
#define PA_TILE 16          /* positions per tile (one AVX-512 vector of scores) */
#define PA_GROUP 4          /* query heads of one KV head processed together */
#define PA_MIN_CHUNK 128    /* never cut a request into chunks shorter than this (positions) */
#ifndef PA_PREFETCH
#define PA_PREFETCH 1       /* software prefetch of the K/V rows this many tiles ahead (0: none) */
#endif
#ifndef PA_PF_LOC
#define PA_PF_LOC 2         /* __builtin_prefetch locality: 2 = into L2 (prefetcht1); into L1 (3),
                               the prefetches queue behind the core's few L1 miss buffers and the
                               tile reads the cache at 12-13 GB/s, into L2 at 17-23 GB/s (1.5-1.7x) */
#endif

#define PA_F32 0
#define PA_F16 1
#define PA_BF16 2
#define PA_FP8E4M3 3        /* torch.float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa, max 448, no inf */
#define PA_FP8E5M2 4        /* torch.float8_e5m2: the top byte of a float16, max 57344 */
#define PA_KT_COUNT 5
#define PA_ES(kt) ((kt) == PA_F32 ? 4 : (kt) <= PA_BF16 ? 2 : 1)   /* bytes per element */

typedef struct {
    const char *kv, *vbase;        /* the cache's keys and values; offsets below are in elements */
    int64_t D, token_stride, block_stride, BS, es;   /* es: bytes per element */
    int kt;
    float scale;                   /* softmax scale, times the keys' read factor (8-bit caches) */
    float vmul;                    /* the values' read factor (1 but for 8-bit caches) */
    float softcap;                 /* > 0: scores capped, softcap * tanh(s / softcap) (Gemma 2) */
} pa_ctx;

/* ---- 8-bit floats ------------------------------------------------------------------------
 * float32 -> fp8: round to nearest even, the same bit arithmetic as torch's .to() (c10's
 * fp8e4m3fn/fp8e5m2_from_fp32_value), so every value in range gets torch's byte; beyond the
 * largest finite value (448 / 57344, infinities included) it saturates there, as vLLM's
 * kernels do; NaN stays NaN (0x7f with its sign). fp8 -> float32 is exact: a 256-entry table. */
static inline uint8_t pa_f32_to_fp8(float f, int kt) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = (bits >> 24) & 0x80u, u = bits & 0x7fffffffu;
    if (u > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    const int e4 = kt == PA_FP8E4M3;
    uint32_t code;
    if (u >= (e4 ? 121u : 113u) << 23) {              /* normal: round the mantissa, rebias */
        const int sh = e4 ? 20 : 21;
        const uint32_t r = u - ((e4 ? 120u : 112u) << 23);
        code = (r + ((1u << (sh - 1)) - 1u) + ((r >> sh) & 1u)) >> sh;
        const uint32_t mx = e4 ? 0x7eu : 0x7bu;
        if (code > mx) code = mx;
    } else {                                          /* subnormal: adding 2^14 (2^7) rounds |f| */
        float a, big = e4 ? 16384.f : 128.f;          /* to the fp8 step, 2^-9 (2^-16), by the FPU */
        memcpy(&a, &u, 4);
        const float t = a + big;
        uint32_t tb, bb;
        memcpy(&tb, &t, 4);
        memcpy(&bb, &big, 4);
        code = tb - bb;
    }
    return (uint8_t)(sign | code);
}

static float pa_fp8_value(uint8_t b, int kt) {
    const int e4 = kt == PA_FP8E4M3, mbits = e4 ? 3 : 2, bias = e4 ? 7 : 15;
    const int e = (b & 0x7f) >> mbits, m = b & ((1 << mbits) - 1);
    float v;
    if (e4 && (b & 0x7f) == 0x7f) v = NAN;
    else if (!e4 && e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexpf((float)m, 1 - bias - mbits);
    else v = ldexpf((float)(m + (1 << mbits)), e - bias - mbits);
    return (b & 0x80) ? -v : v;
}

static float pa_fp8_lut[2][256];       /* [kt - PA_FP8E4M3][byte]: the byte's value */

__attribute__((constructor)) static void pa_fp8_init(void) {
    for (int t = 0; t < 2; t++)
        for (int b = 0; b < 256; b++) pa_fp8_lut[t][b] = pa_fp8_value((uint8_t)b, PA_FP8E4M3 + t);
}

/* Element to float32 conversion of a whole call for an 8-bit cache read with scale s: the
 * portable path reads the table's exact values (factor 1); the AVX-512 tiles read e4m3 bytes
 * as float16 bit patterns, 2^-8 of their value (every fp8 value, subnormals included, exact),
 * so their factor is 256. */
static inline float pa_read_factor(int kt, int vec, const float *s) {
    if (kt < PA_FP8E4M3) return 1.f;
    return (s ? *s : 1.f) * (vec && kt == PA_FP8E4M3 ? 256.f : 1.f);
}

/* One element of a 16-bit cache row as float32 (the portable path). */
static inline float pa_half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0x1f) bits = sign | 0x7f800000u | (m << 13);          /* inf, nan */
    else if (e) bits = sign | ((e + 112u) << 23) | (m << 13);      /* normal */
    else if (!m) bits = sign;                                     /* zero */
    else {                                                        /* subnormal: normalize */
        int sh = 0;
        uint32_t mm = m;
        while (!(mm & 0x400u)) { mm <<= 1; sh++; }
        bits = sign | ((uint32_t)(113 - sh) << 23) | ((mm & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void pa_row_to_f32(const char *src, int kt, int64_t n, float *dst) {
    if (kt == PA_F32) { memcpy(dst, src, sizeof(float) * n); return; }
    if (kt >= PA_FP8E4M3) {
        const uint8_t *b = (const uint8_t *)src;
        const float *lut = pa_fp8_lut[kt - PA_FP8E4M3];
        for (int64_t i = 0; i < n; i++) dst[i] = lut[b[i]];
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
    if (kt == PA_F16)
        for (int64_t i = 0; i < n; i++) dst[i] = pa_half_to_f32(h[i]);
    else
        for (int64_t i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(dst + i, &bits, 4);
        }
}

/* The tile functions of a vector width, instantiated per element type KT, heads NH and D / lanes
 * DV (0: any, read at run time) from one always-inline template T, and their table
 * pa_tiles[element type][D == 64, == 128, other][heads - 1] (DV64, DV128: D / lanes there). */
typedef void (*pa_tile_fn)(const float *, const char *, const char *, int64_t, int, int64_t, float,
                           float *, float *, float *, const char *, const char *, int);
#define PA_TILE_FN(T, KT, NH, DV)                                                                    \
    static void T##_##KT##_##NH##_##DV(const float *q, const char *k, const char *v, int64_t ts,      \
                                       int n, int64_t D, float scale, float *m, float *l,             \
                                       float *acc, const char *kp, const char *vp, int np) {          \
        T(NH, DV, KT, q, k, v, ts, n, D, scale, m, l, acc, kp, vp, np);                              \
    }
#define PA_TILE_FNS(T, KT, DV)                                                                       \
    PA_TILE_FN(T, KT, 1, DV) PA_TILE_FN(T, KT, 2, DV) PA_TILE_FN(T, KT, 3, DV) PA_TILE_FN(T, KT, 4, DV)
#define PA_TILE_ROW(T, KT, DV) {T##_##KT##_1_##DV, T##_##KT##_2_##DV, T##_##KT##_3_##DV, T##_##KT##_4_##DV}
#define PA_TILE_KT(T, KT, DV64, DV128) PA_TILE_FNS(T, KT, 0) PA_TILE_FNS(T, KT, DV64) PA_TILE_FNS(T, KT, DV128)
#define PA_TILE_TABLE(T, DV64, DV128)                                                                \
    PA_TILE_KT(T, 0, DV64, DV128) PA_TILE_KT(T, 1, DV64, DV128) PA_TILE_KT(T, 2, DV64, DV128)        \
    PA_TILE_KT(T, 3, DV64, DV128) PA_TILE_KT(T, 4, DV64, DV128)                                      \
    static const pa_tile_fn pa_tiles[PA_KT_COUNT][3][PA_GROUP] = {                                   \
        {PA_TILE_ROW(T, 0, DV64), PA_TILE_ROW(T, 0, DV128), PA_TILE_ROW(T, 0, 0)},                    \
        {PA_TILE_ROW(T, 1, DV64), PA_TILE_ROW(T, 1, DV128), PA_TILE_ROW(T, 1, 0)},                    \
        {PA_TILE_ROW(T, 2, DV64), PA_TILE_ROW(T, 2, DV128), PA_TILE_ROW(T, 2, 0)},                    \
        {PA_TILE_ROW(T, 3, DV64), PA_TILE_ROW(T, 3, DV128), PA_TILE_ROW(T, 3, 0)},                    \
        {PA_TILE_ROW(T, 4, DV64), PA_TILE_ROW(T, 4, DV128), PA_TILE_ROW(T, 4, 0)},                    \
    };

#ifdef __AVX512F__
#define PA_VW 16            /* the tile's vector width: 16 float32 lanes */
/* 16 consecutive elements of a cache row (kt a compile-time constant where inlined) as float32;
 * e4m3 bytes as 2^-8 of their value (see pa_read_factor). */
static inline __attribute__((always_inline)) __m512 pa_load16(const char *p, const int kt) {
    if (kt == PA_FP8E4M3) {   /* s eeee mmm -> float16 s 0eeee mmm0000000: bias 15 for 7 */
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        return _mm512_cvtph_ps(h);
    }
    if (kt == PA_FP8E5M2)     /* the top byte of a float16 */
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
    if (kt == PA_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (kt == PA_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* expf of 16 lanes, x <= ~88 (Cephes' polynomial, about 1 ulp); -inf and very negative -> 0. */
static inline __m512 pa_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* v[t] (t < 16): 16 partial sums of token t -> lane t: the sum of v[t]. A transpose-and-add in
 * four levels, each adding pairs of vectors' halves so that the tokens end up interleaved:
 * lanes mod 2, mod 4, then 128-bit lanes mod 2 and 4 hold tokens in order. */
static inline __m512 pa_sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)          /* lanes: t0 t1 t0 t1 | ... of pair i */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {        /* lanes: t0 t1 t2 t3 | ... of quad i */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)          /* 128-bit lanes: t0-3 t0-3 t4-7 t4-7 of octet i */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* One tile of n (1..16) positions for NH query heads sharing one KV head, KT the cache's
 * element type (PA_F32 / PA_F16 / PA_BF16 / PA_FP8E4M3 / PA_FP8E5M2).
 * qh: the first head's query (heads D apart); k, v: the tile's first key/value row of this KV
 * head (rows ts elements apart); m, l, acc: the heads' running max, sum and accumulator (acc D
 * apart); kp, vp, np: the rows of a later tile to prefetch. */
static inline __attribute__((always_inline)) void
pa_tile512(const int NH, const int64_t DVc, const int KT, const float *qh, const char *k, const char *v,
           int64_t ts, int n, int64_t Dr, float scale, float *m, float *l, float *acc, const char *kp,
           const char *vp, int np) {
    const int64_t DV = DVc ? DVc : Dr / 16, D = 16 * DV;   /* DVc: D / 16 known at compile time */
    const int64_t ES = PA_ES(KT), tb = ts * ES;   /* bytes per element, per row */
    __m512 part[PA_GROUP][PA_TILE];
    for (int t = 0; t < n; t++) {
        const char *kt = k + t * tb;
        if (t < np)                     /* a later tile's rows of this KV head, on their way */
            for (int64_t x = 0; x < D * ES; x += 64) {
                __builtin_prefetch(kp + t * tb + x, 0, PA_PF_LOC);
                __builtin_prefetch(vp + t * tb + x, 0, PA_PF_LOC);
            }
        __m512 s[PA_GROUP];
        for (int h = 0; h < NH; h++) s[h] = _mm512_setzero_ps();
        for (int64_t dv = 0; dv < DV; dv++) {
            const __m512 kk = pa_load16(kt + 16 * dv * ES, KT);
            for (int h = 0; h < NH; h++)
                s[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + h * D + 16 * dv), kk, s[h]);
        }
        for (int h = 0; h < NH; h++) part[h][t] = s[h];
    }
    for (int t = n; t < PA_TILE; t++)
        for (int h = 0; h < NH; h++) part[h][t] = _mm512_setzero_ps();
    const __mmask16 valid = (__mmask16)((1u << n) - 1u);
    float p[PA_GROUP][PA_TILE] __attribute__((aligned(64)));
    float c[PA_GROUP];
    for (int h = 0; h < NH; h++) {
        __m512 sc = _mm512_mul_ps(pa_sum16(part[h]), _mm512_set1_ps(scale));
        sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sc);
        const float mx = _mm512_reduce_max_ps(sc);
        const float mnew = mx > m[h] ? mx : m[h];
        c[h] = mnew == m[h] ? 1.f : expf(m[h] - mnew);  /* 0 for the first tile (m = -inf) */
        const __m512 e = pa_exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mnew)));
        l[h] = l[h] * c[h] + _mm512_reduce_add_ps(e);
        m[h] = mnew;
        _mm512_store_ps(p[h], e);
    }
    /* acc[h] = acc[h] * c[h] + sum_t p[h][t] v[t], 4 vectors of D at a time in registers */
    for (int64_t d0 = 0; d0 < DV; d0 += 4) {
        const int w = DV - d0 < 4 ? (int)(DV - d0) : 4;
        if (w == 4) {
            __m512 a[PA_GROUP][4];
            for (int h = 0; h < NH; h++)
                for (int j = 0; j < 4; j++)
                    a[h][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + 16 * (d0 + j)), _mm512_set1_ps(c[h]));
            for (int t = 0; t < n; t++) {
                const char *vt = v + t * tb + 16 * d0 * ES;
                const __m512 v0 = pa_load16(vt, KT), v1 = pa_load16(vt + 16 * ES, KT),
                             v2 = pa_load16(vt + 32 * ES, KT), v3 = pa_load16(vt + 48 * ES, KT);
                for (int h = 0; h < NH; h++) {
                    const __m512 pb = _mm512_set1_ps(p[h][t]);
                    a[h][0] = _mm512_fmadd_ps(pb, v0, a[h][0]);
                    a[h][1] = _mm512_fmadd_ps(pb, v1, a[h][1]);
                    a[h][2] = _mm512_fmadd_ps(pb, v2, a[h][2]);
                    a[h][3] = _mm512_fmadd_ps(pb, v3, a[h][3]);
                }
            }
            for (int h = 0; h < NH; h++)
                for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + h * D + 16 * (d0 + j), a[h][j]);
        } else {
            for (int j = 0; j < w; j++) {
                __m512 a[PA_GROUP];
                for (int h = 0; h < NH; h++)
                    a[h] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + 16 * (d0 + j)), _mm512_set1_ps(c[h]));
                for (int t = 0; t < n; t++) {
                    const __m512 vv = pa_load16(v + t * tb + 16 * (d0 + j) * ES, KT);
                    for (int h = 0; h < NH; h++) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][t]), vv, a[h]);
                }
                for (int h = 0; h < NH; h++) _mm512_storeu_ps(acc + h * D + 16 * (d0 + j), a[h]);
            }
        }
    }
}

PA_TILE_TABLE(pa_tile512, 4, 8)         /* D / 16 == 4, == 8 */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PA_VW 8             /* the tile's vector width: 8 float32 lanes */
/* 8 consecutive elements of a cache row as float32 (as pa_load16, 8 lanes). */
static inline __attribute__((always_inline)) __m256 pa_load8(const char *p, const int kt) {
    if (kt == PA_FP8E4M3) {   /* s eeee mmm -> float16 s 0eeee mmm0000000: bias 15 for 7 */
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                       _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
        return _mm256_cvtph_ps(h);
    }
    if (kt == PA_FP8E5M2)     /* the top byte of a float16 */
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
    if (kt == PA_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (kt == PA_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* expf of 8 lanes, x <= 0 here (scores minus their running max): Cephes' polynomial, about 1
 * ulp; below -87 (where expf is subnormal or 0, -inf included) 0, negligible next to the max's 1. */
static inline __m256 pa_exp256(__m256 x) {
    const __m256 gone = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(gone, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));     /* p * 2^n */
}

/* v[t] (t < 8): 8 partial sums of token t -> lane t: the sum of v[t] (a transpose-and-add in
 * three levels, as pa_sum16). */
static inline __m256 pa_sum8(const __m256 *v) {
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++)          /* lanes: t0 t1 t0 t1 | t0 t1 t0 t1 of pair i */
        a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {        /* lanes: t0 t1 t2 t3 | t0 t1 t2 t3 of quad i */
        const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
        b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

/* pa_tile512 for AVX2 (16 registers of 8 lanes): the tile's 16 positions as two vectors of 8
 * scores per head, and the values added into register accumulators a few vectors of D at a time
 * (fewer when more heads share the KV head). DVc: D / 8 when known at compile time. */
static inline __attribute__((always_inline)) void
pa_tile256(const int NH, const int64_t DVc, const int KT, const float *qh, const char *k, const char *v,
           int64_t ts, int n, int64_t Dr, float scale, float *m, float *l, float *acc, const char *kp,
           const char *vp, int np) {
    const int64_t DV = DVc ? DVc : Dr / 8, D = 8 * DV;
    const int64_t ES = PA_ES(KT), tb = ts * ES;
    const int CW = NH <= 2 ? 4 : 2;            /* vectors of D per head in registers at once */
    __m256 sc[PA_GROUP][2];
    for (int half = 0; half < 2; half++) {
        if (half * 8 >= n) {
            for (int h = 0; h < NH; h++) sc[h][half] = _mm256_set1_ps(-INFINITY);
            continue;
        }
        __m256 part[PA_GROUP][8];
        for (int tt = 0; tt < 8; tt++) {
            const int t = half * 8 + tt;
            if (t >= n) {
                for (int h = 0; h < NH; h++) part[h][tt] = _mm256_setzero_ps();
                continue;
            }
            const char *kt = k + t * tb;
            if (t < np)
                for (int64_t x = 0; x < D * ES; x += 64) {
                    __builtin_prefetch(kp + t * tb + x, 0, PA_PF_LOC);
                    __builtin_prefetch(vp + t * tb + x, 0, PA_PF_LOC);
                }
            __m256 s[PA_GROUP];
            for (int h = 0; h < NH; h++) s[h] = _mm256_setzero_ps();
            for (int64_t dv = 0; dv < DV; dv++) {
                const __m256 kk = pa_load8(kt + 8 * dv * ES, KT);
                for (int h = 0; h < NH; h++)
                    s[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + h * D + 8 * dv), kk, s[h]);
            }
            for (int h = 0; h < NH; h++) part[h][tt] = s[h];
        }
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(n - half * 8), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        for (int h = 0; h < NH; h++)
            sc[h][half] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                           _mm256_mul_ps(pa_sum8(part[h]), _mm256_set1_ps(scale)), valid);
    }
    float p[PA_GROUP][PA_TILE] __attribute__((aligned(32)));
    float c[PA_GROUP];
    for (int h = 0; h < NH; h++) {
        const float mx = hmax8(_mm256_max_ps(sc[h][0], sc[h][1]));
        const float mnew = mx > m[h] ? mx : m[h];
        c[h] = mnew == m[h] ? 1.f : expf(m[h] - mnew);  /* 0 for the first tile (m = -inf) */
        const __m256 mb = _mm256_set1_ps(mnew);
        const __m256 e0 = pa_exp256(_mm256_sub_ps(sc[h][0], mb)), e1 = pa_exp256(_mm256_sub_ps(sc[h][1], mb));
        l[h] = l[h] * c[h] + hsum8(_mm256_add_ps(e0, e1));
        m[h] = mnew;
        _mm256_store_ps(p[h], e0);
        _mm256_store_ps(p[h] + 8, e1);
    }
    /* acc[h] = acc[h] * c[h] + sum_t p[h][t] v[t], CW vectors of D at a time in registers */
    for (int64_t d0 = 0; d0 < DV; d0 += CW) {
        if (DV - d0 >= CW) {
            __m256 a[PA_GROUP][4];
            for (int h = 0; h < NH; h++)
                for (int j = 0; j < CW; j++)
                    a[h][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + 8 * (d0 + j)), _mm256_set1_ps(c[h]));
            for (int t = 0; t < n; t++) {
                const char *vt = v + t * tb + 8 * d0 * ES;
                __m256 vv[4];
                for (int j = 0; j < CW; j++) vv[j] = pa_load8(vt + 8 * j * ES, KT);
                for (int h = 0; h < NH; h++) {
                    const __m256 pb = _mm256_set1_ps(p[h][t]);
                    for (int j = 0; j < CW; j++) a[h][j] = _mm256_fmadd_ps(pb, vv[j], a[h][j]);
                }
            }
            for (int h = 0; h < NH; h++)
                for (int j = 0; j < CW; j++) _mm256_storeu_ps(acc + h * D + 8 * (d0 + j), a[h][j]);
        } else {
            for (int64_t j = d0; j < DV; j++) {
                __m256 a[PA_GROUP];
                for (int h = 0; h < NH; h++)
                    a[h] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + 8 * j), _mm256_set1_ps(c[h]));
                for (int t = 0; t < n; t++) {
                    const __m256 vv = pa_load8(v + t * tb + 8 * j * ES, KT);
                    for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[h][t]), vv, a[h]);
                }
                for (int h = 0; h < NH; h++) _mm256_storeu_ps(acc + h * D + 8 * j, a[h]);
            }
        }
    }
}

PA_TILE_TABLE(pa_tile256, 8, 16)        /* D / 8 == 8, == 16 */
#endif

/* Portable tile: the same blockwise softmax in plain C; softcap > 0 caps each scaled score
 * (softcap * tanh(s / softcap)), the one tile that does. */
static void pa_tile_c(int NH, const float *qh, const float *k, const float *v, int64_t ts, int n,
                      int64_t D, float scale, float softcap, float *m, float *l, float *acc, const float *kp,
                      const float *vp, int np) {
    float p[PA_GROUP][PA_TILE];
    for (int t = 0; t < np; t++)
        for (int64_t x = 0; x < D; x += 16) {
            __builtin_prefetch(kp + t * ts + x, 0, PA_PF_LOC);
            __builtin_prefetch(vp + t * ts + x, 0, PA_PF_LOC);
        }
    for (int h = 0; h < NH; h++) {
        const float *qq = qh + h * D;
        float mx = -INFINITY;
        for (int t = 0; t < n; t++) {
            const float *kt = k + t * ts;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; d++) dot += qq[d] * kt[d];
            p[h][t] = dot * scale;
            if (softcap > 0.f) p[h][t] = softcap * tanhf(p[h][t] / softcap);
            mx = p[h][t] > mx ? p[h][t] : mx;
        }
        const float mnew = mx > m[h] ? mx : m[h];
        const float c = expf(m[h] - mnew);
        float sum = 0.f;
        for (int t = 0; t < n; t++) {
            p[h][t] = expf(p[h][t] - mnew);
            sum += p[h][t];
        }
        l[h] = l[h] * c + sum;
        m[h] = mnew;
        float *a = acc + h * D;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) a[d] *= c;
    }
    for (int t = 0; t < n; t++) {
        const float *vt = v + t * ts;
        for (int h = 0; h < NH; h++) {
            float *a = acc + h * D;
            const float w = p[h][t];
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) a[d] += w * vt[d];
        }
    }
}

/* Positions [p0, p1) of request b: running max m, sum l and unnormalized accumulator acc of
 * every head (acc heads D apart). */
static void pa_range(const pa_ctx *cx, const float *qb, const int32_t *tab, int64_t H, int64_t KVH,
                     int64_t p0, int64_t p1, float *m, float *l, float *acc) {
    const int64_t D = cx->D, G = H / KVH, BS = cx->BS, ts = cx->token_stride, es = cx->es;
    for (int64_t h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    memset(acc, 0, sizeof(float) * H * D);
#ifdef PA_VW
    const int vec = D % PA_VW == 0 && !(cx->softcap > 0.f);     /* capped scores: the C tile */
    const pa_tile_fn *tiles = pa_tiles[cx->kt][D == 64 ? 0 : D == 128 ? 1 : 2];
#endif
    for (int64_t pos = p0; pos < p1;) {
        const int64_t in_blk = pos % BS;
        int64_t n = BS - in_blk;
        if (n > PA_TILE) n = PA_TILE;
        if (n > p1 - pos) n = p1 - pos;
        const int64_t off = ((int64_t)tab[pos / BS] * cx->block_stride + in_blk * ts) * es;
        const char *kt = cx->kv + off, *vt = cx->vbase + off;
        /* the tile PA_PREFETCH tiles ahead: each KV head's rows are prefetched while the same
         * head's rows of this tile are read, spread over its tokens */
        const char *ka = cx->kv, *va = cx->vbase;
        int64_t an = 0;
        const int64_t ap = pos + PA_PREFETCH * PA_TILE;
        if (PA_PREFETCH > 0 && ap < p1) {
            const int64_t ab = ap % BS;
            an = BS - ab;
            if (an > PA_TILE) an = PA_TILE;
            if (an > p1 - ap) an = p1 - ap;
            const int64_t aoff = ((int64_t)tab[ap / BS] * cx->block_stride + ab * ts) * es;
            ka += aoff;
            va += aoff;
        }
        for (int64_t g = 0; g < KVH; g++) {
            const char *k = kt + g * D * es, *v = vt + g * D * es;
            float kbuf[PA_TILE * PA_MAX_D], vbuf[PA_TILE * PA_MAX_D];
            int converted = 0;
            for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += PA_GROUP) {
                const int nh = (g + 1) * G - h0 < PA_GROUP ? (int)((g + 1) * G - h0) : PA_GROUP;
                const float *qh = qb + h0 * D;
                float *mh = m + h0, *lh = l + h0, *ah = acc + h0 * D;
                const int np = h0 == g * G ? (int)an : 0;
#ifdef PA_VW
                if (vec) {
                    tiles[nh - 1](qh, k, v, ts, (int)n, D, cx->scale, mh, lh, ah, ka + g * D * es,
                                  va + g * D * es, np);
                    continue;
                }
#endif
                if (cx->kt == PA_F32) {
                    pa_tile_c(nh, qh, (const float *)k, (const float *)v, ts, (int)n, D, cx->scale, cx->softcap,
                              mh, lh,
                              ah, (const float *)(ka + g * D * es), (const float *)(va + g * D * es), np);
                    continue;
                }
                if (!converted) {       /* narrower rows widened once per KV head and tile */
                    for (int64_t t = 0; t < n; t++) {
                        pa_row_to_f32(k + t * ts * es, cx->kt, D, kbuf + t * D);
                        pa_row_to_f32(v + t * ts * es, cx->kt, D, vbuf + t * D);
                    }
                    converted = 1;
                }
                pa_tile_c(nh, qh, kbuf, vbuf, D, (int)n, D, cx->scale, cx->softcap, mh, lh, ah, kbuf, vbuf, 0);
            }
        }
        pos += n;
    }
}

static void pa_write(float *o, const float *acc, const float *l, int64_t H, int64_t D, float vmul) {
    for (int64_t h = 0; h < H; h++) {
        const float inv = l[h] > 0.f ? vmul / l[h] : 0.f;
        for (int64_t d = 0; d < D; d++) o[h * D + d] = acc[h * D + d] * inv;
    }
}

static void pa_write_lse(float *lse, const float *m, const float *l, int64_t H) {
    for (int64_t h = 0; h < H; h++) lse[h] = l[h] > 0.f ? m[h] + logf(l[h]) : -INFINITY;
}

void paged_decode_lse(const float *q, const void *kv, int64_t kt, const int32_t *table,
                      const int32_t *seq_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                      int64_t BS, int64_t num_blocks, int64_t max_blocks, float scale, int64_t window,
                      const float *k_scale, const float *v_scale, float *lse, float softcap);

void paged_decode(const float *q, const void *kv, int64_t kt, const int32_t *table,
                  const int32_t *seq_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                  int64_t BS, int64_t num_blocks, int64_t max_blocks, float scale, int64_t window,
                  const float *k_scale, const float *v_scale) {
    paged_decode_lse(q, kv, kt, table, seq_lens, out, B, H, KVH, D, BS, num_blocks, max_blocks, scale, window,
                     k_scale, v_scale, NULL, 0.f);
}

/* paged_decode that also writes, when lse is not NULL, each (request, head)'s log-sum-exp of
 * its scaled scores, lse (B, H) float32 (-inf for an empty context): what merging this
 * attention with another over other keys needs. softcap > 0 caps the scaled scores (softcap *
 * tanh(s / softcap), Gemma 2's), through the portable tile. */
void paged_decode_lse(const float *q, const void *kv, int64_t kt, const int32_t *table,
                      const int32_t *seq_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                      int64_t BS, int64_t num_blocks, int64_t max_blocks, float scale, int64_t window,
                      const float *k_scale, const float *v_scale, float *lse, float softcap) {
    if (B <= 0 || kt < PA_F32 || kt >= PA_KT_COUNT) return;
    int vec = 0;
#ifdef PA_VW
    vec = D % PA_VW == 0 && !(softcap > 0.f);    /* as pa_range decides: the key read factor follows */
#endif
    pa_ctx cx;
    cx.kt = (int)kt;
    cx.es = PA_ES(kt);
    cx.kv = (const char *)kv;
    cx.D = D;
    cx.BS = BS;
    cx.token_stride = KVH * D;
    cx.block_stride = BS * KVH * D;
    cx.vbase = cx.kv + num_blocks * cx.block_stride * cx.es;
    cx.scale = scale * pa_read_factor((int)kt, vec, k_scale);    /* exactly scale but for 8-bit caches */
    cx.vmul = pa_read_factor((int)kt, vec, v_scale);
    cx.softcap = softcap;
    int nth = 1;
#ifdef _OPENMP
    nth = omp_get_max_threads();
#endif
    /* Chunk length: whole blocks, long enough that the batch makes about 4 items per thread. */
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        total += (window > 0 && len > window) ? window : (len > 0 ? len : 0);
    }
    int64_t chunk = INT64_MAX / 4;
    if (nth > 1) {
        chunk = (total + 4 * nth - 1) / (4 * nth);
        if (chunk < PA_MIN_CHUNK) chunk = PA_MIN_CHUNK;
        chunk = (chunk + BS - 1) / BS * BS;
    }
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (B + 1));  /* first item of request b */
    if (!first) return;
    first[0] = 0;
    int split = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        int64_t nc = 1;
        if (len > start) {
            const int64_t base = start / BS * BS;
            nc = (len - base + chunk - 1) / chunk;
        }
        split |= nc > 1;
        first[b + 1] = first[b] + nc;
    }
    const int64_t items = first[B];
    int64_t *item_b = (int64_t *)malloc(sizeof(int64_t) * items);
    float *part = NULL;               /* per split item: m[H], l[H], acc[H * D] */
    const int64_t part_stride = H * (D + 2);
    if (split) part = (float *)malloc(sizeof(float) * items * part_stride);
    if (!item_b || (split && !part)) {
        free(first); free(item_b); free(part);
        return;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = first[b]; i < first[b + 1]; i++) item_b[i] = b;

    #pragma omp parallel
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            const int64_t b = item_b[i], len = seq_lens[b], c = i - first[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t base = start / BS * BS;
            int64_t p0 = base + c * chunk, p1 = p0 + chunk;
            if (p0 < start) p0 = start;
            if (p1 > len) p1 = len;
            const float *qb = q + b * H * D;
            const int32_t *tab = table + b * max_blocks;
            if (first[b + 1] - first[b] == 1) {
                float m[PA_MAX_HEADS], l[PA_MAX_HEADS];
                float acc[PA_MAX_HEADS * PA_MAX_D] __attribute__((aligned(64)));
                pa_range(&cx, qb, tab, H, KVH, p0, p1, m, l, acc);
                pa_write(out + b * H * D, acc, l, H, D, cx.vmul);
                if (lse) pa_write_lse(lse + b * H, m, l, H);
            } else {
                float *pm = part + i * part_stride;
                pa_range(&cx, qb, tab, H, KVH, p0, p1, pm, pm + H, pm + 2 * H);
            }
        }
        if (split) {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t b = 0; b < B; b++) {
                const int64_t i0 = first[b], i1 = first[b + 1];
                if (i1 - i0 == 1) continue;
                float *o = out + b * H * D;
                for (int64_t h = 0; h < H; h++) {
                    float M = -INFINITY;
                    for (int64_t i = i0; i < i1; i++) {
                        const float mi = part[i * part_stride + h];
                        M = mi > M ? mi : M;
                    }
                    float L = 0.f;
                    float *oh = o + h * D;
                    for (int64_t d = 0; d < D; d++) oh[d] = 0.f;
                    for (int64_t i = i0; i < i1; i++) {
                        const float *pm = part + i * part_stride;
                        const float w = pm[h] == -INFINITY ? 0.f : expf(pm[h] - M);
                        L += pm[H + h] * w;
                        const float *a = pm + 2 * H + h * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) oh[d] += a[d] * w;
                    }
                    const float inv = L > 0.f ? cx.vmul / L : 0.f;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) oh[d] *= inv;
                    if (lse) lse[b * H + h] = L > 0.f ? M + logf(L) : -INFINITY;
                }
            }
        }
    }
    free(first);
    free(item_b);
    free(part);
}

/* ---------------------------------------------------------------------------------------------
 * Causal attention of prompt chunks, all the step's chunks in one call: request i's lens[i]
 * queries are the positions ctx[i] .. ctx[i] + lens[i] - 1 of a sequence whose keys and values
 * 0 .. ctx[i] + lens[i] - 1 are rows kstarts[i] .. of k and v. A fresh prompt (ctx 0) reads
 * its q/k/v in place from the projection's output (kstarts = qstarts); a chunk after cached
 * context reads keys its caller gathered (the context, then the chunk's own).
 *
 *   q    (T, H, D)    rows qs0 apart, heads qs1 apart, unit stride along D      float32
 *   k, v (S, KVH, D)  rows ks0 / vs0 apart, heads ks1 / vs1 apart               float32
 *   out  (T, H, D)    rows os0 apart, heads os1 apart; only the requests' rows are written
 *   qstarts, kstarts, lens, ctx (R,) int64
 *   lse  (T, H)       rows ls0 apart, heads contiguous, or NULL: each written query row's
 *                     log-sum-exp of its scaled scores (for merging with attention over other keys)
 *
 * Flash-attention style: work items are (request, KV head, query tile of 16 positions, aligned
 * with the key tiles, so a chunk's first and last tiles may hold fewer queries), the longest
 * (latest query tiles) first, shared dynamically among the OpenMP threads. An item walks the
 * request's key tiles of 16 up to the diagonal and, for each of the G query heads of its KV
 * head:
 *   1. scores 16 x 16: the key tile is stored transposed (D rows of 16 keys, done once for the
 *      whole call by a first pass), so each query's 16 scores are one vector accumulated over D
 *      by broadcast FMAs (the query pre-multiplied by the scale);
 *   2. the causal mask on the diagonal tile only; the 16 rows' maxima and sums as one vector
 *      each (transpose-and-reduce), one rescale per row per tile, the vectorized exp;
 *   3. acc += P V, 4 rows x 4 vectors of D held in registers per pass over the tile's values.
 * On AVX2 CPUs (cp_item256) the same with 8-lane vectors, for D a multiple of 8. Other D and
 * CPUs take a plain C path: per query, its scores, softmax and weighted sum of values.
 * With ``bidirectional`` set (an encoder's prompts, ctx 0), every query sees every position of
 * its prompt: an item walks all the prompt's key tiles, the last one's keys past the prompt
 * masked instead of the diagonal's; with ``window`` W > 0 too, only the keys fewer than W
 * positions from the query, on either side (the tiles holding none of them skipped).
 * Returns 0, or -1 when its scratch memory could not be allocated, or a bidirectional call has
 * cached context (nothing written then).
 */
#define CP_TILE 16

/* The key tiles an item of query tile qt walks: causal (nkeys 0) 0 .. qt; bidirectional over a
 * prompt of nkeys keys, all of them, or with a window those holding a key fewer than win
 * positions from one of the tile's queries. */
static inline void cp_key_tiles(int64_t qt, int64_t nkeys, int64_t win, int64_t *first, int64_t *last) {
    *first = 0;
    *last = nkeys ? (nkeys - 1) / CP_TILE : qt;
    if (nkeys && win) {
        const int64_t lo = qt * CP_TILE - win + 1, hi = qt * CP_TILE + CP_TILE - 1 + win - 1;
        *first = lo > 0 ? lo / CP_TILE : 0;
        if (hi / CP_TILE < *last) *last = hi / CP_TILE;
    }
}

static inline uint16_t pa_f32_to_bf16(float f) {   /* round to nearest even, NaN kept quiet */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
/* An item's start: the G heads' 16 query rows scaled into Qs (rows outside r0..nq zero), the
 * accumulators zero, the running maxima -inf and sums 0. */
static void cp_start(const float *q0, int64_t qs0, int64_t qs1, int r0, int nq, int G, int64_t D, float scale,
                     float *Qs, float *acc, float *mv, float *lv) {
    for (int h = 0; h < G; h++)
        for (int r = 0; r < CP_TILE; r++) {
            float *dst = Qs + (h * CP_TILE + r) * D;
            if (r >= r0 && r < nq) {
                const float *src = q0 + (r - r0) * qs0 + h * qs1;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
            } else {
                memset(dst, 0, sizeof(float) * D);
            }
        }
    memset(acc, 0, sizeof(float) * G * CP_TILE * D);
    for (int i = 0; i < G * CP_TILE; i++) {
        mv[i] = -INFINITY;
        lv[i] = 0.f;
    }
}

/* An item's end: each query row's output, its accumulator over its sum, and its log-sum-exp. */
static void cp_finish(float *o0, int64_t os0, int64_t os1, int r0, int nq, int G, int64_t D, const float *acc,
                      const float *mv, const float *lv, float *lse0, int64_t ls0) {
    for (int h = 0; h < G; h++)
        for (int r = r0; r < nq; r++) {
            const float l = lv[h * CP_TILE + r], inv = l > 0.f ? 1.f / l : 0.f;
            const float *a = acc + (h * CP_TILE + r) * D;
            float *dst = o0 + (r - r0) * os0 + h * os1;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] = a[d] * inv;
            if (lse0) lse0[(r - r0) * ls0 + h] = l > 0.f ? mv[h * CP_TILE + r] + logf(l) : -INFINITY;
        }
}
#endif

/* The item functions of a vector width from one always-inline template T, per D / lanes DV (0:
 * any), and their table cp_items[D == 64, == 128, == 32, other] (DV64, DV128, DV32: D / lanes
 * there; all-MiniLM and other small encoders have heads of 32). */
typedef void (*cp_item_fn)(const float *, int64_t, int64_t, const float *, int64_t, const float *, int64_t,
                           float *, int64_t, int64_t, int64_t, int, int, int, int64_t, float, float *,
                           float *, int64_t, int64_t, int64_t);
#define CP_ITEM_FN(T, DV)                                                                          \
    static void T##_##DV(const float *q0, int64_t qs0, int64_t qs1, const float *kT, int64_t kstep, \
                         const float *V0, int64_t vs0, float *o0, int64_t os0, int64_t os1, int64_t qt, \
                         int r0, int nq, int G, int64_t D, float scale, float *ws, float *lse0,      \
                         int64_t ls0, int64_t nkeys, int64_t win) {                                \
        T(DV, q0, qs0, qs1, kT, kstep, V0, vs0, o0, os0, os1, qt, r0, nq, G, D, scale, ws, lse0, ls0, nkeys, win); \
    }
#define CP_ITEM_TABLE(T, NAME, DV64, DV128, DV32)                                                  \
    CP_ITEM_FN(T, 0) CP_ITEM_FN(T, DV64) CP_ITEM_FN(T, DV128) CP_ITEM_FN(T, DV32)                  \
    static const cp_item_fn NAME[4] = {T##_##DV64, T##_##DV128, T##_##DV32, T##_0};


#ifdef __AVX512F__
/* v[t]: lane t of the result is the max over the lanes of v[t] (the max twin of pa_sum16). */
static inline __m512 cp_max16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_max_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_max_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_max_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* The accumulators a[R][W] of acc rows rg..rg+R-1 (of one head, D apart), vectors d0..d0+W-1,
 * loaded times their rows' rescale, and stored back. */
#define CP_ACC_LOAD(R, W)                                                                         \
    __m512 a[R][W];                                                                               \
    for (int i = 0; i < R; i++) {                                                                 \
        const __m512 ci = _mm512_set1_ps(cr[rg + i]);                                             \
        for (int j = 0; j < W; j++) a[i][j] = _mm512_mul_ps(_mm512_load_ps(ah + (rg + i) * D + 16 * (d0 + j)), ci); \
    }
#define CP_ACC_STORE(R, W)                                                                        \
    for (int i = 0; i < R; i++)                                                                   \
        for (int j = 0; j < W; j++) _mm512_store_ps(ah + (rg + i) * D + 16 * (d0 + j), a[i][j]);

/* acc rows rg..rg+R-1, vectors d0..d0+W-1: acc = acc * c + P V (R W independent sums: 8 rows for
 * heads of 32, whose two vectors a row give 4 rows too few). */
#define CP_PVR(R, W)                                                                              \
    do {                                                                                          \
        CP_ACC_LOAD(R, W)                                                                         \
        for (int t = 0; t < nk; t++) {                                                            \
            const float *vt = V + t * vs0 + 16 * d0;                                              \
            __m512 vv[W];                                                                         \
            for (int j = 0; j < W; j++) vv[j] = _mm512_loadu_ps(vt + 16 * j);                     \
            for (int i = 0; i < R; i++) {                                                         \
                const __m512 pb = _mm512_set1_ps(P[(rg + i) * CP_TILE + t]);                      \
                for (int j = 0; j < W; j++) a[i][j] = _mm512_fmadd_ps(pb, vv[j], a[i][j]);        \
            }                                                                                     \
        }                                                                                         \
        CP_ACC_STORE(R, W)                                                                        \
    } while (0)
#define CP_PV(W) CP_PVR(4, W)

#ifdef __AVX512BF16__
/* The same with bfloat16 P and V, two keys a dot product (vdpbf16ps): P2 [16][8] words (keys 2j,
 * 2j + 1 of a row), Vw [8][D] words (keys 2j, 2j + 1 of a value dimension). */
#define CP_PVR_BF(R, W)                                                                           \
    do {                                                                                          \
        CP_ACC_LOAD(R, W)                                                                         \
        for (int t = 0; t < (nk + 1) / 2; t++) {                                                  \
            __m512i vv[W];                                                                        \
            for (int j = 0; j < W; j++) vv[j] = _mm512_loadu_si512(Vw + t * D + 16 * (d0 + j));   \
            for (int i = 0; i < R; i++) {                                                         \
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)P2[(rg + i) * 8 + t]);       \
                for (int j = 0; j < W; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], pb, (__m512bh)vv[j]); \
            }                                                                                     \
        }                                                                                         \
        CP_ACC_STORE(R, W)                                                                        \
    } while (0)
#else
#define CP_PVR_BF(R, W) do { } while (0)
#endif

/* One item: query tile qt (positions 16 qt + r, queries in rows r0 <= r < nq) of one request,
 * the G query heads of one KV head. q0/o0: row r0's query / output at the group's first head;
 * kT: the request's first transposed key tile of this KV head (tiles kstep apart); V: the
 * request's first value row of this KV head. ws: 64-byte aligned scratch of cp_ws_floats(G, D)
 * floats.
 * BF (AVX512-BF16 only): the queries, keys, values and probabilities rounded to bfloat16 and
 * multiplied two dimensions (or two keys) a dot product, float32 sums and softmax: kT is then the
 * tiles of key pairs, kw[tile][D / 2][16] words (dimensions 2i, 2i + 1 of a key), and V0 the first
 * of the value tiles, [8][D] words each, V0 + kt * 16 * vs0 (in floats) the tile kt's. */
static inline __attribute__((always_inline)) void
cp_item512_t(const int BF, const int64_t DVc, const float *q0, int64_t qs0, int64_t qs1, const float *kT,
             int64_t kstep, const float *V0, int64_t vs0, float *o0, int64_t os0, int64_t os1, int64_t qt, int r0,
             int nq, int G, int64_t Dr, float scale, float *ws, float *lse0, int64_t ls0, int64_t nkeys,
             int64_t win) {
    const int64_t DV = DVc ? DVc : Dr / 16, D = 16 * DV;
    float *Qs = ws;                                  /* [G][16][D], scaled, padded rows zero */
    float *acc = Qs + (int64_t)G * CP_TILE * D;      /* [G][16][D] */
    float *mv = acc + (int64_t)G * CP_TILE * D;      /* [G][16] running max */
    float *lv = mv + G * CP_TILE;                    /* [G][16] running sum */
    float *P = lv + G * CP_TILE;                     /* [16][16] */
    float *mr = P + CP_TILE * CP_TILE;               /* [16] new max per row */
    float *cr = mr + CP_TILE;                        /* [16] rescale per row */
    uint32_t *P2 = (uint32_t *)P;                    /* BF: [16][8] words */
    (void)P2;
    cp_start(q0, qs0, qs1, r0, nq, G, D, scale, Qs, acc, mv, lv);
#ifdef __AVX512BF16__
    if (BF)              /* each scaled query row as bfloat16 pairs, in place: [G][16][D / 2] words */
        for (int i = 0; i < G * CP_TILE; i++)
            for (int64_t d = 0; d < D; d += 32) {
                const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_load_ps(Qs + i * D + d + 16), _mm512_load_ps(Qs + i * D + d));
                _mm512_storeu_si512((uint32_t *)Qs + i * D / 2 + d / 2, (__m512i)w);
            }
#endif
    const int rows = (nq + 3) & ~3;
    int64_t first, last;
    cp_key_tiles(qt, nkeys, win, &first, &last);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 band[CP_TILE];                          /* with a window: each row's keys in the tile */
    for (int64_t kt = first; kt <= last; kt++) {
        const float *K = kT + kt * kstep;
        const float *V = V0 + kt * CP_TILE * vs0;
        const uint32_t *Vw = (const uint32_t *)V;       /* BF: the value tile's words */
        (void)Vw;
        const int diag = !nkeys && kt == qt, tail = nkeys && kt == (nkeys - 1) / CP_TILE;
        const int nk = diag ? nq : tail ? (int)(nkeys - kt * CP_TILE) : CP_TILE;
        const __mmask16 keep = (__mmask16)((1u << nk) - 1u);      /* a tail tile's keys */
        if (win) {          /* keys k with |k - position| < win, and k < nkeys */
            const __m512i kpos = _mm512_add_epi32(_mm512_set1_epi32((int)(kt * CP_TILE)), lane);
            for (int r = 0; r < CP_TILE; r++) {
                const int64_t p = qt * CP_TILE + r;
                band[r] = _mm512_cmpgt_epi32_mask(kpos, _mm512_set1_epi32((int)(p - win))) &
                          _mm512_cmplt_epi32_mask(kpos, _mm512_set1_epi32((int)(p + win < nkeys ? p + win : nkeys)));
            }
        }
        for (int h = 0; h < G; h++) {
            const float *Qh = Qs + h * CP_TILE * D;
            __m512 s[CP_TILE];
            for (int r = 0; r < CP_TILE; r++) s[r] = _mm512_setzero_ps();
            if (BF) {
#ifdef __AVX512BF16__
                const uint32_t *Qw = (const uint32_t *)Qs + h * CP_TILE * D / 2, *Kw = (const uint32_t *)K;
                for (int64_t i = 0; i < D / 2; i++) {
                    const __m512i kd = _mm512_load_si512(Kw + i * CP_TILE);
                    for (int r = 0; r < CP_TILE; r++)
                        s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32((int)Qw[r * D / 2 + i]), (__m512bh)kd);
                }
#endif
            } else {
                for (int64_t d = 0; d < D; d++) {
                    const __m512 kd = _mm512_load_ps(K + d * CP_TILE);
                    for (int r = 0; r < CP_TILE; r++)
                        s[r] = _mm512_fmadd_ps(_mm512_set1_ps(Qh[r * D + d]), kd, s[r]);
                }
            }
            if (diag)
                for (int r = 0; r < CP_TILE; r++)
                    s[r] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((2u << r) - 1u), s[r]);
            if (tail && !win)
                for (int r = 0; r < CP_TILE; r++) s[r] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, s[r]);
            if (win)
                for (int r = 0; r < CP_TILE; r++) s[r] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), band[r], s[r]);
            const __m512 mold = _mm512_load_ps(mv + h * CP_TILE);
            __m512 mnew = _mm512_max_ps(mold, cp_max16(s));
            _mm512_store_ps(mv + h * CP_TILE, mnew);
            /* a row none of whose keys so far were in its window: nothing to rescale or add yet */
            mnew = _mm512_mask_mov_ps(mnew, _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                      _mm512_setzero_ps());
            const __m512 c = pa_exp512(_mm512_sub_ps(mold, mnew));   /* 0 on the first tile */
            _mm512_store_ps(mr, mnew);
            _mm512_store_ps(cr, c);
            for (int r = 0; r < CP_TILE; r++) {
                __m512 e = pa_exp512(_mm512_sub_ps(s[r], _mm512_set1_ps(mr[r])));
                if (diag) e = _mm512_maskz_mov_ps((__mmask16)((2u << r) - 1u), e);
                if (tail && !win) e = _mm512_maskz_mov_ps(keep, e);
                if (win) e = _mm512_maskz_mov_ps(band[r], e);
#ifdef __AVX512BF16__
                if (BF) _mm256_storeu_si256((__m256i *)(P2 + r * 8), (__m256i)_mm512_cvtneps_pbh(e));
                else
#endif
                _mm512_store_ps(P + r * CP_TILE, e);
                s[r] = e;
            }
            _mm512_store_ps(lv + h * CP_TILE,
                            _mm512_fmadd_ps(_mm512_load_ps(lv + h * CP_TILE), c, pa_sum16(s)));
            float *ah = acc + h * CP_TILE * D;
            for (int rg = 0; rg < rows && BF;) {
                int64_t d0 = 0;
                if (DV == 2 && rg + 8 <= rows) {
                    CP_PVR_BF(8, 2);
                    rg += 8;
                    continue;
                }
                for (; d0 + 4 <= DV; d0 += 4) CP_PVR_BF(4, 4);
                for (; d0 + 2 <= DV; d0 += 2) CP_PVR_BF(4, 2);
                for (; d0 < DV; d0++) CP_PVR_BF(4, 1);
                rg += 4;
            }
            for (int rg = 0; rg < rows && !BF;) {
                int64_t d0 = 0;
                if (DV == 2 && rg + 8 <= rows) {
                    CP_PVR(8, 2);
                    rg += 8;
                    continue;
                }
                for (; d0 + 4 <= DV; d0 += 4) CP_PV(4);
                for (; d0 + 2 <= DV; d0 += 2) CP_PV(2);
                for (; d0 < DV; d0++) CP_PV(1);
                rg += 4;
            }
        }
    }
    cp_finish(o0, os0, os1, r0, nq, G, D, acc, mv, lv, lse0, ls0);
}

/* The item template for float32 products (BF 0) or bfloat16 ones (BF 1), with CP_ITEM_FN's arguments. */
#define CP_ITEM512_OF(NAME, BF)                                                                    \
    static inline __attribute__((always_inline)) void                                              \
    NAME(const int64_t DVc, const float *q0, int64_t qs0, int64_t qs1, const float *kT, int64_t kstep, \
         const float *V0, int64_t vs0, float *o0, int64_t os0, int64_t os1, int64_t qt, int r0, int nq, \
         int G, int64_t Dr, float scale, float *ws, float *lse0, int64_t ls0, int64_t nkeys, int64_t win) { \
        cp_item512_t(BF, DVc, q0, qs0, qs1, kT, kstep, V0, vs0, o0, os0, os1, qt, r0, nq, G, Dr, scale, ws, \
                     lse0, ls0, nkeys, win);                                                        \
    }
CP_ITEM512_OF(cp_item512, 0)
CP_ITEM_TABLE(cp_item512, cp_items, 4, 8, 2)      /* D / 16 == 4, == 8, == 2 */
#ifdef __AVX512BF16__
CP_ITEM512_OF(cp_item512bf, 1)
CP_ITEM_TABLE(cp_item512bf, cp_items_bf16, 4, 8, 2)
#endif
#define CP_VW 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* acc rows rg..rg+3 (of one head, D apart), vectors d0..d0+W-1 of 8: acc = acc * c + P V. */
static inline __attribute__((always_inline)) void
cp_pv256(const int W, float *ah, int64_t D, int rg, int64_t d0, const float *cr, const float *P, const float *V,
         int64_t vs0, int nk) {
    __m256 a[4][2];
    for (int i = 0; i < 4; i++) {
        const __m256 ci = _mm256_set1_ps(cr[rg + i]);
        for (int j = 0; j < W; j++) a[i][j] = _mm256_mul_ps(_mm256_load_ps(ah + (rg + i) * D + 8 * (d0 + j)), ci);
    }
    for (int t = 0; t < nk; t++) {
        const float *vt = V + t * vs0 + 8 * d0;
        __m256 vv[2];
        for (int j = 0; j < W; j++) vv[j] = _mm256_loadu_ps(vt + 8 * j);
        for (int i = 0; i < 4; i++) {
            const __m256 pb = _mm256_set1_ps(P[(rg + i) * CP_TILE + t]);
            for (int j = 0; j < W; j++) a[i][j] = _mm256_fmadd_ps(pb, vv[j], a[i][j]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < W; j++) _mm256_store_ps(ah + (rg + i) * D + 8 * (d0 + j), a[i][j]);
}

/* cp_item512 for AVX2 (16 registers of 8 lanes): a row's 16 scores are two vectors, computed
 * 4 rows at a time over D; the softmax goes row by row (a horizontal max and sum per row and
 * tile); acc += P V 4 rows x 2 vectors of D at a time. Same arguments and scratch layout. */
static inline __attribute__((always_inline)) void
cp_item256(const int64_t DVc, const float *q0, int64_t qs0, int64_t qs1, const float *kT, int64_t kstep,
           const float *V0, int64_t vs0, float *o0, int64_t os0, int64_t os1, int64_t qt, int r0, int nq,
           int G, int64_t Dr, float scale, float *ws, float *lse0, int64_t ls0, int64_t nkeys, int64_t win) {
    const int64_t DV = DVc ? DVc : Dr / 8, D = 8 * DV;
    float *Qs = ws;                                  /* [G][16][D], scaled, padded rows zero */
    float *acc = Qs + (int64_t)G * CP_TILE * D;      /* [G][16][D] */
    float *mv = acc + (int64_t)G * CP_TILE * D;      /* [G][16] running max */
    float *lv = mv + G * CP_TILE;                    /* [G][16] running sum */
    float *P = lv + G * CP_TILE;                     /* [16][16] scores, then probabilities */
    float *cr = P + CP_TILE * CP_TILE;               /* [16] rescale per row */
    cp_start(q0, qs0, qs1, r0, nq, G, D, scale, Qs, acc, mv, lv);
    const int rows = (nq + 3) & ~3;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), lane8 = _mm256_add_epi32(lane, _mm256_set1_epi32(8));
    int64_t first, last;
    cp_key_tiles(qt, nkeys, win, &first, &last);
    for (int64_t kt = first; kt <= last; kt++) {
        const float *K = kT + kt * kstep;
        const float *V = V0 + kt * CP_TILE * vs0;
        const int diag = !nkeys && kt == qt, tail = nkeys && kt == (nkeys - 1) / CP_TILE;
        const int nk = diag ? nq : tail ? (int)(nkeys - kt * CP_TILE) : CP_TILE;
        for (int h = 0; h < G; h++) {
            const float *Qh = Qs + h * CP_TILE * D;
            for (int rg = 0; rg < rows; rg += 4) {
                __m256 s[4][2];
                for (int i = 0; i < 4; i++) s[i][0] = s[i][1] = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d++) {
                    const __m256 k0 = _mm256_load_ps(K + d * CP_TILE), k1 = _mm256_load_ps(K + d * CP_TILE + 8);
                    for (int i = 0; i < 4; i++) {
                        const __m256 qb = _mm256_set1_ps(Qh[(rg + i) * D + d]);
                        s[i][0] = _mm256_fmadd_ps(qb, k0, s[i][0]);
                        s[i][1] = _mm256_fmadd_ps(qb, k1, s[i][1]);
                    }
                }
                for (int i = 0; i < 4; i++) {
                    _mm256_store_ps(P + (rg + i) * CP_TILE, s[i][0]);
                    _mm256_store_ps(P + (rg + i) * CP_TILE + 8, s[i][1]);
                }
            }
            float *mh = mv + h * CP_TILE, *lh = lv + h * CP_TILE;
            for (int r = 0; r < rows; r++) {
                __m256 s0 = _mm256_load_ps(P + r * CP_TILE), s1 = _mm256_load_ps(P + r * CP_TILE + 8);
                if (diag || tail || win) {  /* keys past the row's position (a tail: the prompt's end), or
                                               * outside its window: -inf */
                    const int64_t p = qt * CP_TILE + r - kt * CP_TILE;   /* the row's position in the tile */
                    const int hi = diag ? r + 1 : win ? (int)(p + win < nk ? p + win : nk) : nk;
                    const __m256i lim = _mm256_set1_epi32(hi);
                    const __m256i lo = _mm256_set1_epi32(win ? (int)(p - win > -1 ? p - win : -1) : -1);
                    const __m256 in0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lim, lane),
                                                                             _mm256_cmpgt_epi32(lane, lo)));
                    const __m256 in1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lim, lane8),
                                                                             _mm256_cmpgt_epi32(lane8, lo)));
                    s0 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s0, in0);
                    s1 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s1, in1);
                }
                const float rmax = hmax8(_mm256_max_ps(s0, s1));
                const float mold = mh[r], mnew = rmax > mold ? rmax : mold;
                if (mnew == -INFINITY) {   /* none of the row's keys so far in its window */
                    _mm256_store_ps(P + r * CP_TILE, _mm256_setzero_ps());
                    _mm256_store_ps(P + r * CP_TILE + 8, _mm256_setzero_ps());
                    cr[r] = 1.f;
                    continue;
                }
                const float c = expf(mold - mnew);         /* 0 on the first tile */
                const __m256 mb = _mm256_set1_ps(mnew);
                const __m256 e0 = pa_exp256(_mm256_sub_ps(s0, mb)), e1 = pa_exp256(_mm256_sub_ps(s1, mb));
                _mm256_store_ps(P + r * CP_TILE, e0);
                _mm256_store_ps(P + r * CP_TILE + 8, e1);
                lh[r] = lh[r] * c + hsum8(_mm256_add_ps(e0, e1));
                mh[r] = mnew;
                cr[r] = c;
            }
            float *ah = acc + h * CP_TILE * D;
            for (int rg = 0; rg < rows; rg += 4) {
                int64_t d0 = 0;
                for (; d0 + 2 <= DV; d0 += 2) cp_pv256(2, ah, D, rg, d0, cr, P, V, vs0, nk);
                for (; d0 < DV; d0++) cp_pv256(1, ah, D, rg, d0, cr, P, V, vs0, nk);
            }
        }
    }
    cp_finish(o0, os0, os1, r0, nq, G, D, acc, mv, lv, lse0, ls0);
}

CP_ITEM_TABLE(cp_item256, cp_items, 8, 16, 4)     /* D / 8 == 8, == 16, == 4 */
#define CP_VW 8
#endif

/* Portable item: per query of the tile and head, its scores, softmax and weighted values.
 * sc: scratch of at least qt * 16 + nq floats; od: of D doubles. */
static void cp_item_c(const float *q0, int64_t qs0, int64_t qs1, const float *K0, int64_t ks0,
                      const float *V0, int64_t vs0, float *o0, int64_t os0, int64_t os1, int64_t qt,
                      int r0, int nq, int G, int64_t D, float scale, float *sc, double *od, float *lse0,
                      int64_t ls0, int64_t nkeys, int64_t win) {
    for (int h = 0; h < G; h++)
        for (int r = r0; r < nq; r++) {
            const float *qq = q0 + (r - r0) * qs0 + h * qs1;
            const int64_t pos = qt * CP_TILE + r;
            int64_t n = nkeys ? nkeys : pos + 1;                 /* keys 0 .. position, or all */
            int64_t j0 = 0;
            if (win) {                                           /* or those fewer than win away */
                j0 = pos - win + 1 > 0 ? pos - win + 1 : 0;
                n = pos + win < n ? pos + win : n;
            }
            float mx = -INFINITY;
            for (int64_t j = j0; j < n; j++) {
                const float *kj = K0 + j * ks0;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < D; d++) dot += qq[d] * kj[d];
                sc[j] = dot * scale;
                mx = sc[j] > mx ? sc[j] : mx;
            }
            double sum = 0.;                                 /* long sums in double */
            for (int64_t j = j0; j < n; j++) {
                sc[j] = expf(sc[j] - mx);
                sum += sc[j];
            }
            for (int64_t d = 0; d < D; d++) od[d] = 0.;
            for (int64_t j = j0; j < n; j++) {
                const float *vj = V0 + j * vs0;
                const double w = sc[j];
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) od[d] += w * vj[d];
            }
            float *o = o0 + (r - r0) * os0 + h * os1;
            for (int64_t d = 0; d < D; d++) o[d] = (float)(od[d] / sum);
            if (lse0) lse0[(r - r0) * ls0 + h] = mx + (float)log(sum);
        }
}

int64_t causal_prefill_f32(const float *q, const float *k, const float *v, float *out,
                           const int64_t *qstarts, const int64_t *kstarts, const int64_t *lens,
                           const int64_t *ctx, int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t qs0,
                           int64_t qs1, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, int64_t os0,
                           int64_t os1, float scale, float *lse, int64_t ls0, int64_t bidirectional,
                           int64_t window, int64_t bf16) {
    if (R <= 0 || H <= 0 || KVH <= 0 || H % KVH || D <= 0 || window < 0 || (window && !bidirectional))
        return R <= 0 ? 0 : -1;
#ifdef __AVX512BF16__
    bf16 = bf16 && D % 32 == 0;         /* otherwise (and without the instructions) float32 */
#else
    bf16 = 0;
#endif
    if (bidirectional)                  /* every query sees its whole prompt: no cached context */
        for (int64_t i = 0; i < R; i++)
            if (ctx[i]) return -1;
    const int64_t G = H / KVH;
    int vec = 0;
#ifdef CP_VW
    vec = D % CP_VW == 0;
#endif
    /* key tiles of the requests (ktile_base[i]: those of the requests before i); query tiles
     * are the key tiles from the one of position ctx[i] on */
    int64_t *ktile_base = (int64_t *)malloc(sizeof(int64_t) * (R + 1));
    if (!ktile_base) return -1;
    int64_t max_tiles = 0, max_len = 0, items = 0;
    ktile_base[0] = 0;
    for (int64_t i = 0; i < R; i++) {
        const int64_t L = lens[i] > 0 ? ctx[i] + lens[i] : 0, nt = (L + CP_TILE - 1) / CP_TILE;
        ktile_base[i + 1] = ktile_base[i] + nt;
        max_tiles = nt > max_tiles ? nt : max_tiles;
        max_len = L > max_len ? L : max_len;
        if (L) items += (nt - ctx[i] / CP_TILE) * KVH;
    }
    const int64_t tiles = ktile_base[R];
    /* items (request, query tile, kv head), latest query tiles (the most key tiles) first */
    int64_t *item = (int64_t *)malloc(sizeof(int64_t) * 3 * (items ? items : 1));
    int64_t *tile_req = (int64_t *)malloc(sizeof(int64_t) * (tiles ? tiles : 1));
    float *kT = NULL;
    if (vec && tiles) kT = (float *)aligned_alloc(64, sizeof(float) * tiles * KVH * D * CP_TILE);
    if (!item || !tile_req || (vec && tiles && !kT)) {
        free(ktile_base); free(item); free(tile_req); free(kT);
        return -1;
    }
    int64_t n = 0;
    for (int64_t qt = max_tiles - 1; qt >= 0; qt--)
        for (int64_t i = 0; i < R; i++)
            if (ktile_base[i + 1] - ktile_base[i] > qt && qt >= ctx[i] / CP_TILE)
                for (int64_t g = 0; g < KVH; g++) {
                    item[3 * n] = i;
                    item[3 * n + 1] = qt;
                    item[3 * n + 2] = g;
                    n++;
                }
    for (int64_t i = 0; i < R; i++)
        for (int64_t t = ktile_base[i]; t < ktile_base[i + 1]; t++) tile_req[t] = i;
    const int64_t ws_floats = vec ? 2 * G * CP_TILE * D + 2 * G * CP_TILE + CP_TILE * CP_TILE + 2 * CP_TILE
                                  : (max_len + 1) / 2 * 2 + 2 * D;   /* scores, then D doubles */
    int failed = 0;
    #pragma omp parallel
    {
        float *ws = (float *)aligned_alloc(64, sizeof(float) * ((ws_floats + 15) & ~(int64_t)15));
        if (!ws) {
            #pragma omp atomic write
            failed = 1;
        }
        if (vec && !bf16) {   /* keys transposed: kT[tile][g][d][16], positions past the request zero */
            #pragma omp for schedule(static)
            for (int64_t x = 0; x < tiles * KVH; x++) {
                const int64_t t = x / KVH, g = x % KVH, i = tile_req[t], p0 = (t - ktile_base[i]) * CP_TILE;
                float *dst = kT + x * D * CP_TILE;
                for (int j = 0; j < CP_TILE; j++) {
                    const int64_t p = p0 + j;
                    if (p < ctx[i] + lens[i]) {
                        const float *src = k + (kstarts[i] + p) * ks0 + g * ks1;
                        for (int64_t d = 0; d < D; d++) dst[d * CP_TILE + j] = src[d];
                    } else {
                        for (int64_t d = 0; d < D; d++) dst[d * CP_TILE + j] = 0.f;
                    }
                }
            }
        }
        if (bf16 && ws) {   /* bfloat16 pairs: keys kw[tile][g][D / 2][16] (two dimensions of a key a word),
                       * values vw[tile][g][8][D] (two keys of a dimension), positions past the request zero */
            uint32_t *kw = (uint32_t *)kT, *vw = kw + tiles * KVH * (D / 2) * CP_TILE;
#ifdef __AVX512BF16__
            uint32_t *rowp = (uint32_t *)ws;            /* a tile's keys as pairs: [16][D / 2] */
            #pragma omp for schedule(static)
            for (int64_t x = 0; x < tiles * KVH; x++) {
                const int64_t t = x / KVH, g = x % KVH, i = tile_req[t], p0 = (t - ktile_base[i]) * CP_TILE;
                const int64_t L = ctx[i] + lens[i];
                uint32_t *kd = kw + x * (D / 2) * CP_TILE, *vd = vw + x * 8 * D;
                for (int j = 0; j < CP_TILE; j++) {
                    const float *src = p0 + j < L ? k + (kstarts[i] + p0 + j) * ks0 + g * ks1 : NULL;
                    for (int64_t d = 0; d < D; d += 32) {
                        const __m512i w = src ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16),
                                                                             _mm512_loadu_ps(src + d))
                                              : _mm512_setzero_si512();
                        _mm512_storeu_si512(rowp + j * (D / 2) + d / 2, w);
                    }
                }
                for (int64_t w = 0; w < D / 2; w++)
                    for (int j = 0; j < CP_TILE; j++) kd[w * CP_TILE + j] = rowp[j * (D / 2) + w];
                for (int j = 0; j < CP_TILE; j += 2) {
                    const int64_t p = p0 + j;
                    const float *a = p < L ? v + (kstarts[i] + p) * vs0 + g * vs1 : NULL;
                    const float *b = p + 1 < L ? v + (kstarts[i] + p + 1) * vs0 + g * vs1 : NULL;
                    for (int64_t d = 0; d < D; d += 16) {
                        const __m512i lo = a ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + d)))
                                             : _mm512_setzero_si512();
                        const __m512i hi = b ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b + d)))
                                             : _mm512_setzero_si512();
                        _mm512_storeu_si512(vd + (j / 2) * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                    }
                }
            }
#else
            (void)kw; (void)vw;
#endif
        }
        #pragma omp barrier
        if (!failed) {
#ifdef CP_VW
            const int fi = D == 64 ? 0 : D == 128 ? 1 : D == 32 ? 2 : 3;
            cp_item_fn fn = cp_items[fi];
#ifdef __AVX512BF16__
            if (bf16) fn = cp_items_bf16[fi];
#endif
#endif
            #pragma omp for schedule(dynamic, 1)
            for (int64_t x = 0; x < items; x++) {
                const int64_t i = item[3 * x], qt = item[3 * x + 1], g = item[3 * x + 2];
                const int64_t L = ctx[i] + lens[i], first = qt * CP_TILE;   /* the tile's first position */
                const int r0 = (int)(ctx[i] > first ? ctx[i] - first : 0);
                const int nq = (int)(L - first < CP_TILE ? L - first : CP_TILE);
                const int64_t row = qstarts[i] + first + r0 - ctx[i];          /* q / out row of r0 */
                const float *q0 = q + row * qs0 + g * G * qs1;
                float *o0 = out + row * os0 + g * G * os1;
                float *lse0 = lse ? lse + row * ls0 + g * G : NULL;
                const float *V0 = v + kstarts[i] * vs0 + g * vs1;
                const int64_t nkeys = bidirectional ? L : 0;
#ifdef CP_VW
                if (bf16) {     /* the pair tiles: kT's words, then vw's (tile strides in 4-byte units) */
                    const float *vw = kT + tiles * KVH * (D / 2) * CP_TILE;
                    fn(q0, qs0, qs1, kT + (ktile_base[i] * KVH + g) * (D / 2) * CP_TILE, KVH * (D / 2) * CP_TILE,
                       vw + (ktile_base[i] * KVH + g) * 8 * D, KVH * D / 2, o0, os0, os1, qt, r0, nq, (int)G, D,
                       scale, ws, lse0, ls0, nkeys, window);
                    continue;
                }
                if (vec) {
                    fn(q0, qs0, qs1, kT + (ktile_base[i] * KVH + g) * D * CP_TILE, KVH * D * CP_TILE, V0, vs0,
                       o0, os0, os1, qt, r0, nq, (int)G, D, scale, ws, lse0, ls0, nkeys, window);
                    continue;
                }
#endif
                cp_item_c(q0, qs0, qs1, k + kstarts[i] * ks0 + g * ks1, ks0, V0, vs0, o0, os0, os1, qt, r0, nq,
                          (int)G, D, scale, ws, (double *)(ws + (max_len + 1) / 2 * 2), lse0, ls0, nkeys, window);
            }
        }
        free(ws);
    }
    free(ktile_base); free(item); free(tile_req); free(kT);
    return failed ? -1 : 0;
}


#ifdef __AVX512F__
/* pa_f32_to_fp8 of 16 lanes (the same arithmetic), as 16 bytes. */
static inline __m128i pa_fp8_16(__m512 f, const int kt) {
    const int e4 = kt == PA_FP8E4M3, sh = e4 ? 20 : 21;
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    const __m512i u = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(u, _mm512_set1_epi32(0x7f800000));
    const __mmask16 normal = _mm512_cmpge_epu32_mask(u, _mm512_set1_epi32((e4 ? 121 : 113) << 23));
    const __m512i r = _mm512_sub_epi32(u, _mm512_set1_epi32((e4 ? 120 : 112) << 23));
    __m512i code = _mm512_add_epi32(_mm512_add_epi32(r, _mm512_set1_epi32((1 << (sh - 1)) - 1)),
                                    _mm512_and_si512(_mm512_srli_epi32(r, sh), _mm512_set1_epi32(1)));
    code = _mm512_min_epu32(_mm512_srli_epi32(code, sh), _mm512_set1_epi32(e4 ? 0x7e : 0x7b));
    const __m512 big = _mm512_set1_ps(e4 ? 16384.f : 128.f);
    const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), big)),
                                         _mm512_castps_si512(big));
    code = _mm512_mask_mov_epi32(sub, normal, code);
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}
#endif

/* A row of n float32 values into the cache's element type: 16-bit rounded to nearest even;
 * 8-bit as fp8(x / s) (pa_f32_to_fp8). */
static void pa_store_row(char *dst, const float *src, int64_t n, int kt, float s) {
    if (kt >= PA_FP8E4M3) {
        uint8_t *d = (uint8_t *)dst;
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 sv = _mm512_set1_ps(s);
        if (kt == PA_FP8E4M3)
            for (; i + 16 <= n; i += 16)
                _mm_storeu_si128((__m128i *)(d + i),
                                 pa_fp8_16(_mm512_div_ps(_mm512_loadu_ps(src + i), sv), PA_FP8E4M3));
        else
            for (; i + 16 <= n; i += 16)
                _mm_storeu_si128((__m128i *)(d + i),
                                 pa_fp8_16(_mm512_div_ps(_mm512_loadu_ps(src + i), sv), PA_FP8E5M2));
#endif
        for (; i < n; i++) d[i] = pa_f32_to_fp8(src[i] / s, kt);
    } else if (kt == PA_F32) {
        memcpy(dst, src, sizeof(float) * n);
    } else if (kt == PA_F16) {
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(dst + 2 * i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; i < n; i++) {
            const _Float16 h = (_Float16)src[i];              /* round to nearest even */
            memcpy(dst + 2 * i, &h, 2);
        }
    } else {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = pa_f32_to_bf16(src[i]);
    }
}

/* The step's keys and values into the paged cache: kv[0 or 1][slot] = key / value row of token
 * t for every slot_mapping[t] >= 0 (padding tokens carry -1). key, value (T, KVH, D) float32
 * with heads packed and any row stride (views into the qkv projection); kv (2, num_slots, KVH,
 * D) of element type kt (PA_F32 / PA_F16 / PA_BF16: rounded to nearest even, as torch's .to();
 * PA_FP8E4M3 / PA_FP8E5M2: fp8(key / *k_scale), fp8(value / *v_scale), NULL scales 1).
 * Returns -1, or the first token whose slot is past the cache (then nothing is written). */
int64_t kv_store(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                 const int64_t *slots, int64_t T, void *kv, int64_t kt, int64_t num_slots, int64_t row,
                 const float *k_scale, const float *v_scale) {
    if (kt < PA_F32 || kt >= PA_KT_COUNT) return T;
    const int64_t es = PA_ES(kt);
    const float ks = k_scale ? *k_scale : 1.f, vs = v_scale ? *v_scale : 1.f;
    char *kbase = (char *)kv, *vbase = kbase + num_slots * row * es;
    for (int64_t t = 0; t < T; t++) {            /* a slot past the cache: nothing written */
        if (slots[t] >= num_slots) return t;
    }
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        pa_store_row(kbase + s * row * es, key + t * key_stride, row, (int)kt, ks);
        pa_store_row(vbase + s * row * es, value + t * value_stride, row, (int)kt, vs);
    }
    return -1;
}

/* The cache's rows at slots[0..S) as float32, as the attention reads them: kout[i] = kv[0][slots[i]]
 * and vout[i] = kv[1][slots[i]] (rows of `row` elements), widened, 8-bit ones times *k_scale /
 * *v_scale (NULL: 1), the same float32 product as torch's fp8.float() * scale. Returns -1, or the
 * first index whose slot is outside the cache (nothing written then). */
int64_t kv_gather(const void *kv, int64_t kt, int64_t num_slots, int64_t row, const int64_t *slots, int64_t S,
                  const float *k_scale, const float *v_scale, float *kout, float *vout) {
    if (kt < PA_F32 || kt >= PA_KT_COUNT) return 0;
    for (int64_t i = 0; i < S; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return i;
    const int64_t es = PA_ES(kt);
    const char *kbase = (const char *)kv, *vbase = kbase + num_slots * row * es;
    const float ks = kt >= PA_FP8E4M3 && k_scale ? *k_scale : 1.f;
    const float vs = kt >= PA_FP8E4M3 && v_scale ? *v_scale : 1.f;
    #pragma omp parallel for schedule(static) if (S * row >= (1 << 16))
    for (int64_t i = 0; i < S; i++) {
        float *ko = kout + i * row, *vo = vout + i * row;
        pa_row_to_f32(kbase + slots[i] * row * es, (int)kt, row, ko);
        pa_row_to_f32(vbase + slots[i] * row * es, (int)kt, row, vo);
        if (ks != 1.f)
            for (int64_t d = 0; d < row; d++) ko[d] *= ks;
        if (vs != 1.f)
            for (int64_t d = 0; d < row; d++) vo[d] *= vs;
    }
    return -1;
}
