/*
 * CUDA graphs for the fake driver: stream capture, graphs and their nodes, instantiation, launch,
 * executable-graph updates, conditional nodes and the DOT picture.  Included by fakedriver.c (one
 * #include line, before its cuGetProcAddress table), so it uses that file's state and helpers (the
 * object table, ENTER, stale(), the ordering model, launch_pack) and every entry point here has, like
 * the ones there, exactly the C signature cuproc selects at CUDA 13.0 (fakedriver.py checks the names).
 *
 * Model (strict on purpose, like the rest of the fake):
 *   - Three more object kinds in fakedriver.c's handle table, so their handles are reused after destroy
 *     as the real driver reuses them, and a destroyed one is a stale use: a graph (context independent,
 *     as on a GPU: it survives cuCtxDestroy), a graph node (its parent is its graph: it goes with it;
 *     a conditional node's body graphs and a child graph node's graph have the node as parent), and an
 *     executable graph (its context is the one current at instantiation: it goes with that context).
 *     Their data lives in a side table indexed by the handle's slot.
 *   - Nodes: kernel (the argument bytes are copied at add/set time through launch_pack, as a launch
 *     reads them), memcpy (CUDA_MEMCPY3D), memset, host, event record/wait, child graph (a deep copy
 *     of the child, as cuGraphAddChildGraphNode clones it; a child with memory alloc or free nodes is
 *     CUDA_ERROR_INVALID_VALUE, as the driver refuses to clone them), empty, memory alloc (its address is fixed
 *     when the node is made and stays valid while some graph or executable graph has the node; its
 *     bytes are real) and free, and conditional nodes (cuGraphAddNode_v2 with CU_GRAPH_NODE_TYPE_
 *     CONDITIONAL: IF with one or two bodies, WHILE, SWITCH; as on a GPU, the call points phGraph_out at
 *     an array of body graphs that the node owns -- an array the caller passed is not written).
 *     cuGraphAddNode_v2 takes only conditional and empty nodes here (CUDA_ERROR_NOT_SUPPORTED for the rest).
 *   - Instantiation copies the graph (nodes, edges, bodies) into the executable graph and checks it:
 *     a dead function or event is a stale use; a cycle is CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE
 *     (the error node is one of the cycle's); a conditional handle of the graph that no conditional node
 *     uses is CUDA_GRAPH_INSTANTIATE_CONDITIONAL_HANDLE_UNUSED; kernels of two contexts are
 *     CUDA_GRAPH_INSTANTIATE_MULTIPLE_CTXS_NOT_SUPPORTED.  All three are CUDA_ERROR_INVALID_VALUE.
 *   - cuGraphLaunch runs the nodes at once, in dependency order, as work on the launch stream (the
 *     ordering model of fakedriver.c: kernels and copies touch the memory they use): copies and memsets
 *     move real bytes, host nodes are queued as host work that runs later (at the next synchronize, see
 *     "host work" below: never inside cuGraphLaunch), event record and wait nodes are the stream's event
 *     record and wait.  Kernels are recorded like launches (the last
 *     launch, the launch count, a pointer argument into no live allocation is a stale use); in a graph,
 *     and only there, four kernels also do what their GPU namesakes in kernels/kernels.cu do:
 *       VecAdd_kernel(const float *A, const float *B, float *C, int N)   C[i] = A[i] + B[i]
 *       fill_value(float *p, int n, float x)                               p[i] = x
 *       set_condition(u64 handle, const int *counter)                      condition = *counter > 0
 *       countdown(u64 handle, int *counter, int *iterations)               --*counter, ++*iterations,
 *                                                                          condition = *counter > 0
 *     A conditional handle's value is reset to its default at each launch when it was made with
 *     CU_GRAPH_COND_ASSIGN_DEFAULT; a WHILE body runs while the value is not 0 (at most 1 << 20 times).
 *   - cuGraphExecUpdate_v2 accepts a graph of the same node count, node types (in insertion order)
 *     and edges; a kernel may change function within its context, memsets stay 1-D in the same
 *     context, alloc and free nodes may not change, conditional nodes keep their handle, type and size.
 *     Anything else is CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE with the result and the node.  Node handles
 *     that address an executable graph (cuGraphExecKernelNodeSetParams_v2) are those of the graph it
 *     was instantiated from.
 *   - Stream capture (cuStreamBeginCapture_v2 .. cuStreamEndCapture): the legacy stream cannot be
 *     captured (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); a per-thread default stream and any created
 *     stream can.  While a stream captures, the calls below that fakedriver.c implements become nodes
 *     instead of work: kernel launches, the 1-D asynchronous copies and memsets, stream-ordered alloc
 *     (a memory alloc node; the address is the node's) and free (a free node, of a graph allocation
 *     only), cuLaunchHostFunc (a host node).  cuEventRecord marks the event with the stream's capture
 *     dependencies (no node); cuStreamWaitEvent on such an event adds them to the waiting stream, which
 *     joins the capture when it was not in it (fork and join across streams).  Refused with
 *     CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture invalidated: on a capturing stream,
 *     cuStreamSynchronize and cuStreamQuery, 2-D/3-D/peer copies, 2-D memsets, prefetches, uploads and
 *     graph launches (not modelled), and a wait for an event not recorded in the capture (strict); in
 *     a thread that is prohibited from "potentially unsafe" calls by the capture modes (its own capture
 *     not relaxed, or another thread's in global mode), cuMemAlloc, cuMemFree, cuMemAllocHost,
 *     cuMemHostAlloc, cuMemFreeHost, cuModuleUnload, cuGraphExecDestroy, the synchronous copies and 1-D
 *     memsets and cuCtxSynchronize (as the real driver: a finalizer's release is one of these).
 *     Work on the legacy stream (or a synchronous copy or memset) while a blocking stream of its context
 *     captures is CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and invalidates that capture.  Every call on a
 *     stream whose capture is invalidated returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED; so does
 *     cuStreamEndCapture, which ends the capture all the same (the stream is usable again) and hands out
 *     no graph.  cuStreamEndCapture must be called on the stream that began it
 *     (CUDA_ERROR_STREAM_CAPTURE_UNMATCHED), by its thread unless relaxed
 *     (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD), with every forked stream joined back
 *     (CUDA_ERROR_STREAM_CAPTURE_UNJOINED).
 *
 * How the capture reaches fakedriver.c's own entry points without changing them: each one that a
 * capture changes gets a wrapper here (captured_<entry>) that asks, under the lock but without entering
 * the call (the call ring counts it once), whether a capture is involved, and else calls the original.
 * After the wrappers, "#define <entry> captured_<entry>" makes the cuGetProcAddress table that
 * fakedriver.c includes next hand out the wrapper (a macro does not touch the names' string
 * literals); a _Static_assert checks each wrapper's type against the original's.
 */

/* ------------------------------------------------------------------ types */
typedef void *CUgraph, *CUgraphNode, *CUgraphExec;
typedef unsigned long long CUgraphConditionalHandle;

