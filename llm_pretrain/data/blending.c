/* Megatron's greedy blending (megatron/data/helpers.cpp build_blending_indices; PaddleNLP's
 * tool_helpers has the same loop): sample s comes from the dataset furthest behind its share,
 * the first one on ties. The same arithmetic as the Python loop in samples.py, in doubles,
 * compiled without FMA contraction so that every comparison is bit-identical to it.
 * Built on first use by llm_pretrain/data/samples.py (compiled_blending). */
#include <stdint.h>

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
