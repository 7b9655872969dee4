/* bench_startup's exit clock.  A child loads this library (ctypes) as the last thing its code does and
 * calls exit_stamp_register(), which registers a C atexit handler appending "c <CLOCK_MONOTONIC
 * seconds>" to $EXIT_STAMP_FILE.  exit() runs the handlers registered last first, so this one runs as
 * soon as Python's teardown has returned, before any handler registered earlier (libcuda registers its
 * own when cuInit runs) and before the libraries' finalizers.  With the child's Python atexit stamp
 * and the parent's clock when the child is reaped, the exit splits into Python's teardown and the C
 * exit with the kernel's part (libcuda's exit work is in the second).
 * Build: cc -O2 -shared -fPIC -o libexit_stamp.so exit_stamp.c */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static void stamp(void) {
  const char *path = getenv("EXIT_STAMP_FILE");
  FILE *f = path ? fopen(path, "a") : NULL;
  struct timespec t;
  if (!f) return;
  clock_gettime(CLOCK_MONOTONIC, &t);
  fprintf(f, "c %.6f\n", (double)t.tv_sec + (double)t.tv_nsec / 1e9);
  fclose(f);
}

int exit_stamp_register(void) { return atexit(stamp); }