typedef struct { /* CUDA_KERNEL_NODE_PARAMS_v2 (v3 has the same layout) */
  CUfunction func;
  unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  void **kernelParams;
  void **extra;
  CUkernel kern;
  CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS;

typedef struct { /* CUDA_MEMSET_NODE_PARAMS_v1 */
  CUdeviceptr dst;
  size_t pitch;
  unsigned int value, elementSize;
  size_t width, height;
} CUDA_MEMSET_NODE_PARAMS;

typedef struct { CUhostFn fn; void *userData; } CUDA_HOST_NODE_PARAMS; /* _v1 */

typedef struct { /* CUmemPoolProps, whole (fakedriver.c's CUmemPoolProps has the leading fields only) */
  int allocType, handleTypes;
  int locationType, locationId;
  void *win32SecurityAttributes;
  size_t maxSize;
  unsigned short usage;
  unsigned char gpuDirectRDMACapable;
  unsigned char reserved[53];
} CUmemPoolPropsWhole;

typedef struct { /* CUDA_MEM_ALLOC_NODE_PARAMS_v1 */
  CUmemPoolPropsWhole poolProps;
  const void *accessDescs;
  size_t accessDescCount;
  size_t bytesize;
  CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;

typedef struct { /* CUDA_CONDITIONAL_NODE_PARAMS */
  CUgraphConditionalHandle handle;
  int type;
  unsigned int size;
  CUgraph *phGraph_out;
  CUcontext ctx;
} CUDA_CONDITIONAL_NODE_PARAMS;

typedef struct { /* CUgraphNodeParams: the type, then a 232-byte union at offset 16 */
  int type;
  int reserved0[3];
  union {
    long long reserved1[29];
    CUDA_CONDITIONAL_NODE_PARAMS conditional;
    char asBytes[232];
  } u;
  long long reserved2;
} CUgraphNodeParams;

typedef struct { unsigned char from_port, to_port, type, reserved[5]; } CUgraphEdgeData;

typedef struct { /* CUDA_GRAPH_INSTANTIATE_PARAMS */
  cuuint64_t flags;
  CUstream hUploadStream;
  CUgraphNode hErrNode_out;
  int result_out;
} CUDA_GRAPH_INSTANTIATE_PARAMS;

typedef struct { int result; CUgraphNode errorNode, errorFromNode; } CUgraphExecUpdateResultInfo;

/* The sizes cuproc's cffi declarations have (tests/test_graphs_fake.py checks the same numbers there). */
_Static_assert(sizeof(CUDA_KERNEL_NODE_PARAMS) == 72, "CUDA_KERNEL_NODE_PARAMS_v2");
_Static_assert(sizeof(CUDA_MEMSET_NODE_PARAMS) == 40, "CUDA_MEMSET_NODE_PARAMS_v1");
_Static_assert(sizeof(CUDA_HOST_NODE_PARAMS) == 16, "CUDA_HOST_NODE_PARAMS_v1");
_Static_assert(sizeof(CUmemPoolPropsWhole) == 88, "CUmemPoolProps");
_Static_assert(sizeof(CUDA_MEM_ALLOC_NODE_PARAMS) == 120, "CUDA_MEM_ALLOC_NODE_PARAMS_v1");
_Static_assert(sizeof(CUDA_CONDITIONAL_NODE_PARAMS) == 32, "CUDA_CONDITIONAL_NODE_PARAMS");
_Static_assert(sizeof(CUgraphNodeParams) == 256, "CUgraphNodeParams");
_Static_assert(sizeof(CUgraphEdgeData) == 8, "CUgraphEdgeData");
_Static_assert(sizeof(CUDA_GRAPH_INSTANTIATE_PARAMS) == 32, "CUDA_GRAPH_INSTANTIATE_PARAMS");
_Static_assert(sizeof(CUgraphExecUpdateResultInfo) == 24, "CUgraphExecUpdateResultInfo");
_Static_assert(sizeof(CUDA_MEMCPY3D) == 200, "CUDA_MEMCPY3D_v2");

/* More CUresult codes. */
enum {
  E_OPERATING_SYSTEM = 304,
  E_ILLEGAL_STATE = 401,
  E_CAPTURE_UNSUPPORTED = 900,
  E_CAPTURE_INVALIDATED = 901,
  E_CAPTURE_MERGE = 902,
  E_CAPTURE_UNMATCHED = 903,
  E_CAPTURE_UNJOINED = 904,
  E_CAPTURE_IMPLICIT = 906,
  E_CAPTURE_WRONG_THREAD = 908,
  E_GRAPH_EXEC_UPDATE_FAILURE = 910,
};

/* CUgraphNodeType */
enum { N_KERNEL = 0, N_MEMCPY = 1, N_MEMSET = 2, N_HOST = 3, N_GRAPH = 4, N_EMPTY = 5, N_WAIT_EVENT = 6,
       N_EVENT_RECORD = 7, N_MEM_ALLOC = 10, N_MEM_FREE = 11, N_CONDITIONAL = 13 };
/* CUgraphInstantiateResult */
enum { INST_SUCCESS = 0, INST_ERROR = 1, INST_INVALID_STRUCTURE = 2, INST_MULTIPLE_CTXS = 4,
       INST_CONDITIONAL_HANDLE_UNUSED = 5 };
/* CUgraphExecUpdateResult */
enum { UPD_SUCCESS = 0, UPD_TOPOLOGY_CHANGED = 2, UPD_NODE_TYPE_CHANGED = 3, UPD_PARAMETERS_CHANGED = 5,
       UPD_NOT_SUPPORTED = 6, UPD_UNSUPPORTED_FUNCTION_CHANGE = 7 };
enum { COND_IF = 0, COND_WHILE = 1, COND_SWITCH = 2 };
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
#define COND_ASSIGN_DEFAULT 1u
#define MAX_BODIES 8
#define WHILE_LIMIT (1u << 20)
#define GRAPH_POOL ((handle_t)0x8)   /* the "pool" of graph allocations: no object has this handle */

/* Object kinds after fakedriver.c's (kill_obj's switch knows none of them: it only unlinks). */
#define K_GRAPH 32
#define K_GNODE 33
#define K_GEXEC 34

/* ------------------------------------------------------------------ side data */
enum { TAG_GRAPH = 0x47524150, TAG_NODE = 0x4e4f4445, TAG_EXEC = 0x45584543 };

struct kparams {
  handle_t func;
  unsigned grid[3], block[3], shared;
  unsigned char *args;
  size_t nargs;
  struct kinfo layout;      /* the kernel's parameters (name NULL) */
  char name[64];
  void *argp[MAX_PARAMS];   /* kernelParams handed out by cuGraphKernelNodeGetParams_v2 */
};
struct mset { CUdeviceptr dst; size_t pitch; unsigned value, elem; size_t width, height; };
struct xgraph;

/* A node's parameters; in an executable graph the graph-valued ones are copies (struct xgraph). */
union nparams {
  struct kparams *k;
  CUDA_MEMCPY3D cp;
  struct mset ms;
  struct { CUhostFn fn; void *data; } host;
  handle_t event;
  struct { CUdeviceptr dptr; size_t bytes; int dev; } alloc;
  CUdeviceptr free_ptr;
};

struct gnode {
  int tag, type;
  handle_t graph;          /* the graph it is in */
  handle_t ctx;            /* kernel, memcpy, memset, conditional: the context; else 0 */
  size_t ndeps, capdeps;
  handle_t *deps;          /* the nodes it depends on (its incoming edges) */
  union nparams p;
  handle_t child;          /* N_GRAPH: its graph (parent: this node) */
  struct { CUgraphConditionalHandle handle; int type; unsigned size; handle_t body[MAX_BODIES]; } cond;
};

/* owner, owner_serial: the executable graph that is this graph's one instantiation while the graph has memory
 * alloc or free nodes (cuda.h: "at most one executable graph in existence for that graph at a time"; driver 580
 * counts one updated with the graph too, and one updated away from it no more): its handle and serial, so a
 * reused handle is no owner; the executable graph's `owns` says which graph it is the instantiation of now. */
struct gdata { int tag; size_t n, cap; handle_t *nodes; /* insertion order */ handle_t owner;
               unsigned long long owner_serial; };

struct xnode {
  handle_t orig;           /* the node of the instantiated graph */
  int type;
  handle_t ctx;
  size_t ndeps;
  size_t *deps;            /* indices in the same xgraph */
  union nparams p;
  struct xgraph *child;
  struct { CUgraphConditionalHandle handle; int type; unsigned size; struct xgraph *body[MAX_BODIES]; } cond;
};
struct xgraph { size_t n; struct xnode *nodes; size_t *order; };
struct gexec { int tag, busy, dead; unsigned long long flags; struct xgraph *g; unsigned long long serial;
               handle_t owns; };
static unsigned long long exec_serials;

static void **side;
static size_t nside;
static long graph_launches;

static size_t slot_of(handle_t h) { return (h - HANDLE_BASE) / 16; }

static void *side_of(handle_t h, int tag) {
  struct obj *o = obj_at(h);
  if (!o || !o->alive) return NULL;
  size_t n = slot_of(h);
  if (n >= nside || !side[n] || *(int *)side[n] != tag) return NULL;
  return side[n];
}

static void free_side(void *p);

/* Give object o the side data p (what a dead object left at that slot goes first). */
static int set_side(struct obj *o, void *p) {
  size_t n = slot_of(o->h);
  if (n >= nside) {
    size_t cap = nside ? nside : 256;
    while (cap <= n) cap *= 2;
    void **grown = realloc(side, cap * sizeof *grown);
    if (!grown) return 0;
    memset(grown + nside, 0, (cap - nside) * sizeof *grown);
    side = grown;
    nside = cap;
  }
  if (side[n]) free_side(side[n]);
  side[n] = p;
  return 1;
}

/* The side data of live object h of kind (tagged tag); else NULL and *rc (a stale use either way). */
static void *side_data(const void *h, int kind, int tag, CUresult *rc) {
  struct obj *o = get(h, kind, rc);
  if (!o) return NULL;
  void *p = side_of(o->h, tag);
  if (!p) *rc = stale(E_INVALID_HANDLE);
  return p;
}

static struct gdata *graph_of(CUgraph h, CUresult *rc) { return side_data(h, K_GRAPH, TAG_GRAPH, rc); }
static struct gnode *node_of(CUgraphNode h, CUresult *rc) { return side_data(h, K_GNODE, TAG_NODE, rc); }
static struct gexec *exec_of(CUgraphExec h, CUresult *rc) { return side_data(h, K_GEXEC, TAG_EXEC, rc); }

/* The node of handle h when it is of kind type; else NULL and *rc: a stale use, or CUDA_ERROR_INVALID_VALUE
 * for a live node of another kind (what every cuGraph*NodeGet/SetParams answers). */
static struct gnode *typed_node(CUgraphNode h, int type, CUresult *rc) {
  struct gnode *n = node_of(h, rc);
  if (n && n->type != type) { *rc = E_INVALID_VALUE; return NULL; }
  return n;
}
/* Declares CUresult rc and struct gnode *N, the node of handle H of kind TYPE, or returns typed_node's answer. */
#define TYPED_NODE(N, H, TYPE)                  \
  CUresult rc;                                  \
  struct gnode *N = typed_node(H, TYPE, &rc);   \
  if (!N) return rc

/* ------------------------------------------------------------------ graph allocations
 * A memory alloc node's address belongs to the node and to every executable graph made from it
 * (references counted by address); the allocation goes with the last of them, or with its context.
 * As on a GPU, the memory exists ("live") only from a launch that runs the alloc node until it is freed
 * (a free node, cuMemFreeAsync, cuMemFree): freeing it while not live is CUDA_ERROR_INVALID_VALUE,
 * launching an executable graph while an allocation of its is live is CUDA_ERROR_INVALID_VALUE unless
 * it was instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, and a live allocation
 * outlives its nodes (graph destruction does not free it) until it is freed. */
struct galloc { CUdeviceptr base; int refs, live; };
static struct galloc *gallocs;
static size_t ngallocs, cap_gallocs;

static void galloc_ref(CUdeviceptr base, int delta) {
  for (size_t i = 0; i < ngallocs; i++) {
    if (gallocs[i].base != base) continue;
    gallocs[i].refs += delta;
    if (gallocs[i].refs <= 0 && !gallocs[i].live) {
      struct alloc *a = find_alloc(base, 0);
      if (a && a->base == base && a->kind == A_ASYNC && a->pool == GRAPH_POOL) free_alloc(a);
      gallocs[i] = gallocs[--ngallocs];
    }
    return;
  }
  if (delta <= 0) return;
  if (ngallocs == cap_gallocs) {
    size_t cap = cap_gallocs ? 2 * cap_gallocs : 32;
    struct galloc *grown = realloc(gallocs, cap * sizeof *grown);
    if (!grown) return;
    gallocs = grown;
    cap_gallocs = cap;
  }
  gallocs[ngallocs].base = base;
  gallocs[ngallocs].refs = delta;
  gallocs[ngallocs].live = 0;
  ngallocs++;
}

static struct galloc *galloc_of(CUdeviceptr base) {
  for (size_t i = 0; i < ngallocs; i++) if (gallocs[i].base == base) return &gallocs[i];
  return NULL;
}

/* A launch ran the alloc node of base (live = 1), or a free node or call freed it (live = 0; the allocation
 * goes when no node has it any more). */
static void galloc_live(CUdeviceptr base, int live) {
  struct galloc *g = galloc_of(base);
  if (!g) return;
  g->live = live;
  if (!live) galloc_ref(base, 0);
}

/* Is an allocation of executable graph x (its nodes, bodies and child graphs) live? */
static int xgraph_has_live_alloc(const struct xgraph *x) {
  for (size_t i = 0; x && i < x->n; i++) {
    const struct xnode *n = &x->nodes[i];
    struct galloc *g = n->type == N_MEM_ALLOC ? galloc_of(n->p.alloc.dptr) : NULL;
    if (g && g->live) return 1;
    if (n->type == N_GRAPH && xgraph_has_live_alloc(n->child)) return 1;
    for (unsigned b = 0; n->type == N_CONDITIONAL && b < n->cond.size; b++)
      if (xgraph_has_live_alloc(n->cond.body[b])) return 1;
  }
  return 0;
}

/* ------------------------------------------------------------------ conditional handles */
struct cond { handle_t graph; unsigned dflt, flags, value; int used, live; };
static struct cond *conds;
static size_t nconds, cap_conds;
#define COND_TAG (0xC0ULL << 56)

static struct cond *cond_of(CUgraphConditionalHandle h) {
  if ((h & (0xFFULL << 56)) != COND_TAG) return NULL;
  size_t i = (size_t)(h & 0xFFFFFFFFULL);
  if (i == 0 || i > nconds || !conds[i - 1].live) return NULL;
  return &conds[i - 1];
}

/* ------------------------------------------------------------------ freeing */
static void free_kparams(struct kparams *k) { if (k) { free(k->args); free(k); } }

static void free_xgraph(struct xgraph *x) {
  if (!x) return;
  for (size_t i = 0; i < x->n; i++) {
    struct xnode *n = &x->nodes[i];
    free(n->deps);
    if (n->type == N_KERNEL) free_kparams(n->p.k);
    if (n->type == N_MEM_ALLOC) galloc_ref(n->p.alloc.dptr, -1);
    free_xgraph(n->child);
    for (int b = 0; b < MAX_BODIES; b++) free_xgraph(n->cond.body[b]);
  }
  free(x->nodes);
  free(x->order);
  free(x);
}

static void free_side(void *p) {
  int tag = *(int *)p;
  if (tag == TAG_GRAPH) {
    free(((struct gdata *)p)->nodes);
  } else if (tag == TAG_NODE) {
    struct gnode *n = p;
    free(n->deps);
    if (n->type == N_KERNEL) free_kparams(n->p.k);
    if (n->type == N_MEM_ALLOC) galloc_ref(n->p.alloc.dptr, -1);
  } else if (tag == TAG_EXEC) {
    struct gexec *x = p;
    if (x->busy) { x->dead = 1; return; }   /* a launch still runs it: it frees it */
    free_xgraph(x->g);
  }
  free(p);
}

static void drop_side(handle_t h) {
  size_t n = slot_of(h);
  if (n < nside && side[n]) { free_side(side[n]); side[n] = NULL; }
}

static void destroy_graph_obj(handle_t h);

/* A node's end: out of its graph's list and its dependents' edges, its bodies destroyed. */
static void destroy_node_obj(handle_t h) {
  struct gnode *n = side_of(h, TAG_NODE);
  struct obj *o = obj_at(h);
  if (!n || !o) return;
  struct gdata *g = side_of(n->graph, TAG_GRAPH);
  if (g) {
    for (size_t i = 0; i < g->n; i++) {
      if (g->nodes[i] == h) { memmove(&g->nodes[i], &g->nodes[i + 1], (g->n - i - 1) * sizeof *g->nodes); g->n--; i--; continue; }
      struct gnode *m = side_of(g->nodes[i], TAG_NODE);
      if (!m) continue;
      for (size_t d = 0; d < m->ndeps; d++)
        if (m->deps[d] == h) { m->deps[d] = m->deps[--m->ndeps]; d--; }
    }
  }
  if (n->type == N_GRAPH && n->child) destroy_graph_obj(n->child);
  if (n->type == N_CONDITIONAL)
    for (int b = 0; b < MAX_BODIES; b++) if (n->cond.body[b]) destroy_graph_obj(n->cond.body[b]);
  drop_side(h);
  kill_obj(o);
}

static void destroy_graph_obj(handle_t h) {
  struct gdata *g = side_of(h, TAG_GRAPH);
  struct obj *o = obj_at(h);
  if (!o || !o->alive || o->kind != K_GRAPH) return;
  while (g && g->n) destroy_node_obj(g->nodes[g->n - 1]);
  for (size_t i = 0; i < nconds; i++) if (conds[i].live && conds[i].graph == h) conds[i].live = 0;
  drop_side(h);
  kill_obj(o);
}

/* ------------------------------------------------------------------ making graphs and nodes */
static struct obj *new_graph_obj(handle_t parent, struct gdata **out) {
  struct gdata *g = calloc(1, sizeof *g);
  if (!g) return NULL;
  g->tag = TAG_GRAPH;
  struct obj *o = new_obj(K_GRAPH, 0, 0);
  if (!o) { free(g); return NULL; }
  o->parent = parent;
  if (!set_side(o, g)) { free(g); kill_obj(o); return NULL; }
  if (out) *out = g;
  return o;
}

static int in_graph(const struct gdata *g, handle_t node) {
  for (size_t i = 0; i < g->n; i++) if (g->nodes[i] == node) return 1;
  return 0;
}

/* Check the dependencies of a new node of graph gh: live nodes of that graph, no repeats. */
static CUresult check_deps(handle_t gh, const struct gdata *g, const CUgraphNode *deps, size_t n) {
  if (n) NEED(deps);
  for (size_t i = 0; i < n; i++) {
    CUresult rc;
    struct gnode *d = node_of(deps[i], &rc);
    if (!d) return rc;
    if (d->graph != gh || !in_graph(g, (handle_t)deps[i])) return E_INVALID_VALUE;
    for (size_t j = 0; j < i; j++) if (deps[j] == deps[i]) return E_INVALID_VALUE;
  }
  return OK;
}

static CUresult new_node(CUgraph graph, int type, const CUgraphNode *deps, size_t ndeps, struct gnode **out,
                         handle_t *handle) {
  CUresult rc;
  struct gdata *g = graph_of(graph, &rc);
  if (!g) return rc;
  TRY(check_deps((handle_t)graph, g, deps, ndeps));
  if (g->n == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 16;
    handle_t *grown = realloc(g->nodes, cap * sizeof *grown);
    if (!grown) return E_OUT_OF_MEMORY;
    g->nodes = grown;
    g->cap = cap;
  }
  struct gnode *n = calloc(1, sizeof *n);
  if (!n) return E_OUT_OF_MEMORY;
  n->tag = TAG_NODE;
  n->type = type;
  n->graph = (handle_t)graph;
  if (ndeps) {
    n->deps = malloc(ndeps * sizeof *n->deps);
    if (!n->deps) { free(n); return E_OUT_OF_MEMORY; }
    for (size_t i = 0; i < ndeps; i++) n->deps[i] = (handle_t)deps[i];
    n->ndeps = n->capdeps = ndeps;
  }
  struct obj *o = new_obj(K_GNODE, 0, 0);
  if (!o) { free(n->deps); free(n); return E_OUT_OF_MEMORY; }
  o->parent = (handle_t)graph;
  if (!set_side(o, n)) { free(n->deps); free(n); kill_obj(o); return E_OUT_OF_MEMORY; }
  g = side_of((handle_t)graph, TAG_GRAPH);   /* (set_side may have moved the table, not the graph) */
  g->nodes[g->n++] = o->h;
  *out = n;
  *handle = o->h;
  return OK;
}

/* The kernel parameters of a node (kernelParams or extra, read as a launch reads them). */
static CUresult make_kparams(const CUDA_KERNEL_NODE_PARAMS *p, struct kparams **out, handle_t *ctx) {
  NEED(p);
  struct obj *f;
  CUfunction func = p->func;
  if (!func) { NEED(p->kern); func = (CUfunction)p->kern; }
  TRY(func_arg(func, &f));
  if (f->kind == K_FUNCTION) *ctx = f->ctx;
  else if (p->ctx) { CUresult rc; struct obj *c = get(p->ctx, K_CTX, &rc); if (!c) return rc; *ctx = c->h; }
  else { struct obj *c; TRY(cur_ctx(&c)); *ctx = c->h; }
  struct launch L = {{p->gridDimX, p->gridDimY, p->gridDimZ}, {p->blockDimX, p->blockDimY, p->blockDimZ}, NULL,
                     p->kernelParams, p->extra, p->sharedMemBytes};
  for (int i = 0; i < 3; i++) NEED(L.grid[i] && L.block[i]);
  NEED((unsigned long long)L.block[0] * L.block[1] * L.block[2] <= 1024);
  NEED(!(L.params && L.extra));
  const struct kinfo *k = &f->img->k[f->kidx];
  NEED(k->nparams == 0 || L.params || L.extra);
  struct kparams *kp = calloc(1, sizeof *kp);
  unsigned char *buf = malloc(MAX_ARG_BYTES);
  if (!kp || !buf) { free(kp); free(buf); return E_OUT_OF_MEMORY; }
  kp->layout = *k;
  kp->layout.name = NULL;
  snprintf(kp->name, sizeof kp->name, "%s", k->name);
  size_t nbytes = 0;
  CUresult rc = launch_pack(&L, k, buf, &nbytes);
  if (rc != OK) { free(kp); free(buf); return rc; }
  kp->args = buf;
  kp->nargs = nbytes;
  kp->func = f->h;
  memcpy(kp->grid, L.grid, sizeof kp->grid);
  memcpy(kp->block, L.block, sizeof kp->block);
  kp->shared = L.shared_mem;
  *out = kp;
  return OK;
}

/* A copy's sides as copy_3d reads them, checked now (the real driver checks at add time too). */
static CUresult check_copy(const CUDA_MEMCPY3D *c) {
  NEED(c);
  size_t w = c->WidthInBytes, h = c->Height ? c->Height : 1, depth = c->Depth ? c->Depth : 1;
  if (w == 0) return OK;
  size_t sh = c->srcHeight ? c->srcHeight : h, dh = c->dstHeight ? c->dstHeight : h;
  size_t sp = c->srcPitch ? c->srcPitch : w, dp = c->dstPitch ? c->dstPitch : w;
  NEED(sp >= w && dp >= w && sh >= h && dh >= h);
  size_t soff = (c->srcZ * sh + c->srcY) * sp + c->srcXInBytes;
  size_t doff = (c->dstZ * dh + c->dstY) * dp + c->dstXInBytes;
  struct alloc *a;
  char *p;
  TRY(copy_side(c->srcMemoryType, c->srcHost, c->srcDevice, soff, ((depth - 1) * sh + (h - 1)) * sp + w, &a, &p));
  TRY(copy_side(c->dstMemoryType, c->dstHost, c->dstDevice, doff, ((depth - 1) * dh + (h - 1)) * dp + w, &a, &p));
  return OK;
}

/* A memset node's parameters as the node keeps them. */
static struct mset mset_of(const CUDA_MEMSET_NODE_PARAMS *p) {
  struct mset m = {p->dst, p->pitch, p->value, p->elementSize, p->width, p->height};
  return m;
}

static CUresult check_memset(const CUDA_MEMSET_NODE_PARAMS *m) {
  NEED(m);
  NEED(m->elementSize == 1 || m->elementSize == 2 || m->elementSize == 4);
  NEED(m->dst % m->elementSize == 0 && m->width && m->height);
  if (m->height > 1) NEED(m->pitch >= m->width * m->elementSize);
  size_t extent = (m->height - 1) * m->pitch + m->width * m->elementSize;
  struct alloc *a;
  char *p;
  return dev_range(m->dst, extent, &a, &p);
}

/* The context a memcpy or memset node names (NULL: the current one). */
static CUresult node_ctx(CUcontext ctx, handle_t *out) {
  struct obj *c;
  TRY(ctx_arg(ctx, &c));
  *out = c->h;
  return OK;
}

/* A new graph allocation of the current context, for a memory alloc node. */
static CUresult graph_alloc(size_t bytes, int dev, CUdeviceptr *dptr) {
  struct obj *c;
  TRY(cur_ctx(&c));
  NEED(dev >= 0 && dev < ndev);
  CUresult rc;
  struct alloc *a = new_alloc(A_ASYNC, bytes, dev, c->h, GRAPH_POOL, &rc);
  if (!a) return rc;
  galloc_ref(a->base, 1);
  *dptr = a->base;
  return OK;
}

static int is_graph_alloc(CUdeviceptr p) {
  struct alloc *a = find_alloc(p, 0);
  return a && a->base == p && a->kind == A_ASYNC && a->pool == GRAPH_POOL;
}

/* ------------------------------------------------------------------ the graph API */
static CUresult cuGraphCreate(CUgraph *ph, unsigned int flags) {
  ENTER("cuGraphCreate");
  NEED(ph && flags == 0);
  struct obj *o = new_graph_obj(0, NULL);
  if (!o) return E_OUT_OF_MEMORY;
  *ph = (CUgraph)o->h;
  return OK;
}

static CUresult cuGraphDestroy(CUgraph graph) {
  ENTER("cuGraphDestroy");
  CUresult rc;
  if (!graph_of(graph, &rc)) return rc;
  if (obj_at((handle_t)graph)->parent) return E_INVALID_VALUE;   /* a body or child graph: its node's */
  destroy_graph_obj((handle_t)graph);
  return OK;
}

static CUresult cuGraphAddKernelNode_v2(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                        const CUDA_KERNEL_NODE_PARAMS *params) {
  ENTER("cuGraphAddKernelNode");
  NEED(ph);
  struct kparams *kp;
  handle_t ctx;
  CUresult rc;
  if (!graph_of(graph, &rc)) return rc;
  TRY(make_kparams(params, &kp, &ctx));
  struct gnode *n;
  handle_t h;
  if ((rc = new_node(graph, N_KERNEL, deps, ndeps, &n, &h)) != OK) { free_kparams(kp); return rc; }
  n->p.k = kp;
  n->ctx = ctx;
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS *p) {
  ENTER("cuGraphKernelNodeGetParams");
  NEED(p);
  TYPED_NODE(n, node, N_KERNEL);
  struct kparams *k = n->p.k;
  for (int i = 0; i < k->layout.nparams; i++) k->argp[i] = k->args + k->layout.off[i];
  memset(p, 0, sizeof *p);
  p->func = (CUfunction)k->func;
  p->gridDimX = k->grid[0]; p->gridDimY = k->grid[1]; p->gridDimZ = k->grid[2];
  p->blockDimX = k->block[0]; p->blockDimY = k->block[1]; p->blockDimZ = k->block[2];
  p->sharedMemBytes = k->shared;
  p->kernelParams = k->argp;
  p->ctx = (CUcontext)n->ctx;
  return OK;
}

static CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *params) {
  ENTER("cuGraphKernelNodeSetParams");
  TYPED_NODE(n, node, N_KERNEL);
  struct kparams *kp;
  handle_t ctx;
  TRY(make_kparams(params, &kp, &ctx));
  free_kparams(n->p.k);
  n->p.k = kp;
  n->ctx = ctx;
  return OK;
}

/* A memcpy or memset node of graph, in the context ctx names, its parameters checked (in the driver's order:
 * the graph, the context, the parameters); *out for the caller to fill. */
static CUresult add_in_ctx(CUgraphNode *ph, CUgraph graph, int type, const CUgraphNode *deps, size_t ndeps,
                           CUcontext ctx, const void *params, struct gnode **out) {
  NEED(ph);
  CUresult rc;
  if (!graph_of(graph, &rc)) return rc;
  handle_t c, h;
  TRY(node_ctx(ctx, &c));
  TRY(type == N_MEMCPY ? check_copy(params) : check_memset(params));
  TRY(new_node(graph, type, deps, ndeps, out, &h));
  (*out)->ctx = c;
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphAddMemcpyNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                     const CUDA_MEMCPY3D *copy, CUcontext ctx) {
  ENTER("cuGraphAddMemcpyNode");
  struct gnode *n;
  TRY(add_in_ctx(ph, graph, N_MEMCPY, deps, ndeps, ctx, copy, &n));
  n->p.cp = *copy;
  return OK;
}

static CUresult cuGraphMemcpyNodeGetParams(CUgraphNode node, CUDA_MEMCPY3D *out) {
  ENTER("cuGraphMemcpyNodeGetParams");
  NEED(out);
  TYPED_NODE(n, node, N_MEMCPY);
  *out = n->p.cp;
  return OK;
}

static CUresult cuGraphMemcpyNodeSetParams(CUgraphNode node, const CUDA_MEMCPY3D *copy) {
  ENTER("cuGraphMemcpyNodeSetParams");
  TYPED_NODE(n, node, N_MEMCPY);
  TRY(check_copy(copy));
  n->p.cp = *copy;
  return OK;
}

static CUresult cuGraphAddMemsetNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                     const CUDA_MEMSET_NODE_PARAMS *params, CUcontext ctx) {
  ENTER("cuGraphAddMemsetNode");
  struct gnode *n;
  TRY(add_in_ctx(ph, graph, N_MEMSET, deps, ndeps, ctx, params, &n));
  n->p.ms = mset_of(params);
  return OK;
}

