/* Paged attention for decode on the CPU: one query token per request, its keys and values read
 * in place through the block table (no gather copy), grouped-query heads sharing each K/V load.
 *
 *   q       (B, H, D)                       float32
 *   kv      (2, num_blocks, BS, KVH, D)     float32, [0] keys, [1] values
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
 * prefetched, a few lines per token (blocks are scattered, so the hardware prefetchers lose the
 * stream at every block; spread out, the prefetches overlap the arithmetic).
 * A request cut into several chunks has its partial (max, sum, accumulator) merged by their
 * log-sum-exps at the end.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
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
#define PA_PF_LOC 3         /* __builtin_prefetch locality: 3 = into L1 */
#endif

typedef struct {
    const float *kv, *vbase;
    int64_t D, token_stride, block_stride, BS;
    float scale;
} pa_ctx;

#ifdef __AVX512F__
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

/* One tile of n (1..16) positions for NH query heads sharing one KV head.
 * qh: the first head's query (heads D apart); k, v: the tile's first key/value row of this KV
 * head (rows ts apart); m, l, acc: the heads' running max, sum and accumulator (acc D apart). */
static inline __attribute__((always_inline)) void
pa_tile512(const int NH, const int64_t DVc, const float *qh, const float *k, const float *v, int64_t ts,
           int n, int64_t Dr, float scale, float *m, float *l, float *acc, const float *kp,
           const float *vp, int np) {
    const int64_t DV = DVc ? DVc : Dr / 16, D = 16 * DV;   /* DVc: D / 16 known at compile time */
    __m512 part[PA_GROUP][PA_TILE];
    for (int t = 0; t < n; t++) {
        const float *kt = k + t * ts;
        if (t < np)                     /* a later tile's rows of this KV head, on their way */
            for (int64_t x = 0; x < D; x += 16) {
                __builtin_prefetch(kp + t * ts + x, 0, PA_PF_LOC);
                __builtin_prefetch(vp + t * ts + x, 0, PA_PF_LOC);
            }
        __m512 s[PA_GROUP];
        for (int h = 0; h < NH; h++) s[h] = _mm512_setzero_ps();
        for (int64_t dv = 0; dv < DV; dv++) {
            const __m512 kk = _mm512_loadu_ps(kt + 16 * dv);
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
                const float *vt = v + t * ts + 16 * d0;
                const __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16),
                             v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
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
                    const __m512 vv = _mm512_loadu_ps(v + t * ts + 16 * (d0 + j));
                    for (int h = 0; h < NH; h++) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][t]), vv, a[h]);
                }
                for (int h = 0; h < NH; h++) _mm512_storeu_ps(acc + h * D + 16 * (d0 + j), a[h]);
            }
        }
    }
}

typedef void (*pa_tile_fn)(const float *, const float *, const float *, int64_t, int, int64_t, float,
                           float *, float *, float *, const float *, const float *, int);
#define PA_TILE_FN(NH, DV)                                                                          \
    static void pa_tile512_##NH##_##DV(const float *q, const float *k, const float *v, int64_t ts,   \
                                       int n, int64_t D, float scale, float *m, float *l, float *acc, \
                                       const float *kp, const float *vp, int np) {                   \
        pa_tile512(NH, DV, q, k, v, ts, n, D, scale, m, l, acc, kp, vp, np);                         \
    }
PA_TILE_FN(1, 0) PA_TILE_FN(2, 0) PA_TILE_FN(3, 0) PA_TILE_FN(4, 0)
PA_TILE_FN(1, 4) PA_TILE_FN(2, 4) PA_TILE_FN(3, 4) PA_TILE_FN(4, 4)
PA_TILE_FN(1, 8) PA_TILE_FN(2, 8) PA_TILE_FN(3, 8) PA_TILE_FN(4, 8)
/* [D / 16 == 4, == 8, other][heads - 1] */
static const pa_tile_fn pa_tiles512[3][PA_GROUP] = {
    {pa_tile512_1_4, pa_tile512_2_4, pa_tile512_3_4, pa_tile512_4_4},
    {pa_tile512_1_8, pa_tile512_2_8, pa_tile512_3_8, pa_tile512_4_8},
    {pa_tile512_1_0, pa_tile512_2_0, pa_tile512_3_0, pa_tile512_4_0},
};
#endif

