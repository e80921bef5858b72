/* The batched multi-adapter LoRA update on CPU, fp32 (lora_ref.lora_apply's semantics): for each
 * token t with slot s = token_slot[t] in [0, S),
 *
 *     y[t] += sum_i (scaling[s] * x[t] . A[s, i]) * B_t[s, i]      (i < rank)
 *
 * with A [S, r_max, in] and B_t [S, r_max, out] (B_stack transposed, kept by the adapter
 * registry on CPU), so that both the shrink (dots along `in`) and the expand (rows of B_t added
 * along `out`) read contiguous memory. A rank i whose shrunk value is exactly 0 (the zero rows
 * of an adapter below r_max) adds nothing and is skipped. Tokens with slot -1 are untouched and
 * slots no token names are never read.
 *
 * Why: the reference loops over the adapters of a batch in Python, ~8 torch ops per adapter and
 * projection, so a decode step's cost grew with the number of adapters in the batch. One call
 * per projection here, threads over tokens.
 */
#include "vec.h"

#define MAX_RANK 256

/* Returns 0, or -1 when r_max exceeds MAX_RANK (the caller checks first). */
int lora_apply(float *y, long ldy, const float *x, long ldx, int tokens, int in_dim, int out_dim,
               const float *a, const float *b_t, const float *scaling, const int *token_slot,
               int slots, int r_max, int threads) {
  if (r_max > MAX_RANK) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < tokens; t++) {
    const int s = token_slot[t];
    if (s < 0 || s >= slots) continue;
    const float *xt = x + (long)t * ldx;
    float *yt = y + (long)t * ldy;
    for (int i = 0; i < r_max; i++) {
      const float shrunk = scaling[s] * vdot(xt, a + ((long)s * r_max + i) * in_dim, in_dim);
      if (shrunk == 0.0f) continue;
      const float *row = b_t + ((long)s * r_max + i) * out_dim;
      for (int o = 0; o < out_dim; o++) yt[o] += shrunk * row[o];
    }
  }
  return 0;
}
