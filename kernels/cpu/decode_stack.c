/* All decoder layers of a Llama-style model for one pure-decode step, in one call.
 *
 * A decode step of a small model spends as much time between its kernels as in them: at one
 * request, each of the ~15 native calls a layer makes costs a few microseconds of Python
 * around a few microseconds of work. This runs the same kernels, in the same order, on the
 * same buffers as the per-layer Python path (models/llama.py with the fused kernels, native
 * matmuls and native attention), so its results are bit for bit those of that path:
 *
 *   layer 0:   residual = emb,  x = rmsnorm(emb)
 *   layer l>0: residual += h,   x = rmsnorm(residual)          (rms_norm_f32 with residual)
 *   qkv = x Wqkv^T (+ b);  rotary on q, k in place (its leading dims; none in a NoPE layer);  k, v into the paged cache
 *   a = paged decode attention of q (copied contiguous, as the Python path does)
 *   o = a Wo^T (+ b) (times m);  residual += o,  x = rmsnorm(residual)
 *   h = (silu(x Wg^T) * x Wu^T) Wd^T (times m)
 * and returns h and residual (the caller applies the final norm).
 *
 * Per layer, desc holds DS_WORDS int64 words (four linears of DS_LIN words each: kernel, kind,
 * codes, d, m, N, K, bias; then the two norm weights, the layer's KV cache, its window, and the
 * addresses of its k_scale and v_scale floats, read at each call, for an 8-bit cache, and
 * how many leading dims of each head turn: the head's, fewer for a partial rotary, 0 in a NoPE
 * layer) and fdesc DS_FLOATS floats (attention scale, the two
 * norms' eps, the residual multiplier m: Granite's, 1 elsewhere; the attention score cap:
 * Gemma 2's, 0 elsewhere). Linear kernel 0 is panel_gemm,
 * 1 is i8x2_gemm (kinds as gemm.c numbers them).
 *
 * lora_desc, when not NULL, adds LoRA after each of the four linears (lora.c's kernel, the same
 * call the per-layer path makes): per layer DS_LORA_WORDS words, per linear its slots' A and B,
 * R, the number of output slices, their offsets and the slots' ranks (A NULL: no LoRA there);
 * lora_slots (B,) holds each row's slot (-1: none). The int8 gate|up kernel with SiLU fused in is
 * not used then (the delta goes between the matmul and the activation).
 *
 * comm, when not NULL, makes it a tensor-parallel rank's layers (its heads, its MLP columns): the
 * o and down projections' outputs are summed over the ranks (after their LoRA deltas, before the
 * residual), as RowParallel's all-reduce does, through the ranks' shared memory segment
 * (shm_allreduce.c; comm: segment, world, rank, chunk, address of the round counter).
 *
 * seconds, when not NULL, accumulates the wall time of each phase (DS_PHASES of them, in the
 * order of ds_phase) over all layers: the profile of a decode step.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *w, float *out,
                  int64_t T, int64_t N, float eps);
void rotary_f32(float *q, int64_t q_stride, int64_t H, float *k, int64_t k_stride, int64_t KVH,
                const float *cos, const float *sin, int64_t cs_stride, int64_t T, int64_t D, int64_t RD);
void silu_and_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t T, int64_t I);
int panel_gemm(int kind, const void *codes, const void *d, const void *m, int64_t N, int64_t K,
               const float *x, int64_t M, float *y);
int i8x2_gemm(int kind, const void *codes, const void *d, const void *m, int64_t N, int64_t K,
              const float *x, int64_t M, float *y);
int i8x2_gated_gemm(int kind, const void *codes, const void *d, const void *m, int64_t N, int64_t K,
                    const float *x, int64_t M, float *out);
int panel_gated_gemm(int kind, const void *codes, const void *d, const void *m, int64_t N, int64_t K,
                     const float *x, int64_t M, float *out);
int64_t kv_store(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                 const int64_t *slots, int64_t T, void *kv, int64_t kt, int64_t num_slots, int64_t row,
                 const float *k_scale, const float *v_scale);
void paged_decode_lse(const float *q, const void *kv, int64_t kt, const int32_t *table,
                      const int32_t *seq_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                      int64_t BS, int64_t num_blocks, int64_t max_blocks, float scale, int64_t window,
                      const float *k_scale, const float *v_scale, float *lse, float softcap);

int64_t lora_shrink_expand(int64_t T, const float *x, int64_t ldx, float *y, int64_t ldy,
                           const float *a, const float *b, const int64_t *token_slots,
                           const int64_t *slot_ranks, int64_t in, int64_t out, int64_t R,
                           int64_t num_slices, const int64_t *offsets);

#define DS_LIN 8
#define DS_WORDS (4 * DS_LIN + 7)
#define DS_FLOATS 5
#define DS_LORA 6
#define DS_LORA_WORDS (4 * DS_LORA)
#define DS_ALLOC_FAILED (-2)
#define DS_PEER_DIED (-3)          /* a tensor-parallel rank died during an all-reduce */

