/* Horizontal reductions of 8 float lanes (AVX2), shared by the kernels' AVX2 paths. */
#ifndef TROUPE_VEC8_H
#define TROUPE_VEC8_H
#if defined(__AVX2__)
#include <immintrin.h>

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

/* lanes 0-3 + 4-7, then 0-1 + 2-3, then 0 + 1 */
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif
#endif
