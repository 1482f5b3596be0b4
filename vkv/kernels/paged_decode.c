/* Paged decode attention on a CPU, float32, read in place from the paged KV cache.
 *
 * The definition is vkv.kernels.reference.paged_decode_attention: one new token per sequence
 * attends to the context_lens[b] tokens cached for it (its own included), grouped-query heads
 * (query head h reads KV head h / (num_heads / num_kv_heads)). The reference gathers every block
 * of every sequence into one padded tensor and masks the padding; this loop walks each block
 * table instead and reads a block's keys and values where they lie, for all of the sequence's
 * heads while the block is in the CPU's cache, with an online softmax (a running maximum,
 * rescaled block by block), so nothing is copied and no padding is computed.
 *
 * A call computes the whole batch, one sequence per iteration of an OpenMP loop (without
 * -fopenmp, one thread). Layouts, all contiguous:
 *   query          [batch, num_heads, head_dim], a sequence's row query_stride floats apart
 *   out            [batch, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables   [batch, table_width] int32 (entries past a sequence's blocks are not read)
 *   context_lens   [batch] int32 (0: a padded row, which attends to nothing: its output is 0)
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Blocks read ahead of the one being computed: a block of another sequence lies anywhere in the
 * cache, so the CPU cannot guess it; fetched early, it is in the cache when its turn comes. */
#define BLOCKS_AHEAD 4

/* out[t] = scale * (q . k_t) for the n tokens of a block, whose rows lie token_stride floats
 * apart. With AVX2 and FMA, eight tokens at a time: an 8-lane partial sum per token, then the
 * eight sums reduced together by one tree of horizontal adds (eight separate reductions cost
 * several times more); otherwise, and for the last tokens, one dot product each. */
static void block_scores(const float *q, const float *k, int64_t token_stride, int64_t n,
                         int64_t head_dim, float scale, float *out) {
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; head_dim % 8 == 0 && t + 8 <= n; t += 8) {
        __m256 sums[8];
        for (int r = 0; r < 8; ++r) {
            const float *row = k + (t + r) * token_stride;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < head_dim; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(row + i), acc);
            sums[r] = acc;
        }
        /* pairs, then quads: lanes [t0 t1 t2 t3 | t0 t1 t2 t3] (and t4..t7); add the halves */
        const __m256 low4 = _mm256_hadd_ps(_mm256_hadd_ps(sums[0], sums[1]),
                                           _mm256_hadd_ps(sums[2], sums[3]));
        const __m256 high4 = _mm256_hadd_ps(_mm256_hadd_ps(sums[4], sums[5]),
                                            _mm256_hadd_ps(sums[6], sums[7]));
        const __m256 total = _mm256_add_ps(_mm256_permute2f128_ps(low4, high4, 0x20),
                                           _mm256_permute2f128_ps(low4, high4, 0x31));
        _mm256_storeu_ps(out + t, _mm256_mul_ps(total, _mm256_set1_ps(scale)));
    }
#endif
    for (; t < n; ++t)
        out[t] = dot(q, k + t * token_stride, head_dim) * scale;
}

/* acc[d] += sum over t of weight[t] * v_t[d], for the n tokens of a block, whose rows lie
 * token_stride floats apart. The running sums stay in registers while the block's tokens stream
 * past: 32 channels at a time, with even and odd tokens in separate sums (eight independent
 * chains, so the adds do not wait on one another), then 8 at a time; the remaining channels
 * (all of them without AVX2) token by token. */
static void add_weighted_rows(const float *weight, const float *v, int64_t token_stride,
                              int64_t n, int64_t head_dim, float *acc) {
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 32 <= head_dim; d += 32) {
        __m256 even[4], odd[4];
        for (int c = 0; c < 4; ++c) {
            even[c] = _mm256_loadu_ps(acc + d + 8 * c);
            odd[c] = _mm256_setzero_ps();
        }
        int64_t t = 0;
        for (; t + 2 <= n; t += 2) {
            const float *row = v + t * token_stride + d;
            const __m256 w_even = _mm256_set1_ps(weight[t]), w_odd = _mm256_set1_ps(weight[t + 1]);
            for (int c = 0; c < 4; ++c) {
                even[c] = _mm256_fmadd_ps(w_even, _mm256_loadu_ps(row + 8 * c), even[c]);
                odd[c] = _mm256_fmadd_ps(w_odd, _mm256_loadu_ps(row + token_stride + 8 * c),
                                         odd[c]);
            }
        }
        if (t < n)
            for (int c = 0; c < 4; ++c)
                even[c] = _mm256_fmadd_ps(_mm256_set1_ps(weight[t]),
                                          _mm256_loadu_ps(v + t * token_stride + d + 8 * c),
                                          even[c]);
        for (int c = 0; c < 4; ++c)
            _mm256_storeu_ps(acc + d + 8 * c, _mm256_add_ps(even[c], odd[c]));
    }
    for (; d + 8 <= head_dim; d += 8) {
        __m256 sum = _mm256_loadu_ps(acc + d);
        for (int64_t t = 0; t < n; ++t)
            sum = _mm256_fmadd_ps(_mm256_set1_ps(weight[t]),
                                  _mm256_loadu_ps(v + t * token_stride + d), sum);
        _mm256_storeu_ps(acc + d, sum);
    }
