/* C floor for the launch benchmark: loops over cuLaunchKernel (both argument conventions) and
 * cuLaunchKernelEx of the empty (float*, int, float) kernel, grid 1, block 32, argument values
 * changing on every launch.
 *
 * Two forms of the same loop:
 *   a program:        cc -O2 -o c_floor_launch c_floor_launch.c -ldl;  ./c_floor_launch kernels.cubin
 *                     (its own process, prints JSON)
 *   a shared library: cc -O2 -shared -fPIC -DC_FLOOR_LIBRARY -o libc_floor_launch.so c_floor_launch.c -ldl
 *                     bench_launch.py calls c_floor_burst() between the bursts of the Python launchers,
 *                     so the C loop and the Python ones share the process, the context and the moment. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult; typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned gx, gy, gz, bx, by, bz, shared; CUstream stream; void *attrs; unsigned nattrs; }
    CUlaunchConfig;   /* the layout of CUlaunchConfig in cuda.h (attrs: CUlaunchAttribute *) */
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
static launch_fn launch;
static launch_ex_fn launch_ex;
enum { BURST = 256, REPS = 200, STEADY = 20000 };

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

/* count launches of variant v (0: kernelParams, 1: packed buffer, 2/3: the same through cuLaunchKernelEx),
 * the argument values changed before each, as the Python launchers do; seconds per launch */
static double loop(int v, CUfunction f, CUdeviceptr p, int count) {
  int n = 0; float x = 0; void *params[3] = {&p, &n, &x};
  char block[16]; size_t block_size = sizeof block;
  void *extra[5] = {(void *)1, block, (void *)2, &block_size, (void *)0};
  CUlaunchConfig config = {1, 1, 1, 32, 1, 1, 0, 0, 0, 0};
  memcpy(block, &p, 8);
  double a = now();
  for (int i = 0; i < count; i++) {
    n = i; x = (float)i; memcpy(block + 8, &n, 4); memcpy(block + 12, &x, 4);
    if (v == 0) launch(f, 1, 1, 1, 32, 1, 1, 0, 0, params, 0);
    else if (v == 1) launch(f, 1, 1, 1, 32, 1, 1, 0, 0, 0, extra);
    else if (v == 2) launch_ex(&config, f, params, 0);
    else launch_ex(&config, f, 0, extra);
  }
  return (now() - a) / count;
}

static int bind(void *h) {
  launch = (launch_fn)dlsym(h, "cuLaunchKernel");
  launch_ex = (launch_ex_fn)dlsym(h, "cuLaunchKernelEx");
  return launch && launch_ex;
}

#ifdef C_FLOOR_LIBRARY
double c_floor_burst(int variant, void *f, unsigned long long p, int count) {
  if (!launch && !bind(dlopen("libcuda.so.1", RTLD_NOW))) return -1;
  return loop(variant, (CUfunction)f, (CUdeviceptr)p, count);
}
#else
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h || !bind(h) || argc < 2) { fprintf(stderr, "usage: c_floor_launch kernels.cubin (needs libcuda.so.1)\n"); return 1; }
  CUresult (*cuInit)(unsigned) = dlsym(h, "cuInit");
  CUresult (*cuDeviceGet)(int *, int) = dlsym(h, "cuDeviceGet");
  CUresult (*retain)(CUcontext *, int) = dlsym(h, "cuDevicePrimaryCtxRetain");
  CUresult (*setcur)(CUcontext) = dlsym(h, "cuCtxSetCurrent");
  CUresult (*load)(CUmodule *, const char *) = dlsym(h, "cuModuleLoad");
  CUresult (*getfn)(CUfunction *, CUmodule, const char *) = dlsym(h, "cuModuleGetFunction");
  CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(h, "cuMemAlloc_v2");
  CUresult (*sync)(void) = dlsym(h, "cuCtxSynchronize");
  int dev; CUcontext ctx; CUmodule mod; CUfunction f; CUdeviceptr p;
  cuInit(0); cuDeviceGet(&dev, 0); retain(&ctx, dev); setcur(ctx);
  if (load(&mod, argv[1])) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
  getfn(&f, mod, "empty"); alloc(&p, 1024);
  const char *names[4] = {"params", "buffer", "ex_params", "ex_buffer"};
  printf("{");
  for (int variant = 0; variant < 4; variant++) {
    double bursts[REPS];
    loop(variant, f, p, BURST);   /* warm up */
    for (int r = 0; r < REPS; r++) {
      sync();
      bursts[r] = loop(variant, f, p, BURST);
    }
    sync();
    qsort(bursts, REPS, sizeof(double), cmp);
    double a = now();
    loop(variant, f, p, STEADY);
    sync();
    double steady = (now() - a) / STEADY;
    printf("%s\"%s\": {\"burst_us\": %.4f, \"steady_us\": %.4f}", variant ? ", " : "", names[variant],
           bursts[REPS / 2] * 1e6, steady * 1e6);
  }
  printf("}\n");
  return 0;
}
#endif
