/* Synchronous device memory in C: cuproc._fastpath_c.make_device_buffer(...) returns the callables that
 * ``DeviceBuffer.__init__`` and ``DeviceBuffer.close`` / ``free`` are on the compiled fast path, and
 * make_claim(...) the one that ``Resource._claim`` is.  Compiled into the cffi API-mode module by tools/build_fastpath.py after fastpath_memory.c
 * (cuproc_fn, cuproc_fn_pointer, cuproc_free_start, cuproc_saved_error) and fastpath_launch.c (CUPROC_SLOT, cuproc_slot_offset,
 * cuproc_u64, cuproc_publish, cuproc_one_shot_get).
 *
 * Why C: ``DeviceBuffer(n).free()`` is two driver calls of about a microsecond each on an H200; in Python the
 * object around them -- asking which context is current and finding its object, the checks, the claim under
 * a lock, four Python frames -- cost 3.4 us more, 2.4x the C pair against issue 9's goal of 1.3x.
 *
 * Each front takes only the common case and hands every other call, unchanged, to the Python function it
 * stands in for (``slow``), which checks, refuses and raises as it always does:
 *
 *   DeviceBuffer.__init__(buffer, nbytes) and (buffer, nbytes, context=ctx): an exact DeviceBuffer not yet
 *     initialized, an exact positive int, at most ``context=`` an exact live Context; not a forked child.
 *     The driver is the context's, or the default handle (``default_driver[0]``, cuproc.driver keeps it
 *     there).  It asks cuCtxGetCurrent in C (a read of the driver's thread state: the caller, or another
 *     library, may have changed the context since).  With ``context=``, that context must be the current
 *     one (else the Python code pushes it); without, the current handle's Context object is the one
 *     remembered for (driver, handle) -- weakly, in a small table, while it lives and has not ended -- or
 *     ``current(driver)`` (Python: Context.require_current, which refuses when none is current) finds it
 *     and it is remembered.  Then cuMemAlloc, and the slots stored as the Python code stores them.  A
 *     driver error goes to ``failed(driver, rc, call)`` (Python: the exception naming cuCtxGetCurrent or
 *     cuMemAlloc).
 *   DeviceBuffer.close(buffer) / free(buffer): an exact DeviceBuffer of cuMemAlloc memory (``stream``
 *     None), live with its context, no export of it, not forked.  The claim -- ``ended`` from None to
 *     "freed" with no Python code between the test and the store, so under the GIL one step -- then
 *     cuMemFree(address) as is; an error goes to ``failed(buffer, rc)`` (Python: the context's rebind and
 *     retry, else the exception).  An ended buffer returns at once (idempotent).
 *   a dropped live buffer (DeviceBuffer's tp_finalize, fastpath_memory.c, hands it here): of cuMemAlloc
 *     memory, its context live, not forked: "dropped" and cuMemFree, as Resource.__del__ does, a failure
 *     reported by ``drop_failed(buffer, rc)`` (Python: the rebind, else a CudaWarning).
 *   Resource._claim(resource, how): the same test-and-store for every resource, and the epoch moved for
 *     one that is not a leaf, as the Python method does under its lock.  On the fast path this is the one
 *     claim there is, so a Python close and a C close of the same object cannot both win.
 *
 * Slots are read and stored at the offsets of the member descriptors Python hands over, checked to be
 * object slots of those classes.  cuMemAlloc and cuMemFree release the GIL, as cffi's calls do;
 * cuCtxGetCurrent does not (it reads the thread's state and returns).
 */

/* A new reference to a weak reference's object, or NULL (no error) when it is gone. */
static PyObject *cuproc_weak_get(PyObject *ref)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(ref, &obj) <= 0) { PyErr_Clear(); return NULL; }
    return obj;
#else
    PyObject *obj = PyWeakref_GET_OBJECT(ref);
    return obj == Py_None ? NULL : Py_NewRef(obj);
#endif
}

/* Which Context object a (driver, current handle) pair was last found to be: both weakly, so that the
 * table keeps neither alive (a created context dropped by its owner is still destroyed). */
#define CUPROC_DB_MEMO 4
typedef struct {
    PyObject *driver_ref, *context_ref;   /* weak references, or NULL for a free entry */
    void *handle;
} cuproc_db_memo;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *slow, *failed, *current, *drop_failed;
    PyObject *buffer_type, *context_type, *resource_type, *ccontext_type;
    PyObject *forked, *exports, *freed, *default_driver, *epoch, *defer, *s_context, *s_leaf;
    Py_ssize_t off_driver, off_ended, off_context, off_address, off_nbytes, off_stream, off_pool, off_last,
        off_key, off_ctx_handle;
    cuproc_fn get_current;    /* cuCtxGetCurrent (__init__) */
    cuproc_fn call;           /* cuMemAlloc (__init__) or cuMemFree (close) */
    cuproc_fn free_orphan;    /* cuMemFree, for memory no object could come to own (__init__) */
    cuproc_db_memo memo[CUPROC_DB_MEMO];
    int memo_next;
    Py_ssize_t taken;
} cuproc_db;