static CUresult cuGraphMemsetNodeGetParams(CUgraphNode node, CUDA_MEMSET_NODE_PARAMS *out) {
  ENTER("cuGraphMemsetNodeGetParams");
  NEED(out);
  TYPED_NODE(n, node, N_MEMSET);
  struct mset *m = &n->p.ms;
  out->dst = m->dst; out->pitch = m->pitch; out->value = m->value; out->elementSize = m->elem;
  out->width = m->width; out->height = m->height;
  return OK;
}

static CUresult cuGraphMemsetNodeSetParams(CUgraphNode node, const CUDA_MEMSET_NODE_PARAMS *params) {
  ENTER("cuGraphMemsetNodeSetParams");
  TYPED_NODE(n, node, N_MEMSET);
  TRY(check_memset(params));
  n->p.ms = mset_of(params);
  return OK;
}

static CUresult cuGraphAddHostNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                   const CUDA_HOST_NODE_PARAMS *params) {
  ENTER("cuGraphAddHostNode");
  NEED(ph && params && params->fn);
  struct gnode *n;
  handle_t h;
  TRY(new_node(graph, N_HOST, deps, ndeps, &n, &h));
  n->p.host.fn = params->fn;
  n->p.host.data = params->userData;
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphHostNodeGetParams(CUgraphNode node, CUDA_HOST_NODE_PARAMS *out) {
  ENTER("cuGraphHostNodeGetParams");
  NEED(out);
  TYPED_NODE(n, node, N_HOST);
  out->fn = n->p.host.fn;
  out->userData = n->p.host.data;
  return OK;
}

static CUresult cuGraphHostNodeSetParams(CUgraphNode node, const CUDA_HOST_NODE_PARAMS *params) {
  ENTER("cuGraphHostNodeSetParams");
  NEED(params && params->fn);
  TYPED_NODE(n, node, N_HOST);
  n->p.host.fn = params->fn;
  n->p.host.data = params->userData;
  return OK;
}

static CUresult event_node(const char *call, int type, CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps,
                           size_t ndeps, CUevent event) {
  (void)call;
  NEED(ph);
  CUresult rc;
  if (!get(event, K_EVENT, &rc)) return rc;
  struct gnode *n;
  handle_t h;
  TRY(new_node(graph, type, deps, ndeps, &n, &h));
  n->p.event = (handle_t)event;
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphAddEventRecordNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                          CUevent event) {
  ENTER("cuGraphAddEventRecordNode");
  return event_node("cuGraphAddEventRecordNode", N_EVENT_RECORD, ph, graph, deps, ndeps, event);
}

static CUresult cuGraphAddEventWaitNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                        CUevent event) {
  ENTER("cuGraphAddEventWaitNode");
  return event_node("cuGraphAddEventWaitNode", N_WAIT_EVENT, ph, graph, deps, ndeps, event);
}

static CUresult get_event(CUgraphNode node, int type, CUevent *out) {
  NEED(out);
  TYPED_NODE(n, node, type);
  *out = (CUevent)n->p.event;
  return OK;
}

static CUresult set_event(CUgraphNode node, int type, CUevent event) {
  TYPED_NODE(n, node, type);
  if (!get(event, K_EVENT, &rc)) return rc;
  n->p.event = (handle_t)event;
  return OK;
}

static CUresult cuGraphEventRecordNodeGetEvent(CUgraphNode node, CUevent *out) {
  ENTER("cuGraphEventRecordNodeGetEvent");
  return get_event(node, N_EVENT_RECORD, out);
}

static CUresult cuGraphEventRecordNodeSetEvent(CUgraphNode node, CUevent event) {
  ENTER("cuGraphEventRecordNodeSetEvent");
  return set_event(node, N_EVENT_RECORD, event);
}

static CUresult cuGraphEventWaitNodeGetEvent(CUgraphNode node, CUevent *out) {
  ENTER("cuGraphEventWaitNodeGetEvent");
  return get_event(node, N_WAIT_EVENT, out);
}

static CUresult cuGraphEventWaitNodeSetEvent(CUgraphNode node, CUevent event) {
  ENTER("cuGraphEventWaitNodeSetEvent");
  return set_event(node, N_WAIT_EVENT, event);
}

/* A deep copy of graph src as a new graph owned by node parent (what cuGraphAddChildGraphNode does). */
static CUresult clone_graph(handle_t src, handle_t parent, handle_t *out);

static CUresult clone_node_into(struct gnode *from, handle_t graph, const handle_t *deps, size_t ndeps,
                                handle_t *out) {
  struct gnode *n;
  handle_t h;
  TRY(new_node((CUgraph)graph, from->type, (const CUgraphNode *)deps, ndeps, &n, &h));
  n->ctx = from->ctx;
  n->p = from->p;
  n->cond.handle = from->cond.handle;
  n->cond.type = from->cond.type;
  n->cond.size = from->cond.size;
  if (from->type == N_KERNEL) {
    struct kparams *k = malloc(sizeof *k);
    unsigned char *args = malloc(from->p.k->nargs ? from->p.k->nargs : 1);
    if (!k || !args) { free(k); free(args); n->type = N_EMPTY; destroy_node_obj(h); return E_OUT_OF_MEMORY; }
    *k = *from->p.k;
    memcpy(args, from->p.k->args, from->p.k->nargs);
    k->args = args;
    n->p.k = k;
  }
  if (from->type == N_MEM_ALLOC) galloc_ref(from->p.alloc.dptr, 1);
  if (from->type == N_GRAPH) TRY(clone_graph(from->child, h, &n->child));
  if (from->type == N_CONDITIONAL)
    for (int b = 0; b < MAX_BODIES; b++) if (from->cond.body[b]) TRY(clone_graph(from->cond.body[b], h, &n->cond.body[b]));
  *out = h;
  return OK;
}

static CUresult clone_graph(handle_t src, handle_t parent, handle_t *out) {
  struct gdata *g = side_of(src, TAG_GRAPH);
  if (!g) return stale(E_INVALID_HANDLE);
  struct obj *o = new_graph_obj(parent, NULL);
  if (!o) return E_OUT_OF_MEMORY;
  handle_t copy = o->h;
  *out = copy;
  size_t n = g->n;
  handle_t *map = calloc(n ? n : 1, sizeof *map), *deps = calloc(n ? n : 1, sizeof *deps);
  if (!map || !deps) { free(map); free(deps); return E_OUT_OF_MEMORY; }
  CUresult rc = OK;
  /* nodes in an order where every dependency comes first: repeat passes over the insertion order */
  size_t done = 0;
  for (int pass = 0; done < n && pass <= (int)n; pass++) {
    g = side_of(src, TAG_GRAPH);
    for (size_t i = 0; i < g->n && rc == OK; i++) {
      if (map[i]) continue;
      struct gnode *from = side_of(g->nodes[i], TAG_NODE);
      size_t k = 0;
      int ready = 1;
      for (size_t d = 0; d < from->ndeps && ready; d++) {
        size_t j = 0;
        while (j < g->n && g->nodes[j] != from->deps[d]) j++;
        if (j == g->n || !map[j]) ready = 0;
        else deps[k++] = map[j];
      }
      if (!ready) continue;
      rc = clone_node_into(from, copy, deps, k, &map[i]);
      done++;
    }
  }
  free(map);
  free(deps);
  if (rc == OK && done < n) rc = E_INVALID_VALUE;   /* a cycle: the real driver refuses it at instantiation */
  return rc;
}

/* The one-instantiation rule of graphs with memory nodes (see struct gdata): is g's owner a live executable
 * graph other than `except` (a handle; 0: none)?  own() makes e (handle h) its owner. */
static int owner_alive(handle_t graph, struct gdata *g, handle_t except) {
  if (!g || !g->owner || g->owner == except) return 0;
  struct gexec *e = side_of(g->owner, TAG_EXEC);   /* no stale use: a destroyed owner is simply none */
  return e && e->serial == g->owner_serial && e->owns == graph;
}

static void own(struct gdata *g, handle_t h, struct gexec *e) {
  if (g) { g->owner = h; g->owner_serial = e->serial; }
}

/* Does graph h (or a child graph in it) have a memory alloc or free node?  cuGraphAddChildGraphNode clones
 * its child (CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE) and refuses such a child, as cuda.h documents. */
static int has_memory_nodes(handle_t h) {
  struct gdata *g = side_of(h, TAG_GRAPH);
  for (size_t i = 0; g && i < g->n; i++) {
    struct gnode *n = side_of(g->nodes[i], TAG_NODE);
    if (n && (n->type == N_MEM_ALLOC || n->type == N_MEM_FREE)) return 1;
    if (n && n->type == N_GRAPH && has_memory_nodes(n->child)) return 1;
  }
  return 0;
}

static CUresult cuGraphAddChildGraphNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                         CUgraph child) {
  ENTER("cuGraphAddChildGraphNode");
  NEED(ph);
  CUresult rc;
  if (!graph_of(child, &rc)) return rc;
  NEED(child != graph && !has_memory_nodes((handle_t)child));
  struct gnode *n;
  handle_t h;
  TRY(new_node(graph, N_GRAPH, deps, ndeps, &n, &h));
  handle_t copy = 0;
  rc = clone_graph((handle_t)child, h, &copy);
  n = side_of(h, TAG_NODE);
  n->child = copy;
  if (rc != OK) { destroy_node_obj(h); return rc; }
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode node, CUgraph *out) {
  ENTER("cuGraphChildGraphNodeGetGraph");
  NEED(out);
  TYPED_NODE(n, node, N_GRAPH);
  *out = (CUgraph)n->child;
  return OK;
}

static CUresult cuGraphAddEmptyNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps) {
  ENTER("cuGraphAddEmptyNode");
  NEED(ph);
  struct gnode *n;
  handle_t h;
  TRY(new_node(graph, N_EMPTY, deps, ndeps, &n, &h));
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphAddMemAllocNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                       CUDA_MEM_ALLOC_NODE_PARAMS *params) {
  ENTER("cuGraphAddMemAllocNode");
  NEED(ph && params && params->bytesize);
  NEED(params->poolProps.allocType == 1 && params->poolProps.locationType == 1); /* pinned, on a device */
  CUresult rc;
  if (!graph_of(graph, &rc)) return rc;
  TRY(check_deps((handle_t)graph, side_of((handle_t)graph, TAG_GRAPH), deps, ndeps));
  CUdeviceptr dptr;
  TRY(graph_alloc(params->bytesize, params->poolProps.locationId, &dptr));
  struct gnode *n;
  handle_t h;
  if ((rc = new_node(graph, N_MEM_ALLOC, deps, ndeps, &n, &h)) != OK) { galloc_ref(dptr, -1); return rc; }
  n->p.alloc.dptr = dptr;
  n->p.alloc.bytes = params->bytesize;
  n->p.alloc.dev = params->poolProps.locationId;
  params->dptr = dptr;
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *out) {
  ENTER("cuGraphMemAllocNodeGetParams");
  NEED(out);
  TYPED_NODE(n, node, N_MEM_ALLOC);
  memset(out, 0, sizeof *out);
  out->poolProps.allocType = 1;
  out->poolProps.locationType = 1;
  out->poolProps.locationId = n->p.alloc.dev;
  out->bytesize = n->p.alloc.bytes;
  out->dptr = n->p.alloc.dptr;
  return OK;
}

