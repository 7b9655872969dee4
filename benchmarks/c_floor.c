/* The C floor for the driver benchmarks: the same operations, straight from C.
 * Build: cc -O2 -o c_floor c_floor.c -ldl     Run: ./c_floor NAMES_FILE
 * Prints one JSON object. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef void *CUcontext;
typedef CUresult (*gpa_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*init_t)(unsigned int);
typedef CUresult (*ver_t)(int *);
typedef CUresult (*getcur_t)(CUcontext *);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

int main(int argc, char **argv) {
  double t0 = now();
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  ver_t ver = (ver_t)dlsym(h, "cuDriverGetVersion");
  int v = 0; ver(&v);
  double t1 = now();
  gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
  init_t init = (init_t)dlsym(h, "cuInit");
  init(0);
  /* resolve every name in the file */
  char names[1024][128]; int n = 0;
  FILE *f = fopen(argv[1], "r");
  while (n < 1024 && fscanf(f, "%127s", names[n]) == 1) n++;
  fclose(f);
  void *p; int st;
  double best_resolve = 1e9;
  for (int rep = 0; rep < 20; rep++) {
    double a = now();
    for (int i = 0; i < n; i++) gpa(names[i], &p, v, 0, &st);
    double b = now();
    if (b - a < best_resolve) best_resolve = b - a;
  }
  getcur_t getcur = NULL; gpa("cuCtxGetCurrent", (void **)&getcur, 4000, 0, &st);
  CUcontext ctx; long iters = 2000000; double best_call = 1e9;
  for (int rep = 0; rep < 7; rep++) {
    double a = now();
    for (long i = 0; i < iters; i++) getcur(&ctx);
    double b = now();
    if ((b - a) / iters < best_call) best_call = (b - a) / iters;
  }
  printf("{\"open_first_call_ms\": %.4f, \"resolve_all_ms\": %.4f, \"resolved_names\": %d, "
         "\"trivial_call_us\": %.5f, \"driver_version\": %d}\n",
         (t1 - t0) * 1e3, best_resolve * 1e3, n, best_call * 1e6, v);
  return 0;
}
