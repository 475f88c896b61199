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