static CUresult cuGraphAddMemFreeNode(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                      CUdeviceptr dptr) {
  ENTER("cuGraphAddMemFreeNode");
  NEED(ph);
  if (!is_graph_alloc(dptr)) return find_alloc(dptr, 0) ? E_INVALID_VALUE : stale(E_INVALID_VALUE);
  struct gnode *n;
  handle_t h;
  TRY(new_node(graph, N_MEM_FREE, deps, ndeps, &n, &h));
  n->p.free_ptr = dptr;
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphMemFreeNodeGetParams(CUgraphNode node, CUdeviceptr *out) {
  ENTER("cuGraphMemFreeNodeGetParams");
  NEED(out);
  TYPED_NODE(n, node, N_MEM_FREE);
  *out = n->p.free_ptr;
  return OK;
}

static CUresult cuGraphConditionalHandleCreate(CUgraphConditionalHandle *out, CUgraph graph, CUcontext ctx,
                                               unsigned int dflt, unsigned int flags) {
  ENTER("cuGraphConditionalHandleCreate");
  NEED(out && (flags & ~COND_ASSIGN_DEFAULT) == 0);
  CUresult rc;
  if (!graph_of(graph, &rc)) return rc;
  struct obj *c;
  TRY(ctx_arg(ctx, &c));
  if (nconds == cap_conds) {
    size_t cap = cap_conds ? 2 * cap_conds : 32;
    struct cond *grown = realloc(conds, cap * sizeof *grown);
    if (!grown) return E_OUT_OF_MEMORY;
    conds = grown;
    cap_conds = cap;
  }
  struct cond *cd = &conds[nconds++];
  memset(cd, 0, sizeof *cd);
  cd->graph = (handle_t)graph;
  cd->dflt = dflt;
  cd->value = dflt;
  cd->flags = flags;
  cd->live = 1;
  *out = COND_TAG | nconds;
  return OK;
}

/* Is handle h usable by a conditional node in graph g: made for g or a graph g is (nested) inside? */
static int cond_reaches(const struct cond *cd, handle_t g) {
  for (int depth = 0; g && depth < 64; depth++) {
    if (cd->graph == g) return 1;
    struct obj *o = obj_at(g);
    handle_t node = o ? o->parent : 0;
    struct gnode *n = node ? side_of(node, TAG_NODE) : NULL;
    g = n ? n->graph : 0;
  }
  return 0;
}

static CUresult cuGraphAddNode_v2(CUgraphNode *ph, CUgraph graph, const CUgraphNode *deps,
                                  const CUgraphEdgeData *edges, size_t ndeps, CUgraphNodeParams *params) {
  ENTER("cuGraphAddNode");
  NEED(ph && params);
  if (edges)
    for (size_t i = 0; i < ndeps; i++) NEED(!edges[i].type && !edges[i].from_port && !edges[i].to_port);
  struct gnode *n;
  handle_t h;
  if (params->type == N_EMPTY) {
    TRY(new_node(graph, N_EMPTY, deps, ndeps, &n, &h));
    *ph = (CUgraphNode)h;
    return OK;
  }
  if (params->type != N_CONDITIONAL) return E_NOT_SUPPORTED;   /* not modelled: see the top */
  CUDA_CONDITIONAL_NODE_PARAMS *cp = &params->u.conditional;
  CUresult rc;
  if (!graph_of(graph, &rc)) return rc;
  struct cond *cd = cond_of(cp->handle);
  NEED(cd && cond_reaches(cd, (handle_t)graph));
  NEED(cp->size >= 1 && cp->size <= MAX_BODIES);
  NEED(cp->type == COND_IF ? cp->size <= 2 : cp->type == COND_WHILE ? cp->size == 1 : cp->type == COND_SWITCH);
  handle_t ctx;
  TRY(node_ctx(cp->ctx, &ctx));
  TRY(new_node(graph, N_CONDITIONAL, deps, ndeps, &n, &h));
  n->ctx = ctx;
  n->cond.handle = cp->handle;
  n->cond.type = cp->type;
  n->cond.size = cp->size;
  for (unsigned b = 0; b < cp->size; b++) {
    struct obj *body = new_graph_obj(h, NULL);
    if (!body) { destroy_node_obj(h); return E_OUT_OF_MEMORY; }
    n = side_of(h, TAG_NODE);
    n->cond.body[b] = body->h;
  }
  /* As the real driver does: phGraph_out is pointed at an array the node owns (valid while it lives),
   * whatever the caller put there (measured on driver 580: a caller's own array is left untouched). */
  _Static_assert(sizeof(handle_t) == sizeof(CUgraph), "body handles are CUgraph values");
  cp->phGraph_out = (CUgraph *)n->cond.body;
  cd->used = 1;
  *ph = (CUgraphNode)h;
  return OK;
}

static CUresult cuGraphNodeGetType(CUgraphNode node, int *type) {
  ENTER("cuGraphNodeGetType");
  NEED(type);
  CUresult rc;
  struct gnode *n = node_of(node, &rc);
  if (!n) return rc;
  *type = n->type;
  return OK;
}

static CUresult cuGraphDestroyNode(CUgraphNode node) {
  ENTER("cuGraphDestroyNode");
  CUresult rc;
  struct gnode *n = node_of(node, &rc);
  if (!n) return rc;
  /* cuda.h: nodes of a graph with memory alloc or free nodes cannot be destroyed (driver 580: NOT_SUPPORTED) */
  if (has_memory_nodes(n->graph)) return E_NOT_SUPPORTED;
  destroy_node_obj((handle_t)node);
  return OK;
}

/* The list convention of cuGraphGetNodes and its kin: a NULL array asks for the count. */
static void hand_out(const handle_t *items, size_t n, CUgraphNode *out, size_t *count) {
  if (!out) { *count = n; return; }
  size_t i = 0;
  for (; i < *count && i < n; i++) out[i] = (CUgraphNode)items[i];
  for (size_t j = i; j < *count; j++) out[j] = NULL;
  *count = i;
}

static CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *count) {
  ENTER("cuGraphGetNodes");
  NEED(count);
  CUresult rc;
  struct gdata *g = graph_of(graph, &rc);
  if (!g) return rc;
  hand_out(g->nodes, g->n, nodes, count);
  return OK;
}

static CUresult cuGraphGetRootNodes(CUgraph graph, CUgraphNode *nodes, size_t *count) {
  ENTER("cuGraphGetRootNodes");
  NEED(count);
  CUresult rc;
  struct gdata *g = graph_of(graph, &rc);
  if (!g) return rc;
  handle_t *roots = malloc((g->n ? g->n : 1) * sizeof *roots);
  if (!roots) return E_OUT_OF_MEMORY;
  size_t k = 0;
  for (size_t i = 0; i < g->n; i++) {
    struct gnode *n = side_of(g->nodes[i], TAG_NODE);
    if (n && !n->ndeps) roots[k++] = g->nodes[i];
  }
  hand_out(roots, k, nodes, count);
  free(roots);
  return OK;
}

static CUresult cuGraphGetEdges_v2(CUgraph graph, CUgraphNode *from, CUgraphNode *to, CUgraphEdgeData *edges,
                                   size_t *count) {
  ENTER("cuGraphGetEdges");
  NEED(count);
  CUresult rc;
  struct gdata *g = graph_of(graph, &rc);
  if (!g) return rc;
  size_t total = 0, k = 0;
  for (size_t i = 0; i < g->n; i++) {
    struct gnode *n = side_of(g->nodes[i], TAG_NODE);
    total += n ? n->ndeps : 0;
  }
  if (!from && !to) { *count = total; return OK; }
  NEED(from && to);
  for (size_t i = 0; i < g->n; i++) {
    struct gnode *n = side_of(g->nodes[i], TAG_NODE);
    for (size_t d = 0; n && d < n->ndeps && k < *count; d++, k++) {
      from[k] = (CUgraphNode)n->deps[d];
      to[k] = (CUgraphNode)g->nodes[i];
      if (edges) memset(&edges[k], 0, sizeof edges[k]);
    }
  }
  for (size_t j = k; j < *count; j++) { from[j] = to[j] = NULL; if (edges) memset(&edges[j], 0, sizeof edges[j]); }
  *count = k;
  return OK;
}

/* The 10.0 ABI (no edge data), what a handle pinned before 12.3 asks for: the 12.3 one without it. */
static CUresult cuGraphGetEdges(CUgraph graph, CUgraphNode *from, CUgraphNode *to, size_t *count) {
  return cuGraphGetEdges_v2(graph, from, to, NULL, count);
}

/* hand_out() of a node's edges, with their (default, zero) edge data where asked for. */
static void hand_out_edges(const handle_t *items, size_t n, CUgraphNode *out, CUgraphEdgeData *edges, size_t *count) {
  size_t want = *count;
  hand_out(items, n, out, count);
  if (out && edges) memset(edges, 0, want * sizeof *edges);
}

static CUresult cuGraphNodeGetDependencies_v2(CUgraphNode node, CUgraphNode *deps, CUgraphEdgeData *edges,
                                              size_t *count) {
  ENTER("cuGraphNodeGetDependencies");
  NEED(count);
  CUresult rc;
  struct gnode *n = node_of(node, &rc);
  if (!n) return rc;
  hand_out_edges(n->deps, n->ndeps, deps, edges, count);
  return OK;
}

static CUresult cuGraphNodeGetDependentNodes_v2(CUgraphNode node, CUgraphNode *out, CUgraphEdgeData *edges,
                                                size_t *count) {
  ENTER("cuGraphNodeGetDependentNodes");
  NEED(count);
  CUresult rc;
  struct gnode *n = node_of(node, &rc);
  if (!n) return rc;
  struct gdata *g = side_of(n->graph, TAG_GRAPH);
  handle_t *found = malloc(((g ? g->n : 0) + 1) * sizeof *found);
  if (!found) return E_OUT_OF_MEMORY;
  size_t k = 0;
  for (size_t i = 0; g && i < g->n; i++) {
    struct gnode *m = side_of(g->nodes[i], TAG_NODE);
    for (size_t d = 0; m && d < m->ndeps; d++) if (m->deps[d] == (handle_t)node) { found[k++] = g->nodes[i]; break; }
  }
  hand_out_edges(found, k, out, edges, count);
  free(found);
  return OK;
}

/* Edges from[i] -> to[i] of graph: both its live nodes, distinct; add (or remove) each. */
static CUresult edit_edges(CUgraph graph, const CUgraphNode *from, const CUgraphNode *to,
                           const CUgraphEdgeData *edges, size_t n, int add) {
  CUresult rc;
  struct gdata *g = graph_of(graph, &rc);
  if (!g) return rc;
  if (n) NEED(from && to);
  for (size_t i = 0; i < n; i++) {
    struct gnode *a = node_of(from[i], &rc), *b;
    if (!a) return rc;
    if (!(b = node_of(to[i], &rc))) return rc;
    NEED(a->graph == (handle_t)graph && b->graph == (handle_t)graph && from[i] != to[i]);
    if (edges) NEED(!edges[i].type && !edges[i].from_port && !edges[i].to_port);
    size_t d = 0;
    while (d < b->ndeps && b->deps[d] != (handle_t)from[i]) d++;
    if (add ? d < b->ndeps : d == b->ndeps) return E_INVALID_VALUE;   /* there already / not there */
  }
  for (size_t i = 0; i < n; i++) {
    struct gnode *b = side_of((handle_t)to[i], TAG_NODE);
    if (add) {
      if (b->ndeps == b->capdeps) {
        size_t cap = b->capdeps ? 2 * b->capdeps : 4;
        handle_t *grown = realloc(b->deps, cap * sizeof *grown);
        if (!grown) return E_OUT_OF_MEMORY;
        b->deps = grown;
        b->capdeps = cap;
      }
      b->deps[b->ndeps++] = (handle_t)from[i];
    } else {
      for (size_t d = 0; d < b->ndeps; d++)
        if (b->deps[d] == (handle_t)from[i]) { memmove(&b->deps[d], &b->deps[d + 1], (b->ndeps - d - 1) * sizeof *b->deps); b->ndeps--; break; }
    }
  }
  return OK;
}

static CUresult cuGraphAddDependencies_v2(CUgraph graph, const CUgraphNode *from, const CUgraphNode *to,
                                          const CUgraphEdgeData *edges, size_t n) {
  ENTER("cuGraphAddDependencies");
  return edit_edges(graph, from, to, edges, n, 1);
}

static CUresult cuGraphRemoveDependencies_v2(CUgraph graph, const CUgraphNode *from, const CUgraphNode *to,
                                             const CUgraphEdgeData *edges, size_t n) {
  ENTER("cuGraphRemoveDependencies");
  /* cuda.h: no edge of a graph with memory alloc or free nodes is removed (driver 580: NOT_SUPPORTED) */
  if (side_of((handle_t)graph, TAG_GRAPH) && has_memory_nodes((handle_t)graph)) return E_NOT_SUPPORTED;
  return edit_edges(graph, from, to, edges, n, 0);
}

/* ------------------------------------------------------------------ instantiation */
struct inst { int result; handle_t err_node; const char *why; handle_t ctx; };

/* The executable copy of graph h; on failure *rc and in->result, err_node, why say why. */
static struct xgraph *snapshot(handle_t h, struct inst *in, CUresult *rc) {
  struct gdata *g = side_of(h, TAG_GRAPH);
  if (!g) { *rc = stale(E_INVALID_HANDLE); return NULL; }
  struct xgraph *x = calloc(1, sizeof *x);
  size_t n = g->n;
  if (!x) { *rc = E_OUT_OF_MEMORY; return NULL; }
  x->n = n;
  x->nodes = calloc(n ? n : 1, sizeof *x->nodes);
  x->order = calloc(n ? n : 1, sizeof *x->order);
  size_t *indeg = calloc(n ? n : 1, sizeof *indeg);
  if (!x->nodes || !x->order || !indeg) { free(indeg); free_xgraph(x); *rc = E_OUT_OF_MEMORY; return NULL; }
  for (size_t i = 0; i < n; i++) {
    struct gnode *s = side_of(g->nodes[i], TAG_NODE);
    struct xnode *d = &x->nodes[i];
    d->orig = g->nodes[i];
    d->type = s->type;
    d->ctx = s->ctx;
    d->p = s->p;
    d->cond.handle = s->cond.handle;
    d->cond.type = s->cond.type;
    d->cond.size = s->cond.size;
    d->deps = calloc(s->ndeps ? s->ndeps : 1, sizeof *d->deps);
    if (!d->deps) { d->type = N_EMPTY; free(indeg); free_xgraph(x); *rc = E_OUT_OF_MEMORY; return NULL; }
    d->ndeps = s->ndeps;
    indeg[i] = s->ndeps;
    for (size_t k = 0; k < s->ndeps; k++) {
      size_t j = 0;
      while (j < n && g->nodes[j] != s->deps[k]) j++;
      d->deps[k] = j;
    }
    if (s->type == N_KERNEL) {
      struct obj *f = obj_at(s->p.k->func);
      if (!f || !f->alive || (f->kind != K_FUNCTION && f->kind != K_KERNEL)) {
        d->type = N_EMPTY; free(indeg); free_xgraph(x); *rc = stale(E_INVALID_HANDLE); return NULL;
      }
      struct kparams *k = malloc(sizeof *k);
      unsigned char *args = malloc(s->p.k->nargs ? s->p.k->nargs : 1);
      if (!k || !args) { free(k); free(args); d->type = N_EMPTY; free(indeg); free_xgraph(x); *rc = E_OUT_OF_MEMORY; return NULL; }
      *k = *s->p.k;
      memcpy(args, s->p.k->args, s->p.k->nargs);
      k->args = args;
      d->p.k = k;
      if (in->ctx && s->ctx != in->ctx) {
        in->result = INST_MULTIPLE_CTXS; in->err_node = g->nodes[i]; in->why = "kernels of two contexts";
        free(indeg); free_xgraph(x); *rc = E_INVALID_VALUE; return NULL;
      }
    }
    if (s->type == N_MEM_ALLOC) galloc_ref(s->p.alloc.dptr, 1);
    if ((s->type == N_EVENT_RECORD || s->type == N_WAIT_EVENT) && !get((CUevent)s->p.event, K_EVENT, rc)) {
      d->type = N_EMPTY; free(indeg); free_xgraph(x); return NULL;
    }
    if (s->type == N_GRAPH && !(d->child = snapshot(s->child, in, rc))) { free(indeg); free_xgraph(x); return NULL; }
    if (s->type == N_CONDITIONAL)
      for (unsigned b = 0; b < s->cond.size; b++)
        if (!(d->cond.body[b] = snapshot(s->cond.body[b], in, rc))) { free(indeg); free_xgraph(x); return NULL; }
  }
  /* Kahn's order; what is left is a cycle */
  size_t head = 0, tail = 0;
  for (size_t i = 0; i < n; i++) if (!indeg[i]) x->order[tail++] = i;
  while (head < tail) {
    size_t i = x->order[head++];
    for (size_t j = 0; j < n; j++)
      for (size_t k = 0; k < x->nodes[j].ndeps; k++)
        if (x->nodes[j].deps[k] == i && --indeg[j] == 0) x->order[tail++] = j;
  }
  if (tail < n) {
    size_t j = 0;
    while (!indeg[j]) j++;
    in->result = INST_INVALID_STRUCTURE;
    in->err_node = g->nodes[j];
    in->why = "the graph has a cycle";
    free(indeg);
    free_xgraph(x);
    *rc = E_INVALID_VALUE;
    return NULL;
  }
  free(indeg);
  return x;
}

static CUresult instantiate(CUgraphExec *out, CUgraph graph, unsigned long long flags, struct inst *in) {
  NEED(out);
  NEED((flags & ~15ULL) == 0);
  CUresult rc;
  if (!graph_of(graph, &rc)) return rc;
  struct obj *c;
  TRY(cur_ctx(&c));
  in->ctx = c->h;
  for (size_t i = 0; i < nconds; i++) {
    if (conds[i].live && conds[i].graph == (handle_t)graph && !conds[i].used) {
      in->result = INST_CONDITIONAL_HANDLE_UNUSED;
      in->why = "a conditional handle of the graph is used by no conditional node";
      return E_INVALID_VALUE;
    }
  }
  int memory = has_memory_nodes((handle_t)graph);
  if (memory && owner_alive((handle_t)graph, graph_of(graph, &rc), 0)) return E_NOT_SUPPORTED;   /* 801 */
  struct xgraph *x = snapshot((handle_t)graph, in, &rc);
  if (!x) return rc;
  struct gexec *e = calloc(1, sizeof *e);
  struct obj *o = e ? new_obj(K_GEXEC, c->h, c->dev) : NULL;
  if (!o || !set_side(o, e)) { if (o) kill_obj(o); free(e); free_xgraph(x); return E_OUT_OF_MEMORY; }
  e->tag = TAG_EXEC;
  e->flags = flags;
  e->g = x;
  e->serial = ++exec_serials;
  e->owns = (handle_t)graph;
  *out = (CUgraphExec)o->h;
  if (memory) own(graph_of(graph, &rc), o->h, e);
  return OK;
}

