/* y[M, N] = x[M, K] @ W[N, K]^T + bias, fp32, on a weight packed once for this loop.
 *
 * Why a kernel of our own: a decode step multiplies a few rows (one per running sequence) by
 * every weight of the model once, so it is a stream of the weights through the FMA units, and
 * what counts is how close that stream gets to the memory bandwidth. At a few rows this loop
 * gets closer to it than oneDNN or MKL (F.linear) do (measured: docs/results/README.md).
 *
 * Packed layout (cpu_gemm.pack): the N outputs in blocks of BLOCK = 32 columns, block b stored
 * as [K][32] contiguous floats, so that one block is read front to back exactly once per tile
 * of rows; the last block is zero-padded. Each tile keeps up to 8 rows x 32 columns of
 * accumulators in vector registers (16 x 512-bit on AVX-512) and broadcasts one x value per
 * row and k. Written with GCC vector extensions, so that -march=native compiles it to whatever
 * vector width the machine has.
 *
 * Numerics: each output is a plain fp32 sum over k in order, starting from the bias (F.linear's
 * value up to rounding, like any other GEMM). Threads split the column blocks (OpenMP: the same
 * libgomp as torch's when loaded into a torch process, so no second thread pool).
 */
#include <string.h>

#include "vec.h"

#define BLOCK 32
#define MAX_ROWS 8

static inline __attribute__((always_inline)) void tile(
    const int rows, const float *x, long ldx, int k_dim, const float *w, const float *bias,
    float *y, long ldy, int cols) {
  vec16 acc0[MAX_ROWS], acc1[MAX_ROWS];
  vec16 b0 = {0}, b1 = {0};
  if (bias) {
    b0 = *(const vec16_u *)bias;
    b1 = *(const vec16_u *)(bias + 16);
  }
#pragma GCC unroll 8
  for (int m = 0; m < rows; m++) {
    acc0[m] = b0;
    acc1[m] = b1;
  }
  for (int k = 0; k < k_dim; k++) {
    const vec16 w0 = *(const vec16_u *)(w + (long)k * BLOCK);
    const vec16 w1 = *(const vec16_u *)(w + (long)k * BLOCK + 16);
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) {
      const float xv = x[m * ldx + k];
      acc0[m] += xv * w0;
      acc1[m] += xv * w1;
    }
  }
  for (int m = 0; m < rows; m++) {
    float out[BLOCK];
    memcpy(out, &acc0[m], sizeof(vec16));
    memcpy(out + 16, &acc1[m], sizeof(vec16));
    memcpy(y + m * ldy, out, sizeof(float) * cols);
  }
}

/* x: [M, K] with row stride ldx; w: packed [ceil(N/32)][K][32]; bias: NULL or [ceil(N/32)*32];
 * y: [M, N] with row stride ldy. */
void cpu_gemm(const float *x, long ldx, int m_dim, int k_dim, const float *w, const float *bias,
              int n_dim, float *y, long ldy, int threads) {
  const int blocks = (n_dim + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int b = 0; b < blocks; b++) {
    const float *wb = w + (long)b * k_dim * BLOCK;
    const float *bb = bias ? bias + (long)b * BLOCK : 0;
    const int cols = n_dim - b * BLOCK < BLOCK ? n_dim - b * BLOCK : BLOCK;
    for (int m0 = 0; m0 < m_dim; m0 += MAX_ROWS) {
      const int rows = m_dim - m0 < MAX_ROWS ? m_dim - m0 : MAX_ROWS;
      const float *xm = x + m0 * ldx;
      float *ym = y + m0 * ldy + b * BLOCK;
      /* One specialisation per row count: the accumulators must be compile-time registers. */
      switch (rows) {
        case 8: tile(8, xm, ldx, k_dim, wb, bb, ym, ldy, cols); break;
        case 7: tile(7, xm, ldx, k_dim, wb, bb, ym, ldy, cols); break;
        case 6: tile(6, xm, ldx, k_dim, wb, bb, ym, ldy, cols); break;
        case 5: tile(5, xm, ldx, k_dim, wb, bb, ym, ldy, cols); break;
        case 4: tile(4, xm, ldx, k_dim, wb, bb, ym, ldy, cols); break;
        case 3: tile(3, xm, ldx, k_dim, wb, bb, ym, ldy, cols); break;
        case 2: tile(2, xm, ldx, k_dim, wb, bb, ym, ldy, cols); break;
        default: tile(1, xm, ldx, k_dim, wb, bb, ym, ldy, cols); break;
      }
    }
  }
}