int64_t shm_all_reduce_f32(void *base, int64_t world, int64_t rank, int64_t chunk, int64_t *seq, float *x,
                           int64_t n);

/* With tensor parallelism (comm: the ranks' shared memory segment, world, rank, chunk, and the
 * address of the communicator's round counter; shm_allreduce.c), x (n floats) summed over the
 * ranks, as RowParallel does after the o and down projections. */
static int ds_all_reduce(const int64_t *comm, float *x, int64_t n) {
    return !comm || shm_all_reduce_f32((void *)(intptr_t)comm[0], comm[1], comm[2], comm[3],
                                       (int64_t *)(intptr_t)comm[4], x, n) == 0;
}

enum ds_phase { DS_NORM, DS_QKV, DS_ROTARY_STORE, DS_ATTENTION, DS_O, DS_GATE_UP, DS_SILU, DS_DOWN, DS_PHASES };

static double ds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* seconds[phase] += the time since *t; *t = now (nothing without seconds). */
static inline void ds_lap(double *seconds, int phase, double *t) {
    if (!seconds) return;
    const double now = ds_now();
    seconds[phase] += now - *t;
    *t = now;
}

/* y (M, N) = x W^T (+ bias) through the linear described at lin. 0 when a buffer failed. */
static int ds_linear(const int64_t *lin, const float *x, int64_t M, float *y) {
    const void *codes = (const void *)(intptr_t)lin[2], *d = (const void *)(intptr_t)lin[3],
               *m = (const void *)(intptr_t)lin[4];
    const int64_t N = lin[5], K = lin[6];
    const int ok = lin[0] ? i8x2_gemm((int)lin[1], codes, d, m, N, K, x, M, y)
                          : panel_gemm((int)lin[1], codes, d, m, N, K, x, M, y);
    const float *bias = (const float *)(intptr_t)lin[7];
    if (bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < N; j++) y[r * N + j] += bias[j];
    return ok;
}

/* y (M, N) += the LoRA delta of x (M, K) for the linear whose LoRA words are at lw (none: NULL). */
static void ds_lora(const int64_t *lw, const int64_t *slots, const float *x, int64_t M, int64_t K, float *y,
                    int64_t N) {
    if (!lw || !lw[0]) return;
    lora_shrink_expand(M, x, K, y, N, (const float *)(intptr_t)lw[0], (const float *)(intptr_t)lw[1], slots,
                       (const int64_t *)(intptr_t)lw[5], K, N, lw[2], lw[3], (const int64_t *)(intptr_t)lw[4]);
}

/* emb (B, Hd) -> h, residual (B, Hd). Returns -1, DS_ALLOC_FAILED, or the first token whose
 * slot lies past the cache (nothing of that layer's keys written, the outputs incomplete). */