static CUresult cuGraphInstantiate_v2(CUgraphExec *out, CUgraph graph, CUgraphNode *err_node, char *log,
                                      size_t size) {
  ENTER("cuGraphInstantiate");
  struct inst in = {0, 0, NULL, 0};
  CUresult rc = instantiate(out, graph, 0, &in);
  if (err_node) *err_node = (CUgraphNode)in.err_node;
  if (log && size) snprintf(log, size, "%s", rc == OK ? "" : in.why ? in.why : "instantiation failed");
  return rc;
}

static CUresult cuGraphInstantiateWithFlags(CUgraphExec *out, CUgraph graph, unsigned long long flags) {
  ENTER("cuGraphInstantiateWithFlags");
  NEED(!(flags & 2));   /* CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD needs WithParams' stream */
  struct inst in = {0, 0, NULL, 0};
  return instantiate(out, graph, flags, &in);
}

static CUresult cuGraphInstantiateWithParams(CUgraphExec *out, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
  ENTER("cuGraphInstantiateWithParams");
  NEED(p);
  if (p->flags & 2) { struct queue q; TRY(use_queue(p->hUploadStream, &q, NULL)); }
  struct inst in = {0, 0, NULL, 0};
  CUresult rc = instantiate(out, graph, p->flags, &in);
  p->hErrNode_out = (CUgraphNode)in.err_node;
  p->result_out = rc == OK ? INST_SUCCESS : in.result ? in.result : INST_ERROR;
  if (rc == OK && (p->flags & 2)) { struct queue q; use_queue(p->hUploadStream, &q, NULL); enqueue(q.uid); }
  return rc;
}

static CUresult cuGraphExecDestroy(CUgraphExec exec) {
  ENTER("cuGraphExecDestroy");
  CUresult rc;
  struct obj *o = get(exec, K_GEXEC, &rc);
  if (!o) return rc;
  TRY(need_current(o));
  drop_side(o->h);
  kill_obj(o);
  return OK;
}

/* ------------------------------------------------------------------ host work, run later
 * A graph's host nodes run later, as on a GPU, where the driver calls them from its own thread when the
 * stream reaches them: cuGraphLaunch queues them (in the graph's order), and the queue runs, in order and
 * without the lock, on the next thread that synchronizes (cuStreamSynchronize, cuStreamQuery,
 * cuCtxSynchronize, cuEventSynchronize, cuEventQuery) or calls fake_run_host_work().  A host function
 * launched (cuLaunchHostFunc) while host work is queued joins the queue behind it, so stream order holds;
 * with none queued it runs at once, as fakedriver.c has it.  So a callable that died between a launch and
 * its run is seen: what it did is missing (or the process crashes). */
struct hostwork { CUhostFn fn; void *data; };
static struct hostwork *hwork;        /* under mu */
static size_t nhwork, caphwork;
static int host_work_pending;         /* queued and not run yet: read atomically without mu */
static long host_work_ran;

/* Under the lock: queue fn(data). */
static CUresult queue_host(CUhostFn fn, void *data) {
  if (nhwork == caphwork) {
    size_t cap = caphwork ? 2 * caphwork : 16;
    struct hostwork *grown = realloc(hwork, cap * sizeof *grown);
    if (!grown) return E_OUT_OF_MEMORY;
    hwork = grown;
    caphwork = cap;
  }
  hwork[nhwork].fn = fn;
  hwork[nhwork].data = data;
  nhwork++;
  __atomic_add_fetch(&host_work_pending, 1, __ATOMIC_RELAXED);
  return OK;
}

/* Without the lock: run the queued host work until none is left (another thread's batch included: a
 * synchronize returns once all of it ran). */
static void run_host_work(void) {
  while (__atomic_load_n(&host_work_pending, __ATOMIC_RELAXED)) {
    pthread_mutex_lock(&mu);
    struct hostwork *batch = hwork;
    size_t n = nhwork;
    hwork = NULL;
    nhwork = caphwork = 0;
    pthread_mutex_unlock(&mu);
    for (size_t i = 0; i < n; i++) {
      batch[i].fn(batch[i].data);
      __atomic_add_fetch(&host_work_ran, 1, __ATOMIC_RELAXED);
      __atomic_sub_fetch(&host_work_pending, 1, __ATOMIC_RELAXED);
    }
    free(batch);
    if (!n) sched_yield();          /* another thread runs the rest */
  }
}

/* cuLaunchHostFunc outside a capture: behind queued host work, else fakedriver.c's (at once). */
static CUresult launch_host_fn(CUstream stream, CUhostFn fn, void *data) {
  if (!__atomic_load_n(&host_work_pending, __ATOMIC_RELAXED)) return cuLaunchHostFunc(stream, fn, data);
  ENTER("cuLaunchHostFunc");
  NEED(fn);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  enqueue(q.uid);
  return queue_host(fn, data);
}

/* ------------------------------------------------------------------ launch */
static int capturing_member_uid(unsigned uid);   /* below: is a stream state in a capture? */

static unsigned get_arg_u32(const struct kparams *k, int i) {
  unsigned v = 0;
  if (i < k->layout.nparams && k->layout.off[i] + 4 <= k->nargs) memcpy(&v, k->args + k->layout.off[i], 4);
  return v;
}

static unsigned long long get_arg_u64(const struct kparams *k, int i) {
  unsigned long long v = 0;
  if (i < k->layout.nparams && k->layout.size[i] == 8 && k->layout.off[i] + 8 <= k->nargs)
    memcpy(&v, k->args + k->layout.off[i], 8);
  return v;
}

/* Bytes [p, p + n) of live device memory, else NULL (a stale use counted). */
static char *device_bytes(CUdeviceptr p, size_t n) {
  struct alloc *a;
  char *s;
  if (dev_range(p, n, &a, &s) != OK) return NULL;
  return s;
}

/* What the four kernels the fake knows do in a graph (see the top). */
static void kernel_semantics(const struct kparams *k) {
  const char *name = k->name;
  if (strcmp(name, "VecAdd_kernel") == 0 && k->layout.nparams == 4) {
    int n = (int)get_arg_u32(k, 3);
    if (n <= 0) return;
    char *a = device_bytes(get_arg_u64(k, 0), 4 * (size_t)n), *b = device_bytes(get_arg_u64(k, 1), 4 * (size_t)n),
         *c = device_bytes(get_arg_u64(k, 2), 4 * (size_t)n);
    if (!a || !b || !c) return;
    for (int i = 0; i < n; i++) {
      float x, y;
      memcpy(&x, a + 4 * i, 4);
      memcpy(&y, b + 4 * i, 4);
      x += y;
      memcpy(c + 4 * i, &x, 4);
    }
  } else if (strcmp(name, "fill_value") == 0 && k->layout.nparams == 3) {
    int n = (int)get_arg_u32(k, 1);
    unsigned bits = get_arg_u32(k, 2);
    char *p = n > 0 ? device_bytes(get_arg_u64(k, 0), 4 * (size_t)n) : NULL;
    for (int i = 0; p && i < n; i++) memcpy(p + 4 * i, &bits, 4);
  } else if ((strcmp(name, "set_condition") == 0 && k->layout.nparams == 2) ||
             (strcmp(name, "countdown") == 0 && k->layout.nparams == 3)) {
    struct cond *cd = cond_of(get_arg_u64(k, 0));
    char *counter = device_bytes(get_arg_u64(k, 1), 4);
    if (!counter) return;
    int value;
    memcpy(&value, counter, 4);
    if (name[0] == 'c') {
      char *iterations = device_bytes(get_arg_u64(k, 2), 4);
      if (!iterations) return;
      int it;
      memcpy(&it, iterations, 4);
      it++;
      value--;
      memcpy(iterations, &it, 4);
      memcpy(counter, &value, 4);
    }
    if (cd) cd->value = value > 0;
  }
}

/* A kernel node's run: recorded as fakedriver.c's launch() records a launch. */
static CUresult run_kernel(struct xnode *n, const struct queue *q, CUstream stream) {
  struct kparams *k = n->p.k;
  struct obj *f = obj_at(k->func);
  if (!f || !f->alive || (f->kind != K_FUNCTION && f->kind != K_KERNEL)) return stale(E_INVALID_HANDLE);
  for (int i = 0; i < k->layout.nparams; i++) {
    if (k->layout.size[i] != 8 || k->layout.off[i] + 8 > k->nargs) continue;
    CUdeviceptr v;
    memcpy(&v, k->args + k->layout.off[i], 8);
    if (v >= dev_base && v < dev_next && !find_alloc(v, 0)) return stale(E_INVALID_VALUE);
  }
  unsigned long long work = enqueue(q->uid);
  for (size_t off = 0; off + 8 <= k->nargs; off += 8) {
    CUdeviceptr v;
    memcpy(&v, k->args + off, 8);
    if (v >= dev_base && v < dev_next) touch(find_alloc(v, 0), q->uid, work);
  }
  kernel_semantics(k);
  launch_count++;
  snprintf(last_name, sizeof last_name, "%s", k->name);
  memcpy(last_args, k->args, k->nargs);
  last_nargs = k->nargs;
  memcpy(last_dims, k->grid, sizeof k->grid);
  memcpy(last_dims + 3, k->block, sizeof k->block);
  last_shared_mem = k->shared;
  last_stream = stream;
  return OK;
}

static CUresult record_event(handle_t event, const struct queue *q) {
  CUresult rc;
  struct obj *e = get((CUevent)event, K_EVENT, &rc);
  if (!e) return rc;
  e->u.e.seq = ++event_seq;
  unsigned long long k = enqueue(q->uid);
  if (!e->u.e.clk) e->u.e.clk = malloc(sizeof *e->u.e.clk);
  if (e->u.e.clk) {
    e->u.e.clk->n = 0;
    if (q->uid) { *e->u.e.clk = sst[q->uid].seen; clock_set(e->u.e.clk, q->uid, k); }
  }
  return OK;
}

static CUresult wait_event(handle_t event, const struct queue *q) {
  CUresult rc;
  struct obj *e = get((CUevent)event, K_EVENT, &rc);
  if (!e) return rc;
  enqueue(q->uid);
  if (q->uid && e->u.e.clk) clock_merge(&sst[q->uid].seen, e->u.e.clk);
  return OK;
}

/* Run an executable graph's nodes in order on queue q; its host nodes are queued as host work. */
static CUresult run_xgraph(struct xgraph *x, const struct queue *q, CUstream stream) {
  for (size_t o = 0; o < x->n; o++) {
    struct xnode *n = &x->nodes[x->order[o]];
    CUresult rc = OK;
    switch (n->type) {
    case N_KERNEL: rc = run_kernel(n, q, stream); break;
    case N_MEMCPY: rc = copy_3d(&n->p.cp, q); break;
    case N_MEMSET:
      rc = memset_2d(n->p.ms.dst, n->p.ms.pitch, n->p.ms.value, n->p.ms.elem, n->p.ms.width, n->p.ms.height, q);
      break;
    case N_HOST:             /* run later, as on a GPU (see "host work" above) */
      enqueue(q->uid);
      rc = queue_host(n->p.host.fn, n->p.host.data);
      break;
    case N_EVENT_RECORD: rc = record_event(n->p.event, q); break;
    case N_WAIT_EVENT: rc = wait_event(n->p.event, q); break;
    case N_GRAPH: rc = run_xgraph(n->child, q, stream); break;
    case N_MEM_ALLOC: enqueue(q->uid); galloc_live(n->p.alloc.dptr, 1); break;
    case N_MEM_FREE: enqueue(q->uid); galloc_live(n->p.free_ptr, 0); break;
    case N_CONDITIONAL: {
      struct cond *cd = cond_of(n->cond.handle);
      if (!cd) break;
      if (n->cond.type == COND_IF) {
        if (cd->value) rc = run_xgraph(n->cond.body[0], q, stream);
        else if (n->cond.size == 2) rc = run_xgraph(n->cond.body[1], q, stream);
      } else if (n->cond.type == COND_WHILE) {
        for (unsigned it = 0; rc == OK && (cd = cond_of(n->cond.handle)) && cd->value && it < WHILE_LIMIT; it++)
          rc = run_xgraph(n->cond.body[0], q, stream);
      } else if (cd->value < n->cond.size) {
        rc = run_xgraph(n->cond.body[cd->value], q, stream);
      }
      break;
    }
    default: break;
    }
    if (rc != OK) return rc;
  }
  return OK;
}

/* Reset the conditional handles an executable graph uses that assign their default at each launch. */
static void reset_conditions(struct xgraph *x) {
  for (size_t i = 0; i < x->n; i++) {
    struct xnode *n = &x->nodes[i];
    if (n->type == N_CONDITIONAL) {
      struct cond *cd = cond_of(n->cond.handle);
      if (cd && (cd->flags & COND_ASSIGN_DEFAULT)) cd->value = cd->dflt;
      for (unsigned b = 0; b < n->cond.size; b++) reset_conditions(n->cond.body[b]);
    }
    if (n->type == N_GRAPH) reset_conditions(n->child);
  }
}

static CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) {
  ENTER("cuGraphLaunch");
  CUresult rc;
  struct obj *o = get(exec, K_GEXEC, &rc);
  if (!o) return rc;
  struct gexec *x = side_of(o->h, TAG_EXEC);
  if (!x) return stale(E_INVALID_HANDLE);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  if (capturing_member_uid(q.uid)) return E_CAPTURE_UNSUPPORTED;   /* not modelled (see the top) */
  if (!(x->flags & 1) && xgraph_has_live_alloc(x->g)) return E_INVALID_VALUE;   /* AUTO_FREE_ON_LAUNCH */
  graph_launches++;
  reset_conditions(x->g);
  x->busy++;
  rc = run_xgraph(x->g, &q, stream);
  if (--x->busy == 0 && x->dead) { free_xgraph(x->g); free(x); }
  return rc;
}

static CUresult cuGraphUpload(CUgraphExec exec, CUstream stream) {
  ENTER("cuGraphUpload");
  CUresult rc;
  if (!exec_of(exec, &rc)) return rc;
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  if (capturing_member_uid(q.uid)) return E_CAPTURE_UNSUPPORTED;
  enqueue(q.uid);
  return OK;
}

/* ------------------------------------------------------------------ updates */
struct upd { int result; handle_t node; };

static int same_ctx_of(CUdeviceptr p, handle_t ctx) {
  struct alloc *a = find_alloc(p, 0);
  return !a || !a->bound || a->ctx == ctx;
}

/* Can executable graph x take the parameters of graph snapshot y (see the top)?  0 and u filled if not. */
static int updatable(const struct xgraph *x, const struct xgraph *y, struct upd *u) {
  if (x->n != y->n) { u->result = UPD_TOPOLOGY_CHANGED; return 0; }
  for (size_t i = 0; i < x->n; i++) {
    const struct xnode *a = &x->nodes[i], *b = &y->nodes[i];
    u->node = b->orig;
    if (a->type != b->type) { u->result = UPD_NODE_TYPE_CHANGED; return 0; }
    if (a->ndeps != b->ndeps) { u->result = UPD_TOPOLOGY_CHANGED; return 0; }
    for (size_t k = 0; k < a->ndeps; k++) {
      size_t d = 0;
      while (d < b->ndeps && b->deps[d] != a->deps[k]) d++;
      if (d == b->ndeps) { u->result = UPD_TOPOLOGY_CHANGED; return 0; }
    }
    switch (a->type) {
    case N_KERNEL: if (a->ctx != b->ctx) { u->result = UPD_UNSUPPORTED_FUNCTION_CHANGE; return 0; } break;
    case N_MEMSET:
      if (b->p.ms.height != 1 || b->p.ms.elem != a->p.ms.elem || !same_ctx_of(b->p.ms.dst, a->ctx)) {
        u->result = UPD_PARAMETERS_CHANGED; return 0;
      }
      break;
    case N_MEMCPY:
      if (a->p.cp.srcMemoryType != b->p.cp.srcMemoryType || a->p.cp.dstMemoryType != b->p.cp.dstMemoryType) {
        u->result = UPD_PARAMETERS_CHANGED; return 0;
      }
      break;
    case N_MEM_ALLOC:
      if (a->p.alloc.bytes != b->p.alloc.bytes) { u->result = UPD_NOT_SUPPORTED; return 0; }
      break;
    case N_MEM_FREE:
      if (a->p.free_ptr != b->p.free_ptr) { u->result = UPD_NOT_SUPPORTED; return 0; }
      break;
    case N_GRAPH: if (!updatable(a->child, b->child, u)) return 0; break;
    case N_CONDITIONAL:
      if (a->cond.handle != b->cond.handle || a->cond.type != b->cond.type || a->cond.size != b->cond.size) {
        u->result = UPD_PARAMETERS_CHANGED; return 0;
      }
      for (unsigned c = 0; c < a->cond.size; c++) if (!updatable(a->cond.body[c], b->cond.body[c], u)) return 0;
      break;
    default: break;
    }
  }
  return 1;
}

/* y's parameters into x, node by node (x keeps its node handles); y keeps what x had, to be freed. */
static void take_params(struct xgraph *x, struct xgraph *y) {
  for (size_t i = 0; i < x->n; i++) {
    struct xnode *a = &x->nodes[i], *b = &y->nodes[i];
    union nparams p = a->p;
    a->p = b->p;
    b->p = p;
    if (a->type == N_GRAPH) take_params(a->child, b->child);
    if (a->type == N_CONDITIONAL) for (unsigned c = 0; c < a->cond.size; c++) take_params(a->cond.body[c], b->cond.body[c]);
  }
}

