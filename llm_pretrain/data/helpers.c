/* The two index loops of Megatron's megatron/data/helpers.cpp (PaddleNLP ships the same ones
 * compiled, in tool_helpers), in C for llm_pretrain/data/samples.py, which compiles this file on
 * first use (compiled_helpers) and falls back to NumPy / Python without a C compiler. Compiled
 * without FMA contraction, so that the blending arithmetic is the Python loop's to the last bit. */
#include <stdint.h>

/* Greedy blending: sample s comes from the dataset furthest behind its share, the first on ties. */
void build_blending_indices(const double *weights, int64_t num_datasets, int64_t size, void *dataset_index,
                            int wide, int64_t *dataset_sample_index, int64_t *counts) {
    for (int64_t s = 0; s < size; ++s) {
        double target = s > 1 ? (double)s : 1.0;
        int64_t best = 0;
        double best_lag = weights[0] * target - (double)counts[0];
        for (int64_t i = 1; i < num_datasets; ++i) {
            double lag = weights[i] * target - (double)counts[i];
            if (lag > best_lag) {
                best = i;
                best_lag = lag;
            }
        }
        if (wide)
            ((int64_t *)dataset_index)[s] = best;
        else
            ((uint8_t *)dataset_index)[s] = (uint8_t)best;
        dataset_sample_index[s] = counts[best]++;
    }
}

/* sample_idx[k] = (position in doc_idx, token offset) where window k of seq_length + 1 tokens
 * starts; windows k and k + 1 share one token. int32 sizes, doc_idx and result (the usual case). */
void build_sample_idx_int32(const int32_t *sizes, const int32_t *doc_idx, int32_t seq_length, int64_t num_samples,
                            int32_t *sample_idx) {
    int64_t position = 0, offset = 0;
    sample_idx[0] = 0;
    sample_idx[1] = 0;
    for (int64_t k = 1; k <= num_samples; ++k) {
        int64_t remaining = (int64_t)seq_length + 1;
        while (remaining != 0) {
            int64_t length = (int64_t)sizes[doc_idx[position]] - offset;
            remaining -= length;
            if (remaining <= 0) {
                offset += remaining + length - 1;
                remaining = 0;
            } else {
                ++position;
                offset = 0;
            }
        }
        sample_idx[2 * k] = (int32_t)position;
        sample_idx[2 * k + 1] = (int32_t)offset;
    }
}