static PyObject *cuproc_s_cuCtxGetCurrent, *cuproc_s_cuMemAlloc, *cuproc_s_cuMemFree, *cuproc_s_context,
    *cuproc_s_leaf;

/* A Context's handle as the driver's CUcontext, or NULL (no error) when it is not one. */
static void *cuproc_db_handle(cuproc_db *self, PyObject *ctx)
{
    PyObject *handle = CUPROC_SLOT(ctx, self->off_ctx_handle);
    char *raw;
    if (handle == NULL) return NULL;
    Py_INCREF(handle);                 /* held across the conversion */
    raw = _cffi_to_c_pointer(handle, (struct _cffi_ctypedescr *)self->ccontext_type);
    Py_DECREF(handle);
    if (raw == NULL) PyErr_Clear();
    return raw;
}

/* Whether ``ctx`` is a live Context of ``drv`` whose handle is ``handle``. */
static int cuproc_db_usable(cuproc_db *self, PyObject *ctx, PyObject *drv, void *handle)
{
    return (PyObject *)Py_TYPE(ctx) == self->context_type && CUPROC_SLOT(ctx, self->off_ended) == Py_None
        && CUPROC_SLOT(ctx, self->off_driver) == drv && cuproc_db_handle(self, ctx) == handle;
}

/* The Context remembered for (drv, handle), a new reference, or NULL (no error). */
static PyObject *cuproc_db_remembered(cuproc_db *self, PyObject *drv, void *handle)
{
    int i;
    for (i = 0; i < CUPROC_DB_MEMO; i++) {
        cuproc_db_memo *m = &self->memo[i];
        PyObject *d, *ctx;
        if (m->driver_ref == NULL || m->handle != handle) continue;
        d = cuproc_weak_get(m->driver_ref);
        Py_XDECREF(d);                  /* compared by identity only: drv is held by the caller */
        if (d != drv) continue;
        ctx = cuproc_weak_get(m->context_ref);
        if (ctx != NULL && cuproc_db_usable(self, ctx, drv, handle)) return ctx;
        Py_XDECREF(ctx);
    }
    return NULL;
}

/* Remember ``ctx`` for (drv, handle); a failure to make the weak references only costs the next call. */
static void cuproc_db_remember(cuproc_db *self, PyObject *drv, PyObject *ctx, void *handle)
{
    cuproc_db_memo *m = &self->memo[self->memo_next];
    PyObject *d = PyWeakref_NewRef(drv, NULL), *c = d == NULL ? NULL : PyWeakref_NewRef(ctx, NULL);
    if (c == NULL) { PyErr_Clear(); Py_XDECREF(d); return; }
    self->memo_next = (self->memo_next + 1) % CUPROC_DB_MEMO;
    Py_XSETREF(m->driver_ref, d);      /* (freeing a weak reference runs no Python: it has no callback) */
    Py_XSETREF(m->context_ref, c);
    m->handle = handle;
}

/* Memory that no object could come to own (out of memory building it, or the buffer initialized by another
 * thread meanwhile): given back with cuMemFree; the error set (or ``message``) is what is raised.  NULL. */
static PyObject *cuproc_db_orphan(cuproc_db *self, PyObject *drv, CUdeviceptr out, const char *message)
{
    cuproc_saved_error saved;
    void *fn;
    if (message != NULL) PyErr_SetString(PyExc_RuntimeError, message);
    cuproc_error_save(&saved);
    fn = cuproc_fn_pointer(&self->free_orphan, drv);
    if (fn != NULL) {
        Py_BEGIN_ALLOW_THREADS
        ((PFN_cuMemFree_v3020)fn)(out);
        Py_END_ALLOW_THREADS
    }
    PyErr_Clear();
    cuproc_error_restore(&saved);
    return NULL;
}

/* Whether none of a buffer's slots that __init__ stores is set yet (a buffer just made by object.__new__). */
static int cuproc_db_fresh(cuproc_db *self, PyObject *buf)
{
    const Py_ssize_t offs[9] = {self->off_driver, self->off_ended, self->off_context, self->off_address,
                                self->off_nbytes, self->off_stream, self->off_pool, self->off_last, self->off_key};
    int i;
    for (i = 0; i < 9; i++)
        if (CUPROC_SLOT(buf, offs[i]) != NULL) return 0;
    return 1;
}

/* ``failed(driver, rc, call)``: the exception for what the driver answered ``call`` (Python raises it).  NULL. */
static PyObject *cuproc_db_raise(cuproc_db *self, PyObject *drv, CUresult rc, PyObject *call)
{
    PyObject *code = PyLong_FromLong((long)rc), *result = NULL;
    if (code != NULL) {
        PyObject *argv[3] = {drv, code, call};
        result = PyObject_Vectorcall(self->failed, argv, 3, NULL);
        Py_DECREF(code);
    }
    if (result != NULL) {   /* failed() always raises */
        Py_DECREF(result);
        PyErr_Format(PyExc_SystemError, "%U answered %d and its handler raised nothing", call, (int)rc);
    }
    return NULL;
}

