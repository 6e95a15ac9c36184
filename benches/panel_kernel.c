/* How fast could a hand-written kernel stream SmolLM2-135M's float32 weights
 * through a 32-row decode step? Sizes the gap between the available kernels
 * (benches/linears.py) and the machine's read bandwidth; the engine does not
 * use this code.
 *
 * The same 121 matmuls as benches/linears.py (per layer q/k/v 960x576, o
 * 576x576, gate/up 3072x576, down 576x1536; then the 49152x576 LM head), each
 * weight packed in panels of 16 output columns ([k][16] contiguous), 32 rows
 * of random input. A panel is read once: k in chunks of CH, each chunk used by
 * rows 0-15 and then rows 16-31 while it is in L1 (16 AVX-512 accumulators
 * per block), with a prefetch into L2 of the weight PF floats ahead at every
 * step. Panels are split between the OpenMP threads. Best of 5 passes.
 *
 * Run: gcc -O3 -march=native -fopenmp benches/panel_kernel.c -o /tmp/panel_kernel
 *      OMP_NUM_THREADS=2 /tmp/panel_kernel [CH=64] [PF=256]
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define M 32

static int CH = 64, PF = 256;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline void panel(const float *restrict x, int k, const float *restrict w, float *restrict c,
                         int ldc) {
  __m512 a[16], b[16];
  for (int i = 0; i < 16; i++) a[i] = b[i] = _mm512_setzero_ps();
  for (int k0 = 0; k0 < k; k0 += CH) {
    int k1 = k0 + CH < k ? k0 + CH : k;
    for (int kk = k0; kk < k1; kk++) {
      _mm_prefetch((const char *)(w + (size_t)kk * 16 + PF), _MM_HINT_T1);
      __m512 wv = _mm512_load_ps(w + (size_t)kk * 16);
      for (int i = 0; i < 16; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * k + kk]), wv, a[i]);
    }
    for (int kk = k0; kk < k1; kk++) {
      __m512 wv = _mm512_load_ps(w + (size_t)kk * 16);
      for (int i = 0; i < 16; i++)
        b[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[(16 + i) * k + kk]), wv, b[i]);
    }
  }
  for (int i = 0; i < 16; i++) {
    _mm512_storeu_ps(c + (size_t)i * ldc, a[i]);
    _mm512_storeu_ps(c + (size_t)(16 + i) * ldc, b[i]);
  }
}

int main(int argc, char **argv) {
  if (argc > 1) CH = atoi(argv[1]);
  if (argc > 2) PF = atoi(argv[2]);
  static const int layer[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  int shapes[121][2], n = 0;
  for (int l = 0; l < 30; l++)
    for (int j = 0; j < 4; j++, n++) shapes[n][0] = layer[j][0], shapes[n][1] = layer[j][1];
  shapes[n][0] = 49152, shapes[n][1] = 576, n++;
  size_t total = 0;
  double flops = 0;
  for (int i = 0; i < n; i++) {
    total += (size_t)shapes[i][0] * shapes[i][1];
    flops += 2.0 * M * shapes[i][0] * shapes[i][1];
  }
  float *w = aligned_alloc(64, total * 4), *x = aligned_alloc(64, M * 3072 * 4),
        *c = aligned_alloc(64, (size_t)M * 49152 * 4);
  for (size_t i = 0; i < total; i++) w[i] = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
  for (int i = 0; i < M * 3072; i++) x[i] = (float)(i % 17) / 17.f;
  double best = 1e9;
  for (int rep = 0; rep < 6; rep++) {
    double t = now();
    size_t off = 0;
    for (int s = 0; s < n; s++) {
      int rows = shapes[s][0], k = shapes[s][1];
      const float *ws = w + off;
#pragma omp parallel for schedule(static)
      for (int p = 0; p < rows / 16; p++) panel(x, k, ws + (size_t)p * k * 16, c + p * 16, rows);
      off += (size_t)rows * k;
    }
    double d = now() - t;
    if (rep && d < best) best = d;
  }
  printf("CH=%d PF=%d threads=%d: %.1f ms per pass, %.0f GFLOP/s, weights read at %.1f GB/s\n", CH,
         PF, omp_get_max_threads(), best * 1e3, flops / best / 1e9, total * 4 / best / 1e9);
  return 0;
}
