/* expf for the native kernels, in a form the compiler vectorizes. */
#ifndef TROUPE_EXPF_H
#define TROUPE_EXPF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* expf in a form the compiler vectorizes (libm's expf is a call per element): Cephes' range
 * reduction x = n ln2 + r, |r| <= ln2 / 2, and its degree-5 polynomial; max error about 1 ulp.
 * Inputs are clamped to [-87, 88], where the result stays normal and finite. */
static inline float exp_f32(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);    /* not fminf/fmaxf: libm calls */
    /* n = round(x / ln2): adding 1.5 * 2^23 rounds to an integer (floorf does not vectorize) */
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
    float r = x - n * 0.693359375f;          /* ln2 split in two: the first part is exact */
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float y = fmaf(p, r * r, r) + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;   /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#endif