static PyObject *cuproc_db_init(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_db *self = (cuproc_db *)obj;
    PyObject *buf, *nbytes, *given = NULL, *drv, *ctx, *address;
    void *get, *alloc;
    CUcontext current = NULL;
    CUdeviceptr out = 0;
    CUresult rc;
    size_t n;
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (PyVectorcall_NARGS(nargsf) != 2) goto slow;
    if (kwnames != NULL) {   /* context= alone (an interned name: any other spelling takes the Python code) */
        if (PyTuple_GET_SIZE(kwnames) != 1 || PyTuple_GET_ITEM(kwnames, 0) != self->s_context) goto slow;
        given = args[2];
        if (given == Py_None) given = NULL;
        else if ((PyObject *)Py_TYPE(given) != self->context_type) goto slow;
    }
    buf = args[0];
    nbytes = args[1];
    if ((PyObject *)Py_TYPE(buf) != self->buffer_type || !PyLong_CheckExact(nbytes)
        || !cuproc_db_fresh(self, buf))   /* __init__ of a buffer made already: the Python code */
        goto slow;
    n = PyLong_AsSize_t(nbytes);
    if (n == 0 || (n == (size_t)-1 && PyErr_Occurred())) { PyErr_Clear(); goto slow; }   /* Python refuses */
    if (given != NULL)
        drv = CUPROC_SLOT(given, self->off_driver);
    else   /* (a public list: its length is read, never assumed) */
        drv = PyList_GET_SIZE(self->default_driver) == 1 ? PyList_GET_ITEM(self->default_driver, 0) : NULL;
    if (drv == NULL || drv == Py_None) goto slow;   /* no default handle yet: the Python code opens it */
    Py_INCREF(drv);
    /* The driver's functions first: their lookup may run Python (any thread), so every check comes after. */
    get = cuproc_fn_pointer(&self->get_current, drv);
    alloc = get == NULL ? NULL : cuproc_fn_pointer(&self->call, drv);
    if (alloc == NULL || PyList_GET_ITEM(self->forked, 0) != Py_False) { Py_DECREF(drv); goto slow; }
    rc = ((PFN_cuCtxGetCurrent_v4000)get)(&current);
    /* The Python code answers: CUDA_ERROR_NOT_INITIALIZED (a handle opened without an object, so cuInit never ran
     * for it: it runs cuInit first, _support.get_driver, asks again, and raises what that answer says); any error
     * with context= given (it pushes that context whatever the current one is, Context.call_current); no current
     * context.  Any other error is raised naming cuCtxGetCurrent, as the Python code raises it. */
    if ((rc != 0 && (rc == CUDA_ERROR_NOT_INITIALIZED || given != NULL)) || (rc == 0 && current == NULL)) {
        Py_DECREF(drv);
        goto slow;
    }
    if (rc != 0) {
        cuproc_db_raise(self, drv, rc, cuproc_s_cuCtxGetCurrent);
        Py_DECREF(drv);
        return NULL;
    }
    if (given != NULL) {   /* it must be the current one: else the Python code pushes it */
        if (!cuproc_db_usable(self, given, drv, current)) { Py_DECREF(drv); goto slow; }
        ctx = Py_NewRef(given);
    }
    else if ((ctx = cuproc_db_remembered(self, drv, current)) == NULL) {
        PyObject *found = PyObject_CallOneArg(self->current, drv);   /* refuses when none is current */
        if (found == NULL) { Py_DECREF(drv); return NULL; }
        /* Python ran: this thread's context may have changed, or the fork flag, or the buffer */
        if (!cuproc_db_usable(self, found, drv, current) || PyList_GET_ITEM(self->forked, 0) != Py_False
            || !cuproc_db_fresh(self, buf)) {
            Py_DECREF(found);
            Py_DECREF(drv);
            goto slow;
        }
        cuproc_db_remember(self, drv, found, current);
        ctx = found;
    }
    /* drv and ctx are held until the buffer takes them: other threads run while the GIL is released */
    Py_BEGIN_ALLOW_THREADS
    rc = ((PFN_cuMemAlloc_v3020)alloc)(&out, n);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        Py_DECREF(ctx);
        cuproc_db_raise(self, drv, rc, cuproc_s_cuMemAlloc);
        Py_DECREF(drv);
        return NULL;
    }
    if (!cuproc_db_fresh(self, buf)) {   /* another thread ran __init__ on it meanwhile */
        Py_DECREF(ctx);
        cuproc_db_orphan(self, drv, out, "DeviceBuffer.__init__ ran on the same buffer in two threads at once; "
                                         "this call's memory was given back");
        Py_DECREF(drv);
        return NULL;
    }
    address = PyLong_FromUnsignedLongLong((unsigned long long)out);
    if (address == NULL) {
        Py_DECREF(ctx);
        cuproc_db_orphan(self, drv, out, NULL);
        Py_DECREF(drv);
        return NULL;
    }
    self->taken++;
    /* the slots as __init__'s Python code stores them (all unset: checked just above, no Python ran since) */
    CUPROC_SLOT(buf, self->off_driver) = drv;   /* the references taken above */
    CUPROC_SLOT(buf, self->off_context) = ctx;
    CUPROC_SLOT(buf, self->off_address) = address;
    CUPROC_SLOT(buf, self->off_nbytes) = Py_NewRef(nbytes);
    CUPROC_SLOT(buf, self->off_stream) = Py_NewRef(Py_None);
    CUPROC_SLOT(buf, self->off_pool) = Py_NewRef(Py_None);
    CUPROC_SLOT(buf, self->off_last) = Py_NewRef(Py_None);
    CUPROC_SLOT(buf, self->off_key) = Py_NewRef(Py_None);
    CUPROC_SLOT(buf, self->off_ended) = Py_NewRef(Py_None);   /* last: usable once everything is there */
    Py_RETURN_NONE;
