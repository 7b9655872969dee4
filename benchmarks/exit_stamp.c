/* bench_startup's exit clock: preloaded (LD_PRELOAD) into a child, it registers a C atexit handler
 * that appends "c <CLOCK_MONOTONIC seconds>" to $EXIT_STAMP_FILE.  exit() runs it after Python's
 * teardown and before the libraries' own finalizers (libcuda's included, registered earlier through
 * ld.so), so the child's Python atexit stamp, this one and the parent's clock when the child is
 * reaped split the exit into Python's teardown and the C exit with the kernel's part.
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

__attribute__((constructor)) static void register_stamp(void) { atexit(stamp); }
