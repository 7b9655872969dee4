/* memory.copy between a device buffer and host memory in C: cuproc._fastpath_c.make_copy(...) returns the
 * callable that ``cuproc.transfers.copy`` (``cuproc.memory.copy``) is on the compiled fast path.  Compiled
 * into the cffi API-mode module by tools/build_fastpath.py after fastpath_launch.c (CUPROC_SLOT,
 * cuproc_slot_offset, cuproc_u64, cuproc_publish, cuproc_one_shot_get, cuproc_front_dealloc) and
 * fastpath_memory.c (cuproc_fn, cuproc_fn_pointer).
 *
 * Why C: a 64 MiB copy from pinned memory read 0.975x the driver's own call on an H200 (2026-11-28, issue 9's
 * goal is 0.98x) while the Python around the call costs about 3.6 us warm.  The rest is the Python's reach
 * when the CPU's caches are cold -- in the benchmark, after its pageable copies (the driver moves those
 * through staging buffers with the CPU) or a flush; in a program, after any large CPU work: the Python
 * layers (the checks, the binding, the stores: a few dozen functions, dicts and code objects) then miss in
 * them.  A diagnostic run on the H200 read memory.copy 11-38 us slower per copy than the same driver call
 * from a one-line lambda, and 19 us more right after a 256 MiB flush, while the raw call did not move.
 *
 * The front takes only the common case and hands every other call, unchanged, to the Python function
 * (``slow``), which checks, refuses and raises as it always does:
 *
 *   copy(dst, src) and copy(dst, src, nbytes): no keyword; one side an exact device-buffer class, the other
 *     an exact host-memory class of the table Python hands over (no subclass, no view, no CAI exporter, no
 *     buffer-protocol object); each side not ended and checked since the last resource ended (its
 *     ``_checked_at`` is EPOCH[0]: the Python check's own shortcut); not a forked child; ``nbytes`` None or an
 *     exact int from 0 to both sizes; the device side's context current on this thread (cuCtxGetCurrent, a
 *     read of the driver's thread state: a synchronous copy runs in whichever context is current, on its
 *     default stream, even on another context's memory -- unordered with that context's work, measured on
 *     driver 580 -- so with another one current the Python code pushes the right one, Context.call_current).
 *     The call is the device side's context's driver's cuMemcpyHtoD or
 *     cuMemcpyDtoH as that driver publishes it (the selected ABI variant, checked to have the front's C type),
 *     made with the GIL released, as cffi's calls are.  Success stores None as both sides' ``last_stream``
 *     (a synchronous copy leaves nothing pending); a driver error goes to ``failed(rc, dst, src, n)``
 *     (Python: the exception naming the call; no second attempt, the context was current).
 */

#define CUPROC_CP_CLASSES 4   /* DeviceBuffer, PinnedBuffer (not registered memory, which may be read-only) */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *slow, *failed, *context_type, *ccontext_type, *forked, *epoch;
    PyObject *classes[CUPROC_CP_CLASSES];   /* exact classes taken */
    int is_host[CUPROC_CP_CLASSES];
    Py_ssize_t off_last[CUPROC_CP_CLASSES];  /* each class's last_stream slot */
    int nclasses;
    Py_ssize_t off_driver, off_ended, off_checked, off_context, off_address, off_nbytes, off_ctx_handle;
    cuproc_fn htod, dtoh, get_current;
    Py_ssize_t taken;
} cuproc_cp;

/* The table index of ``obj``'s exact class, or -1. */
static int cuproc_cp_class(cuproc_cp *self, PyObject *obj)
{
    int i;
    for (i = 0; i < self->nclasses; i++)
        if ((PyObject *)Py_TYPE(obj) == self->classes[i]) return i;
    return -1;
}

