/* Fused elementwise kernels for the float32 CPU path of the decoder layers: RMSNorm (optionally
 * with the residual add folded in), rotary embedding in place on q and k, the activations (SiLU,
 * GELU with erf or tanh, ReLU) alone or gating a second half (SiLU(gate) * up).
 * Each replaces a handful of torch ops (and their temporaries) with one pass over the rows.
 * OpenMP over rows; the inner loops are plain C that the compiler vectorizes (omp simd).
 *
 * The arithmetic follows the torch ops they replace, rounding step by step in the same order,
 * so rotary and the residual add are bit-identical and RMSNorm differs only in the order of its
 * sum of squares; SiLU's exp is a vectorizable polynomial within an ulp of expf, GELU's erf
 * a rational function within 4.4e-7. Multiply-add
 * contraction into FMA is switched off for this file (torch rounds x * cos and x2 * sin
 * separately, and so must we); exp's polynomial asks for its FMAs explicitly (fmaf). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "expf.h"

/* Threads pay off only from some tens of thousands of elements; most decode calls stay on one. */
#define PAR_MIN_ELEMENTS 32768

/* ---- RMSNorm ---------------------------------------------------------------------------------
 *   residual == NULL:  out = x * (1 / sqrt(mean(x^2) + eps)) * w
 *   residual != NULL:  residual += x (in place), then out = norm(residual) as above
 * x, residual, out (T, N) with row strides x_stride, N, N; w (N,). */
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *w, float *out,
                  int64_t T, int64_t N, float eps) {
    #pragma omp parallel for schedule(static) if (T * N >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * N;
        const float *src = xr;
        float ss = 0.f;
        if (residual != NULL) {
            float *r = residual + t * N;
            #pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < N; i++) {
                const float v = r[i] + xr[i];
                r[i] = v;
                ss += v * v;
            }
            src = r;
        } else {
            #pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < N; i++)
                ss += xr[i] * xr[i];
        }
        const float rstd = 1.f / sqrtf(ss / (float)N + eps);
        #pragma omp simd
        for (int64_t i = 0; i < N; i++)
            o[i] = (src[i] * rstd) * w[i];
    }
}

/* ---- Rotary embedding (NeoX / Hugging Face half-split), in place ----------------------------
 * The leading RD dimensions of each head turn (RD = D, or less for a partial rotary), dimension
 * j pairing with j + RD/2:  x' = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); the
 * others pass. q (T, H, D) and k (T, KVH, D) with heads contiguous inside a row and row strides
 * q_stride, k_stride (views into the fused qkv output need no copy); cos, sin (T, RD) with row
 * stride cs_stride, already looked up by position. */
static inline void rotate_heads(float *x, int64_t heads, int64_t D, int64_t RD, const float *c,
                                const float *s) {
    const int64_t half = RD / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * D, *x2 = x1 + half;
        #pragma omp simd
        for (int64_t j = 0; j < half; j++) {
            const float a = x1[j], b = x2[j];
            x1[j] = a * c[j] - b * s[j];
            x2[j] = b * c[j + half] + a * s[j + half];
        }
    }
}

void rotary_f32(float *q, int64_t q_stride, int64_t H, float *k, int64_t k_stride, int64_t KVH,
                const float *cos, const float *sin, int64_t cs_stride, int64_t T, int64_t D, int64_t RD) {
    #pragma omp parallel for schedule(static) if (T * (H + KVH) * RD >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        rotate_heads(q + t * q_stride, H, D, RD, c, s);
        rotate_heads(k + t * k_stride, KVH, D, RD, c, s);
    }
}

/* ---- Activations, alone or gating a second half ------------------------------------------------
 * act: ACT_SILU  silu(x) = x / (1 + exp(-x))
 *      ACT_GELU  gelu(x) = x * 0.5 * (1 + erf(x / sqrt(2)))   (erf_f32 below; the result within
 *                1.4e-6 of the exact value over [-12, 12], as torch's CPU gelu, within 1.2e-6)
 *      ACT_GELU_TANH  x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))), computed as
 *                x / (1 + exp(-2 sqrt(2 / pi) (x + 0.044715 x^3)))
 *      ACT_RELU  max(x, 0)
 *      ACT_RELU2  max(x, 0)^2 (Nemotron-H's squared ReLU)
 * The same numbers in fused.py's ``ACTIVATIONS``. */
enum { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_RELU = 4, ACT_RELU2 = 5 };

static inline float silu_f32(float x) { return x / (1.f + exp_f32(-x)); }

/* erf(z) as a rational function, odd over even polynomials in z^2 on [-4, 4] (past 4 erf is 1 in
 * float32): within 4.4e-7 of the exact value, and no exp. */