slow:
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *cuproc_db_close(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_db *self = (cuproc_db *)obj;
    PyObject *buf, *ctx, *address, *code, *result;
    unsigned long long dptr;
    CUresult rc;
    void *fn;
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    switch (cuproc_free_start(args, nargsf, kwnames, self->buffer_type, self->off_ended, self->off_driver, &self->call,
                              self->exports, &fn)) {
    case CUPROC_FREE_ENDED: Py_RETURN_NONE;   /* idempotent */
    case CUPROC_FREE_SLOW: goto slow;
    case CUPROC_FREE_ERROR: return NULL;
    default: break;
    }
    buf = args[0];
    ctx = CUPROC_SLOT(buf, self->off_context);
    address = CUPROC_SLOT(buf, self->off_address);
    if (CUPROC_SLOT(buf, self->off_ended) != Py_None || CUPROC_SLOT(buf, self->off_stream) != Py_None
        || ctx == NULL || !PyObject_TypeCheck(ctx, (PyTypeObject *)self->context_type)
        || CUPROC_SLOT(ctx, self->off_ended) != Py_None || PyList_GET_ITEM(self->forked, 0) != Py_False
        || address == NULL || !PyLong_CheckExact(address))
        goto slow;   /* ended meanwhile, stream-ordered, its context gone, forked: Python says what to do */
    dptr = cuproc_u64(address);
    if (dptr == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); goto slow; }
    /* The claim: no Python code has run since ``ended`` was read None just above. */
    Py_SETREF(CUPROC_SLOT(buf, self->off_ended), Py_NewRef(self->freed));
    Py_INCREF(buf);   /* held through the call: the failure path hands it to Python */
    Py_BEGIN_ALLOW_THREADS
    rc = ((PFN_cuMemFree_v3020)fn)((CUdeviceptr)dptr);
    Py_END_ALLOW_THREADS
    if (rc == 0) {
        self->taken++;
        Py_DECREF(buf);
        Py_RETURN_NONE;
    }
    code = PyLong_FromLong((long)rc);
    result = NULL;
    if (code != NULL) {
        PyObject *call[2] = {buf, code};
        result = PyObject_Vectorcall(self->failed, call, 2, NULL);
        Py_DECREF(code);
    }
    Py_DECREF(buf);
    return result;
