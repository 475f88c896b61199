/* LoRA's shrink and expand for one (possibly fused) linear layer, every adapter of a step in
 * one call (vLLM's punica shrink/expand): each token reads the weights of its own adapter slot,
 * so tokens of different adapters and tokens without one share the call, and no token is moved.
 *
 *   for each token t with s = token_slots[t] >= 0 and r = slot_ranks[s]:
 *     h[j*R + k] = sum_i x[t, i] * a[s, i, j*R + k]               k < r, slice j < num_slices
 *     y[t, o]   += sum_{k < r} h[j*R + k] * b[s, k, o]             o in [offsets[j], offsets[j+1])
 *
 * x (T, in) with row stride ldx; y (T, out) with row stride ldy, added to in place;
 * a (S, in, num_slices * R): each slice's A transposed, side by side; b (S, R, out): each
 * slice's B (its scaling folded in) transposed, in its slice's columns. Both inner loops are
 * axpy's over contiguous floats, which the compiler vectorizes without reordering a sum.
 * OpenMP over tokens. Ranks past r hold zeros and are skipped in the expand.
 */
#include <stdint.h>
#include <string.h>

#define LORA_MAX_COLS 4096     /* num_slices * R: h lives on the stack */
/* Below this many multiply-adds a call runs on one thread: a decode step's delta takes tens of
   microseconds, less than waking the other threads costs (and on a loaded machine a parallel
   region can wait a scheduler time slice for a descheduled thread). */
#define LORA_PAR_MIN_FMAS (1 << 23)

int64_t lora_shrink_expand(int64_t T, const float *x, int64_t ldx, float *y, int64_t ldy,
                           const float *a, const float *b, const int64_t *token_slots,
                           const int64_t *slot_ranks, int64_t in, int64_t out, int64_t R,
                           int64_t num_slices, const int64_t *offsets) {
    const int64_t NR = num_slices * R;
    if (NR > LORA_MAX_COLS) return -1;
    #pragma omp parallel for schedule(static) if (T * (in * NR + R * out) >= LORA_PAR_MIN_FMAS)
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = token_slots[t];
        if (s < 0) continue;
        const int64_t r = slot_ranks[s];
        float h[LORA_MAX_COLS];
        memset(h, 0, (size_t)NR * sizeof(float));
        const float *xt = x + t * ldx;
        const float *as = a + s * in * NR;
        for (int64_t i = 0; i < in; i++) {           /* shrink: h += x_i * a[i, :] */
            const float xi = xt[i];
            const float *ai = as + i * NR;
            #pragma omp simd
            for (int64_t k = 0; k < NR; k++) h[k] += xi * ai[k];
        }
        float *yt = y + t * ldy;
        const float *bs = b + s * R * out;
        for (int64_t j = 0; j < num_slices; j++) {   /* expand: y[slice j] += h_k * b[k, slice j] */
            const int64_t o0 = offsets[j], o1 = offsets[j + 1];
            for (int64_t k = 0; k < r; k++) {
                const float hk = h[j * R + k];
                const float *bk = bs + k * out;
                #pragma omp simd
                for (int64_t o = o0; o < o1; o++) yt[o] += hk * bk[o];
            }
        }
    }
    return 0;
}
