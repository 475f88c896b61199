/* The state-space layers' kernels (models/mamba.py, models/qwen3_next.py) for the float32 CPU path:
 * the recurrences of Mamba, Mamba-2 and Gated DeltaNet and the causal convolution before them, for
 * every request of a step, prompt chunks and decodes alike, each state read and written in place in
 * its slot (no gather, no scatter); Mamba-2's gated RMSNorm. Mamba's and Mamba-2's recurrence below,
 * one pass over the state per token:
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

/* The causal depthwise convolution of a state-space layer's inputs over every request of a step,
 * SiLU applied where ``silu`` (LFM2's short convolutions take none), continued from each request's
 * last K - 1 inputs: for request r (tokens qsl[r] .. qsl[r+1] - 1, state slot slots[r];
 * ``fresh[r]``: zero inputs before its first token) and channel c,
 *     out[t,c] = silu(bias[c] + sum_k w[c,k] in[t - (K-1) + k, c])
 * x (T, C) row stride x_stride, conv_state (slots, C, K - 1) contiguous (updated: the last K - 1
 * inputs), w (C, K), bias (C,) or NULL, out (T, C) contiguous. OpenMP over blocks of 64 channels,
 * each running every request with the block's weights loaded once; the channels of a block run
 * side by side (vectorized). */
#define CONV_BLOCK 64
#define CONV_MAX_K 8

/* One block of nc channels of request r's tokens; K a constant where inlined with one (its loops unrolled). */
static inline __attribute__((always_inline)) void conv_block(
        const float *x, int64_t x_stride, float *st, int fresh, int64_t t0, int64_t t1, float wk[][CONV_BLOCK],
        const float *b, float *out, int64_t C, int64_t c0, int64_t nc, const int64_t K, const int silu) {
    const int64_t keep = K - 1;
    float win[CONV_MAX_K][CONV_BLOCK];                  /* win[k][c]: the K - 1 inputs before the token */
    for (int64_t c = 0; c < nc; c++)
        for (int64_t k = 0; k < keep; k++) win[k][c] = fresh ? 0.f : st[(c0 + c) * keep + k];
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * x_stride + c0;
        float *ot = out + t * C + c0;
        #pragma omp simd
        for (int64_t c = 0; c < nc; c++) {
            float acc = b[c] + wk[keep][c] * xt[c];
            for (int64_t k = 0; k < keep; k++) acc += wk[k][c] * win[k][c];
            for (int64_t k = 0; k + 1 < keep; k++) win[k][c] = win[k + 1][c];
            win[keep - 1][c] = xt[c];
            ot[c] = silu ? acc / (1.f + exp_f32(-acc)) : acc;
        }
    }
    for (int64_t c = 0; c < nc; c++)
        for (int64_t k = 0; k < keep; k++) st[(c0 + c) * keep + k] = win[k][c];
}

void ssm_conv_f32(const float *x, int64_t x_stride, float *conv_state, const int64_t *slots, const uint8_t *fresh,
                  const int64_t *qsl, int64_t R, const float *w, const float *bias, float *out, int64_t C, int64_t K,
                  int silu) {
    const int64_t blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK, keep = K - 1;
    #pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t c0 = blk * CONV_BLOCK, nc = C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK;
        float wk[CONV_MAX_K][CONV_BLOCK], b[CONV_BLOCK];
        for (int64_t c = 0; c < nc; c++) {
            for (int64_t k = 0; k < K; k++) wk[k][c] = w[(c0 + c) * K + k];
            b[c] = bias ? bias[c0 + c] : 0.f;
        }
        for (int64_t r = 0; r < R; r++) {
            float *st = conv_state + slots[r] * C * keep;
            if (K == 4 && silu)                         /* every Mamba checkpoint's */
                conv_block(x, x_stride, st, fresh[r], qsl[r], qsl[r + 1], wk, b, out, C, c0, nc, 4, 1);
            else if (K == 3 && !silu)                   /* LFM2's */
                conv_block(x, x_stride, st, fresh[r], qsl[r], qsl[r + 1], wk, b, out, C, c0, nc, 3, 0);
            else
                conv_block(x, x_stride, st, fresh[r], qsl[r], qsl[r + 1], wk, b, out, C, c0, nc, K, silu);
        }
    }
}