/* Portable tile: the same blockwise softmax in plain C. */
static void pa_tile_c(int NH, const float *qh, const float *k, const float *v, int64_t ts, int n,
                      int64_t D, float scale, float *m, float *l, float *acc, const float *kp,
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
    const int64_t D = cx->D, G = H / KVH, BS = cx->BS, ts = cx->token_stride;
    for (int64_t h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    memset(acc, 0, sizeof(float) * H * D);
#ifdef __AVX512F__
    const int vec = D % 16 == 0;
    const pa_tile_fn *tiles = pa_tiles512[D == 64 ? 0 : D == 128 ? 1 : 2];
#endif
    for (int64_t pos = p0; pos < p1;) {
        const int64_t in_blk = pos % BS;
        int64_t n = BS - in_blk;
        if (n > PA_TILE) n = PA_TILE;
        if (n > p1 - pos) n = p1 - pos;
        const int64_t off = (int64_t)tab[pos / BS] * cx->block_stride + in_blk * ts;
        const float *kt = cx->kv + off, *vt = cx->vbase + off;
        /* the tile PA_PREFETCH tiles ahead: each KV head's rows are prefetched while the same
         * head's rows of this tile are read, spread over its tokens */
        const float *ka = cx->kv, *va = cx->vbase;
        int64_t an = 0;
        const int64_t ap = pos + PA_PREFETCH * PA_TILE;
        if (PA_PREFETCH > 0 && ap < p1) {
            const int64_t ab = ap % BS;
            an = BS - ab;
            if (an > PA_TILE) an = PA_TILE;
            if (an > p1 - ap) an = p1 - ap;
            const int64_t aoff = (int64_t)tab[ap / BS] * cx->block_stride + ab * ts;
            ka += aoff;
            va += aoff;
        }
        for (int64_t g = 0; g < KVH; g++) {
            for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += PA_GROUP) {
                const int nh = (g + 1) * G - h0 < PA_GROUP ? (int)((g + 1) * G - h0) : PA_GROUP;
                const float *qh = qb + h0 * D, *k = kt + g * D, *v = vt + g * D;
                float *mh = m + h0, *lh = l + h0, *ah = acc + h0 * D;
                const int np = h0 == g * G ? (int)an : 0;
#ifdef __AVX512F__
                if (vec) {
                    tiles[nh - 1](qh, k, v, ts, (int)n, D, cx->scale, mh, lh, ah, ka + g * D, va + g * D, np);
                    continue;
                }
#endif
                pa_tile_c(nh, qh, k, v, ts, (int)n, D, cx->scale, mh, lh, ah, ka + g * D, va + g * D, np);
            }
        }
        pos += n;
    }
}

static void pa_write(float *o, const float *acc, const float *l, int64_t H, int64_t D) {
    for (int64_t h = 0; h < H; h++) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < D; d++) o[h * D + d] = acc[h * D + d] * inv;
    }
}

void paged_decode_f32(const float *q, const float *kv, const int32_t *table, const int32_t *seq_lens,
                      float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                      int64_t num_blocks, int64_t max_blocks, float scale, int64_t window) {
    if (B <= 0) return;
    pa_ctx cx;
    cx.kv = kv;
    cx.D = D;
    cx.BS = BS;
    cx.token_stride = KVH * D;
    cx.block_stride = BS * KVH * D;
    cx.vbase = kv + num_blocks * cx.block_stride;
    cx.scale = scale;
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
                pa_write(out + b * H * D, acc, l, H, D);
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
                    const float inv = L > 0.f ? 1.f / L : 0.f;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) oh[d] *= inv;
                }
            }
        }
    }
    free(first);
    free(item_b);
    free(part);
}
