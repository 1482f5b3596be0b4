/* A decoder layer's small operations on a CPU, float32, one call each (vkv.kernels.layer_ops).
 *
 * The definitions are layer_ops.py's PyTorch compositions, which take two to nine torch calls
 * each: a call here walks each token's row once, one token per iteration of an OpenMP loop
 * (without -fopenmp, one thread). A row is contiguous; rows lie a stride apart (the q, k and v
 * of a token are slices of one projection's row).
 *
 *   vkv_add_rms_norm_f32    residual += x (or residual = x), out = rms_norm(residual) * weight
 *   vkv_qk_norm_rotary_f32  per head of q and of k, in place: optional RMSNorm, then the rotary
 *                           turn of the token's position (half-split: i turns with i + half)
 *   vkv_silu_and_mul_f32    out = silu(gate) * up, gate and up the two halves of a row
 *   vkv_store_kv_f32        key and value rows into their cache slots; slot -1 is skipped
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

/* 1 / sqrt(mean(x^2) + eps) of a row of n floats. */
static float inverse_rms(const float *x, int64_t n, float eps) {
    return 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
}

void vkv_add_rms_norm_f32(const float *x, float *residual, float *out, const float *weight,
                          int64_t tokens, int64_t hidden, int64_t x_stride, int add, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *row = x + t * x_stride;
        float *sum = residual + t * hidden;
        float *o = out + t * hidden;
        for (int64_t i = 0; i < hidden; ++i)
            sum[i] = add ? sum[i] + row[i] : row[i];
        const float inverse = inverse_rms(sum, hidden, eps);
        for (int64_t i = 0; i < hidden; ++i)
            o[i] = sum[i] * inverse * weight[i];
    }
}

/* One head's row, in place: normalized by weight (if not NULL), then turned by cos and the
 * signed sine (the first half's sine negated). */
static void norm_and_turn(float *x, const float *weight, const float *cos, const float *sin,
                          int64_t head_dim, float eps) {
    float normed[head_dim];
    const int64_t half = head_dim / 2;
    const float inverse = weight ? inverse_rms(x, head_dim, eps) : 1.0f;
    for (int64_t i = 0; i < head_dim; ++i)
        normed[i] = weight ? x[i] * inverse * weight[i] : x[i];
    for (int64_t i = 0; i < half; ++i) {
        x[i] = normed[i] * cos[i] + normed[i + half] * sin[i];
        x[i + half] = normed[i + half] * cos[i + half] + normed[i] * sin[i + half];
    }
}

/* Returns 0, or -1 if a position lies outside the table (that token is left as it was). */
int vkv_qk_norm_rotary_f32(float *q, float *k, const int64_t *positions, const float *cos,
                           const float *signed_sin, const float *q_weight, const float *k_weight,
                           int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                           int64_t q_stride, int64_t k_stride, int64_t table_rows, float eps) {
    int status = 0;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        if (positions[t] < 0 || positions[t] >= table_rows) {
#pragma omp atomic write
            status = -1;
            continue;
        }
        const float *c = cos + positions[t] * head_dim;
        const float *s = signed_sin + positions[t] * head_dim;
        for (int64_t h = 0; h < q_heads; ++h)
            norm_and_turn(q + t * q_stride + h * head_dim, q_weight, c, s, head_dim, eps);
        for (int64_t h = 0; h < k_heads; ++h)
            norm_and_turn(k + t * k_stride + h * head_dim, k_weight, c, s, head_dim, eps);
    }
    return status;
}

void vkv_silu_and_mul_f32(const float *x, float *out, int64_t tokens, int64_t width,
                          int64_t x_stride) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *gate = x + t * x_stride;
        const float *up = gate + width;
        float *o = out + t * width;
        for (int64_t i = 0; i < width; ++i) {
            /* sigmoid(g) from e = e^-|g| <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below */
            const float e = exp_nonpositive(-fabsf(gate[i]));
            const float sigmoid = (gate[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = gate[i] * sigmoid * up[i];
        }
    }
}

/* Returns 0, or -1 if a slot lies past the cache (nothing is written for that token). */
int vkv_store_kv_f32(const float *key, const float *value, float *k_cache, float *v_cache,
                     const int64_t *slots, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                     int64_t key_stride, int64_t value_stride, int64_t head_stride,
                     int64_t num_slots) {
    int status = 0;
    const int64_t row = kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0)
            continue;
        if (slot >= num_slots) {
            status = -1;
            continue;
        }
        for (int64_t h = 0; h < kv_heads; ++h) {
            memcpy(k_cache + slot * row + h * head_dim, key + t * key_stride + h * head_stride,
                   head_dim * sizeof(float));
            memcpy(v_cache + slot * row + h * head_dim,
                   value + t * value_stride + h * head_stride, head_dim * sizeof(float));
        }
    }
    return status;
}