/* Mamba-2's gated RMSNorm: g = y * silu(gate), each of G groups of its D / G channels divided by
 * their root mean square (+ eps), times w. y (T, D) contiguous, gate (T, D) row stride g_stride,
 * w (D,), out (T, D) contiguous. */
void ssm_gated_norm_f32(const float *y, const float *gate, int64_t g_stride, const float *w, float *out,
                        int64_t T, int64_t D, int64_t G, float eps) {
    const int64_t n = D / G;
    #pragma omp parallel for schedule(static) if (T * D >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *yt = y + t * D, *gt = gate + t * g_stride;
        float *ot = out + t * D;
        #pragma omp simd
        for (int64_t i = 0; i < D; i++) ot[i] = yt[i] * (gt[i] / (1.f + exp_f32(-gt[i])));
        for (int64_t g = 0; g < G; g++) {
            float *o = ot + g * n;
            float ss = 0.f;
            #pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < n; i++) ss += o[i] * o[i];
            const float inv = 1.f / sqrtf(ss / (float)n + eps);
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) o[i] = o[i] * inv * w[g * n + i];
        }
    }
}

/* Gated DeltaNet's recurrence (Qwen3-Next, Qwen3.5) for every request of a step: for request r
 * (tokens qsl[r] .. qsl[r+1] - 1, state slot slots[r], zeroed first where fresh[r]) and value head
 * h, its state S (DK, DV) at state + slot * slot_stride + h * DK * DV, for each token
 *     S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q
 * q, k (T, H, DK) and v, o (T, H, DV) contiguous; g, beta (T, H). OpenMP over (request, head)
 * pairs; two passes over S a token (S^T k, then the update with o accumulated), vectorized over DV. */
#define GDN_MAX_DV 1024

void gdn_scan_f32(float *state, int64_t slot_stride, const int64_t *slots, const uint8_t *fresh,
                  const int64_t *qsl, int64_t R, const float *q, const float *k, const float *v,
                  const float *g, const float *beta, float *o, int64_t H, int64_t DK, int64_t DV) {
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            float *S = state + slots[r] * slot_stride + h * DK * DV;
            if (fresh[r]) memset(S, 0, (size_t)(DK * DV) * sizeof(float));
            float kv[GDN_MAX_DV], delta[GDN_MAX_DV], out[GDN_MAX_DV];
            for (int64_t t = qsl[r]; t < qsl[r + 1]; t++) {
                const float *qt = q + (t * H + h) * DK, *kt = k + (t * H + h) * DK, *vt = v + (t * H + h) * DV;
                const float decay = exp_f32(g[t * H + h]), b = beta[t * H + h];
                for (int64_t j = 0; j < DV; j++) kv[j] = 0.f;
                for (int64_t i = 0; i < DK; i++) {
                    const float ki = kt[i];
                    const float *Si = S + i * DV;
                    #pragma omp simd
                    for (int64_t j = 0; j < DV; j++) kv[j] += Si[j] * ki;
                }
                #pragma omp simd
                for (int64_t j = 0; j < DV; j++) {
                    delta[j] = (vt[j] - decay * kv[j]) * b;
                    out[j] = 0.f;
                }
                for (int64_t i = 0; i < DK; i++) {
                    const float ki = kt[i], qi = qt[i];
                    float *Si = S + i * DV;
                    #pragma omp simd
                    for (int64_t j = 0; j < DV; j++) {
                        const float s = decay * Si[j] + ki * delta[j];
                        Si[j] = s;
                        out[j] += s * qi;
                    }
                }
                memcpy(o + (t * H + h) * DV, out, (size_t)DV * sizeof(float));
            }
        }
    }
}