static CUresult cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph, CUgraphExecUpdateResultInfo *info) {
  ENTER("cuGraphExecUpdate");
  NEED(info);
  CUresult rc;
  struct gexec *x = exec_of(exec, &rc);
  if (!x) return rc;
  struct gdata *gd = graph_of(graph, &rc);
  if (!gd) return rc;
  memset(info, 0, sizeof *info);
  int memory = has_memory_nodes((handle_t)graph);
  /* driver 580: a graph with memory nodes whose instantiation is another live executable graph: 801, the
   * result left SUCCESS; a successful update makes this executable graph that graph's instantiation */
  if (memory && owner_alive((handle_t)graph, gd, (handle_t)exec)) return E_NOT_SUPPORTED;
  struct inst in = {0, 0, NULL, obj_at((handle_t)exec)->ctx};
  struct xgraph *y = snapshot((handle_t)graph, &in, &rc);
  if (!y) {
    if (rc != E_INVALID_VALUE) return rc;
    info->result = in.result == INST_MULTIPLE_CTXS ? UPD_UNSUPPORTED_FUNCTION_CHANGE : UPD_TOPOLOGY_CHANGED;
    info->errorNode = (CUgraphNode)in.err_node;
    return E_GRAPH_EXEC_UPDATE_FAILURE;
  }
  struct upd u = {UPD_SUCCESS, 0};
  if (!updatable(x->g, y, &u)) {
    info->result = u.result;
    info->errorNode = (CUgraphNode)u.node;
    free_xgraph(y);
    return E_GRAPH_EXEC_UPDATE_FAILURE;
  }
  take_params(x->g, y);
  free_xgraph(y);
  x->owns = (handle_t)graph;       /* the graph it was updated with: no more the one it had */
  if (memory) own(gd, (handle_t)exec, x);
  return OK;
}

/* The 10.2 ABI (the error node and the result through two pointers), what a handle pinned before 12.0 asks
 * for: the 12.0 one, its answer copied out. */
static CUresult cuGraphExecUpdate(CUgraphExec exec, CUgraph graph, CUgraphNode *error_node,
                                  int *result) {   /* CUgraphExecUpdateResult * */
  if (!error_node || !result) return E_INVALID_VALUE;
  CUgraphExecUpdateResultInfo info;
  memset(&info, 0, sizeof info);
  CUresult rc = cuGraphExecUpdate_v2(exec, graph, &info);
  *error_node = info.errorNode;
  *result = info.result;
  return rc;
}

static struct xnode *xnode_of(struct xgraph *x, handle_t orig) {
  for (size_t i = 0; x && i < x->n; i++) {
    struct xnode *n = &x->nodes[i];
    if (n->orig == orig) return n;
    struct xnode *m = n->type == N_GRAPH ? xnode_of(n->child, orig) : NULL;
    for (unsigned b = 0; !m && n->type == N_CONDITIONAL && b < n->cond.size; b++) m = xnode_of(n->cond.body[b], orig);
    if (m) return m;
  }
  return NULL;
}

static CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node,
                                                  const CUDA_KERNEL_NODE_PARAMS *params) {
  ENTER("cuGraphExecKernelNodeSetParams");
  CUresult rc;
  struct gexec *x = exec_of(exec, &rc);
  if (!x) return rc;
  struct xnode *n = xnode_of(x->g, (handle_t)node);
  if (!n) return node_of(node, &rc) ? E_INVALID_VALUE : rc;   /* not of this executable graph */
  if (n->type != N_KERNEL) return E_INVALID_VALUE;
  struct kparams *kp;
  handle_t ctx;
  TRY(make_kparams(params, &kp, &ctx));
  if (ctx != n->ctx) { free_kparams(kp); return E_INVALID_VALUE; }   /* the function's context cannot change */
  free_kparams(n->p.k);
  n->p.k = kp;
  return OK;
}

/* ------------------------------------------------------------------ the picture */
static const char *type_name(int t) {
  switch (t) {
  case N_KERNEL: return "KERNEL";
  case N_MEMCPY: return "MEMCPY";
  case N_MEMSET: return "MEMSET";
  case N_HOST: return "HOST";
  case N_GRAPH: return "GRAPH";
  case N_EMPTY: return "EMPTY";
  case N_WAIT_EVENT: return "WAIT_EVENT";
  case N_EVENT_RECORD: return "EVENT_RECORD";
  case N_MEM_ALLOC: return "MEM_ALLOC";
  case N_MEM_FREE: return "MEM_FREE";
  case N_CONDITIONAL: return "CONDITIONAL";
  default: return "UNKNOWN";
  }
}

#define DOT_VERBOSE 1u
#define DOT_KERNEL_NODE_PARAMS 4u
#define DOT_HANDLES 1024u

/* Graph h as DOT (subgraph clusters for bodies and child graphs).  Of CUgraphDebugDot_flags the fake
 * honours VERBOSE (everything below), KERNEL_NODE_PARAMS (a kernel's launch dimensions) and HANDLES (each
 * node's handle); the others add nothing. */
static void dot_graph(FILE *f, handle_t h, unsigned flags) {
  unsigned params = flags & (DOT_VERBOSE | DOT_KERNEL_NODE_PARAMS), handles = flags & (DOT_VERBOSE | DOT_HANDLES);
  struct gdata *g = side_of(h, TAG_GRAPH);
  size_t id = slot_of(h);
  fprintf(f, "subgraph cluster_%zu {\nlabel=\"graph_%zu\" graph[style=\"dashed\"];\n", id, id);
  for (size_t i = 0; g && i < g->n; i++) {
    struct gnode *n = side_of(g->nodes[i], TAG_NODE);
    fprintf(f, "\"graph_%zu_node_%zu\"[style=\"solid\" shape=\"rectangle\" label=\"%zu\n%s", id, i, i,
            type_name(n->type));
    if (n->type == N_KERNEL) {
      fprintf(f, "\n%s", n->p.k->name);
      if (params) fprintf(f, "\n\\<\\<\\<(%u,%u,%u),(%u,%u,%u),%u\\>\\>\\>", n->p.k->grid[0], n->p.k->grid[1],
                           n->p.k->grid[2], n->p.k->block[0], n->p.k->block[1], n->p.k->block[2], n->p.k->shared);
    }
    if (handles) fprintf(f, "\n%#llx", (unsigned long long)g->nodes[i]);
    fprintf(f, "\n\"];\n");
  }
  for (size_t i = 0; g && i < g->n; i++) {
    struct gnode *n = side_of(g->nodes[i], TAG_NODE);
    for (size_t d = 0; d < n->ndeps; d++) {
      size_t j = 0;
      while (j < g->n && g->nodes[j] != n->deps[d]) j++;
      fprintf(f, "\"graph_%zu_node_%zu\" -> \"graph_%zu_node_%zu\";\n", id, j, id, i);
    }
  }
  for (size_t i = 0; g && i < g->n; i++) {
    struct gnode *n = side_of(g->nodes[i], TAG_NODE);
    if (n->type == N_GRAPH) dot_graph(f, n->child, flags);
    for (unsigned b = 0; n->type == N_CONDITIONAL && b < n->cond.size; b++) dot_graph(f, n->cond.body[b], flags);
  }
  fprintf(f, "}\n");
}

static CUresult cuGraphDebugDotPrint(CUgraph graph, const char *path, unsigned int flags) {
  ENTER("cuGraphDebugDotPrint");
  NEED(path);
  CUresult rc;
  if (!graph_of(graph, &rc)) return rc;
  FILE *f = fopen(path, "w");
  if (!f) return E_OPERATING_SYSTEM;
  fprintf(f, "digraph dot {\n");
  dot_graph(f, (handle_t)graph, flags);
  fprintf(f, "}\n");
  fclose(f);
  return OK;
}

/* ------------------------------------------------------------------ stream capture: state */
struct cseq { int live, invalid, mode; unsigned long long id; handle_t graph; pthread_t thread; unsigned origin;
              unsigned long long ctx_id; };
struct cmember { int live, seq; unsigned uid; size_t ndeps, cap; handle_t *deps; };
struct cevent { int live, seq; unsigned long long seq_id; handle_t event; unsigned long long ctx_id; size_t ndeps;
                handle_t *deps; };
#define MAX_SEQS 64
#define MAX_MEMBERS 256
#define MAX_CEVENTS 256
static struct cseq seqs[MAX_SEQS];
static struct cmember members[MAX_MEMBERS];
static struct cevent cevents[MAX_CEVENTS];
static int nlive_members, nlive_seqs, nlive_cevents;   /* written under mu, read atomically without it */
static unsigned long long capture_ids;

static int counted(const int *n) { return __atomic_load_n(n, __ATOMIC_RELAXED); }
static void count(int *n, int delta) { __atomic_add_fetch(n, delta, __ATOMIC_RELAXED); }

static struct cmember *member_of_uid(unsigned uid) {
  if (!uid || !nlive_members) return NULL;
  for (int i = 0; i < MAX_MEMBERS; i++) if (members[i].live && members[i].uid == uid) return &members[i];
  return NULL;
}

static int capturing_member_uid(unsigned uid) { return member_of_uid(uid) != NULL; }

/* The stream state of a stream argument without making the call (no records; 0 when unknown). */
static unsigned peek_uid(CUstream h) {
  struct obj *c = obj_at(top());
  if (!c || !c->alive || c->kind != K_CTX) return 0;
  if (!is_default_stream(h)) {
    struct obj *s = obj_at((handle_t)h);
    return s && s->alive && s->kind == K_STREAM ? s->u.s.uid : 0;
  }
  if ((handle_t)h == PER_THREAD_STREAM) return state_of(h, c, NULL);
  return c->u.c.legacy;
}

static void end_members(int seq) {
  for (int i = 0; i < MAX_MEMBERS; i++) {
    if (members[i].live && members[i].seq == seq) {
      free(members[i].deps);
      memset(&members[i], 0, sizeof members[i]);
      count(&nlive_members, -1);
    }
  }
}

static void invalidate(int seq) { if (seqs[seq].live) seqs[seq].invalid = 1; }

/* A capturing blocking stream (or per-thread stream) of the context whose legacy stream is legacy. */
static int legacy_conflict(unsigned legacy, int do_invalidate) {
  int hit = 0;
  if (!legacy || !nlive_members) return 0;
  for (int i = 0; i < MAX_MEMBERS; i++) {
    struct cmember *m = &members[i];
    if (!m->live || seqs[m->seq].invalid) continue;
    struct sstate *st = &sst[m->uid];
    if (st->kind == ST_BLOCKING && st->legacy == legacy) {
      hit = 1;
      if (do_invalidate) invalidate(m->seq);
    }
  }
  return hit;
}

/* Is this thread prohibited from potentially unsafe calls (see the top)?  Invalidates the captures that
 * prohibit them when do_invalidate. */
static int unsafe_prohibited(int do_invalidate) {
  int hit = 0;
  pthread_t me = pthread_self();
  for (int i = 0; i < MAX_SEQS; i++) {
    struct cseq *s = &seqs[i];
    if (!s->live) continue;
    int mine = pthread_equal(s->thread, me);
    if ((mine && s->mode != MODE_RELAXED) || (!mine && s->mode == MODE_GLOBAL)) {
      hit = 1;
      if (do_invalidate) s->invalid = 1;
    }
  }
  return hit;
}

static int any_capture(void) { for (int i = 0; i < MAX_SEQS; i++) if (seqs[i].live) return 1; return 0; }

/* Add node h after member m's dependencies; m then depends on h alone. */
static CUresult member_depends_on(struct cmember *m, handle_t h) {
  if (m->cap < 1) {
    handle_t *grown = realloc(m->deps, 4 * sizeof *grown);
    if (!grown) return E_OUT_OF_MEMORY;
    m->deps = grown;
    m->cap = 4;
  }
  m->deps[0] = h;
  m->ndeps = 1;
  return OK;
}

/* ------------------------------------------------------------------ stream capture: the calls */
static CUresult cuStreamBeginCapture_v2(CUstream stream, int mode) {
  ENTER("cuStreamBeginCapture");
  NEED(mode == MODE_GLOBAL || mode == MODE_THREAD_LOCAL || mode == MODE_RELAXED);
  struct queue q;
  struct obj *c;
  TRY(use_queue(stream, &q, &c));
  if (!q.named && (handle_t)stream != PER_THREAD_STREAM) return E_CAPTURE_UNSUPPORTED;   /* the legacy stream */
  if (!q.uid) return E_OUT_OF_MEMORY;
  if (member_of_uid(q.uid)) return E_ILLEGAL_STATE;
  int s = 0, m = 0;
  while (s < MAX_SEQS && seqs[s].live) s++;
  while (m < MAX_MEMBERS && members[m].live) m++;
  if (s == MAX_SEQS || m == MAX_MEMBERS) return E_OUT_OF_MEMORY;
  struct obj *g = new_graph_obj(0, NULL);
  if (!g) return E_OUT_OF_MEMORY;
  struct cseq *sq = &seqs[s];
  memset(sq, 0, sizeof *sq);
  sq->live = 1;
  sq->mode = mode;
  sq->id = ++capture_ids;
  sq->graph = g->h;
  sq->thread = pthread_self();
  sq->origin = q.uid;
  sq->ctx_id = c->u.c.id;
  memset(&members[m], 0, sizeof members[m]);
  members[m].live = 1;
  members[m].seq = s;
  members[m].uid = q.uid;
  count(&nlive_members, 1);
  count(&nlive_seqs, 1);
  return OK;
}

/* Is node x of graph g an ancestor of (or one of) the nodes in set? */
static int reaches(struct gdata *g, handle_t x, const handle_t *set, size_t n, int depth) {
  if (depth > 4096) return 0;
  for (size_t i = 0; i < n; i++) {
    if (set[i] == x) return 1;
    struct gnode *s = side_of(set[i], TAG_NODE);
    if (s && reaches(g, x, s->deps, s->ndeps, depth + 1)) return 1;
  }
  return 0;
}

static CUresult cuStreamEndCapture(CUstream stream, CUgraph *out) {
  ENTER("cuStreamEndCapture");
  NEED(out);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  struct cmember *m = member_of_uid(q.uid);
  if (!m) return E_ILLEGAL_STATE;
  int s = m->seq;
  struct cseq *sq = &seqs[s];
  if (sq->origin != q.uid) { sq->invalid = 1; return E_CAPTURE_UNMATCHED; }
  if (sq->mode != MODE_RELAXED && !pthread_equal(sq->thread, pthread_self())) return E_CAPTURE_WRONG_THREAD;
  *out = NULL;
  CUresult rc = OK;
  if (sq->invalid) {
    rc = E_CAPTURE_INVALIDATED;
  } else {
    struct gdata *g = side_of(sq->graph, TAG_GRAPH);
    for (int i = 0; i < MAX_MEMBERS && rc == OK; i++) {
      struct cmember *o = &members[i];
      if (!o->live || o->seq != s || o == m) continue;
      for (size_t d = 0; d < o->ndeps && rc == OK; d++)
        if (!reaches(g, o->deps[d], m->deps, m->ndeps, 0)) rc = E_CAPTURE_UNJOINED;
    }
  }
  end_members(s);
  if (rc == OK) *out = (CUgraph)sq->graph;
  else destroy_graph_obj(sq->graph);
  sq->live = 0;
  count(&nlive_seqs, -1);
  return rc;
}

static CUresult cuStreamIsCapturing(CUstream stream, int *status) {
  ENTER("cuStreamIsCapturing");
  NEED(status);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  struct cmember *m = member_of_uid(q.uid);
  *status = !m ? 0 : seqs[m->seq].invalid ? 2 : 1;
  return OK;
}

static CUresult cuStreamGetCaptureInfo_v3(CUstream stream, int *status, cuuint64_t *id, CUgraph *graph,
                                          const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *ndeps) {
  ENTER("cuStreamGetCaptureInfo");
  NEED(status);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  struct cmember *m = member_of_uid(q.uid);
  *status = !m ? 0 : seqs[m->seq].invalid ? 2 : 1;
  if (id) *id = m ? seqs[m->seq].id : 0;
  if (graph) *graph = m ? (CUgraph)seqs[m->seq].graph : NULL;
  if (deps) *deps = m ? (const CUgraphNode *)m->deps : NULL;
  if (edges) *edges = NULL;
  if (ndeps) *ndeps = m ? m->ndeps : 0;
  return OK;
}

/* The 11.3 ABI (no edge data), what a handle pinned to 11.3-12.2 asks for: the 12.3 one without it. */
static CUresult cuStreamGetCaptureInfo_v2(CUstream stream, int *status, cuuint64_t *id, CUgraph *graph,
                                          const CUgraphNode **deps, size_t *ndeps) {
  return cuStreamGetCaptureInfo_v3(stream, status, id, graph, deps, NULL, ndeps);
}

