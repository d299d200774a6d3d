/* MiTA's layer backward on the CPU, head by head: the kernel behind attentions/ops/landmark/mita_layer_cpu.py
 * (float32).
 *
 * The backward of MiTA's default form is two passes that meet in the same buffers: the grouped
 * attention's (grouped_cpu.c: the shared and routed experts' softmax) makes dq, the key and value
 * gradients dK, dV [G N, D] and the shared tables' gradients d marks, d V_s [G, m, D]; the landmark
 * pass's (landmark_cpu.c) takes d V_s and adds into d marks, dK and dV. Run as two calls over every
 * head, each reads and writes dK and dV whole (2 MB each at N = 1K, batch 8, 2 heads), and with the
 * scores, keys and values between them nothing is left in the cache for the second. Here a thread
 * takes a head through both: zeroes its rows of dK, dV and d marks, d V_s, runs the grouped backward
 * of its m experts (their routed keys are rows of the same head: the head's rows are its own) and
 * then the landmark backward of the head, into the same rows while they are in the cache (and, when
 * asked, the landmarks' pooling backward into the head's dq rows). The same
 * arithmetic in the same order as the two calls: the same bits (tests/test_mita_cpu.py). MiTA's layer
 * (forward and backward, batch 8, 2 threads, AMD EPYC) 4-7% faster at 1K-4K; the same at 64K (B = 1,
 * H = 4), where a head's rows no longer fit the caches (results/throughput/kernel-ab-amd-epyc-2c/).
 *
 * Both kernels are compiled into this library (their sources included: static functions, one
 * translation unit); their own libraries stay the entry points of every other caller.
 */
#include "grouped_cpu.c"
#include "landmark_cpu.c"

/* ga: the grouped backward of G m experts, M = m shared keys per group of m experts (group = m),
 * keys read by index from rows of their own head (rows [G m, S] into [G N, D]); its dkeys, dvalues,
 * dskeys, dsvalues are written whole (no zero fill needed). la: the landmark backward of the same G heads with accumulate 1,
 * dshared = ga->dsvalues, dmarks = ga->dskeys, dkeys and dvalues those of ga. pool, or NULL: the
 * landmarks' pooling (backward, accumulate 1, dout = dmarks, dx = ga->dq with its rows in query
 * order): the head's d marks are multiplied by pool_scale (the gradient of the unscaled landmarks,
 * which the layer scaled by it) and spread over the head's dq rows while they are in the cache, as
 * lra::pool_bins_backward_add of them would after the call (the same bits). 0 on success, 1 when a
 * thread's buffers could not be allocated. */
int mita_backward(const Grouped *ga, const Landmarks *la, const Pool *pool, float pool_scale) {
    const int64_t G = la->G, m = la->m, N = la->N, D = la->D;
    const int64_t threads = ga->threads < 1 ? 1 : (ga->threads > G ? G : ga->threads);
    no_expert_pairs(ga, 1);
    offsets_of_pairs(ga);
    int64_t *order = heads_by_size(la);
    if (!order) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        void *work = calloc(1, work_bytes(ga));
        float *pass = (float *)malloc(sizeof(float) * (D * BLOCK + 2 * m * BLOCK + m + BLOCK));
        failed |= work == NULL || pass == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < G; i++) {
            const int64_t g = order[i];
            if (!work || !pass) continue;
            memset(ga->dkeys + g * N * D, 0, sizeof(float) * N * D);
            memset(ga->dvalues + g * N * D, 0, sizeof(float) * N * D);
            memset(ga->dskeys + g * m * D, 0, sizeof(float) * m * D);
            memset(ga->dsvalues + g * m * D, 0, sizeof(float) * m * D);
            run_experts(ga, g * m, (g + 1) * m, 1, work);
            backward_head(la, g, pass);
            if (pool) {
                for (int64_t i = 0; i < m * D; i++) ga->dskeys[g * m * D + i] *= pool_scale;
                pool_head(pool, g);
            }
        }
        free(work);
        free(pass);
    }
    free(order);
    return failed;
}