#endif
    for (int64_t t = 0; t < n; ++t) /* token by token, so the compiler vectorizes over channels */
        for (int64_t e = d; e < head_dim; ++e)
            acc[e] += weight[t] * v[t * token_stride + e];
}

/* Whether the table covers the context with blocks of the cache. */
static int valid_table(const int32_t *table, int64_t context, int64_t block_size,
                       int64_t table_width, int64_t num_blocks) {
    const int64_t blocks = (context + block_size - 1) / block_size;
    if (context < 0 || blocks > table_width)
        return 0;
    for (int64_t b = 0; b < blocks; ++b)
        if (table[b] < 0 || table[b] >= num_blocks)
            return 0;
    return 1;
}

static void prefetch_block(const float *k_cache, const float *v_cache, int64_t offset,
                           int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) { /* a cache line holds 16 floats */
        __builtin_prefetch(k_cache + offset + i);
        __builtin_prefetch(v_cache + offset + i);
    }
}

/* Returns 0, or -1 if a sequence's context is longer than its table or its table names a block
 * outside the cache: that sequence's output is then left unwritten (nothing is read out of
 * bounds). */
int vkv_paged_decode_f32(const float *query, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, const int32_t *context_lens, float *out,
                         int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t table_width, int64_t num_blocks,
                         int64_t query_stride, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    int status = 0;

    /* one sequence per iteration: its blocks are read whole, by one thread, once */
#pragma omp parallel for schedule(dynamic)
    for (int64_t seq = 0; seq < batch; ++seq) {
        float running_max[num_heads], total[num_heads], acc[num_heads][head_dim];
        float weight[block_size];
        const int32_t *table = block_tables + seq * table_width;
        const int64_t context = context_lens[seq];
        const float *q = query + seq * query_stride;
        if (!valid_table(table, context, block_size, table_width, num_blocks)) {
#pragma omp atomic write
            status = -1;
            continue;
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            running_max[h] = -INFINITY;
            total[h] = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d)
                acc[h][d] = 0.0f;
        }
        for (int64_t b = 0; b < BLOCKS_AHEAD && b * block_size < context; ++b)
            prefetch_block(k_cache, v_cache, table[b] * block_stride, block_stride);
        for (int64_t start = 0; start < context; start += block_size) {
            const int64_t n = context - start < block_size ? context - start : block_size;
            const float *k_block = k_cache + table[start / block_size] * block_stride;
            const float *v_block = v_cache + table[start / block_size] * block_stride;
            const int64_t ahead = start / block_size + BLOCKS_AHEAD;
            if (ahead * block_size < context) /* fetched while this block computes */
                prefetch_block(k_cache, v_cache, table[ahead] * block_stride, block_stride);
            for (int64_t h = 0; h < num_heads; ++h) {
                /* query head h reads KV head h / group: its slice of every token's row */
                const float *k = k_block + (h / group) * head_dim;
                const float *v = v_block + (h / group) * head_dim;
                block_scores(q + h * head_dim, k, token_stride, n, head_dim, scale, weight);
                float block_max = -INFINITY;
                for (int64_t t = 0; t < n; ++t)
                    block_max = weight[t] > block_max ? weight[t] : block_max;
                const float new_max = block_max > running_max[h] ? block_max : running_max[h];
                const float rescale = exp_nonpositive(running_max[h] - new_max);
                for (int64_t t = 0; t < n; ++t)
                    weight[t] = exp_nonpositive(weight[t] - new_max);
                float block_total = 0.0f;
                for (int64_t t = 0; t < n; ++t)
                    block_total += weight[t];
                total[h] = total[h] * rescale + block_total;
                for (int64_t d = 0; d < head_dim; ++d)
                    acc[h][d] *= rescale;
                add_weighted_rows(weight, v, token_stride, n, head_dim, acc[h]);
                running_max[h] = new_max;
            }
        }
        float *o = out + seq * num_heads * head_dim;
        for (int64_t h = 0; h < num_heads; ++h)
            for (int64_t d = 0; d < head_dim; ++d)
                o[h * head_dim + d] = context ? acc[h][d] / total[h] : 0.0f;
    }
    return status;
}