/* ------------------------------------------------------------------ stream capture: the wrappers
 * route(): whether a call on stream h is a capture's business (without entering the call).  The
 * wrapper then enters the call and asks capture_of() for the member, answering for an invalidated
 * capture or an implicit dependency on one. */
static int route(CUstream h) {
  if (!counted(&nlive_members)) return 0;
  pthread_mutex_lock(&mu);
  int hit = 0;
  if (nlive_members) {
    unsigned uid = peek_uid(h);
    struct obj *c = obj_at(top());
    hit = member_of_uid(uid) != NULL ||
          (!is_default_stream(h) ? 0 : (handle_t)h != PER_THREAD_STREAM && c && c->alive && c->kind == K_CTX &&
                                       legacy_conflict(c->u.c.legacy, 0));
  }
  pthread_mutex_unlock(&mu);
  return hit;
}

/* Under the lock: the capturing member of stream h, NULL with *rc set when the call must fail (or when
 * no capture is involved any more: *rc = -1, the caller does the work itself). */
static struct cmember *capture_of(CUstream h, struct queue *q, CUresult *rc) {
  struct obj *c;
  *rc = use_queue(h, q, &c);
  if (*rc != OK) return NULL;
  struct cmember *m = member_of_uid(q->uid);
  if (!m) {
    if (!q->named && (handle_t)h != PER_THREAD_STREAM && legacy_conflict(c->u.c.legacy, 1)) {
      *rc = E_CAPTURE_IMPLICIT;
      return NULL;
    }
    *rc = -1;
    return NULL;
  }
  if (seqs[m->seq].invalid) { *rc = E_CAPTURE_INVALIDATED; return NULL; }
  return m;
}

/* A call on a capturing stream that is not modelled: refused, and the capture invalidated. */
static CUresult unsupported_in_capture(struct cmember *m) {
  invalidate(m->seq);
  return E_CAPTURE_UNSUPPORTED;
}

/* Capture the work of a call on stream as a node made by add (its graph and dependencies given). */
#define CAPTURED_CALL(CALL, STREAM, ORIGINAL, ADD)                                   \
  do {                                                                                \
    if (!route(STREAM)) return ORIGINAL;                                              \
    ENTER(CALL);                                                                      \
    struct queue q_;                                                                  \
    CUresult rc_;                                                                     \
    struct cmember *m_ = capture_of(STREAM, &q_, &rc_);                               \
    if (!m_) {                                                                        \
      if (rc_ != (CUresult)-1) return rc_;                                            \
      pthread_mutex_unlock(&mu); /* the capture ended meanwhile: the work itself */   \
      held_ = 0;                                                                      \
      return ORIGINAL;                                                                \
    }                                                                                 \
    CUgraph g_ = (CUgraph)seqs[m_->seq].graph;                                        \
    CUgraphNode node_ = NULL;                                                         \
    rc_ = (ADD);                                                                      \
    if (rc_ != OK) { invalidate(m_->seq); return rc_; }                               \
    return member_depends_on(m_, (handle_t)node_);                                    \
  } while (0)
#define DEPS_ (const CUgraphNode *)m_->deps, m_->ndeps

static CUresult captured_kernel(CUfunction f, const struct launch *L, CUgraph g, const CUgraphNode *deps,
                                size_t ndeps, CUgraphNode *node) {
  struct obj *fn;
  TRY(func_arg(f, &fn));
  CUDA_KERNEL_NODE_PARAMS p = {f, L->grid[0], L->grid[1], L->grid[2], L->block[0], L->block[1], L->block[2],
                               L->shared_mem, L->params, L->extra, NULL, NULL};
  struct kparams *kp;
  handle_t ctx;
  TRY(make_kparams(&p, &kp, &ctx));
  struct gnode *n;
  handle_t h;
  CUresult rc = new_node(g, N_KERNEL, deps, ndeps, &n, &h);
  if (rc != OK) { free_kparams(kp); return rc; }
  n->p.k = kp;
  n->ctx = ctx;
  *node = (CUgraphNode)h;
  return OK;
}

static CUresult captured_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                        unsigned by, unsigned bz, unsigned shmem, CUstream stream, void **params,
                                        void **extra) {
  struct launch L = {{gx, gy, gz}, {bx, by, bz}, stream, params, extra, shmem};
  CAPTURED_CALL("cuLaunchKernel", stream, cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra),
                captured_kernel(f, &L, g_, DEPS_, &node_));
}

static CUresult captured_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
  if (!config) return cuLaunchKernelEx(config, f, params, extra);
  struct launch L = {{config->gridDimX, config->gridDimY, config->gridDimZ},
                     {config->blockDimX, config->blockDimY, config->blockDimZ}, config->hStream, params, extra,
                     config->sharedMemBytes};
  CAPTURED_CALL("cuLaunchKernelEx", config->hStream, cuLaunchKernelEx(config, f, params, extra),
                captured_kernel(f, &L, g_, DEPS_, &node_));
}

static CUresult captured_cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                                   unsigned by, unsigned bz, unsigned shmem, CUstream stream,
                                                   void **params) {
  struct launch L = {{gx, gy, gz}, {bx, by, bz}, stream, params, NULL, shmem};
  CAPTURED_CALL("cuLaunchCooperativeKernel", stream,
                cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params),
                captured_kernel(f, &L, g_, DEPS_, &node_));
}

static CUresult captured_copy(int dst_type, void *dst_host, CUdeviceptr dst, int src_type, const void *src_host,
                              CUdeviceptr src, size_t n, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                              CUgraphNode *node) {
  CUDA_MEMCPY3D c;
  memset(&c, 0, sizeof c);
  c.srcMemoryType = src_type; c.srcHost = src_host; c.srcDevice = src;
  c.dstMemoryType = dst_type; c.dstHost = dst_host; c.dstDevice = dst;
  c.WidthInBytes = n; c.Height = 1; c.Depth = 1;
  TRY(check_copy(&c));
  struct obj *ctx;
  TRY(cur_ctx(&ctx));
  struct gnode *nd;
  handle_t h;
  TRY(new_node(g, N_MEMCPY, deps, ndeps, &nd, &h));
  nd->p.cp = c;
  nd->ctx = ctx->h;
  *node = (CUgraphNode)h;
  return OK;
}

static CUresult captured_cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream stream) {
  CAPTURED_CALL("cuMemcpyHtoDAsync", stream, cuMemcpyHtoDAsync_v2(dst, src, n, stream),
                captured_copy(2, NULL, dst, 1, src, 0, n, g_, DEPS_, &node_));
}

static CUresult captured_cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream stream) {
  CAPTURED_CALL("cuMemcpyDtoHAsync", stream, cuMemcpyDtoHAsync_v2(dst, src, n, stream),
                captured_copy(1, dst, 0, 2, NULL, src, n, g_, DEPS_, &node_));
}

static CUresult captured_cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
  CAPTURED_CALL("cuMemcpyDtoDAsync", stream, cuMemcpyDtoDAsync_v2(dst, src, n, stream),
                captured_copy(2, NULL, dst, 2, NULL, src, n, g_, DEPS_, &node_));
}

static CUresult captured_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
  CAPTURED_CALL("cuMemcpyAsync", stream, cuMemcpyAsync(dst, src, n, stream),
                captured_copy(4, NULL, dst, 4, NULL, src, n, g_, DEPS_, &node_));
}

static CUresult captured_memset(CUdeviceptr dst, unsigned value, unsigned elem, size_t n, CUgraph g,
                                const CUgraphNode *deps, size_t ndeps, CUgraphNode *node) {
  if (n == 0) return E_INVALID_VALUE;   /* (no empty memset node) */
  CUDA_MEMSET_NODE_PARAMS p = {dst, 0, value, elem, n, 1};
  TRY(check_memset(&p));
  struct obj *ctx;
  TRY(cur_ctx(&ctx));
  struct gnode *nd;
  handle_t h;
  TRY(new_node(g, N_MEMSET, deps, ndeps, &nd, &h));
  struct mset m = {dst, 0, value, elem, n, 1};
  nd->p.ms = m;
  nd->ctx = ctx->h;
  *node = (CUgraphNode)h;
  return OK;
}

static CUresult captured_cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream stream) {
  CAPTURED_CALL("cuMemsetD8Async", stream, cuMemsetD8Async(dst, v, n, stream),
                captured_memset(dst, v, 1, n, g_, DEPS_, &node_));
}

static CUresult captured_cuMemsetD16Async(CUdeviceptr dst, unsigned short v, size_t n, CUstream stream) {
  CAPTURED_CALL("cuMemsetD16Async", stream, cuMemsetD16Async(dst, v, n, stream),
                captured_memset(dst, v, 2, n, g_, DEPS_, &node_));
}

static CUresult captured_cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, CUstream stream) {
  CAPTURED_CALL("cuMemsetD32Async", stream, cuMemsetD32Async(dst, v, n, stream),
                captured_memset(dst, v, 4, n, g_, DEPS_, &node_));
}

static CUresult captured_alloc(CUdeviceptr *dptr, size_t size, struct obj *pool, CUgraph g, const CUgraphNode *deps,
                               size_t ndeps, CUgraphNode *node) {
  NEED(dptr && size);
  struct obj *c;
  TRY(cur_ctx(&c));
  CUdeviceptr p;
  TRY(graph_alloc(size, pool ? pool->dev : c->dev, &p));
  struct gnode *nd;
  handle_t h;
  CUresult rc = new_node(g, N_MEM_ALLOC, deps, ndeps, &nd, &h);
  if (rc != OK) { galloc_ref(p, -1); return rc; }
  nd->p.alloc.dptr = p;
  nd->p.alloc.bytes = size;
  nd->p.alloc.dev = pool ? pool->dev : c->dev;
  *dptr = p;
  *node = (CUgraphNode)h;
  return OK;
}

static CUresult captured_cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream) {
  CAPTURED_CALL("cuMemAllocAsync", stream, cuMemAllocAsync(dptr, size, stream),
                captured_alloc(dptr, size, NULL, g_, DEPS_, &node_));
}

static CUresult captured_alloc_from(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUgraph g,
                                    const CUgraphNode *deps, size_t ndeps, CUgraphNode *node) {
  CUresult rc;
  struct obj *p = get(pool, K_POOL, &rc);
  if (!p) return rc;
  return captured_alloc(dptr, size, p, g, deps, ndeps, node);
}

static CUresult captured_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream) {
  CAPTURED_CALL("cuMemAllocFromPoolAsync", stream, cuMemAllocFromPoolAsync(dptr, size, pool, stream),
                captured_alloc_from(dptr, size, pool, g_, DEPS_, &node_));
}

static CUresult captured_free(CUdeviceptr dptr, CUgraph g, const CUgraphNode *deps, size_t ndeps, CUgraphNode *node) {
  if (!is_graph_alloc(dptr)) return find_alloc(dptr, 0) ? E_CAPTURE_UNSUPPORTED : stale(E_INVALID_VALUE);
  struct gnode *nd;
  handle_t h;
  TRY(new_node(g, N_MEM_FREE, deps, ndeps, &nd, &h));
  nd->p.free_ptr = dptr;
  *node = (CUgraphNode)h;
  return OK;
}

/* cuMemFreeAsync / cuMemFree outside a capture of a graph allocation: only a live one (see "graph allocations"). */
static CUresult free_graph_alloc(const char *call, CUdeviceptr dptr, CUstream stream) {
  ENTER(call);
  struct galloc *g = galloc_of(dptr);
  if (!g || !g->live) return E_INVALID_VALUE;
  if (stream != (CUstream)-1) {
    struct queue q;
    TRY(use_queue(stream, &q, NULL));
    enqueue(q.uid);
  }
  galloc_live(dptr, 0);
  return OK;
}

static CUresult graph_or_pool_free_async(CUdeviceptr dptr, CUstream stream) {
  return galloc_of(dptr) ? free_graph_alloc("cuMemFreeAsync", dptr, stream) : cuMemFreeAsync(dptr, stream);
}

static CUresult captured_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
  CAPTURED_CALL("cuMemFreeAsync", stream, graph_or_pool_free_async(dptr, stream),
                captured_free(dptr, g_, DEPS_, &node_));
}

static CUresult captured_host(CUhostFn fn, void *data, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                              CUgraphNode *node) {
  NEED(fn);
  struct gnode *nd;
  handle_t h;
  TRY(new_node(g, N_HOST, deps, ndeps, &nd, &h));
  nd->p.host.fn = fn;
  nd->p.host.data = data;
  *node = (CUgraphNode)h;
  return OK;
}

static CUresult captured_cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *data) {
  CAPTURED_CALL("cuLaunchHostFunc", stream, launch_host_fn(stream, fn, data),
                captured_host(fn, data, g_, DEPS_, &node_));
}

static struct cevent *cevent_of(handle_t event) {
  struct obj *e = obj_at(event);
  if (!e || !e->alive || e->kind != K_EVENT) return NULL;
  struct obj *c = obj_at(e->ctx);
  unsigned long long ctx_id = c && c->alive ? c->u.c.id : 0;
  for (int i = 0; i < MAX_CEVENTS; i++)
    if (cevents[i].live && cevents[i].event == event && cevents[i].ctx_id == ctx_id) return &cevents[i];
  return NULL;
}

static void forget_cevent(handle_t event) {
  for (int i = 0; i < MAX_CEVENTS; i++)
    if (cevents[i].live && cevents[i].event == event) {
      free(cevents[i].deps);
      memset(&cevents[i], 0, sizeof cevents[i]);
      count(&nlive_cevents, -1);
    }
}

/* cuEventRecord on a capturing stream: the event stands for the stream's capture dependencies now. */
static CUresult captured_cuEventRecord(CUevent event, CUstream stream) {
  if (counted(&nlive_cevents)) {   /* recorded again: what it stood for in a capture is gone */
    pthread_mutex_lock(&mu);
    forget_cevent((handle_t)event);
    pthread_mutex_unlock(&mu);
  }
  if (!route(stream)) return cuEventRecord(event, stream);
  ENTER("cuEventRecord");
  struct queue q;
  CUresult rc;
  struct cmember *m = capture_of(stream, &q, &rc);
  if (!m) {
    if (rc != (CUresult)-1) return rc;
    pthread_mutex_unlock(&mu);
    held_ = 0;
    return cuEventRecord(event, stream);
  }
  struct obj *e = get(event, K_EVENT, &rc);
  if (!e) return rc;
  int i = 0;
  while (i < MAX_CEVENTS && cevents[i].live) i++;
  if (i == MAX_CEVENTS) return E_OUT_OF_MEMORY;
  struct cevent *ce = &cevents[i];
  ce->deps = malloc((m->ndeps ? m->ndeps : 1) * sizeof *ce->deps);
  if (!ce->deps) return E_OUT_OF_MEMORY;
  memcpy(ce->deps, m->deps, m->ndeps * sizeof *ce->deps);
  ce->ndeps = m->ndeps;
  ce->live = 1;
  count(&nlive_cevents, 1);
  ce->seq = m->seq;
  ce->seq_id = seqs[m->seq].id;
  ce->event = e->h;
  struct obj *c = obj_at(e->ctx);
  ce->ctx_id = c && c->alive ? c->u.c.id : 0;
  return OK;
}

static CUresult captured_cuEventDestroy_v2(CUevent event) {
  if (counted(&nlive_cevents)) {
    pthread_mutex_lock(&mu);
    forget_cevent((handle_t)event);
    pthread_mutex_unlock(&mu);
  }
  return cuEventDestroy_v2(event);
}

/* cuStreamWaitEvent: a captured event's dependencies join the waiting stream (which joins the capture);
 * a capturing stream cannot wait for an event recorded outside the capture (strict, see the top). */
static CUresult captured_cuStreamWaitEvent(CUstream stream, CUevent event, unsigned flags) {
  int captured = 0;
  if (counted(&nlive_cevents)) {
    pthread_mutex_lock(&mu);
    struct cevent *probe = cevent_of((handle_t)event);
    captured = probe && seqs[probe->seq].live && seqs[probe->seq].id == probe->seq_id;
    pthread_mutex_unlock(&mu);
  }
  if (!captured && !route(stream)) return cuStreamWaitEvent(stream, event, flags);
  ENTER("cuStreamWaitEvent");
  NEED((flags & ~1u) == 0);
  struct queue q;
  CUresult rc;
  struct cmember *m = capture_of(stream, &q, &rc);
  struct cevent *ce = cevent_of((handle_t)event);
  if (ce && !(seqs[ce->seq].live && seqs[ce->seq].id == ce->seq_id)) ce = NULL;
  if (!m && rc != (CUresult)-1) return rc;
  if (!ce) {
    if (m) return unsupported_in_capture(m);
    pthread_mutex_unlock(&mu);
    held_ = 0;
    return cuStreamWaitEvent(stream, event, flags);
  }
  if (seqs[ce->seq].invalid) return E_CAPTURE_INVALIDATED;
  if (m && m->seq != ce->seq) { invalidate(m->seq); invalidate(ce->seq); return E_CAPTURE_MERGE; }
  if (!m) {   /* the stream joins the capture (a fork) */
    int i = 0;
    while (i < MAX_MEMBERS && members[i].live) i++;
    if (i == MAX_MEMBERS || !q.uid) return E_OUT_OF_MEMORY;
    m = &members[i];
    memset(m, 0, sizeof *m);
    m->live = 1;
    m->seq = ce->seq;
    m->uid = q.uid;
    count(&nlive_members, 1);
  }
  size_t need = m->ndeps + ce->ndeps;
  if (need > m->cap) {
    handle_t *grown = realloc(m->deps, need * sizeof *grown);
    if (!grown) return E_OUT_OF_MEMORY;
    m->deps = grown;
    m->cap = need;
  }
  for (size_t i = 0; i < ce->ndeps; i++) {
    size_t j = 0;
    while (j < m->ndeps && m->deps[j] != ce->deps[i]) j++;
    if (j == m->ndeps) m->deps[m->ndeps++] = ce->deps[i];
  }
  return OK;
}

