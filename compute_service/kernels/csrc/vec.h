/* 16-float vectors through GCC vector extensions: -march=native compiles them to the machine's
 * widest vectors (one AVX-512 register, two AVX2 ones, ...), so the kernels carry no intrinsics. */
#ifndef PREFIXCACHE_VEC_H
#define PREFIXCACHE_VEC_H

typedef float vec16 __attribute__((vector_size(64)));
typedef int vec16i __attribute__((vector_size(64)));
/* The same vector, read from memory aligned only to a float. */
typedef float vec16_u __attribute__((vector_size(64), aligned(4)));

static inline vec16 vsplat(float x) { return (vec16){0} + x; }

static inline vec16 vselect(vec16i mask, vec16 a, vec16 b) {
  return (vec16)((mask & (vec16i)a) | (~mask & (vec16i)b));
}

/* The sum of the lanes, as a tree of in-register shuffles (a loop over the lanes would be 16
 * dependent adds). */
static inline float vsum(vec16 v) {
  v += __builtin_shuffle(v, (vec16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, (vec16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, (vec16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, (vec16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

/* a . b over n floats. */
static inline float vdot(const float *a, const float *b, int n) {
  vec16 acc = {0};
  int i = 0;
  for (; i + 16 <= n; i += 16) acc += *(const vec16_u *)(a + i) * *(const vec16_u *)(b + i);
  float s = vsum(acc);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* exp(x) to about 2 ulp for x in [-87, 88] (clamped there: below, results are ~1e-38 rather than
 * 0, which callers never sum with an unclamped weight), as Cephes' expf: x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n by the exponent bits. */
static inline vec16 vexp(vec16 x) {
  x = vselect(x < vsplat(-87.0f), vsplat(-87.0f), x);
  x = vselect(x > vsplat(88.0f), vsplat(88.0f), x);
  const vec16 t = x * 1.44269504088896341f + 0.5f;
  vec16 n = __builtin_convertvector(__builtin_convertvector(t, vec16i), vec16);
  n = vselect(n > t, n - 1.0f, n); /* floor(t): the conversion truncated toward zero */
  const vec16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec16 p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vec16i bits = (__builtin_convertvector(n, vec16i) + 127) << 23;
  return p * (vec16)bits;
}

#endif
