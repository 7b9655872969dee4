/* C floor for the graph benchmark: loops over cuGraphLaunch of an executable graph that Python made (the
 * same CUgraphExec and stream as cuproc's rows), called between the Python bursts so that both share the
 * process, the context and the moment.
 *
 *   cc -O2 -shared -fPIC -DC_FLOOR_LIBRARY -o libc_floor_graph.so c_floor_graph.c -ldl
 *
 * c_graph_burst(exec, stream, count): seconds per cuGraphLaunch, host time only (no synchronize);
 * c_graph_steady(exec, stream, count, &host): count launches (host: seconds per launch until the last returned)
 *   then cuStreamSynchronize; returns seconds per launch, end to end. */
#include <dlfcn.h>
#include <time.h>

typedef int CUresult;
typedef void *CUgraphExec, *CUstream;
typedef CUresult (*graph_launch_fn)(CUgraphExec, CUstream);
typedef CUresult (*stream_sync_fn)(CUstream);
static graph_launch_fn graph_launch;
static stream_sync_fn stream_sync;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static int bind(void) {
  if (graph_launch) return 1;
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) return 0;
  graph_launch = (graph_launch_fn)dlsym(h, "cuGraphLaunch");
  stream_sync = (stream_sync_fn)dlsym(h, "cuStreamSynchronize");
  return graph_launch && stream_sync;
}

double c_graph_burst(void *exec, void *stream, int count) {
  if (!bind()) return -1;
  double a = now();
  for (int i = 0; i < count; i++)
    if (graph_launch(exec, stream)) return -1;
  return (now() - a) / count;
}

double c_graph_steady(void *exec, void *stream, int count, double *host) {
  if (!bind()) return -1;
  double a = now();
  for (int i = 0; i < count; i++)
    if (graph_launch(exec, stream)) return -1;
  *host = (now() - a) / count;
  if (stream_sync(stream)) return -1;
  return (now() - a) / count;
}