/* Whether ``ctx`` (an exact Context) is this thread's current context; 0 also when either is not known. */
static int cuproc_cp_current(cuproc_cp *self, PyObject *ctx, void *get)
{
    PyObject *handle = CUPROC_SLOT(ctx, self->off_ctx_handle);
    CUcontext current = NULL;
    char *raw;
    if (handle == NULL) return 0;
    Py_INCREF(handle);                 /* held across the conversion */
    raw = _cffi_to_c_pointer(handle, (struct _cffi_ctypedescr *)self->ccontext_type);
    Py_DECREF(handle);
    if (raw == NULL) { PyErr_Clear(); return 0; }
    return ((PFN_cuCtxGetCurrent_v4000)get)(&current) == 0 && (void *)current == (void *)raw;
}

/* Whether ``obj`` (of a table class) is usable as Resource.check would find it without walking its parents:
 * not ended, and checked since the last resource ended. */
static int cuproc_cp_checked(cuproc_cp *self, PyObject *obj)
{
    PyObject *at = CUPROC_SLOT(obj, self->off_checked), *epoch = PyList_GET_ITEM(self->epoch, 0);
    if (CUPROC_SLOT(obj, self->off_ended) != Py_None || at == NULL) return 0;
    if (at == epoch) return 1;
    /* two exact ints compare without running Python */
    return PyLong_CheckExact(at) && PyLong_CheckExact(epoch) && PyObject_RichCompareBool(at, epoch, Py_EQ) == 1;
}

/* An address or size slot's value, or (unsigned long long)-1 with no error set when it is not an exact int
 * that fits. */
static unsigned long long cuproc_cp_u64(PyObject *v)
{
    unsigned long long x;
    if (v == NULL || !PyLong_CheckExact(v)) return (unsigned long long)-1;
    x = cuproc_u64(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) PyErr_Clear();
    return x;
}

