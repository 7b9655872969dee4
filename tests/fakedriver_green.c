/*
 * Green contexts for the fake driver: device resources (cuDeviceGetDevResource, cuCtxGetDevResource,
 * cuGreenCtxGetDevResource), SM splits (cuDevSmResourceSplitByCount), descriptors
 * (cuDevResourceGenerateDesc), green contexts (cuGreenCtxCreate, cuGreenCtxDestroy, cuCtxFromGreenCtx) and
 * their streams (cuGreenCtxStreamCreate).  Included by fakedriver.c after fakedriver_ipc.c (one #include
 * line each); every entry point has the C signature CUDA 13.0 selects.
 *
 * Model (strict on purpose, like the rest of the fake):
 *   - A device has 132 SMs (its MULTIPROCESSOR_COUNT), a minimum partition of 8 and a co-scheduling
 *     alignment of 8, as an H100/H200 reports.  A CUdevResource the fake hands out carries a tag in its
 *     internal padding (as the real driver keeps its own data there): a resource cuproc built or changed
 *     itself is CUDA_ERROR_INVALID_RESOURCE_TYPE.
 *   - cuDevSmResourceSplitByCount rounds minCount up to a multiple of 8; with result NULL it only says how
 *     many groups would be made; else it makes min(*nbGroups, what fits) groups and puts the rest in
 *     remaining (which may be NULL).  No group fits: CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION.
 *   - A descriptor is a handle the driver keeps (there is no call to destroy one).  cuGreenCtxCreate needs
 *     flags CU_GREEN_CTX_DEFAULT_STREAM; it makes a context object of fakedriver.c's (not primary) that
 *     cuCtxFromGreenCtx returns and cuGreenCtxDestroy destroys with everything made in it.
 *   - cuGreenCtxStreamCreate needs CU_STREAM_NON_BLOCKING, as documented.  Work runs at once here, so the
 *     SM limit itself is the GPU tests' to show.
 */
typedef void *CUdevResourceDesc;

#define K_GREEN 48
#define K_RDESC 49
#define FAKE_SMS 132
#define SM_ALIGN 8
#define E_INVALID_RESOURCE_TYPE 914
#define E_INVALID_RESOURCE_CONFIGURATION 915
#define GREEN_TAG 0x4d534b46u   /* "FKSM" */

typedef struct {
  int type;
  unsigned tag, dev, pad0;            /* the fake's own data in _internal_padding */
  unsigned char padding[80];
  unsigned smCount, minSmPartitionSize, smCoscheduledAlignment, flags, localityDomainId;
  unsigned char oversize[20];
  void *nextResource;
} CUdevResource;
_Static_assert(sizeof(CUdevResource) == 144, "CUdevResource_v1");
_Static_assert(offsetof(CUdevResource, smCount) == 96, "CUdevResource.sm");

static void sm_resource(CUdevResource *r, int dev, unsigned count) {
  memset(r, 0, sizeof *r);
  r->type = 1;   /* CU_DEV_RESOURCE_TYPE_SM */
  r->tag = GREEN_TAG;
  r->dev = (unsigned)dev;
  r->smCount = count;
  r->minSmPartitionSize = SM_ALIGN;
  r->smCoscheduledAlignment = SM_ALIGN;
}

static CUresult check_sm_resource(const CUdevResource *r) {
  NEED(r);
  if (r->type != 1 || r->tag != GREEN_TAG || check_dev((int)r->dev) != OK || r->smCount > FAKE_SMS)
    return E_INVALID_RESOURCE_TYPE;
  return OK;
}

static CUresult cuDeviceGetDevResource(CUdevice dev, CUdevResource *result, int type) {
  ENTER("cuDeviceGetDevResource");
  NEED(result);
  TRY(check_dev(dev));
  if (type != 1) return E_INVALID_RESOURCE_TYPE;
  sm_resource(result, dev, FAKE_SMS);
  return OK;
}

static CUresult cuDevSmResourceSplitByCount(CUdevResource *result, unsigned *nbGroups, const CUdevResource *input,
                                            CUdevResource *remaining, unsigned useFlags, unsigned minCount) {
  ENTER("cuDevSmResourceSplitByCount");
  NEED(nbGroups && (useFlags & ~3u) == 0);
  TRY(check_sm_resource(input));
  unsigned count = minCount == 0 ? SM_ALIGN : (minCount + SM_ALIGN - 1) / SM_ALIGN * SM_ALIGN;
  unsigned fit = input->smCount / count;
  if (!result) { *nbGroups = fit; return OK; }
  NEED(*nbGroups > 0);
  if (fit == 0) return E_INVALID_RESOURCE_CONFIGURATION;
  unsigned made = *nbGroups < fit ? *nbGroups : fit;
  for (unsigned i = 0; i < made; i++) sm_resource(&result[i], (int)input->dev, count);
  if (remaining) sm_resource(remaining, (int)input->dev, input->smCount - made * count);
  *nbGroups = made;
  return OK;
}

static CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *desc, CUdevResource *resources, unsigned n) {
  ENTER("cuDevResourceGenerateDesc");
  NEED(desc && resources && n > 0);
  unsigned total = 0;
  for (unsigned i = 0; i < n; i++) {
    TRY(check_sm_resource(&resources[i]));
    NEED(resources[i].dev == resources[0].dev);
    total += resources[i].smCount;
  }
  NEED(total > 0 && total <= FAKE_SMS);
  struct obj *d = new_obj(K_RDESC, 0, (int)resources[0].dev);
  if (!d) return E_OUT_OF_MEMORY;
  d->flags = total;
  *desc = (CUdevResourceDesc)d->h;
  return OK;
}

static CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned flags) {
  ENTER("cuGreenCtxCreate");
  NEED(phCtx && flags == 1);   /* CU_GREEN_CTX_DEFAULT_STREAM */
  TRY(check_dev(dev));
  CUresult rc;
  struct obj *d = get(desc, K_RDESC, &rc);
  if (!d) return rc;
  NEED(d->dev == dev);
  struct obj *c = new_ctx(dev, 0, 0, 0);
  if (!c) return E_OUT_OF_MEMORY;
  struct obj *g = new_obj(K_GREEN, 0, dev);
  if (!g) { kill_obj(c); return E_OUT_OF_MEMORY; }
  g->flags = d->flags;
  g->parent = c->h;   /* its context */
  *phCtx = (CUgreenCtx)g->h;
  return OK;
}

static CUresult cuGreenCtxDestroy(CUgreenCtx hCtx) {
  ENTER("cuGreenCtxDestroy");
  CUresult rc;
  struct obj *g = get(hCtx, K_GREEN, &rc);
  if (!g) return rc;
  struct obj *c = obj_at(g->parent);
  if (c && c->alive && c->kind == K_CTX) kill_obj(c);
  kill_obj(g);
  return OK;
}

static CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx) {
  ENTER("cuCtxFromGreenCtx");
  NEED(pContext);
  CUresult rc;
  struct obj *g = get(hCtx, K_GREEN, &rc);
  if (!g) return rc;
  *pContext = (CUcontext)g->parent;
  return OK;
}

static struct obj *green_of_ctx(handle_t ctx) {
  for (size_t i = 0; i < nlive; i++) {
    struct obj *o = live_obj(i);
    if (o->kind == K_GREEN && o->parent == ctx) return o;
  }
  return NULL;
}

static CUresult cuGreenCtxGetDevResource(CUgreenCtx hCtx, CUdevResource *result, int type) {
  ENTER("cuGreenCtxGetDevResource");
  NEED(result);
  CUresult rc;
  struct obj *g = get(hCtx, K_GREEN, &rc);
  if (!g) return rc;
  if (type != 1) return E_INVALID_RESOURCE_TYPE;
  sm_resource(result, g->dev, g->flags);
  return OK;
}

static CUresult cuCtxGetDevResource(CUcontext hCtx, CUdevResource *result, int type) {
  ENTER("cuCtxGetDevResource");
  NEED(result);
  struct obj *c;
  TRY(ctx_arg(hCtx, &c));
  if (type != 1) return E_INVALID_RESOURCE_TYPE;
  struct obj *g = green_of_ctx(c->h);
  sm_resource(result, c->dev, g ? g->flags : FAKE_SMS);
  return OK;
}

static CUresult cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned flags, int priority) {
  ENTER("cuGreenCtxStreamCreate");
  NEED(phStream && flags == 1);   /* CU_STREAM_NON_BLOCKING, as documented */
  CUresult rc;
  struct obj *g = get(greenCtx, K_GREEN, &rc);
  if (!g) return rc;
  struct obj *c = obj_at(g->parent);
  if (!c || !c->alive) return stale(E_INVALID_HANDLE);
  struct obj *s = new_obj(K_STREAM, c->h, c->dev);
  if (!s) return E_OUT_OF_MEMORY;
  s->flags = flags;
  s->u.s.priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
  s->u.s.uid = new_state(c->u.c.id, ST_NONBLOCKING, c->u.c.legacy);
  *phStream = (CUstream)s->h;
  return OK;
}

/* ------------------------------------------------------------------ control API (tests) */
/* Forget every green context and descriptor (fake_reset destroyed their contexts). */
EXPORT void fake_green_reset(void) {
  pthread_mutex_lock(&mu);
  for (size_t i = nlive; i > 0;) {
    i--;
    struct obj *o = live_obj(i);
    if (o->kind == K_GREEN || o->kind == K_RDESC) kill_obj(o);
    if (i > nlive) i = nlive;
  }
  pthread_mutex_unlock(&mu);
}

/* Live green contexts ("green") or descriptors ("desc"); -1 for another name. */
EXPORT long fake_green_live(const char *kind) {
  if (!kind) return -1;
  int k = strcmp(kind, "green") == 0 ? K_GREEN : strcmp(kind, "desc") == 0 ? K_RDESC : -1;
  if (k < 0) return -1;
  pthread_mutex_lock(&mu);
  long n = 0;
  for (size_t i = 0; i < nlive; i++) n += live_obj(i)->kind == k;
  pthread_mutex_unlock(&mu);
  return n;
}