/* Calls on a capturing stream that are not modelled, or that wait for it: refused, capture invalidated. */
#define REFUSED_IN_CAPTURE(CALL, STREAM, ORIGINAL)                                   \
  do {                                                                                \
    if (!route(STREAM)) return ORIGINAL;                                              \
    ENTER(CALL);                                                                      \
    struct queue q_;                                                                  \
    CUresult rc_;                                                                     \
    struct cmember *m_ = capture_of(STREAM, &q_, &rc_);                               \
    if (!m_) {                                                                        \
      if (rc_ != (CUresult)-1) return rc_;                                            \
      pthread_mutex_unlock(&mu);                                                      \
      held_ = 0;                                                                      \
      return ORIGINAL;                                                                \
    }                                                                                 \
    return unsupported_in_capture(m_);                                                \
  } while (0)

static CUresult captured_cuStreamSynchronize(CUstream stream) {
  run_host_work();
  REFUSED_IN_CAPTURE("cuStreamSynchronize", stream, cuStreamSynchronize(stream));
}

static CUresult captured_cuStreamQuery(CUstream stream) {
  run_host_work();
  REFUSED_IN_CAPTURE("cuStreamQuery", stream, cuStreamQuery(stream));
}

static CUresult captured_cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *c, CUstream stream) {
  REFUSED_IN_CAPTURE("cuMemcpy2DAsync", stream, cuMemcpy2DAsync_v2(c, stream));
}

static CUresult captured_cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *c, CUstream stream) {
  REFUSED_IN_CAPTURE("cuMemcpy3DAsync", stream, cuMemcpy3DAsync_v2(c, stream));
}

static CUresult captured_cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
                                           size_t n, CUstream stream) {
  REFUSED_IN_CAPTURE("cuMemcpyPeerAsync", stream, cuMemcpyPeerAsync(dst, dctx, src, sctx, n, stream));
}

static CUresult captured_cuMemPrefetchAsync_v2(CUdeviceptr ptr, size_t n, unsigned long long location,
                                               unsigned flags, CUstream stream) {
  REFUSED_IN_CAPTURE("cuMemPrefetchAsync", stream, cuMemPrefetchAsync_v2(ptr, n, location, flags, stream));
}

#define MEMSET_2D_REFUSED(NAME, CALL, T)                                                                    \
  static CUresult captured_##NAME(CUdeviceptr dst, size_t pitch, T value, size_t w, size_t h, CUstream stream) { \
    REFUSED_IN_CAPTURE(CALL, stream, NAME(dst, pitch, value, w, h, stream));                                  \
  }
MEMSET_2D_REFUSED(cuMemsetD2D8Async, "cuMemsetD2D8Async", unsigned char)
MEMSET_2D_REFUSED(cuMemsetD2D16Async, "cuMemsetD2D16Async", unsigned short)
MEMSET_2D_REFUSED(cuMemsetD2D32Async, "cuMemsetD2D32Async", unsigned int)

/* Potentially unsafe calls (see the top): refused while the capture modes prohibit them in this thread;
 * synchronous copies and memsets also meet the legacy stream's implicit dependency on a capture. */
static int refused_unsafe(const char *call, int legacy_work, CUresult *rc) {
  if (!counted(&nlive_seqs)) return 0;
  pthread_mutex_lock(&mu);
  int hit = 0;
  if (any_capture()) {
    struct obj *c = obj_at(top());
    hit = unsafe_prohibited(0) ||
          (legacy_work && c && c->alive && c->kind == K_CTX && legacy_conflict(c->u.c.legacy, 0));
  }
  pthread_mutex_unlock(&mu);
  if (!hit) return 0;
  if (!enter(call, rc)) return 1;
  if (unsafe_prohibited(1)) {
    *rc = E_CAPTURE_UNSUPPORTED;
  } else {
    struct obj *c = obj_at(top());
    *rc = c && c->alive && c->kind == K_CTX && legacy_conflict(c->u.c.legacy, 1) ? E_CAPTURE_IMPLICIT : -1;
  }
  pthread_mutex_unlock(&mu);
  return *rc != (CUresult)-1;
}

#define UNSAFE(CALL, LEGACY_WORK, ORIGINAL)                   \
  do {                                                         \
    CUresult unsafe_rc_;                                       \
    if (refused_unsafe(CALL, LEGACY_WORK, &unsafe_rc_)) return unsafe_rc_; \
    return ORIGINAL;                                           \
  } while (0)

static CUresult captured_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { UNSAFE("cuMemAlloc", 0, cuMemAlloc_v2(p, n)); }
static CUresult captured_cuMemFree_v2(CUdeviceptr p) {
  UNSAFE("cuMemFree", 0, galloc_of(p) ? free_graph_alloc("cuMemFree", p, (CUstream)-1) : cuMemFree_v2(p));
}
static CUresult captured_cuMemAllocHost_v2(void **p, size_t n) { UNSAFE("cuMemAllocHost", 0, cuMemAllocHost_v2(p, n)); }
static CUresult captured_cuMemHostAlloc(void **p, size_t n, unsigned flags) {
  UNSAFE("cuMemHostAlloc", 0, cuMemHostAlloc(p, n, flags));
}
static CUresult captured_cuMemFreeHost(void *p) { UNSAFE("cuMemFreeHost", 0, cuMemFreeHost(p)); }
static CUresult captured_cuModuleUnload(CUmodule mod) { UNSAFE("cuModuleUnload", 0, cuModuleUnload(mod)); }
static CUresult captured_cuGraphExecDestroy(CUgraphExec exec) {
  UNSAFE("cuGraphExecDestroy", 0, cuGraphExecDestroy(exec));
}
static CUresult captured_cuCtxSynchronize_v2(CUcontext ctx) {
  run_host_work();
  UNSAFE("cuCtxSynchronize", 0, cuCtxSynchronize_v2(ctx));
}
static CUresult captured_cuEventSynchronize(CUevent event) { run_host_work(); return cuEventSynchronize(event); }
static CUresult captured_cuEventQuery(CUevent event) { run_host_work(); return cuEventQuery(event); }
static CUresult captured_cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  UNSAFE("cuMemcpyHtoD", 1, cuMemcpyHtoD_v2(dst, src, n));
}
static CUresult captured_cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  UNSAFE("cuMemcpyDtoH", 1, cuMemcpyDtoH_v2(dst, src, n));
}
static CUresult captured_cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  UNSAFE("cuMemcpyDtoD", 1, cuMemcpyDtoD_v2(dst, src, n));
}
static CUresult captured_cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  UNSAFE("cuMemcpy", 1, cuMemcpy(dst, src, n));
}
static CUresult captured_cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
  UNSAFE("cuMemsetD8", 1, cuMemsetD8_v2(dst, v, n));
}
static CUresult captured_cuMemsetD16_v2(CUdeviceptr dst, unsigned short v, size_t n) {
  UNSAFE("cuMemsetD16", 1, cuMemsetD16_v2(dst, v, n));
}
static CUresult captured_cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n) {
  UNSAFE("cuMemsetD32", 1, cuMemsetD32_v2(dst, v, n));
}

/* Each wrapper has its original's type, and the table below takes the wrapper. */
#define WRAPPED(NAME)                                                                                         \
  _Static_assert(__builtin_types_compatible_p(__typeof__(&captured_##NAME), __typeof__(&NAME)), #NAME);
WRAPPED(cuLaunchKernel)
WRAPPED(cuLaunchKernelEx)
WRAPPED(cuLaunchCooperativeKernel)
WRAPPED(cuMemcpyHtoDAsync_v2)
WRAPPED(cuMemcpyDtoHAsync_v2)
WRAPPED(cuMemcpyDtoDAsync_v2)
WRAPPED(cuMemcpyAsync)
WRAPPED(cuMemsetD8Async)
WRAPPED(cuMemsetD16Async)
WRAPPED(cuMemsetD32Async)
WRAPPED(cuMemAllocAsync)
WRAPPED(cuMemAllocFromPoolAsync)
WRAPPED(cuMemFreeAsync)
WRAPPED(cuLaunchHostFunc)
WRAPPED(cuEventRecord)
WRAPPED(cuEventDestroy_v2)
WRAPPED(cuStreamWaitEvent)
WRAPPED(cuStreamSynchronize)
WRAPPED(cuStreamQuery)
WRAPPED(cuMemcpy2DAsync_v2)
WRAPPED(cuMemcpy3DAsync_v2)
WRAPPED(cuMemcpyPeerAsync)
WRAPPED(cuMemPrefetchAsync_v2)
WRAPPED(cuMemsetD2D8Async)
WRAPPED(cuMemsetD2D16Async)
WRAPPED(cuMemsetD2D32Async)
WRAPPED(cuMemAlloc_v2)
WRAPPED(cuMemFree_v2)
WRAPPED(cuMemAllocHost_v2)
WRAPPED(cuMemHostAlloc)
WRAPPED(cuMemFreeHost)
WRAPPED(cuModuleUnload)
WRAPPED(cuGraphExecDestroy)
WRAPPED(cuCtxSynchronize_v2)
WRAPPED(cuEventSynchronize)
WRAPPED(cuEventQuery)
WRAPPED(cuMemcpyHtoD_v2)
WRAPPED(cuMemcpyDtoH_v2)
WRAPPED(cuMemcpyDtoD_v2)
WRAPPED(cuMemcpy)
WRAPPED(cuMemsetD8_v2)
WRAPPED(cuMemsetD16_v2)
WRAPPED(cuMemsetD32_v2)
#define cuLaunchKernel captured_cuLaunchKernel
#define cuLaunchKernelEx captured_cuLaunchKernelEx
#define cuLaunchCooperativeKernel captured_cuLaunchCooperativeKernel
#define cuMemcpyHtoDAsync_v2 captured_cuMemcpyHtoDAsync_v2
#define cuMemcpyDtoHAsync_v2 captured_cuMemcpyDtoHAsync_v2
#define cuMemcpyDtoDAsync_v2 captured_cuMemcpyDtoDAsync_v2
#define cuMemcpyAsync captured_cuMemcpyAsync
#define cuMemsetD8Async captured_cuMemsetD8Async
#define cuMemsetD16Async captured_cuMemsetD16Async
#define cuMemsetD32Async captured_cuMemsetD32Async
#define cuMemAllocAsync captured_cuMemAllocAsync
#define cuMemAllocFromPoolAsync captured_cuMemAllocFromPoolAsync
#define cuMemFreeAsync captured_cuMemFreeAsync
#define cuLaunchHostFunc captured_cuLaunchHostFunc
#define cuEventRecord captured_cuEventRecord
#define cuEventDestroy_v2 captured_cuEventDestroy_v2
#define cuStreamWaitEvent captured_cuStreamWaitEvent
#define cuStreamSynchronize captured_cuStreamSynchronize
#define cuStreamQuery captured_cuStreamQuery
#define cuMemcpy2DAsync_v2 captured_cuMemcpy2DAsync_v2
#define cuMemcpy3DAsync_v2 captured_cuMemcpy3DAsync_v2
#define cuMemcpyPeerAsync captured_cuMemcpyPeerAsync
#define cuMemPrefetchAsync_v2 captured_cuMemPrefetchAsync_v2
#define cuMemsetD2D8Async captured_cuMemsetD2D8Async
#define cuMemsetD2D16Async captured_cuMemsetD2D16Async
#define cuMemsetD2D32Async captured_cuMemsetD2D32Async
#define cuMemAlloc_v2 captured_cuMemAlloc_v2
#define cuMemFree_v2 captured_cuMemFree_v2
#define cuMemAllocHost_v2 captured_cuMemAllocHost_v2
#define cuMemHostAlloc captured_cuMemHostAlloc
#define cuMemFreeHost captured_cuMemFreeHost
#define cuModuleUnload captured_cuModuleUnload
#define cuGraphExecDestroy captured_cuGraphExecDestroy
#define cuCtxSynchronize_v2 captured_cuCtxSynchronize_v2
#define cuEventSynchronize captured_cuEventSynchronize
#define cuEventQuery captured_cuEventQuery
#define cuMemcpyHtoD_v2 captured_cuMemcpyHtoD_v2
#define cuMemcpyDtoH_v2 captured_cuMemcpyDtoH_v2
#define cuMemcpyDtoD_v2 captured_cuMemcpyDtoD_v2
#define cuMemcpy captured_cuMemcpy
#define cuMemsetD8_v2 captured_cuMemsetD8_v2
#define cuMemsetD16_v2 captured_cuMemsetD16_v2
#define cuMemsetD32_v2 captured_cuMemsetD32_v2

/* ------------------------------------------------------------------ control API (tests) */
/* Forget every graph, node, executable graph, capture and conditional handle (after fake_reset). */
EXPORT void fake_graph_reset(void) {
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < ngallocs; i++) gallocs[i].live = 0;   /* (what a test left allocated goes too) */
  for (size_t i = nlive; i > 0;) {
    i--;
    struct obj *o = live_obj(i);
    if (o->kind == K_GRAPH || o->kind == K_GNODE || o->kind == K_GEXEC) kill_obj(o);
    if (i > nlive) i = nlive;
  }
  for (size_t n = 0; n < nside; n++) {
    if (!side[n]) continue;
    int tag = *(int *)side[n];
    if (tag == TAG_EXEC && ((struct gexec *)side[n])->busy) continue;   /* a launch frees it */
    free_side(side[n]);
    side[n] = NULL;
  }
  for (int i = 0; i < MAX_MEMBERS; i++) free(members[i].deps);
  for (int i = 0; i < MAX_CEVENTS; i++) free(cevents[i].deps);
  memset(seqs, 0, sizeof seqs);
  memset(members, 0, sizeof members);
  memset(cevents, 0, sizeof cevents);
  nlive_members = nlive_seqs = nlive_cevents = 0;
  nconds = 0;
  ngallocs = 0;
  graph_launches = 0;
  free(hwork);                      /* queued host work of the last test never runs */
  hwork = NULL;
  nhwork = caphwork = 0;
  __atomic_store_n(&host_work_pending, 0, __ATOMIC_RELAXED);
  host_work_ran = 0;
  pthread_mutex_unlock(&mu);
}

/* Run the queued host work now (what the driver's thread does when the stream reaches it); how many
 * host calls have run since fake_graph_reset. */
EXPORT long fake_run_host_work(void) {
  run_host_work();
  return __atomic_load_n(&host_work_ran, __ATOMIC_RELAXED);
}

/* Host calls queued and not run yet. */
EXPORT long fake_host_work_pending(void) { return __atomic_load_n(&host_work_pending, __ATOMIC_RELAXED); }

/* Live objects of one of the kinds here: "graph" (bodies and child graphs included), "graph_node",
 * "graph_exec", "capture" (capture sequences), "conditional" (handles); -1 for another name. */
EXPORT long fake_graph_live(const char *kind) {
  if (!kind) return -1;
  int k = strcmp(kind, "graph") == 0 ? K_GRAPH : strcmp(kind, "graph_node") == 0 ? K_GNODE
        : strcmp(kind, "graph_exec") == 0 ? K_GEXEC : strcmp(kind, "capture") == 0 ? -2
        : strcmp(kind, "conditional") == 0 ? -3 : -1;
  if (k == -1) return -1;
  long n = 0;
  pthread_mutex_lock(&mu);
  if (k == -2) { for (int i = 0; i < MAX_SEQS; i++) n += seqs[i].live; }
  else if (k == -3) { for (size_t i = 0; i < nconds; i++) n += conds[i].live; }
  else for (size_t i = 0; i < nlive; i++) n += live_obj(i)->kind == k;
  pthread_mutex_unlock(&mu);
  return n;
}

EXPORT long fake_graph_launches(void) { pthread_mutex_lock(&mu); long n = graph_launches; pthread_mutex_unlock(&mu); return n; }

/* A conditional handle's current value (-1: no such handle). */
EXPORT long fake_conditional_value(unsigned long long handle) {
  pthread_mutex_lock(&mu);
  struct cond *cd = cond_of(handle);
  long v = cd ? (long)cd->value : -1;
  pthread_mutex_unlock(&mu);
  return v;
}