static PyObject *cuproc_cp_call(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_cp *self = (cuproc_cp *)obj;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *dst, *src, *dev, *host, *ctx, *drv, *given, *code, *result;
    unsigned long long daddr, haddr, dsize, hsize, n;
    int di, si, to_host;
    void *fn, *get;
    CUresult rc;
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (kwnames != NULL || nargs < 2 || nargs > 3) goto slow;
    dst = args[0];
    src = args[1];
    given = nargs == 3 ? args[2] : Py_None;
    if ((di = cuproc_cp_class(self, dst)) < 0 || (si = cuproc_cp_class(self, src)) < 0
        || self->is_host[di] == self->is_host[si])   /* both device (a peer copy?) or both host (refused) */
        goto slow;
    to_host = self->is_host[di];
    dev = to_host ? src : dst;
    host = to_host ? dst : src;
    ctx = CUPROC_SLOT(dev, self->off_context);
    /* exactly a Context: the Python copy binds through the context's own methods (Context.call), which a
     * subclass may override; the fronts whose Python code makes its first attempt inline take subclasses */
    if (ctx == NULL || (PyObject *)Py_TYPE(ctx) != self->context_type) goto slow;
    drv = CUPROC_SLOT(ctx, self->off_driver);
    if (drv == NULL) goto slow;
    /* The driver's function first: its lookup may run Python (any thread), so every check comes after it,
     * on what this call holds. */
    Py_INCREF(dst); Py_INCREF(src); Py_INCREF(ctx); Py_INCREF(drv);
    fn = cuproc_fn_pointer(to_host ? &self->dtoh : &self->htod, drv);
    get = fn == NULL ? NULL : cuproc_fn_pointer(&self->get_current, drv);
    if (get == NULL || PyList_GET_ITEM(self->forked, 0) != Py_False || CUPROC_SLOT(dev, self->off_context) != ctx
        || CUPROC_SLOT(ctx, self->off_driver) != drv || !cuproc_cp_checked(self, dst) || !cuproc_cp_checked(self, src))
        goto release_slow;
    /* work left on a stream: the Python code orders the copy after it (transfers._order_sides) */
    if (CUPROC_SLOT(dst, self->off_last[di]) != Py_None || CUPROC_SLOT(src, self->off_last[si]) != Py_None)
        goto release_slow;
    daddr = cuproc_cp_u64(CUPROC_SLOT(dev, self->off_address));
    haddr = cuproc_cp_u64(CUPROC_SLOT(host, self->off_address));
    dsize = cuproc_cp_u64(CUPROC_SLOT(dev, self->off_nbytes));
    hsize = cuproc_cp_u64(CUPROC_SLOT(host, self->off_nbytes));
    if (daddr == (unsigned long long)-1 || haddr == (unsigned long long)-1 || dsize == (unsigned long long)-1
        || hsize == (unsigned long long)-1)
        goto release_slow;
    if (given == Py_None)
        n = dsize < hsize ? dsize : hsize;
    else if (!PyLong_CheckExact(given) || (n = cuproc_cp_u64(given)) == (unsigned long long)-1 || n > dsize
             || n > hsize || n > (unsigned long long)PY_SSIZE_T_MAX)
        goto release_slow;   /* not an int, negative, an overrun: Python refuses */
    /* another context current (or none): the Python code makes the copy with this one current (after the
     * checks above, so that a call Python refuses makes no driver call at all) */
    if (!cuproc_cp_current(self, ctx, get))
        goto release_slow;
    Py_BEGIN_ALLOW_THREADS
    if (to_host)
        rc = ((PFN_cuMemcpyDtoH_v3020)fn)((void *)(uintptr_t)haddr, (CUdeviceptr)daddr, (size_t)n);
    else
        rc = ((PFN_cuMemcpyHtoD_v3020)fn)((CUdeviceptr)daddr, (const void *)(uintptr_t)haddr, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_DECREF(ctx);
    Py_DECREF(drv);
    if (rc != 0) {
        code = PyLong_FromLong((long)rc);
        result = NULL;
        if (code != NULL) {
            PyObject *size = PyLong_FromUnsignedLongLong(n);
            if (size != NULL) {
                PyObject *call[4] = {code, dst, src, size};
                result = PyObject_Vectorcall(self->failed, call, 4, NULL);
                Py_DECREF(size);
            }
            Py_DECREF(code);
        }
        Py_DECREF(dst);
        Py_DECREF(src);
        return result;
    }
    self->taken++;
    /* as the Python code: a synchronous call leaves nothing pending on either side (the old values are
     * released after both stores: a Stream's finalizer may run Python) */
    {
        PyObject *old_d = CUPROC_SLOT(dst, self->off_last[di]), *old_s;
        CUPROC_SLOT(dst, self->off_last[di]) = Py_NewRef(Py_None);
        old_s = CUPROC_SLOT(src, self->off_last[si]);
        CUPROC_SLOT(src, self->off_last[si]) = Py_NewRef(Py_None);
        Py_XDECREF(old_d);
        Py_XDECREF(old_s);
    }
    Py_DECREF(dst);
    Py_DECREF(src);
    Py_RETURN_NONE;
release_slow:
    Py_DECREF(dst); Py_DECREF(src); Py_DECREF(ctx); Py_DECREF(drv);
slow:
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static int cuproc_cp_traverse(PyObject *obj, visitproc visit, void *arg)
{
    cuproc_cp *self = (cuproc_cp *)obj;
    int i;
    Py_VISIT(self->dict); Py_VISIT(self->slow); Py_VISIT(self->failed); Py_VISIT(self->context_type);
    Py_VISIT(self->ccontext_type); Py_VISIT(self->forked); Py_VISIT(self->epoch);
    for (i = 0; i < self->nclasses; i++) Py_VISIT(self->classes[i]);
    Py_VISIT(Py_TYPE(obj));
    if ((i = cuproc_fn_traverse(&self->htod, visit, arg)))
        return i;   /* the visitor's own answer */
    if ((i = cuproc_fn_traverse(&self->dtoh, visit, arg)))
        return i;
    return cuproc_fn_traverse(&self->get_current, visit, arg);
}

static int cuproc_cp_clear(PyObject *obj)
{
    cuproc_cp *self = (cuproc_cp *)obj;
    int i;
    Py_CLEAR(self->dict); Py_CLEAR(self->slow); Py_CLEAR(self->failed); Py_CLEAR(self->context_type);
    Py_CLEAR(self->ccontext_type); Py_CLEAR(self->forked); Py_CLEAR(self->epoch);
    for (i = 0; i < self->nclasses; i++) Py_CLEAR(self->classes[i]);
    self->nclasses = 0;   /* (nothing to release twice: a cleared front refuses every call at its entry) */
    cuproc_fn_clear(&self->htod);
    cuproc_fn_clear(&self->dtoh);
    cuproc_fn_clear(&self->get_current);
    return 0;
}

static PyMemberDef cuproc_cp_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(cuproc_cp, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(cuproc_cp, vectorcall), READONLY, NULL},
    {"taken", T_PYSSIZET, offsetof(cuproc_cp, taken), READONLY,
     "how many copies this object made itself (the rest went to the Python function)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef cuproc_cp_getset[] = {   /* __dict__: cuproc.fastpath.dressed fills it */
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot cuproc_cp_slots[] = {
    {Py_tp_getset, (void *)cuproc_cp_getset},
    {Py_tp_call, (void *)PyVectorcall_Call},
    {Py_tp_descr_get, (void *)cuproc_one_shot_get},   /* bound as a method in a class, as a Python function is */
    {Py_tp_traverse, (void *)cuproc_cp_traverse},
    {Py_tp_clear, (void *)cuproc_cp_clear},
    {Py_tp_dealloc, (void *)cuproc_front_dealloc},
    {Py_tp_members, (void *)cuproc_cp_members},
    {Py_tp_doc, (void *)"cuproc.memory.copy with its common case (a device buffer and host memory) in C; the rest "
                        "goes to Python."},
    {0, NULL},
};

static PyType_Spec cuproc_cp_spec = {
    "cuproc._fastpath_c.CopyFront", sizeof(cuproc_cp), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR
        | Py_TPFLAGS_DISALLOW_INSTANTIATION,   /* made by make_copy only: never with NULL fields */
    cuproc_cp_slots,
};

static PyTypeObject *cuproc_cp_type;
static PyObject *cuproc_s_cuMemcpyHtoD, *cuproc_s_cuMemcpyDtoH, *cuproc_s_cp_cuCtxGetCurrent;

/* make_copy(slow, failed, Context, the ctype of CUcontext, FORKED, EPOCH,
 *     (pointer readers of cuMemcpyHtoD, cuMemcpyDtoH, cuCtxGetCurrent),
 *     ((class, is_host, its last_stream member descriptor), ...),
 *     (the member descriptors of a Resource's driver, ended and _checked_at, an Allocation's context, address
 *      and nbytes, a Context's handle))
 *   -> the copy front, or None on a free-threaded build (its reads of the slots rely on the GIL) */
static PyObject *cuproc_make_copy(PyObject *module, PyObject *args)
{
    PyObject *slow, *failed, *context_type, *ccontext_type, *forked, *epoch, *readers, *table, *members;
    Py_ssize_t offsets[6], ctx_handle, i;
    cuproc_cp *self;
    (void)module;
#ifdef Py_GIL_DISABLED
    (void)args;
    Py_RETURN_NONE;
#endif
    if (!PyArg_ParseTuple(args, "OOO!OO!O!O!O!O!", &slow, &failed, &PyType_Type, &context_type, &ccontext_type,
                          &PyList_Type, &forked, &PyList_Type, &epoch, &PyTuple_Type, &readers, &PyTuple_Type, &table,
                          &PyTuple_Type, &members))
        return NULL;
    if (!PyCallable_Check(slow) || !PyCallable_Check(failed) || PyList_GET_SIZE(forked) != 1
        || PyList_GET_SIZE(epoch) != 1 || PyTuple_GET_SIZE(readers) != 3 || !PyCallable_Check(PyTuple_GET_ITEM(readers, 0))
        || !PyCallable_Check(PyTuple_GET_ITEM(readers, 1)) || !PyCallable_Check(PyTuple_GET_ITEM(readers, 2))
        || PyTuple_GET_SIZE(members) != 7
        || PyTuple_GET_SIZE(table) < 1 || PyTuple_GET_SIZE(table) > CUPROC_CP_CLASSES) {
        PyErr_SetString(PyExc_ValueError, "make_copy: inconsistent arguments (a cuproc bug)");
        return NULL;
    }
    /* driver, ended, _checked_at are read from Contexts too (driver, ended) and from every class of the table:
     * each offset is checked against every class it is read from, or a read would fall outside the object */
    for (i = 0; i < 3; i++)
        if (cuproc_slot_offset(PyTuple_GET_ITEM(members, i), context_type, &offsets[i], "make_copy") < 0) return NULL;
    if (cuproc_slot_offset(PyTuple_GET_ITEM(members, 6), context_type, &ctx_handle, "make_copy") < 0) return NULL;
    self = PyObject_GC_New(cuproc_cp, cuproc_cp_type);
    if (self == NULL) return NULL;
    self->vectorcall = cuproc_cp_call;
    self->dict = NULL;
    self->slow = Py_NewRef(slow); self->failed = Py_NewRef(failed); self->context_type = Py_NewRef(context_type);
    self->ccontext_type = Py_NewRef(ccontext_type); self->off_ctx_handle = ctx_handle;
    self->forked = Py_NewRef(forked); self->epoch = Py_NewRef(epoch);
    self->nclasses = 0;
    self->taken = 0;
    cuproc_fn_init(&self->htod, cuproc_s_cuMemcpyHtoD, PyTuple_GET_ITEM(readers, 0));
    cuproc_fn_init(&self->dtoh, cuproc_s_cuMemcpyDtoH, PyTuple_GET_ITEM(readers, 1));
    cuproc_fn_init(&self->get_current, cuproc_s_cp_cuCtxGetCurrent, PyTuple_GET_ITEM(readers, 2));
    PyObject_GC_Track(self);
    for (i = 0; i < PyTuple_GET_SIZE(table); i++) {
        PyObject *row = PyTuple_GET_ITEM(table, i), *cls;
        Py_ssize_t k, off[6], last;
        int host;
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 3 || !PyType_Check(PyTuple_GET_ITEM(row, 0))
            || (host = PyObject_IsTrue(PyTuple_GET_ITEM(row, 1))) < 0) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "make_copy: a class row is not (class, is_host, member) (a cuproc bug)");
            goto fail;
        }
        cls = PyTuple_GET_ITEM(row, 0);
        for (k = 0; k < 6; k++)
            if (cuproc_slot_offset(PyTuple_GET_ITEM(members, k), cls, &off[k], "make_copy") < 0) goto fail;
        if (cuproc_slot_offset(PyTuple_GET_ITEM(row, 2), cls, &last, "make_copy") < 0) goto fail;
        for (k = 0; k < 6; k++) offsets[k] = off[k];   /* the same descriptors: the same offsets in every class */
        self->classes[i] = Py_NewRef(cls);
        self->is_host[i] = host;
        self->off_last[i] = last;
        self->nclasses = (int)i + 1;
    }
    self->off_driver = offsets[0]; self->off_ended = offsets[1]; self->off_checked = offsets[2];
    self->off_context = offsets[3]; self->off_address = offsets[4]; self->off_nbytes = offsets[5];
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static PyMethodDef cuproc_make_copy_def = {
    "make_copy", cuproc_make_copy, METH_VARARGS,
    "memory.copy between a device buffer and host memory in C (cuproc.transfers builds the arguments).",
};

/* Called once through cffi (which released the GIL): put CopyFront and make_copy on the module. */
static int cuproc_install_copy(void)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc;
    if (cuproc_cp_type == NULL) {
        cuproc_s_cuMemcpyHtoD = PyUnicode_InternFromString("cuMemcpyHtoD");
        cuproc_s_cuMemcpyDtoH = PyUnicode_InternFromString("cuMemcpyDtoH");
        cuproc_s_cp_cuCtxGetCurrent = PyUnicode_InternFromString("cuCtxGetCurrent");
        if (cuproc_s_cuMemcpyHtoD && cuproc_s_cuMemcpyDtoH && cuproc_s_cp_cuCtxGetCurrent)
            cuproc_cp_type = (PyTypeObject *)PyType_FromSpec(&cuproc_cp_spec);
    }
    rc = cuproc_publish(&cuproc_make_copy_def, "CopyFront", cuproc_cp_type);
    PyGILState_Release(gil);
    return rc;
}
