/* C floor for the graph benchmark: loops over cuGraphLaunch of an executable graph that Python made (the
 * same CUgraphExec and stream as cuproc's rows), and the capture of 256 launches plus instantiate, called
 * between the Python rounds so that both share the process, the context and the moment.
 *
 *   cc -O2 -shared -fPIC -DC_FLOOR_LIBRARY -o libc_floor_graph.so c_floor_graph.c -ldl
 *
 * c_graph_burst(exec, stream, count): seconds per cuGraphLaunch, host time only (no synchronize);
 * c_graph_steady(exec, stream, count, &host): count launches (host: seconds per launch until the last returned)
 *   then cuStreamSynchronize; returns seconds per launch, end to end;
 * c_graph_capture(function, stream, ptr, count): seconds for one cuStreamBeginCapture (global mode), count
 *   cuLaunchKernel of function(ptr, i, (float)i) (grid 1, block 32, the values changing each launch, as the
 *   Python rows launch), cuStreamEndCapture and cuGraphInstantiateWithFlags; the graph and the executable
 *   graph are destroyed after the timing (negative: a driver call failed). */
#include <dlfcn.h>
#include <time.h>

typedef int CUresult;
typedef void *CUgraphExec, *CUstream, *CUgraph, *CUfunction;
typedef CUresult (*graph_launch_fn)(CUgraphExec, CUstream);
typedef CUresult (*stream_sync_fn)(CUstream);
typedef CUresult (*begin_capture_fn)(CUstream, int);
typedef CUresult (*end_capture_fn)(CUstream, CUgraph *);
typedef CUresult (*instantiate_fn)(CUgraphExec *, CUgraph, unsigned long long);
typedef CUresult (*graph_destroy_fn)(CUgraph);
typedef CUresult (*exec_destroy_fn)(CUgraphExec);
typedef CUresult (*launch_kernel_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                     unsigned, CUstream, void **, void **);
static graph_launch_fn graph_launch;
static stream_sync_fn stream_sync;
static begin_capture_fn begin_capture;
static end_capture_fn end_capture;
static instantiate_fn instantiate;
static graph_destroy_fn graph_destroy;
static exec_destroy_fn exec_destroy;
static launch_kernel_fn launch_kernel;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static int bind(void) {
  if (graph_launch) return 1;
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) return 0;
  stream_sync = (stream_sync_fn)dlsym(h, "cuStreamSynchronize");
  begin_capture = (begin_capture_fn)dlsym(h, "cuStreamBeginCapture_v2");
  end_capture = (end_capture_fn)dlsym(h, "cuStreamEndCapture");
  instantiate = (instantiate_fn)dlsym(h, "cuGraphInstantiateWithFlags");
  graph_destroy = (graph_destroy_fn)dlsym(h, "cuGraphDestroy");
  exec_destroy = (exec_destroy_fn)dlsym(h, "cuGraphExecDestroy");
  launch_kernel = (launch_kernel_fn)dlsym(h, "cuLaunchKernel");
  graph_launch = (graph_launch_fn)dlsym(h, "cuGraphLaunch");
  return graph_launch && stream_sync && begin_capture && end_capture && instantiate && graph_destroy && exec_destroy
         && launch_kernel;
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

double c_graph_capture(void *function, void *stream, unsigned long long ptr, int count) {
  if (!bind()) return -1;
  CUgraph graph = 0;
  CUgraphExec exec = 0;
  int n;
  float x;
  void *params[3] = {&ptr, &n, &x};
  double a = now();
  if (begin_capture(stream, 0)) return -1;   /* CU_STREAM_CAPTURE_MODE_GLOBAL */
  for (int i = 0; i < count; i++) {
    n = i;
    x = (float)i;
    if (launch_kernel(function, 1, 1, 1, 32, 1, 1, 0, stream, params, 0)) { end_capture(stream, &graph); return -1; }
  }
  if (end_capture(stream, &graph)) return -1;
  if (instantiate(&exec, graph, 0)) { graph_destroy(graph); return -1; }
  double elapsed = now() - a;
  exec_destroy(exec);
  graph_destroy(graph);
  return elapsed;
}
