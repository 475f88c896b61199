/* The state-space recurrence of Mamba and Mamba-2 layers (models/mamba.py) for the float32 CPU
 * path: every request of a step, prompt chunks and decodes alike, its state read and written in
 * place in its slot (no gather, no scatter), one pass over the state per token.
 *
 * For request r (tokens qsl[r] .. qsl[r+1] - 1 of the step, state slot slots[r]), head h of H (its
 * group g = h / (H / G) of B and C), channel p of the head's P, state index n of N:
 *     s[h,p,n] = exp(dt[t,h] * A) s[h,p,n] + dt[t,h] x[t,h,p] B[t,g,n]
 *     y[t,h,p] = sum_n s[h,p,n] C[t,g,n] + Dskip[h] x[t,h,p]
 * with A = A[h,n] (``a_per_state``: Mamba, whose heads are its channels, P = 1, G = 1) or A[h]
 * (Mamba-2: one decay per head). The state of a slot is (H, P, N) float32 at state + slot *
 * slot_stride; ``fresh[r]`` zeroes it first (the request starts at position 0).
 *
 * OpenMP over (request, head) pairs, each running its tokens in order; the loops over n are plain
 * C the compiler vectorizes (omp simd, exp a polynomial: expf.h). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "expf.h"

#define SSM_MAX_N 1024

void ssm_scan_f32(float *state, int64_t slot_stride, const int64_t *slots, const uint8_t *fresh,
                  const int64_t *qsl, int64_t R,
                  const float *x, int64_t x_stride, const float *dt, int64_t dt_stride,
                  const float *A, int a_per_state,
                  const float *Bm, int64_t b_stride, const float *Cm, int64_t c_stride,
                  const float *Dskip, float *y, int64_t y_stride,
                  int64_t H, int64_t P, int64_t G, int64_t N) {
    const int64_t heads_per_group = H / G;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            float *s0 = state + slots[r] * slot_stride + h * P * N;
            if (fresh[r]) memset(s0, 0, (size_t)(P * N) * sizeof(float));
            const int64_t g = h / heads_per_group;
            const float *a = A + (a_per_state ? h * N : h);
            const float dh = Dskip[h];
            float decay[SSM_MAX_N];
            for (int64_t t = qsl[r]; t < qsl[r + 1]; t++) {
                const float d = dt[t * dt_stride + h];
                const float *b = Bm + t * b_stride + g * N, *c = Cm + t * c_stride + g * N;
                if (a_per_state) {
                    #pragma omp simd
                    for (int64_t n = 0; n < N; n++) decay[n] = exp_f32(d * a[n]);
                } else {
                    const float e = exp_f32(d * a[0]);
                    for (int64_t n = 0; n < N; n++) decay[n] = e;
                }
                for (int64_t p = 0; p < P; p++) {
                    const float xv = x[t * x_stride + h * P + p];
                    const float dx = d * xv;
                    float *s = s0 + p * N;
                    float acc = 0.f;
                    #pragma omp simd reduction(+:acc)
                    for (int64_t n = 0; n < N; n++) {
                        const float v = decay[n] * s[n] + dx * b[n];
                        s[n] = v;
                        acc += v * c[n];
                    }
                    y[t * y_stride + h * P + p] = acc + dh * xv;
                }
            }
        }
    }
}