slow:
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *cuproc_db_claim(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_db *self = (cuproc_db *)obj;
    PyObject *res, *how, *leaf, *ended;
    int not_leaf;
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (kwnames != NULL || PyVectorcall_NARGS(nargsf) != 2)
        goto slow;
    res = args[0];
    how = args[1];
    if (!PyObject_TypeCheck(res, (PyTypeObject *)self->resource_type) || CUPROC_SLOT(res, self->off_ended) == NULL)
        goto slow;   /* unset: the Python method's AttributeError */
    /* Whether it is a leaf, read before the test: a class attribute lookup that runs no Python, but the
     * claim below must have nothing at all between its test and its store. */
    leaf = PyObject_GetAttr((PyObject *)Py_TYPE(res), self->s_leaf);
    if (leaf == NULL) return NULL;
    not_leaf = PyObject_Not(leaf);
    Py_DECREF(leaf);
    if (not_leaf < 0) return NULL;
    ended = CUPROC_SLOT(res, self->off_ended);
    if (ended == NULL) goto slow;
    if (ended != Py_None) Py_RETURN_FALSE;
    Py_SETREF(CUPROC_SLOT(res, self->off_ended), Py_NewRef(how));
    if (not_leaf) {   /* EPOCH[0] += 1 */
        PyObject *one = PyLong_FromLong(1), *next;
        next = one == NULL ? NULL : PyNumber_Add(PyList_GET_ITEM(self->epoch, 0), one);
        Py_XDECREF(one);
        if (next == NULL || PyList_SetItem(self->epoch, 0, next) < 0) return NULL;   /* (SetItem steals next) */
    }
    Py_RETURN_TRUE;
slow:
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static int cuproc_db_traverse(PyObject *obj, visitproc visit, void *arg)
{
    cuproc_db *self = (cuproc_db *)obj;
    int i;
    Py_VISIT(self->dict); Py_VISIT(self->slow); Py_VISIT(self->failed); Py_VISIT(self->current);
    Py_VISIT(self->drop_failed);
    Py_VISIT(self->buffer_type); Py_VISIT(self->context_type); Py_VISIT(self->resource_type);
    Py_VISIT(self->ccontext_type); Py_VISIT(self->forked); Py_VISIT(self->exports); Py_VISIT(self->freed);
    Py_VISIT(self->default_driver); Py_VISIT(self->epoch); Py_VISIT(self->defer);
    for (i = 0; i < CUPROC_DB_MEMO; i++) { Py_VISIT(self->memo[i].driver_ref); Py_VISIT(self->memo[i].context_ref); }
    Py_VISIT(Py_TYPE(obj));
    if ((i = cuproc_fn_traverse(&self->get_current, visit, arg)) || (i = cuproc_fn_traverse(&self->call, visit, arg)))
        return i;   /* the visitor's own answer */
    return cuproc_fn_traverse(&self->free_orphan, visit, arg);
}

static int cuproc_db_clear(PyObject *obj)
{
    cuproc_db *self = (cuproc_db *)obj;
    int i;
    Py_CLEAR(self->dict); Py_CLEAR(self->slow); Py_CLEAR(self->failed); Py_CLEAR(self->current);
    Py_CLEAR(self->drop_failed);
    Py_CLEAR(self->buffer_type); Py_CLEAR(self->context_type); Py_CLEAR(self->resource_type);
    Py_CLEAR(self->ccontext_type); Py_CLEAR(self->forked); Py_CLEAR(self->exports); Py_CLEAR(self->freed);
    Py_CLEAR(self->default_driver); Py_CLEAR(self->epoch); Py_CLEAR(self->defer);
    for (i = 0; i < CUPROC_DB_MEMO; i++) { Py_CLEAR(self->memo[i].driver_ref); Py_CLEAR(self->memo[i].context_ref); }
    cuproc_fn_clear(&self->get_current);
    cuproc_fn_clear(&self->call);
    cuproc_fn_clear(&self->free_orphan);
    return 0;
}

static PyMemberDef cuproc_db_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(cuproc_db, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(cuproc_db, vectorcall), READONLY, NULL},
    {"taken", T_PYSSIZET, offsetof(cuproc_db, taken), READONLY,
     "how many calls this object handled itself (the rest went to the Python function): the driver calls made"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef cuproc_db_getset[] = {   /* __dict__: cuproc.fastpath.dressed fills it */
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot cuproc_db_slots[] = {
    {Py_tp_getset, (void *)cuproc_db_getset},
    {Py_tp_call, (void *)PyVectorcall_Call},
    {Py_tp_descr_get, (void *)cuproc_one_shot_get},   /* a method, as the functions it stands for are */
    {Py_tp_traverse, (void *)cuproc_db_traverse},
    {Py_tp_clear, (void *)cuproc_db_clear},
    {Py_tp_dealloc, (void *)cuproc_front_dealloc},
    {Py_tp_members, (void *)cuproc_db_members},
    {Py_tp_doc, (void *)"DeviceBuffer.__init__ / close / Resource._claim with the common case in C; the rest goes "
                        "to Python."},
    {0, NULL},
};

static PyType_Spec cuproc_db_spec = {
    "cuproc._fastpath_c.DeviceBufferFront", sizeof(cuproc_db), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR
        | Py_TPFLAGS_DISALLOW_INSTANTIATION,   /* made by make_device_buffer only: never with NULL fields */
    cuproc_db_slots,
};

static PyTypeObject *cuproc_db_type;

/* objs: failed, current, buffer_type, context_type, resource_type, ccontext_type, forked, exports, freed,
 * default_driver, epoch, drop_failed, DEFER_DROP; pointer_of: cuCtxGetCurrent's, the call's, cuMemFree's (for orphans). */
static cuproc_db *cuproc_db_new(PyObject *const *objs, PyObject *const *pointer_of, const Py_ssize_t *offsets,
                                PyObject *slow, PyObject *call_name, vectorcallfunc call)
{
    cuproc_db *self = PyObject_GC_New(cuproc_db, cuproc_db_type);
    int i;
    if (self == NULL) return NULL;
    self->vectorcall = call;
    self->dict = NULL;
    self->slow = Py_NewRef(slow);
    self->failed = Py_NewRef(objs[0]); self->current = Py_NewRef(objs[1]);
    self->buffer_type = Py_NewRef(objs[2]); self->context_type = Py_NewRef(objs[3]);
    self->resource_type = Py_NewRef(objs[4]); self->ccontext_type = Py_NewRef(objs[5]);
    self->forked = Py_NewRef(objs[6]); self->exports = Py_NewRef(objs[7]); self->freed = Py_NewRef(objs[8]);
    self->default_driver = Py_NewRef(objs[9]); self->epoch = Py_NewRef(objs[10]);
    self->drop_failed = Py_NewRef(objs[11]); self->defer = Py_NewRef(objs[12]);
    self->s_context = cuproc_s_context;   /* interned for the process: not counted */
    self->s_leaf = cuproc_s_leaf;
    self->off_driver = offsets[0]; self->off_ended = offsets[1]; self->off_context = offsets[2];
    self->off_address = offsets[3]; self->off_nbytes = offsets[4]; self->off_stream = offsets[5];
    self->off_pool = offsets[6]; self->off_last = offsets[7]; self->off_key = offsets[8];
    self->off_ctx_handle = offsets[9];
    cuproc_fn_init(&self->get_current, cuproc_s_cuCtxGetCurrent, pointer_of[0]);
    cuproc_fn_init(&self->call, call_name, pointer_of[1]);
    cuproc_fn_init(&self->free_orphan, cuproc_s_cuMemFree, pointer_of[2]);
    for (i = 0; i < CUPROC_DB_MEMO; i++) {
        self->memo[i].driver_ref = self->memo[i].context_ref = NULL;
        self->memo[i].handle = NULL;
    }
    self->memo_next = 0;
    self->taken = 0;
    PyObject_GC_Track(self);
    return self;
}

/* The close front of each buffer class whose dropped live buffers are freed here (cuproc_db_drop), kept for
 * the process as the finalizer fronts are (fastpath_memory.c): a reloaded cuproc.device_memory makes a new
 * class, with its own entry.  Beyond the table's size a class's drops take Resource.__del__ (correct, slower). */
#define CUPROC_DB_CLASSES 16
static cuproc_db *cuproc_db_closers[CUPROC_DB_CLASSES];
static PyObject *cuproc_s_dropped;

/* DeviceBuffer's finalizer for a live buffer (through fastpath_memory.c's tp_finalize): what Resource.__del__
 * does for cuMemAlloc memory -- ``ended`` set to "dropped", then cuMemFree as is -- when the buffer is exactly
 * of a class with a close front, of cuMemAlloc memory, its context live, not forked.  A failure goes to
 * ``drop_failed(buffer, rc)`` (Python: the rebind, else a CudaWarning; a finalizer never raises).  Returns 1
 * when it let the buffer go, 0 to leave it to Resource.__del__.  The current exception is kept.
 *
 * While cuproc._resource.DEFER_DROP[0] is set (the list the factory was handed: cuproc.stream_capture sets it
 * while a capture that prohibits releases runs), a drop is Resource.__del__'s, which asks the hook whether to
 * keep the buffer until the capture ended: a cuMemFree here would invalidate the capture. */
static int cuproc_db_drop(PyObject *buf)
{
    cuproc_db *self = NULL;
    cuproc_saved_error saved;
    PyObject *drv, *ctx, *address;
    unsigned long long dptr;
    CUresult rc;
    void *fn;
    int i;
    for (i = 0; i < CUPROC_DB_CLASSES && cuproc_db_closers[i] != NULL; i++)
        if ((PyObject *)Py_TYPE(buf) == cuproc_db_closers[i]->buffer_type) { self = cuproc_db_closers[i]; break; }
    if (self == NULL || self->slow == NULL || CUPROC_SLOT(buf, self->off_ended) != Py_None
        || CUPROC_SLOT(buf, self->off_stream) != Py_None || PyList_GET_ITEM(self->defer, 0) != Py_None)
        return 0;
    drv = CUPROC_SLOT(buf, self->off_driver);
    if (drv == NULL) return 0;
    cuproc_error_save(&saved);
    Py_INCREF(drv);
    Py_INCREF(self);   /* held while Python may run: a new close front for this class replaces the table's row */
    fn = cuproc_fn_pointer(&self->call, drv);   /* may run Python: everything is read after it */
    ctx = CUPROC_SLOT(buf, self->off_context);
    address = CUPROC_SLOT(buf, self->off_address);
    if (fn == NULL || CUPROC_SLOT(buf, self->off_driver) != drv || CUPROC_SLOT(buf, self->off_ended) != Py_None
        || CUPROC_SLOT(buf, self->off_stream) != Py_None || ctx == NULL
        || !PyObject_TypeCheck(ctx, (PyTypeObject *)self->context_type) || CUPROC_SLOT(ctx, self->off_ended) != Py_None
        || PyList_GET_ITEM(self->forked, 0) != Py_False || PyList_GET_ITEM(self->defer, 0) != Py_None
        || address == NULL || !PyLong_CheckExact(address)
        || ((dptr = cuproc_u64(address)) == (unsigned long long)-1 && PyErr_Occurred())) {
        PyErr_Clear();
        Py_DECREF(drv);
        Py_DECREF(self);
        cuproc_error_restore(&saved);
        return 0;
    }
    Py_SETREF(CUPROC_SLOT(buf, self->off_ended), Py_NewRef(cuproc_s_dropped));   /* as Resource.__del__ */
    Py_BEGIN_ALLOW_THREADS
    rc = ((PFN_cuMemFree_v3020)fn)((CUdeviceptr)dptr);
    Py_END_ALLOW_THREADS
    Py_DECREF(drv);
    if (rc == 0)
        self->taken++;
    else {
        PyObject *code = PyLong_FromLong((long)rc), *result = NULL;
        if (code != NULL) {
            PyObject *call[2] = {buf, code};
            result = PyObject_Vectorcall(self->drop_failed, call, 2, NULL);
            Py_DECREF(code);
        }
        if (result == NULL) PyErr_WriteUnraisable(self->drop_failed);
        Py_XDECREF(result);
    }
    Py_DECREF(self);
    cuproc_error_restore(&saved);
    return 1;
}

/* Enter ``close`` as its buffer class's closer for drops (replacing the class's earlier one), and make
 * cuproc_db_drop the finalizer fronts' hook.  A full table leaves the class's drops to Resource.__del__. */
static void cuproc_db_finalizes(cuproc_db *close)
{
    int i;
    for (i = 0; i < CUPROC_DB_CLASSES; i++) {
        if (cuproc_db_closers[i] == NULL)
            cuproc_db_closers[i] = (cuproc_db *)Py_NewRef(close);
        else if (cuproc_db_closers[i]->buffer_type == close->buffer_type)
            Py_SETREF(cuproc_db_closers[i], (cuproc_db *)Py_NewRef(close));
        else
            continue;
        cuproc_so_live_finalizer = cuproc_db_drop;
        return;
    }
}

/* make_device_buffer(init_slow, init_failed, current, close_slow, free_slow, close_failed, drop_failed,
 *     (pointer readers of cuCtxGetCurrent, cuMemAlloc, cuMemFree), DeviceBuffer, Context, Resource,
 *     the ctype of CUcontext, FORKED, EXPORTS, "freed", the default handle's list, DEFER_DROP (read by drops),
 *     (the member descriptors of a DeviceBuffer's driver, ended, context, address, nbytes, stream, pool,
 *      last_stream, claim_key, and Context's handle))
 *   -> (__init__, close, free), or None on a free-threaded build (the GIL makes their claims one step) */
static PyObject *cuproc_make_device_buffer(PyObject *module, PyObject *args)
{
    PyObject *init_slow, *init_failed, *current, *close_slow, *free_slow, *close_failed, *drop_failed, *readers;
    PyObject *buffer_type, *context_type, *resource_type, *ccontext_type, *forked, *exports, *freed, *dflt, *defer;
    PyObject *members, *objs[13], *pointer_of[3], *result;
    Py_ssize_t offsets[10], shared, i;
    cuproc_db *init, *close_, *free_;
    (void)module;
#ifdef Py_GIL_DISABLED
    (void)args;   /* every front here relies on the GIL to make a test and a store one step: none without it */
    Py_RETURN_NONE;
#endif
    if (!PyArg_ParseTuple(args, "OOOOOOOO!O!O!O!OO!O!UO!O!O!", &init_slow, &init_failed, &current, &close_slow,
                          &free_slow, &close_failed, &drop_failed, &PyTuple_Type, &readers, &PyType_Type, &buffer_type,
                          &PyType_Type, &context_type, &PyType_Type, &resource_type, &ccontext_type,
                          &PyList_Type, &forked, &PyDict_Type, &exports, &freed, &PyList_Type, &dflt,
                          &PyList_Type, &defer, &PyTuple_Type, &members))
        return NULL;
    if (PyTuple_GET_SIZE(members) != 10 || PyTuple_GET_SIZE(readers) != 3 || PyList_GET_SIZE(forked) != 1
        || PyList_GET_SIZE(dflt) != 1 || PyList_GET_SIZE(defer) != 1 || !PyCallable_Check(init_slow) || !PyCallable_Check(init_failed)
        || !PyCallable_Check(current) || !PyCallable_Check(close_slow) || !PyCallable_Check(free_slow)
        || !PyCallable_Check(close_failed) || !PyCallable_Check(drop_failed)
        || !PyType_IsSubtype((PyTypeObject *)buffer_type, (PyTypeObject *)resource_type)
        || !PyType_IsSubtype((PyTypeObject *)context_type, (PyTypeObject *)resource_type)) {
        PyErr_SetString(PyExc_ValueError, "make_device_buffer: inconsistent arguments (a cuproc bug)");
        return NULL;
    }
    for (i = 0; i < 3; i++) {
        pointer_of[i] = PyTuple_GET_ITEM(readers, i);
        if (!PyCallable_Check(pointer_of[i])) {
            PyErr_SetString(PyExc_ValueError, "make_device_buffer: a pointer reader is not callable (a cuproc bug)");
            return NULL;
        }
    }
    for (i = 0; i < 10; i++) {   /* nine slots of a DeviceBuffer, the Context's handle */
        if (cuproc_slot_offset(PyTuple_GET_ITEM(members, i), i < 9 ? buffer_type : context_type, &offsets[i],
                               "make_device_buffer") < 0)
            return NULL;
    }
    /* ended and driver are read from Contexts too: the same descriptor there (so the same offset), or a
     * read would fall outside a smaller object */
    if (cuproc_slot_offset(PyTuple_GET_ITEM(members, 1), context_type, &shared, "make_device_buffer") < 0
        || cuproc_slot_offset(PyTuple_GET_ITEM(members, 0), context_type, &shared, "make_device_buffer") < 0)
        return NULL;
    objs[0] = init_failed; objs[1] = current; objs[2] = buffer_type; objs[3] = context_type; objs[4] = resource_type;
    objs[5] = ccontext_type; objs[6] = forked; objs[7] = exports; objs[8] = freed; objs[9] = dflt; objs[10] = Py_None;
    objs[11] = drop_failed; objs[12] = defer;
    init = cuproc_db_new(objs, pointer_of, offsets, init_slow, cuproc_s_cuMemAlloc, cuproc_db_init);
    if (init == NULL) return NULL;
    objs[0] = close_failed;
    pointer_of[1] = pointer_of[2];   /* close and free call cuMemFree */
    close_ = cuproc_db_new(objs, pointer_of, offsets, close_slow, cuproc_s_cuMemFree, cuproc_db_close);
    free_ = close_ == NULL ? NULL : cuproc_db_new(objs, pointer_of, offsets, free_slow, cuproc_s_cuMemFree, cuproc_db_close);
    result = free_ == NULL ? NULL : PyTuple_Pack(3, (PyObject *)init, (PyObject *)close_, (PyObject *)free_);
    if (result != NULL)
        cuproc_db_finalizes(close_);
    Py_DECREF(init);
    Py_XDECREF(close_);
    Py_XDECREF(free_);
    return result;
}

/* make_claim(claim_slow, Resource, Resource's ended member descriptor, EPOCH) -> Resource._claim, or None on a
 * free-threaded build */
static PyObject *cuproc_make_claim(PyObject *module, PyObject *args)
{
    PyObject *slow, *resource_type, *ended, *epoch, *objs[13], *none[3] = {Py_None, Py_None, Py_None};
    Py_ssize_t offsets[10] = {0}, i;
    (void)module;
#ifdef Py_GIL_DISABLED
    (void)args;   /* the claim is one step only under the GIL: the Python method's lock without it */
    Py_RETURN_NONE;
#endif
    if (!PyArg_ParseTuple(args, "OO!OO!", &slow, &PyType_Type, &resource_type, &ended, &PyList_Type, &epoch))
        return NULL;
    if (!PyCallable_Check(slow) || PyList_GET_SIZE(epoch) != 1) {
        PyErr_SetString(PyExc_ValueError, "make_claim: inconsistent arguments (a cuproc bug)");
        return NULL;
    }
    if (cuproc_slot_offset(ended, resource_type, &offsets[1], "make_claim") < 0)
        return NULL;
    for (i = 0; i < 13; i++) objs[i] = Py_None;   /* the claim reads only the resource class and the epoch */
    objs[4] = resource_type;
    objs[10] = epoch;
    return (PyObject *)cuproc_db_new(objs, none, offsets, slow, cuproc_s_cuMemFree, cuproc_db_claim);
}

static PyMethodDef cuproc_make_claim_def = {
    "make_claim", cuproc_make_claim, METH_VARARGS,
    "Resource._claim in C: the test-and-store of ``ended`` in one step under the GIL (cuproc._resource).",
};

static PyMethodDef cuproc_make_device_buffer_def = {
    "make_device_buffer", cuproc_make_device_buffer, METH_VARARGS,
    "DeviceBuffer.__init__, close and free in C (cuproc.device_memory builds the arguments).",
};

/* Called once through cffi (which released the GIL): put DeviceBufferFront, make_device_buffer and make_claim
 * on the module. */
static int cuproc_install_device_buffer(void)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc;
    if (cuproc_db_type == NULL) {
        cuproc_s_cuCtxGetCurrent = PyUnicode_InternFromString("cuCtxGetCurrent");
        cuproc_s_cuMemAlloc = PyUnicode_InternFromString("cuMemAlloc");
        cuproc_s_cuMemFree = PyUnicode_InternFromString("cuMemFree");
        cuproc_s_context = PyUnicode_InternFromString("context");
        cuproc_s_leaf = PyUnicode_InternFromString("_leaf");
        cuproc_s_dropped = PyUnicode_InternFromString("dropped");
        if (cuproc_s_cuCtxGetCurrent && cuproc_s_cuMemAlloc && cuproc_s_cuMemFree && cuproc_s_context && cuproc_s_leaf
            && cuproc_s_dropped)
            cuproc_db_type = (PyTypeObject *)PyType_FromSpec(&cuproc_db_spec);
    }
    rc = cuproc_publish(&cuproc_make_device_buffer_def, "DeviceBufferFront", cuproc_db_type);
    if (rc == 0) rc = cuproc_publish(&cuproc_make_claim_def, "DeviceBufferFront", cuproc_db_type);
    PyGILState_Release(gil);
    return rc;
}
