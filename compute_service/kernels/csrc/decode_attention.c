/* Paged decode attention, fp32: one query token per sequence over its paged K/V, read in place.
 *
 * Semantics are attention_ref.paged_decode_attention's (the oracle the tests compare with):
 * q [B, Hq, D]; k_cache, v_cache [num_pages, page_size, Hkv, D]; block_tables [B, bt_stride]
 * int32; seq_lens [B] int32 >= 1, counting the current token; window 0 = full attention, W > 0 =
 * only the last W positions. Query head h reads kv head h / (Hq / Hkv).
 *
 * Why: the PyTorch path gathers every row's K and V into a padded copy and then runs SDPA over
 * it, so K/V cross memory three times; here each (sequence, kv head) task reads its keys once,
 * straight from the pages its block table names, for all the query heads of its group. Only
 * slots holding one of the row's keys inside its window are read (the never-read guarantee of
 * the reference: other slots may hold NaN or another request's data).
 *
 * Keys are taken a page run at a time (at most RUN keys): scores for every head of the group,
 * then an online-softmax update (one rescale per run, not per key) and the weighted V sum.
 */
#include <math.h>

#include "vec.h"

#define RUN 64
#define MAX_GROUP 16
#define MAX_HEAD_DIM 512

/* Lane i = the sum of v[i]'s lanes, for 16 vectors: a tree of two-vector shuffles (15 adds)
 * instead of 16 separate horizontal sums (64). */
static inline vec16 sum16(const vec16 *v) {
  vec16 x[8], y[4], z[2];
  for (int i = 0; i < 8; i++)
    x[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1],
                             (vec16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1],
                             (vec16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; i++)
    y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1],
                             (vec16i){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(x[2 * i], x[2 * i + 1],
                             (vec16i){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int i = 0; i < 2; i++)
    z[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1],
                             (vec16i){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
           __builtin_shuffle(y[2 * i], y[2 * i + 1],
                             (vec16i){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return __builtin_shuffle(z[0], z[1],
                           (vec16i){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(z[0], z[1],
                           (vec16i){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

/* Lane i < n: q . k_i over head_dim floats, for keys k_i = k + i * row; lanes >= n: 0. */
static inline vec16 dots16(const float *q, const float *k, long row, int n, int head_dim) {
  vec16 acc[16];
  for (int i = 0; i < 16; i++) acc[i] = (vec16){0};
  int d = 0;
  for (; d + 16 <= head_dim; d += 16) {
    const vec16 qv = *(const vec16_u *)(q + d);
    for (int i = 0; i < n; i++) acc[i] += qv * *(const vec16_u *)(k + i * row + d);
  }
  vec16 out = sum16(acc);
  for (; d < head_dim; d++) /* head dims off the vector width */
    for (int i = 0; i < n; i++) out[i] += q[d] * k[i * row + d];
  return out;
}

static void attend_group(const float *q, const float *k_cache, const float *v_cache,
                         const int *block_table, int seq_len, int lo, int group, int kv_head,
                         int num_kv_heads, int head_dim, int page_size, float scale, float *out) {
  float acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64)));
  float p[MAX_GROUP][RUN + 16] __attribute__((aligned(64)));
  float m[MAX_GROUP], l[MAX_GROUP];
  for (int g = 0; g < group; g++) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
  }
  const long row = (long)num_kv_heads * head_dim; /* floats per slot */
  for (int start = lo; start < seq_len;) {
    const int offset = start % page_size;
    int run = page_size - offset;
    if (run > seq_len - start) run = seq_len - start;
    if (run > RUN) run = RUN;
    const long slot = (long)block_table[start / page_size] * page_size + offset;
    const float *k = k_cache + slot * row + (long)kv_head * head_dim;
    const float *v = v_cache + slot * row + (long)kv_head * head_dim;
    for (int g = 0; g < group; g++) {
      for (int j = 0; j < run; j += 16) {
        const int n = run - j < 16 ? run - j : 16;
        *(vec16_u *)&p[g][j] = scale * dots16(q + (long)g * head_dim, k + j * row, row, n,
                                              head_dim);
      }
      float run_max = -INFINITY;
      for (int j = 0; j < run; j++) run_max = p[g][j] > run_max ? p[g][j] : run_max;
      const float new_max = run_max > m[g] ? run_max : m[g];
      const float correction = expf(m[g] - new_max); /* 0 on the first run (m = -inf) */
      m[g] = new_max;
      float total = 0.0f;
      for (int j = 0; j < run; j += 16) {
        vec16 e = vexp(*(vec16_u *)&p[g][j] - new_max);
        *(vec16_u *)&p[g][j] = e;
      }
      for (int j = 0; j < run; j++) total += p[g][j]; /* lanes past `run` are not summed */
      l[g] = l[g] * correction + total;
      for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;
    }
    /* acc[g] += sum_j p[g][j] v_j, 64 channels at a time so that they stay in registers. */
    for (int g = 0; g < group; g++) {
      int d = 0;
      for (; d + 64 <= head_dim; d += 64) {
        vec16 a0 = *(vec16 *)&acc[g][d], a1 = *(vec16 *)&acc[g][d + 16];
        vec16 a2 = *(vec16 *)&acc[g][d + 32], a3 = *(vec16 *)&acc[g][d + 48];
        for (int j = 0; j < run; j++) {
          const float *vj = v + j * row + d;
          const float w = p[g][j];
          a0 += w * *(const vec16_u *)vj;
          a1 += w * *(const vec16_u *)(vj + 16);
          a2 += w * *(const vec16_u *)(vj + 32);
          a3 += w * *(const vec16_u *)(vj + 48);
        }
        *(vec16 *)&acc[g][d] = a0, *(vec16 *)&acc[g][d + 16] = a1;
        *(vec16 *)&acc[g][d + 32] = a2, *(vec16 *)&acc[g][d + 48] = a3;
      }
      for (; d < head_dim; d++) {
        float a = acc[g][d];
        for (int j = 0; j < run; j++) a += p[g][j] * v[j * row + d];
        acc[g][d] = a;
      }
    }
    start += run;
  }
  for (int g = 0; g < group; g++) {
    const float inv = 1.0f / l[g];
    for (int d = 0; d < head_dim; d++) out[(long)g * head_dim + d] = acc[g][d] * inv;
  }
}

/* Returns 0, or -1 when the shapes exceed the kernel's fixed buffers (the caller checks first). */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int *block_tables, long bt_stride, const int *seq_lens,
                           int batch, int num_heads, int num_kv_heads, int head_dim, int page_size,
                           float scale, int window, float *out, int threads) {
  const int group = num_heads / num_kv_heads;
  if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;
  /* A task is a sequence (its rows are read front to back) when there are enough of them for
   * the threads, else one kv head of a sequence. Rows differ in length: handed out one by one. */
  const int per_sequence = batch >= threads;
  const int tasks = per_sequence ? batch : batch * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int t = 0; t < tasks; t++) {
    const int b = per_sequence ? t : t / num_kv_heads;
    const int first_head = per_sequence ? 0 : t % num_kv_heads;
    const int end_head = per_sequence ? num_kv_heads : first_head + 1;
    const int len = seq_lens[b];
    const int lo = window > 0 && len > window ? len - window : 0;
    for (int h = first_head; h < end_head; h++) {
      const long first = ((long)b * num_heads + (long)h * group) * head_dim;
      attend_group(q + first, k_cache, v_cache, block_tables + (long)b * bt_stride, len, lo,
                   group, h, num_kv_heads, head_dim, page_size, scale, out + first);
    }
  }
  return 0;
}
