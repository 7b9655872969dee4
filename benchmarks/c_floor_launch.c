/* C floor for the launch benchmark: a loop over cuLaunchKernel of the empty (float*, int, float)
 * kernel, grid 1, block 32, argument values changing on every launch.
 * Build: cc -O2 -o c_floor_launch c_floor_launch.c -ldl     Run: ./c_floor_launch kernels.cubin */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult; typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
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
  int dev; CUcontext ctx; CUmodule mod; CUfunction f; CUdeviceptr p;
  cuInit(0); cuDeviceGet(&dev, 0); retain(&ctx, dev); setcur(ctx);
  if (load(&mod, argv[1])) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
  getfn(&f, mod, "empty"); alloc(&p, 1024);
  int n = 0; float x = 0; void *params[3] = {&p, &n, &x};
  enum { BURST = 256, REPS = 200, STEADY = 20000 };
  double bursts[REPS];
  for (int r = 0; r < REPS; r++) {
    sync();
    double a = now();
    for (int i = 0; i < BURST; i++) { n = i; x = (float)i; launch(f, 1, 1, 1, 32, 1, 1, 0, 0, params, 0); }
    bursts[r] = (now() - a) / BURST;
  }
  sync();
  qsort(bursts, REPS, sizeof(double), cmp);
  double a = now();
  for (int i = 0; i < STEADY; i++) { n = i; x = (float)i; launch(f, 1, 1, 1, 32, 1, 1, 0, 0, params, 0); }
  sync();
  double steady = (now() - a) / STEADY;
  printf("{\"burst_us\": %.4f, \"steady_us\": %.4f}\n", bursts[REPS / 2] * 1e6, steady * 1e6);
  return 0;
}
