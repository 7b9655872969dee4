/* C floor for the launch benchmark: loops over cuLaunchKernel (both argument conventions) and
 * cuLaunchKernelEx of the empty (float*, int, float)
 * kernel, grid 1, block 32, argument values changing on every launch.
 * Build: cc -O2 -o c_floor_launch c_floor_launch.c -ldl     Run: ./c_floor_launch kernels.cubin */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult; typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef struct { unsigned gx, gy, gz, bx, by, bz, shared; CUstream stream; void *attrs; unsigned nattrs; }
    CUlaunchConfig;   /* the layout of CUlaunchConfig in cuda.h (attrs: CUlaunchAttribute *) */
enum { BURST = 256, REPS = 200, STEADY = 20000 };
/* one launch of variant v (0: kernelParams, 1: packed buffer, 2/3: the same through cuLaunchKernelEx),
 * with the argument values changed first, as the Python launchers do */
#define LAUNCH_ONE(v, i) do { \
    n = (i); x = (float)(i); memcpy(block + 8, &n, 4); memcpy(block + 12, &x, 4); \
    if ((v) == 0) launch(f, 1, 1, 1, 32, 1, 1, 0, 0, params, 0); \
    else if ((v) == 1) launch(f, 1, 1, 1, 32, 1, 1, 0, 0, 0, extra); \
    else if ((v) == 2) launch_ex(&config, f, params, 0); \
    else launch_ex(&config, f, 0, extra); } while (0)
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  CUresult (*cuInit)(unsigned) = dlsym(h, "cuInit");
  CUresult (*cuDeviceGet)(int *, int) = dlsym(h, "cuDeviceGet");
  CUresult (*retain)(CUcontext *, int) = dlsym(h, "cuDevicePrimaryCtxRetain");
  CUresult (*setcur)(CUcontext) = dlsym(h, "cuCtxSetCurrent");
  CUresult (*load)(CUmodule *, const char *) = dlsym(h, "cuModuleLoad");
  CUresult (*getfn)(CUfunction *, CUmodule, const char *) = dlsym(h, "cuModuleGetFunction");
  CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(h, "cuMemAlloc_v2");
  CUresult (*sync)(void) = dlsym(h, "cuCtxSynchronize");
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **, void **) = dlsym(h, "cuLaunchKernel");
  CUresult (*launch_ex)(const CUlaunchConfig *, CUfunction, void **, void **) = dlsym(h, "cuLaunchKernelEx");
  int dev; CUcontext ctx; CUmodule mod; CUfunction f; CUdeviceptr p;
  cuInit(0); cuDeviceGet(&dev, 0); retain(&ctx, dev); setcur(ctx);
  if (load(&mod, argv[1])) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
  getfn(&f, mod, "empty"); alloc(&p, 1024);
  int n = 0; float x = 0; void *params[3] = {&p, &n, &x};
  /* the packed block of the same arguments, for the CU_LAUNCH_PARAM_BUFFER_* convention */
  char block[16]; size_t block_size = sizeof block;
  void *extra[5] = {(void *)1, block, (void *)2, &block_size, (void *)0};
  CUlaunchConfig config = {1, 1, 1, 32, 1, 1, 0, 0, 0, 0};
  memcpy(block, &p, 8);
  const char *names[4] = {"params", "buffer", "ex_params", "ex_buffer"};
  printf("{");
  for (int variant = 0; variant < 4; variant++) {
    double bursts[REPS], steady, a;
    for (int r = 0; r < REPS; r++) {
      sync();
      a = now();
      for (int i = 0; i < BURST; i++) LAUNCH_ONE(variant, i);
      bursts[r] = (now() - a) / BURST;
    }
    sync();
    qsort(bursts, REPS, sizeof(double), cmp);
    a = now();
    for (int i = 0; i < STEADY; i++) LAUNCH_ONE(variant, i);
    sync();
    steady = (now() - a) / STEADY;
    printf("%s\"%s\": {\"burst_us\": %.4f, \"steady_us\": %.4f}", variant ? ", " : "", names[variant],
           bursts[REPS / 2] * 1e6, steady * 1e6);
  }
  printf("}\n");
  return 0;
}
