/* Paged decode attention on a CPU, float32, read in place from the paged KV cache.
 *
 * The definition is vkv.kernels.reference.paged_decode_attention: one new token per sequence
 * attends to the context_lens[b] tokens cached for it (its own included), grouped-query heads
 * (query head h reads KV head h / (num_heads / num_kv_heads)). The reference gathers every block
 * of every sequence into one padded tensor and masks the padding; this loop walks each block
 * table instead and reads a block's keys and values where they lie, once for all the query
 * heads that share them, with an online softmax (a running maximum, rescaled block by block),
 * so nothing is copied and no padding is computed.
 *
 * Work items are (sequence, KV head) pairs; a call computes items [first_item, last_item), so
 * callers can split a batch over threads. Layouts, all contiguous:
 *   query, out     [batch, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables   [batch, table_width] int32 (entries past a sequence's blocks are not read)
 *   context_lens   [batch] int32, each at least 1
 */
#include <math.h>
#include <stdint.h>

/* A dot product in 8 independent lanes, so the compiler vectorizes it without reordering
 * a single running sum (no -ffast-math needed). */
static float dot(const float *a, const float *b, int64_t n) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int r = 0; r < 8; ++r)
            lanes[r] += a[i + r] * b[i + r];
    float sum = 0.0f;
    for (int r = 0; r < 8; ++r)
        sum += lanes[r];
    for (; i < n; ++i)
        sum += a[i] * b[i];
    return sum;
}

void vkv_paged_decode_f32(const float *query, const float *k_cache, const float *v_cache,
                          const int32_t *block_tables, const int32_t *context_lens, float *out,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t table_width, float scale,
                          int64_t first_item, int64_t last_item) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    float running_max[group], total[group], acc[group][head_dim], score[block_size];

    for (int64_t item = first_item; item < last_item; ++item) {
        const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int32_t *table = block_tables + seq * table_width;
        const int64_t context = context_lens[seq];
        const float *q = query + (seq * num_heads + kv_head * group) * head_dim;
        for (int64_t j = 0; j < group; ++j) {
            running_max[j] = -INFINITY;
            total[j] = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d)
                acc[j][d] = 0.0f;
        }
        for (int64_t start = 0; start < context; start += block_size) {
            const int64_t n = context - start < block_size ? context - start : block_size;
            const int64_t offset = table[start / block_size] * block_stride + kv_head * head_dim;
            const float *k = k_cache + offset, *v = v_cache + offset;
            for (int64_t j = 0; j < group; ++j) {
                float block_max = -INFINITY;
                for (int64_t t = 0; t < n; ++t) {
                    score[t] = dot(q + j * head_dim, k + t * token_stride, head_dim) * scale;
                    block_max = score[t] > block_max ? score[t] : block_max;
                }
                const float new_max = block_max > running_max[j] ? block_max : running_max[j];
                const float rescale = expf(running_max[j] - new_max); /* 0 at the first block */
                total[j] *= rescale;
                for (int64_t d = 0; d < head_dim; ++d)
                    acc[j][d] *= rescale;
                for (int64_t t = 0; t < n; ++t) {
                    const float p = expf(score[t] - new_max);
                    const float *vt = v + t * token_stride;
                    total[j] += p;
                    for (int64_t d = 0; d < head_dim; ++d)
                        acc[j][d] += p * vt[d];
                }
                running_max[j] = new_max;
            }
        }
        float *o = out + (seq * num_heads + kv_head * group) * head_dim;
        for (int64_t j = 0; j < group; ++j)
            for (int64_t d = 0; d < head_dim; ++d)
                o[j * head_dim + d] = acc[j][d] / total[j];
    }
}
