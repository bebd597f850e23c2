/* One-row products through gemv: preloaded ahead of the BLAS (neuron/cpu.py builds and preloads it).

   MLX's CPU backend sends every float32 matmul to cblas_sgemm, and a decode step's products have one row per
   sequence: at batch 1, M == 1. There sgemm packs the weight matrix before multiplying, so it reads it at about
   a third of the memory bandwidth, where sgemv streams it once (SmolLM2 fp32, OpenBLAS, 2 cores: a decode step
   46 ms with sgemm, 29 ms with this). Every other call goes on, unchanged, to the BLAS's own sgemm.

   No headers, so a bare compiler builds it (no libc development files): dlsym comes from the C library at run
   time, and the CBLAS constants are the standard's. */

#define RTLD_NEXT ((void *)-1l)
extern void *dlsym(void *handle, const char *symbol);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

/* At load, once every preloaded library is mapped: "next" is the BLAS preloaded after this one. */
__attribute__((constructor)) static void find_next(void) {
  next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  if (order == ROW_MAJOR && m == 1 && next_sgemv) {
    int inc_a = trans_a == NO_TRANS ? 1 : lda; /* a is 1 x k: a row, or a column of a k x 1 matrix */
    if (trans_b == NO_TRANS) /* b is k x n: c = b^T a */
      next_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
    else /* b is stored n x k: c = b a */
      next_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
    return;
  }
  next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
