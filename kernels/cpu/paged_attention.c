/* Paged attention for decode on the CPU: one query token per request, its keys and values read
 * in place through the block table (no gather copy), grouped-query heads sharing each K/V load,
 * a one-pass softmax with a running maximum. OpenMP over requests.
 *
 *   q       (B, H, D)                       float32
 *   kv      (2, num_blocks, BS, KVH, D)     float32, [0] keys, [1] values
 *   table   (B, max_blocks)                 int32 block ids
 *   seq_lens(B,)                            int32: tokens in the cache, the query's included
 *   out     (B, H, D)                       float32
 *   window  0 = full attention; W: keys at positions > p - W only (p = seq_len - 1)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEADS 64
#define MAX_D 256

/* One task per request: its blocks are streamed once, token by token, each token's K (and V)
 * row holding every KV head contiguously, so the reads are sequential within a block. */
void paged_decode_f32(const float *q, const float *kv, const int32_t *table, const int32_t *seq_lens,
                      float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                      int64_t num_blocks, int64_t max_blocks, float scale, int64_t window) {
    const int64_t G = H / KVH;
    const int64_t token_stride = KVH * D;                 /* between tokens of one block */
    const int64_t block_stride = BS * token_stride;
    const float *vbase = kv + num_blocks * block_stride;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        float m[MAX_HEADS], l[MAX_HEADS], acc[MAX_HEADS][MAX_D], s[MAX_HEADS];
        const float *qb = q + b * H * D;
        for (int64_t h = 0; h < H; h++) {
            m[h] = -INFINITY;
            l[h] = 0.f;
            memset(acc[h], 0, sizeof(float) * D);
        }
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        for (int64_t pos = start; pos < len; pos++) {
            const int64_t blk = table[b * max_blocks + pos / BS];
            const int64_t off = blk * block_stride + (pos % BS) * token_stride;
            const float *krow = kv + off, *vrow = vbase + off;
            for (int64_t h = 0; h < H; h++) {              /* scores of this token, every head */
                const float *qh = qb + h * D, *k = krow + (h / G) * D;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];
                s[h] = dot * scale;
            }
            for (int64_t h = 0; h < H; h++) {
                const float *v = vrow + (h / G) * D;
                if (s[h] > m[h]) {                          /* rescale what was accumulated */
                    const float c = expf(m[h] - s[h]);
                    l[h] *= c;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) acc[h][d] *= c;
                    m[h] = s[h];
                }
                const float p = expf(s[h] - m[h]);
                l[h] += p;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[h][d] += p * v[d];
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float *o = out + (b * H + h) * D;
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            for (int64_t d = 0; d < D; d++) o[d] = acc[h][d] * inv;
        }
    }
}
