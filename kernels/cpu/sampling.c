/* Row-wise argmax of float32 logits for greedy sampling, with torch.argmax's answer: the first
 * index of the maximum, or the first NaN if a row has one. torch's CPU reduction is scalar and
 * takes milliseconds for a decode batch's (B, vocab) logits; this reads each row twice at
 * memory speed (find the maximum, then its first index). OpenMP over rows.
 *
 *   x (B, V) float32 rows ld apart;  out (B,) int64
 */
#include <math.h>
#include <stdint.h>

void argmax_rows_f32(const float *x, int64_t B, int64_t V, int64_t ld, int64_t *out) {
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        const float *row = x + b * ld;
        float best = -INFINITY;
        int nan = 0;
        #pragma omp simd reduction(max:best) reduction(|:nan)
        for (int64_t i = 0; i < V; i++) {
            best = row[i] > best ? row[i] : best;
            nan |= row[i] != row[i];
        }
        int64_t at = 0;
        if (nan) {
            while (row[at] == row[at]) at++;
        } else {
            while (at < V && row[at] != best) at++;
            if (at == V) at = 0;                       /* every entry -inf */
        }
        out[b] = at;
    }
}

/* A structured-output bitmask applied in place: logit v of row b becomes -inf unless bit v % 32
 * of word v / 32 of mask row b is set (tokens past 32 W are disallowed). OpenMP over rows.
 *
 *   x (B, V) float32 rows ld apart;  mask (B, W) int32 rows W apart
 */
void apply_bitmask_f32(float *x, int64_t B, int64_t V, int64_t ld, const int32_t *mask, int64_t W) {
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        float *row = x + b * ld;
        const uint32_t *m = (const uint32_t *)(mask + b * W);
        for (int64_t w = 0; w < W && 32 * w < V; w++) {
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;                   /* a whole word allowed */
            int64_t end = 32 * w + 32 < V ? 32 * w + 32 : V;
            for (int64_t v = 32 * w; v < end; v++)
                if (!((bits >> (v - 32 * w)) & 1u)) row[v] = -INFINITY;
        }
        for (int64_t v = 32 * W; v < V; v++) row[v] = -INFINITY;
    }
}