static inline float erf_f32(float z) {
    z = z < -4.f ? -4.f : (z > 4.f ? 4.f : z);
    const float z2 = z * z;
    float p = -2.72614225801306e-10f;
    p = fmaf(p, z2, 2.77068142495902e-08f);
    p = fmaf(p, z2, -2.10102402082508e-06f);
    p = fmaf(p, z2, -5.69250639462346e-05f);
    p = fmaf(p, z2, -7.34990630326855e-04f);
    p = fmaf(p, z2, -2.95459980854025e-03f);
    p = fmaf(p, z2, -1.60960333262415e-02f);
    float q = -1.45660718464996e-05f;
    q = fmaf(q, z2, -2.13374055278905e-04f);
    q = fmaf(q, z2, -1.68282697438203e-03f);
    q = fmaf(q, z2, -7.37332916720468e-03f);
    q = fmaf(q, z2, -1.42647390514189e-02f);
    return z * p / q;
}

static inline float gelu_erf_f32(float x) { return x * 0.5f * (1.f + erf_f32(x * 0.70710678118654752f)); }

/* 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2 u)) */
static inline float gelu_tanh_f32(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    return x / (1.f + exp_f32(-2.f * u));
}

/* rows of n values, row strides xs and os -> o = act(x); o may be x (in place). A tile's rows of 32
 * (a matmul's epilogue) take a loop of known length, vectorized without a remainder. */
#define ACT_ROWS(F)                                                                              \
    do {                                                                                         \
        if (n == 32) {                                                                           \
            for (int64_t r = 0; r < rows; r++) {                                                 \
                const float *xr = x + r * xs;                                                    \
                float *orow = o + r * os;                                                        \
                _Pragma("omp simd")                                                              \
                for (int64_t i = 0; i < 32; i++) orow[i] = F(xr[i]);                             \
            }                                                                                    \
        } else {                                                                                 \
            for (int64_t r = 0; r < rows; r++) {                                                 \
                const float *xr = x + r * xs;                                                    \
                float *orow = o + r * os;                                                        \
                _Pragma("omp simd")                                                              \
                for (int64_t i = 0; i < n; i++) orow[i] = F(xr[i]);                              \
            }                                                                                    \
        }                                                                                        \
    } while (0)

static inline float relu_f32(float x) { return x > 0.f ? x : 0.f; }
static inline float relu2_f32(float x) { return x > 0.f ? x * x : 0.f; }

static void act_rows(int act, const float *x, int64_t xs, float *o, int64_t os, int64_t rows, int64_t n) {
    switch (act) {
    case ACT_SILU: ACT_ROWS(silu_f32); break;
    case ACT_GELU: ACT_ROWS(gelu_erf_f32); break;
    case ACT_GELU_TANH: ACT_ROWS(gelu_tanh_f32); break;
    case ACT_RELU: ACT_ROWS(relu_f32); break;
    case ACT_RELU2: ACT_ROWS(relu2_f32); break;
    default:
        if (o != x)
            for (int64_t r = 0; r < rows; r++) memcpy(o + r * os, x + r * xs, sizeof(float) * (size_t)n);
    }
}

/* o[i] = act(g[i]) * u[i] for n values. */
static inline void gated_row(int act, const float *restrict g, const float *restrict u, float *restrict o,
                             int64_t n) {
    switch (act) {
    case ACT_GELU:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = gelu_erf_f32(g[i]) * u[i];
        break;
    case ACT_GELU_TANH:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = gelu_tanh_f32(g[i]) * u[i];
        break;
    case ACT_RELU:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = relu_f32(g[i]) * u[i];
        break;
    case ACT_RELU2:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = relu2_f32(g[i]) * u[i];
        break;
    default:                                      /* ACT_SILU */
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
    }
}

/* x (T, N) row stride x_stride -> out (T, N) = act(x). */
void act_f32(int act, const float *x, int64_t x_stride, float *out, int64_t T, int64_t N) {
    #pragma omp parallel for schedule(static) if (T * N >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) act_rows(act, x + t * x_stride, 0, out + t * N, 0, 1, N);
}

/* y (rows, cols) row stride ldy = act(y), in place, on the calling thread (a matmul's epilogue,
 * inside its parallel region, while the tile is in the cache). */
void act_rows_serial_f32(int act, float *y, int64_t ldy, int64_t rows, int64_t cols) {
    act_rows(act, y, ldy, y, ldy, rows, cols);
}

/* gate_up (T, 2I) row stride in_stride = gate | up  ->  out (T, I) = act(gate) * up; the
 * calling thread only (for callers already inside a parallel region). */
void gated_act_serial_f32(int act, const float *gate_up, int64_t in_stride, float *out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++)
        gated_row(act, gate_up + t * in_stride, gate_up + t * in_stride + I, out + t * I, I);
}

void gated_act_f32(int act, const float *gate_up, int64_t in_stride, float *out, int64_t T, int64_t I) {
    #pragma omp parallel for schedule(static) if (T * I >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++)
        gated_row(act, gate_up + t * in_stride, gate_up + t * in_stride + I, out + t * I, I);
}

void silu_and_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t T, int64_t I) {
    gated_act_f32(ACT_SILU, gate_up, in_stride, out, T, I);
}
