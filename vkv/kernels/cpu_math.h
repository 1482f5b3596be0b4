/* Arithmetic that the C kernels of the CPU path share (paged_decode.c, layer_ops.c). */
#ifndef VKV_CPU_MATH_H
#define VKV_CPU_MATH_H

#include <math.h>
#include <stdint.h>

/* e^x for x <= 0 (a score minus the running maximum; -|g| for a sigmoid), within about 2 ulp
 * of expf: x = k ln 2 + r with |r| <= ln 2 / 2, e^r by Cephes' polynomial, 2^k put in the
 * exponent bits. Plain arithmetic, so a loop of it vectorizes (expf is a library call per
 * element); below -87 the result is about 1e-38, which is 0 for a softmax weight. */
static inline float exp_nonpositive(float x) {
    union {
        int32_t bits;
        float value;
    } two_to_k;
    x = x < -87.0f ? -87.0f : x;
    const float k = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    two_to_k.bits = ((int32_t)k + 127) << 23;
    return (p * r * r + r + 1.0f) * two_to_k.value;
}

/* A dot product in 8 independent lanes, so the compiler vectorizes it without reordering
 * a single running sum (no -ffast-math needed). */
static inline float dot(const float *a, const float *b, int64_t n) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int r = 0; r < 8; ++r)
            lanes[r] += a[i + r] * b[i + r];
    float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; i < n; ++i)
        sum += a[i] * b[i];
    return sum;
}

#endif