int64_t decode_stack(int64_t L, const int64_t *desc, const float *fdesc, const float *emb, float *h,
                     float *residual, int64_t B, int64_t Hd, int64_t H, int64_t KVH, int64_t D, int64_t I,
                     const float *cos, const float *sin, int64_t cs_stride, const int64_t *slots,
                     const int32_t *table, int64_t max_blocks, const int32_t *seq_lens, int64_t kt,
                     int64_t num_blocks, int64_t BS, double *seconds, const int64_t *lora_desc,
                     const int64_t *lora_slots, const int64_t *comm) {
    const int64_t NQKV = (H + 2 * KVH) * D, HD = H * D;
    float *buf = malloc(sizeof(float) * B * (Hd + NQKV + 2 * HD + Hd + 3 * I));
    if (!buf) return DS_ALLOC_FAILED;
    float *x = buf, *qkv = x + B * Hd, *q = qkv + B * NQKV, *a = q + B * HD, *o = a + B * HD,
          *gu = o + B * Hd, *act = gu + B * 2 * I;
    int64_t status = -1;
    double t = seconds ? ds_now() : 0.;
    memcpy(residual, emb, sizeof(float) * B * Hd);
    for (int64_t l = 0; l < L && status == -1; l++) {
        const int64_t *ld = desc + l * DS_WORDS;
        const int64_t *wqkv = ld, *wo = ld + DS_LIN, *wgu = ld + 2 * DS_LIN, *wd = ld + 3 * DS_LIN;
        const float *in_w = (const float *)(intptr_t)ld[4 * DS_LIN];
        const float *post_w = (const float *)(intptr_t)ld[4 * DS_LIN + 1];
        void *kv = (void *)(intptr_t)ld[4 * DS_LIN + 2];
        const int64_t window = ld[4 * DS_LIN + 3];
        const float *k_scale = (const float *)(intptr_t)ld[4 * DS_LIN + 4];
        const float *v_scale = (const float *)(intptr_t)ld[4 * DS_LIN + 5];
        const int64_t rd = ld[4 * DS_LIN + 6];        /* the dims that turn: D, fewer, or 0 (NoPE) */
        const float scale = fdesc[DS_FLOATS * l], eps_in = fdesc[DS_FLOATS * l + 1],
                    eps_post = fdesc[DS_FLOATS * l + 2], m = fdesc[DS_FLOATS * l + 3],
                    softcap = fdesc[DS_FLOATS * l + 4];
        const int64_t *lw = lora_desc ? lora_desc + l * DS_LORA_WORDS : NULL;

        if (l == 0) rms_norm_f32(emb, Hd, NULL, in_w, x, B, Hd, eps_in);
        else rms_norm_f32(h, Hd, residual, in_w, x, B, Hd, eps_in);
        ds_lap(seconds, DS_NORM, &t);
        if (!ds_linear(wqkv, x, B, qkv)) { status = DS_ALLOC_FAILED; break; }
        if (lw) ds_lora(lw, lora_slots, x, B, Hd, qkv, NQKV);
        ds_lap(seconds, DS_QKV, &t);
        if (rd) rotary_f32(qkv, NQKV, H, qkv + HD, NQKV, KVH, cos, sin, cs_stride, B, D, rd);
        const int64_t bad = kv_store(qkv + HD, NQKV, qkv + HD + KVH * D, NQKV, slots, B, kv, kt,
                                     num_blocks * BS, KVH * D, k_scale, v_scale);
        if (bad >= 0) { status = bad; break; }
        for (int64_t b = 0; b < B; b++) memcpy(q + b * HD, qkv + b * NQKV, sizeof(float) * HD);
        ds_lap(seconds, DS_ROTARY_STORE, &t);
        paged_decode_lse(q, kv, kt, table, seq_lens, a, B, H, KVH, D, BS, num_blocks, max_blocks, scale,
                         window, k_scale, v_scale, NULL, softcap);
        ds_lap(seconds, DS_ATTENTION, &t);
        if (!ds_linear(wo, a, B, o)) { status = DS_ALLOC_FAILED; break; }
        if (lw) ds_lora(lw + DS_LORA, lora_slots, a, B, HD, o, Hd);
        if (!ds_all_reduce(comm, o, B * Hd)) { status = DS_PEER_DIED; break; }
        if (m != 1.0f)
            for (int64_t i = 0; i < B * Hd; i++) o[i] *= m;
        ds_lap(seconds, DS_O, &t);
        rms_norm_f32(o, Hd, residual, post_w, x, B, Hd, eps_post);
        ds_lap(seconds, DS_NORM, &t);
        if (!wgu[7] && I % 32 == 0 && !lw) {          /* SiLU fused in, as GatedMLP does */
            const void *c = (const void *)(intptr_t)wgu[2], *gd = (const void *)(intptr_t)wgu[3],
                       *gm = (const void *)(intptr_t)wgu[4];
            if (!(wgu[0] ? i8x2_gated_gemm((int)wgu[1], c, gd, gm, wgu[5], wgu[6], x, B, act)
                         : panel_gated_gemm((int)wgu[1], c, gd, gm, wgu[5], wgu[6], x, B, act))) {
                status = DS_ALLOC_FAILED;
                break;
            }
            ds_lap(seconds, DS_GATE_UP, &t);
        } else {
            if (!ds_linear(wgu, x, B, gu)) { status = DS_ALLOC_FAILED; break; }
            if (lw) ds_lora(lw + 2 * DS_LORA, lora_slots, x, B, Hd, gu, 2 * I);
            ds_lap(seconds, DS_GATE_UP, &t);
            silu_and_mul_f32(gu, 2 * I, act, B, I);
            ds_lap(seconds, DS_SILU, &t);
        }
        if (!ds_linear(wd, act, B, h)) { status = DS_ALLOC_FAILED; break; }
        if (lw) ds_lora(lw + 3 * DS_LORA, lora_slots, act, B, I, h, Hd);
        if (!ds_all_reduce(comm, h, B * Hd)) { status = DS_PEER_DIED; break; }
        if (m != 1.0f)
            for (int64_t i = 0; i < B * Hd; i++) h[i] *= m;
        ds_lap(seconds, DS_DOWN, &t);
    }
    free(buf);
    return status;
}
