/* Stream-ordered allocation in C: cuproc._fastpath_c.make_stream_ordered(...) returns the three
 * callables that ``cuproc.memory.alloc_async``, ``DeviceBuffer.free_async`` and ``DeviceBuffer.__del__``
 * are on the compiled fast path.  Compiled into the cffi API-mode module by tools/build_fastpath.py, after
 * fastpath_launch.c (structmember.h, cuproc_publish, CUPROC_SLOT, cuproc_slot_offset, cuproc_u64) and the declarations
 * of headers/.
 *
 * Why C: the pair ``alloc_async(n, stream).free_async()`` is two ~0.3 us driver calls; in Python
 * the object around them -- a buffer, its entry in the context's table, the checks -- cost another
 * microsecond, more than cuda.bindings' whole raw pair (issue 9's goal: no more than that pair).
 *
 * Each takes only the common case and hands every other call, unchanged, to the Python function it
 * was made from (``slow``), which checks, refuses and raises as it always does:
 *
 *   alloc_async(nbytes, stream): an exact int and an exact cuproc Stream, positional, no pool; the
 *     stream and its context live (their ``ended`` is None), not a forked child, the context's
 *     table a plain dict.  It makes the one driver call through the pointer the driver resolved
 *     for ``driver.cuMemAllocAsync`` (a handle's own function is honoured: looked up in its dict on
 *     every call, or on 3.12+ remembered until that dict changes, see cuproc_fn_pointer), then
 *     builds what the Python function builds: the DeviceBuffer (its slots stored as the Python
 *     code stores them), its ``claim_key`` (its weak reference) and the entry (address, stream)
 *     under that key in the context's table.  A driver error goes to ``failed(stream, nbytes, rc)``
 *     (Python: the context's rebind and retry, or the exception), never a second first attempt.
 *   buffer.free_async(), or free_async(stream) with that buffer's own Stream object (or None), positional or
 *     ``stream=``: an exact DeviceBuffer allocated on an exact Stream, both live with their
 *     context, no exports of it, not forked.  Everything it needs is read first; then the claim --
 *     removing the buffer's entry from its context's table, under the GIL -- and ``ended`` set to
 *     "freed", as the Python method does; no entry: ended, nothing freed (whoever took it frees).
 *     Then cuMemFreeAsync(address, stream); an error goes to ``failed(buffer, rc)``.
 *
 *   DeviceBuffer.__del__, and DeviceBuffer's tp_finalize (take_finalizer): an ended buffer returns
 *     at once; any other goes to Resource.__del__.
 *
 * The slots (of DeviceBuffer, Context and Stream) are read and stored at the offsets of the member
 * descriptors Python hands over, checked to be object slots of those classes.  Driver calls release
 * the GIL, as cffi's calls do (a host function the driver runs may need it).
 */

/* How a front finds the driver function it calls: ``drv.<name>``, its address read by ``pointer_of``
 * (cuproc.fastpath.pointer_reader of the typedef the front casts to), remembered (cuproc_fn_pointer). */
typedef struct {
    PyObject *name, *pointer_of;
    PyObject *fn;      /* the driver's published function last seen, and the address it calls */
    void *fnptr;
    void *fn_driver, *fn_dict;            /* 3.12+: the handle and its watched dict (identities only, no
                                           * references) that gave fn ... */
    unsigned long long fn_generation;     /* ... when no watched dict had changed since */
} cuproc_fn;

static void cuproc_fn_init(cuproc_fn *f, PyObject *name, PyObject *pointer_of)
{
    f->name = Py_NewRef(name);
    f->pointer_of = Py_NewRef(pointer_of);
    f->fn = NULL;
    f->fnptr = NULL;
    f->fn_driver = f->fn_dict = NULL;
    f->fn_generation = 0;
}

static int cuproc_fn_traverse(cuproc_fn *f, visitproc visit, void *arg)
{
    Py_VISIT(f->name); Py_VISIT(f->pointer_of); Py_VISIT(f->fn);
    return 0;
}

static void cuproc_fn_clear(cuproc_fn *f)
{
    Py_CLEAR(f->name); Py_CLEAR(f->pointer_of); Py_CLEAR(f->fn);
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *slow, *failed;
    PyObject *stream_type, *buffer_type, *context_type, *cstream_type;
    PyObject *forked, *exports, *freed;
    Py_ssize_t off_driver, off_ended, off_context, off_address, off_nbytes, off_stream, off_pool, off_last,
        off_table, off_stream_context, off_stream_handle, off_key;
    cuproc_fn f;       /* cuMemAllocAsync or cuMemFreeAsync */
    Py_ssize_t taken;
} cuproc_so;

static PyObject *cuproc_s_cuMemAllocAsync, *cuproc_s_cuMemFreeAsync;

#if PY_VERSION_HEX >= 0x030C0000
/* Python 3.12's dict watchers: the fronts remember the function they found in a driver handle's dict
 * until any watched dict changes (a function published or replaced by a stand-in, the cache dropped
 * after a fork, the dict freed), instead of looking it up on every call.  They keep the identities of
 * the handle and of its dict, not references: a freed dict is an event, so neither address can be
 * met again by another object without the generation having moved on; a handle given another dict
 * (``drv.__dict__ = ...``) shows as another dict. */
static int cuproc_so_watcher = -1;            /* -1: no watcher (none free): look up every time */
static unsigned long long cuproc_so_generation = 1;

static int cuproc_so_dict_changed(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *value)
{
    (void)event; (void)dict; (void)key; (void)value;
    cuproc_so_generation++;
    return 0;
}
#endif

/* The raw pointer behind ``drv.<name>`` (the function it was last seen to be is kept in self->fn, ``self`` being the front's cuproc_fn), or
 * NULL with no error set when the fast path cannot call it (an Unavailable, a stand-in a test put there).
 * May run Python (a __getattr__ hook, pointer_of; on 3.10/3.11 any allocation, through a collection):
 * the caller holds what it reads afterwards.  That Python may call this front again, which then
 * replaces self->fn and its address: this call reads them only after its own Python ran, stores its
 * result whole, releases the one it replaced last, and returns its own address, not self->fnptr. */
static void *cuproc_fn_pointer(cuproc_fn *self, PyObject *drv)
{
    PyObject *fn = NULL, *value, *dict, *old = NULL;
    void *address;
    int watched = 0;
#if PY_VERSION_HEX >= 0x030C0000
    unsigned long long generation = cuproc_so_generation;   /* before anything below can run Python */
#endif
    dict = PyObject_GenericGetDict(drv, NULL);
    if (dict == NULL) PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
    if (dict != NULL && drv == self->fn_driver && dict == self->fn_dict && generation == self->fn_generation) {
        Py_DECREF(dict);
        return self->fnptr;
    }
#endif
#if PY_VERSION_HEX >= 0x030C0000
    self->fn_driver = self->fn_dict = NULL;   /* what is remembered below is this lookup's, or nothing */
#endif
    if (dict != NULL) {   /* where a handle publishes its functions: cheaper than its __getattr__ hook */
        fn = PyDict_GetItemWithError(dict, self->name);
        Py_XINCREF(fn);
#if PY_VERSION_HEX >= 0x030C0000
        if (fn != NULL && cuproc_so_watcher >= 0) {
            watched = PyDict_Watch(cuproc_so_watcher, dict) == 0;
            if (!watched) PyErr_Clear();
        }
#endif
    }
    if (fn == NULL) {
        PyErr_Clear();   /* no instance dict, or a failed lookup: the ordinary attribute lookup decides */
        fn = PyObject_GetAttr(drv, self->name);
    }
    if (fn == NULL) { PyErr_Clear(); Py_XDECREF(dict); return NULL; }
    if (fn != self->fn) {
        value = PyObject_CallOneArg(self->pointer_of, fn);   /* None: not a driver pointer */
        address = value == NULL || value == Py_None ? NULL : PyLong_AsVoidPtr(value);
        Py_XDECREF(value);
        PyErr_Clear();
        /* The one to replace is read now, not before the call: a call of this front inside pointer_of
         * replaced and released the one there was then (read before, it was released twice: a use
         * after free, reproduced; and the reentrant call's reference leaked). */
        old = self->fn;
        self->fn = fn;              /* kept: the identity test above never meets a reused id */
        self->fnptr = address;
    }
    else {
        address = self->fnptr;      /* NULL: known not to be a driver pointer */
        Py_DECREF(fn);              /* (self->fn holds it: nothing is freed) */
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (watched) {                  /* found in the dict, now watched: valid until a watched dict changes */
        self->fn_driver = drv;
        self->fn_dict = dict;
        self->fn_generation = generation;
    }
    else                            /* what a reentrant call remembered is not what self->fn now is */
        self->fn_driver = self->fn_dict = NULL;
#else
    (void)watched;
#endif
    /* Released only now that fn, its address and what is remembered agree: a release may run Python
     * (a finalizer), hence this front again. */
    Py_XDECREF(old);
    Py_XDECREF(dict);
    return address;
}

/* The CUstream of a Stream (its ``handle`` slot, a cffi cdata), or NULL with no error set. */
static CUstream cuproc_so_handle(cuproc_so *self, PyObject *stream)
{
    PyObject *handle = CUPROC_SLOT(stream, self->off_stream_handle);
    char *raw;
    if (handle == NULL) return NULL;   /* unset: the Python code raises the AttributeError */
    Py_INCREF(handle);                 /* held across the conversion, which may run Python */
    raw = _cffi_to_c_pointer(handle, (struct _cffi_ctypedescr *)self->cstream_type);
    Py_DECREF(handle);
    if (raw == NULL) PyErr_Clear();   /* not a CUstream; a NULL handle is no Stream's */
    return (CUstream)raw;
}

/* The driver of a Stream's context (a new reference), or NULL (no error): only what the function lookup needs. */
static PyObject *cuproc_so_driver_of(cuproc_so *self, PyObject *stream)
{
    PyObject *ctx = CUPROC_SLOT(stream, self->off_stream_context), *drv;
    if (ctx == NULL || !PyObject_TypeCheck(ctx, (PyTypeObject *)self->context_type)) return NULL;
    drv = CUPROC_SLOT(ctx, self->off_driver);
    return Py_XNewRef(drv);
}

/* The live context of a live Stream, a new reference; NULL (no error) when it is not the common case.  (Its
 * driver is the caller's to compare with the one it looked the function up on.) */
static PyObject *cuproc_so_context(cuproc_so *self, PyObject *stream)
{
    PyObject *ctx, *ended = CUPROC_SLOT(stream, self->off_ended);
    if (ended != Py_None || PyList_GET_ITEM(self->forked, 0) != Py_False)
        return NULL;
    ctx = CUPROC_SLOT(stream, self->off_stream_context);
    if (ctx == NULL) return NULL;
    Py_INCREF(ctx);
    if (!PyObject_TypeCheck(ctx, (PyTypeObject *)self->context_type) || CUPROC_SLOT(ctx, self->off_ended) != Py_None
        || CUPROC_SLOT(ctx, self->off_table) == NULL
        || !PyDict_CheckExact(CUPROC_SLOT(ctx, self->off_table))) {
        Py_DECREF(ctx);
        return NULL;
    }
    return ctx;
}

/* The current exception, put aside while other Python code runs and set again after it (one way on every
 * version: PyErr_Fetch is deprecated from 3.12). */
typedef struct {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc;
#else
    PyObject *type, *value, *tb;
#endif
} cuproc_saved_error;

static void cuproc_error_save(cuproc_saved_error *saved)
{
#if PY_VERSION_HEX >= 0x030C0000
    saved->exc = PyErr_GetRaisedException();
#else
    PyErr_Fetch(&saved->type, &saved->value, &saved->tb);
#endif
}

static void cuproc_error_restore(cuproc_saved_error *saved)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(saved->exc);
#else
    PyErr_Restore(saved->type, saved->value, saved->tb);
#endif
}

/* Memory allocated that no object could come to own (out of memory while building it): given back
 * through ``failed(stream, nbytes, 0, address)``; the error that stopped it is raised.  NULL always. */
static PyObject *cuproc_so_orphan(cuproc_so *self, PyObject *stream, PyObject *nbytes, CUdeviceptr out)
{
    cuproc_saved_error saved;
    PyObject *address, *zero, *result = NULL;
    cuproc_error_save(&saved);
    address = PyLong_FromUnsignedLongLong((unsigned long long)out);
    zero = PyLong_FromLong(0);
    if (address != NULL && zero != NULL) {
        PyObject *call[4] = {stream, nbytes, zero, address};
        result = PyObject_Vectorcall(self->failed, call, 4, NULL);
    }
    Py_XDECREF(address);
    Py_XDECREF(zero);
    Py_XDECREF(result);
    PyErr_Clear();   /* the first error is the one to report */
    cuproc_error_restore(&saved);
    return NULL;
}

/* ``failed(a, b, rc)``, or ``failed(a, rc)`` when b is NULL: the rest of the Python code after a first
 * attempt that answered ``rc`` (the context's rebind and retry, else the exception). */
static PyObject *cuproc_so_failed(cuproc_so *self, PyObject *a, PyObject *b, CUresult rc)
{
    PyObject *code = PyLong_FromLong((long)rc), *result;
    if (code == NULL) return NULL;
    {
        PyObject *call[3] = {a, b != NULL ? b : code, code};
        result = PyObject_Vectorcall(self->failed, call, b != NULL ? 3 : 2, NULL);
    }
    Py_DECREF(code);
    return result;
}

static PyObject *cuproc_so_alloc(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_so *self = (cuproc_so *)obj;
    PyObject *stream, *ctx, *drv, *buf, *entry, *key, *address, *nbytes;
    size_t n;
    CUstream h;
    CUdeviceptr out = 0;
    CUresult rc;
    void *fn;
    int failed;
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (kwnames != NULL || PyVectorcall_NARGS(nargsf) != 2)
        goto slow;
    nbytes = args[0];
    stream = args[1];
    if ((PyObject *)Py_TYPE(stream) != self->stream_type || !PyLong_CheckExact(nbytes))
        goto slow;
    n = PyLong_AsSize_t(nbytes);
    if (n == (size_t)-1 && PyErr_Occurred()) { PyErr_Clear(); goto slow; }   /* negative: Python refuses */
    /* The driver's function first: its lookup may run Python (any thread), so every check comes after. */
    drv = cuproc_so_driver_of(self, stream);
    fn = drv == NULL ? NULL : cuproc_fn_pointer(&self->f, drv);
    ctx = fn == NULL ? NULL : cuproc_so_context(self, stream);
    h = ctx == NULL ? NULL : cuproc_so_handle(self, stream);
    if (h == NULL || CUPROC_SLOT(ctx, self->off_driver) != drv) {   /* (drv is held: no reused address) */
        Py_XDECREF(ctx);
        Py_XDECREF(drv);
        goto slow;
    }
    /* drv and ctx stay held until the buffer takes them: other threads run while the GIL is released */
    Py_BEGIN_ALLOW_THREADS
    rc = ((PFN_cuMemAllocAsync_v11020)fn)(&out, n, h);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        Py_DECREF(ctx);
        Py_DECREF(drv);
        return cuproc_so_failed(self, stream, nbytes, rc);
    }
    self->taken++;
    address = PyLong_FromUnsignedLongLong((unsigned long long)out);
    buf = address == NULL ? NULL : ((PyTypeObject *)self->buffer_type)->tp_alloc((PyTypeObject *)self->buffer_type, 0);
    if (buf == NULL) {
        Py_XDECREF(address);
        Py_DECREF(ctx);
        Py_DECREF(drv);
        return cuproc_so_orphan(self, stream, nbytes, out);
    }
    /* the slots as alloc_async's Python code stores them (the object is new and zeroed) */
    CUPROC_SLOT(buf, self->off_driver) = drv;   /* the reference taken above */
    CUPROC_SLOT(buf, self->off_ended) = Py_NewRef(Py_None);
    CUPROC_SLOT(buf, self->off_context) = ctx;   /* the reference taken above */
    CUPROC_SLOT(buf, self->off_address) = Py_NewRef(address);
    CUPROC_SLOT(buf, self->off_nbytes) = Py_NewRef(nbytes);
    CUPROC_SLOT(buf, self->off_stream) = Py_NewRef(stream);
    CUPROC_SLOT(buf, self->off_last) = Py_NewRef(stream);
    CUPROC_SLOT(buf, self->off_pool) = Py_NewRef(Py_None);
    key = PyWeakref_NewRef(buf, NULL);   /* its claim key; the buffer keeps it */
    CUPROC_SLOT(buf, self->off_key) = Py_XNewRef(key);
    entry = key == NULL ? NULL : PyTuple_New(2);
    failed = entry == NULL;
    if (!failed) {
        PyObject *table = CUPROC_SLOT(ctx, self->off_table);   /* read again: Python ran since the check */
        PyTuple_SET_ITEM(entry, 0, Py_NewRef(address));
        PyTuple_SET_ITEM(entry, 1, Py_NewRef(stream));
        if (table == NULL || !PyDict_CheckExact(table)) {
            PyErr_SetString(PyExc_RuntimeError, "alloc_async: the context's table of stream-ordered memory was "
                                                "replaced during the allocation; the memory was given back");
            failed = 1;
        }
        else
            failed = PyDict_SetItem(table, key, entry) < 0;
    }
    Py_XDECREF(entry);
    Py_XDECREF(key);
    Py_DECREF(address);
    if (failed) {   /* no entry, so no claim to find: this code frees it, and the buffer ends as freed */
        Py_SETREF(CUPROC_SLOT(buf, self->off_ended), Py_NewRef(self->freed));
        Py_DECREF(buf);
        return cuproc_so_orphan(self, stream, nbytes, out);
    }
    return buf;
slow:
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

/* What every free front (free_async here, close/free in fastpath_device_buffer.c) does first, for a call
 * ``(buffer)`` on an exact ``buffer_type``: an ended buffer is done (idempotent); then the driver's function,
 * whose lookup may run Python (any thread), so that the caller reads everything else after it; then the
 * exports, whose buffer the Python method refuses to free.  ``*fn``: the function to call on
 * CUPROC_FREE_GO; the caller still checks ``ended`` again. */
enum { CUPROC_FREE_GO, CUPROC_FREE_ENDED, CUPROC_FREE_SLOW, CUPROC_FREE_ERROR };

static int cuproc_free_start(PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject *buffer_type,
                             Py_ssize_t off_ended, Py_ssize_t off_driver, cuproc_fn *f, PyObject *exports, void **fn)
{
    PyObject *buf, *ended, *drv;
    if (kwnames != NULL || PyVectorcall_NARGS(nargsf) != 1)
        return CUPROC_FREE_SLOW;
    buf = args[0];
    if ((PyObject *)Py_TYPE(buf) != buffer_type)
        return CUPROC_FREE_SLOW;
    ended = CUPROC_SLOT(buf, off_ended);
    if (ended != Py_None)
        return ended == NULL ? CUPROC_FREE_SLOW : CUPROC_FREE_ENDED;
    drv = CUPROC_SLOT(buf, off_driver);
    if (drv == NULL) return CUPROC_FREE_SLOW;
    Py_INCREF(drv);
    *fn = cuproc_fn_pointer(f, drv);
    if (*fn == NULL || CUPROC_SLOT(buf, off_driver) != drv) { Py_DECREF(drv); return CUPROC_FREE_SLOW; }
    Py_DECREF(drv);   /* the buffer holds it (drv is not used after) */
    if (PyDict_GET_SIZE(exports) != 0) {   /* exported (EXPORTS is keyed by id): the Python method refuses */
        /* before the caller's reads, as the lookup is: an allocation and a dict lookup have no place
         * between them and the claim (neither runs Python today -- an int is not tracked by the
         * collector, EXPORTS holds ints -- but a failure would raise, and a change could make it so) */
        PyObject *id = PyLong_FromVoidPtr(buf);
        int exported = id == NULL ? -1 : PyDict_Contains(exports, id);
        Py_XDECREF(id);
        if (exported != 0) return exported < 0 ? CUPROC_FREE_ERROR : CUPROC_FREE_SLOW;
    }
    return CUPROC_FREE_GO;
}

/* free_async's stream argument, positional or ``stream=``: 1 with it in *given (borrowed from args; NULL when
 * none was given), 0 for any other form of call (the Python method's). */
static int cuproc_so_free_stream(PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject **given)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    *given = NULL;
    if (kwnames == NULL) {
        if (nargs == 2) *given = args[1];
        return nargs == 1 || nargs == 2;
    }
    if (nargs != 1 || PyTuple_GET_SIZE(kwnames) != 1
        || PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "stream") != 0)
        return 0;
    *given = args[1];
    return 1;
}

static PyObject *cuproc_so_free(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_so *self = (cuproc_so *)obj;
    PyObject *buf, *own, *bctx, *table, *key, *entry, *address, *given;
    unsigned long long dptr;
    CUstream h;
    CUresult rc;
    void *fn;
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    /* free_async(), free_async(None) and free_async(s) where s is the buffer's own Stream: one path (the Python
     * method's too); any other stream goes to the Python method, which checks it in full */
    if (!cuproc_so_free_stream(args, nargsf, kwnames, &given))
        goto slow;
    switch (cuproc_free_start(args, 1, NULL, self->buffer_type, self->off_ended, self->off_driver, &self->f,
                              self->exports, &fn)) {
    case CUPROC_FREE_ENDED: Py_RETURN_NONE;   /* idempotent */
    case CUPROC_FREE_SLOW: goto slow;
    case CUPROC_FREE_ERROR: return NULL;
    default: break;
    }
    buf = args[0];
    if (CUPROC_SLOT(buf, self->off_ended) != Py_None) goto slow;   /* ended meanwhile: Python says how */
    own = CUPROC_SLOT(buf, self->off_stream);
    bctx = CUPROC_SLOT(buf, self->off_context);
    address = CUPROC_SLOT(buf, self->off_address);
    if (own == NULL || (PyObject *)Py_TYPE(own) != self->stream_type || bctx == NULL || address == NULL
        || !PyLong_CheckExact(address) || (given != NULL && given != Py_None && given != own))
        goto slow;
    /* the last work cuproc queued on it went to another stream: the Python method orders the free after it
     * (device_memory.after_last_work) */
    if (CUPROC_SLOT(buf, self->off_last) != own) goto slow;
    /* the checks of the Python method: the stream, its context (the buffer's: alloc_async took it from
     * this stream) and fork */
    if (!PyObject_TypeCheck(bctx, (PyTypeObject *)self->context_type) || CUPROC_SLOT(own, self->off_ended) != Py_None
        || CUPROC_SLOT(bctx, self->off_ended) != Py_None || PyList_GET_ITEM(self->forked, 0) != Py_False)
        goto slow;
    table = CUPROC_SLOT(bctx, self->off_table);
    if (table == NULL || !PyDict_CheckExact(table)) goto slow;
    dptr = cuproc_u64(address);
    if (dptr == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); goto slow; }
    h = cuproc_so_handle(self, own);   /* runs no Python but to refuse (then nothing read here is used) */
    key = CUPROC_SLOT(buf, self->off_key);
    if (h == NULL || key == NULL || !PyWeakref_CheckRefExact(key)) goto slow;
    /* The claim: removing the entry.  No Python code has run since the reads above, nor runs between the
     * lookup and the removal: the key is the buffer's weak reference, found by identity, and a
     * DeviceBuffer compares by identity. */
    Py_INCREF(key);
    entry = PyDict_GetItemWithError(table, key);
    if (entry == NULL) {
        Py_DECREF(key);
        if (PyErr_Occurred()) return NULL;
        Py_SETREF(CUPROC_SLOT(buf, self->off_ended), Py_NewRef(self->freed));   /* whoever has it frees */
        Py_RETURN_NONE;
    }
    Py_INCREF(entry);
    if (PyDict_DelItem(table, key) < 0) { Py_DECREF(entry); Py_DECREF(key); return NULL; }
    Py_DECREF(key);
    Py_SETREF(CUPROC_SLOT(buf, self->off_ended), Py_NewRef(self->freed));
    Py_BEGIN_ALLOW_THREADS
    rc = ((PFN_cuMemFreeAsync_v11020)fn)((CUdeviceptr)dptr, h);
    Py_END_ALLOW_THREADS
    Py_DECREF(entry);   /* after the call: it holds the stream */
    if (rc != 0)
        return cuproc_so_failed(self, buf, NULL, rc);
    self->taken++;
    Py_RETURN_NONE;
slow:
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

/* Whether a buffer (of the front's class, or a subclass) has ended: its finalizer has nothing to give back. */
static int cuproc_so_ended(cuproc_so *self, PyObject *buf)
{
    PyObject *ended = CUPROC_SLOT(buf, self->off_ended);
    return ended != NULL && ended != Py_None;
}

/* DeviceBuffer.__del__: a buffer that has ended (freed, or its context gone) has nothing to give back,
 * the common case once free_async or free() ran, and returns here without the Python finalizer's frame;
 * any other goes to Resource.__del__. */
static PyObject *cuproc_so_finalize(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_so *self = (cuproc_so *)obj;
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (kwnames == NULL && PyVectorcall_NARGS(nargsf) == 1
        && PyObject_TypeCheck(args[0], (PyTypeObject *)self->buffer_type) && cuproc_so_ended(self, args[0]))
        Py_RETURN_NONE;   /* (not counted: taken counts the class finalizer's own returns) */
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

/* The finalizer fronts whose buffer class's tp_finalize is cuproc_so_tp_finalize, one per class
 * (take_finalizer; a reloaded cuproc.device_memory makes a new class), kept for the process: such a
 * class calls back here for as long as it lives.  Beyond the table's size a class keeps the generic
 * slot (correct, slower). */
#define CUPROC_SO_FINALIZERS 16
static cuproc_so *cuproc_so_finalizers[CUPROC_SO_FINALIZERS];
static PyObject *cuproc_s_del;

/* A C finalizer for a live buffer, set by fastpath_device_buffer.c once its fronts exist: 1 when it let the
 * buffer go (freed, or handed a failure to its Python report), 0 to leave it to Resource.__del__. */
static int (*cuproc_so_live_finalizer)(PyObject *buf);

/* DeviceBuffer's tp_finalize once take_finalizer() ran: an ended buffer (the common case) returns without
 * the generic slot's lookup and call of ``__del__``; any other calls the class's ``__del__`` -- the front,
 * so Resource.__del__ -- as that slot does (the current exception saved; one raised is reported, not
 * propagated).  Subclasses never inherit it (a class's slots follow its __del__, which is this front: the
 * generic slot), and assigning DeviceBuffer.__del__ later puts the generic slot back. */
static void cuproc_so_tp_finalize(PyObject *obj)
{
    cuproc_so *fin = NULL;
    cuproc_saved_error saved;
    PyObject *result, *del;
    int i;
    for (i = 0; i < CUPROC_SO_FINALIZERS && cuproc_so_finalizers[i] != NULL; i++)
        if ((PyObject *)Py_TYPE(obj) == cuproc_so_finalizers[i]->buffer_type) { fin = cuproc_so_finalizers[i]; break; }
    /* (the table holds its fronts, so the collector never clears one; if something did, the class's __del__
     * below raises and the failure is reported) */
    if (fin != NULL && fin->slow == NULL) fin = NULL;
    if (fin != NULL && cuproc_so_ended(fin, obj)) {
        fin->taken++;
        return;
    }
    /* held while Python may run (the live finalizer's lookup, a rebind): taking the finalizer again for this
     * class replaces the table's row, which would free the front in use */
    Py_XINCREF(fin);
    if (fin != NULL && cuproc_so_live_finalizer != NULL && cuproc_so_live_finalizer(obj)) {
        Py_DECREF(fin);
        return;   /* cuMemAlloc memory, freed in C (counted by that front) */
    }
    cuproc_error_save(&saved);
    /* the front's Python finalizer; a class not in the table (never the case) gets its own __del__ */
    del = fin != NULL ? Py_NewRef(fin->slow) : PyObject_GetAttr((PyObject *)Py_TYPE(obj), cuproc_s_del);
    Py_XDECREF(fin);
    result = del == NULL ? NULL : PyObject_CallOneArg(del, obj);
    if (result == NULL)
        PyErr_WriteUnraisable(del != NULL ? del : obj);
    Py_XDECREF(result);
    Py_XDECREF(del);
    cuproc_error_restore(&saved);
}

/* finalizer.take_finalizer(): make this front its buffer class's tp_finalize (after ``DeviceBuffer.__del__ =
 * it``, whose assignment set the generic slot): see cuproc_so_tp_finalize.  False when the table is full. */
static PyObject *cuproc_so_take_finalizer(PyObject *obj, PyObject *unused)
{
    cuproc_so *self = (cuproc_so *)obj;
    PyTypeObject *tp = (PyTypeObject *)self->buffer_type;
    PyObject *del;
    int i;
    (void)unused;
    if (self->buffer_type == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (self->vectorcall != cuproc_so_finalize || !(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || tp->tp_dict == NULL)
        goto bad;
    del = PyDict_GetItemWithError(tp->tp_dict, cuproc_s_del);
    if (del != obj) {
        if (del == NULL && PyErr_Occurred()) return NULL;
        goto bad;
    }
    for (i = 0; i < CUPROC_SO_FINALIZERS; i++) {
        if (cuproc_so_finalizers[i] == NULL)
            cuproc_so_finalizers[i] = (cuproc_so *)Py_NewRef(obj);
        else if (cuproc_so_finalizers[i]->buffer_type == self->buffer_type)
            Py_SETREF(cuproc_so_finalizers[i], (cuproc_so *)Py_NewRef(obj));   /* the class's own, now */
        else
            continue;
        tp->tp_finalize = cuproc_so_tp_finalize;
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
bad:
    PyErr_SetString(PyExc_ValueError, "take_finalizer: only the finalizer front, once it is its buffer class's own "
                                      "__del__ (a cuproc bug)");
    return NULL;
}

/* finalizer.finalizes_class: whether the buffer class's tp_finalize is this front's (for tests). */
static PyObject *cuproc_so_finalizes_class(PyObject *obj, void *unused)
{
    cuproc_so *self = (cuproc_so *)obj;
    int i;
    (void)unused;
    if (self->buffer_type == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (((PyTypeObject *)self->buffer_type)->tp_finalize != cuproc_so_tp_finalize) Py_RETURN_FALSE;
    for (i = 0; i < CUPROC_SO_FINALIZERS; i++)
        if (cuproc_so_finalizers[i] == self) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyMethodDef cuproc_so_methods[] = {
    {"take_finalizer", cuproc_so_take_finalizer, METH_NOARGS,
     "Make this finalizer front its buffer class's tp_finalize (after assigning it as __del__)."},
    {NULL, NULL, 0, NULL},
};

static int cuproc_so_traverse(PyObject *obj, visitproc visit, void *arg)
{
    cuproc_so *self = (cuproc_so *)obj;
    Py_VISIT(self->dict); Py_VISIT(self->slow); Py_VISIT(self->failed);
    Py_VISIT(self->stream_type); Py_VISIT(self->buffer_type);
    Py_VISIT(self->context_type); Py_VISIT(self->cstream_type); Py_VISIT(self->forked); Py_VISIT(self->exports);
    Py_VISIT(self->freed); Py_VISIT(Py_TYPE(obj));
    return cuproc_fn_traverse(&self->f, visit, arg);
}

static int cuproc_so_clear(PyObject *obj)
{
    cuproc_so *self = (cuproc_so *)obj;
    Py_CLEAR(self->dict); Py_CLEAR(self->slow); Py_CLEAR(self->failed);
    Py_CLEAR(self->stream_type); Py_CLEAR(self->buffer_type);
    Py_CLEAR(self->context_type); Py_CLEAR(self->cstream_type); Py_CLEAR(self->forked); Py_CLEAR(self->exports);
    Py_CLEAR(self->freed);
    cuproc_fn_clear(&self->f);
    return 0;
}

static PyMemberDef cuproc_so_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(cuproc_so, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(cuproc_so, vectorcall), READONLY, NULL},
    {"taken", T_PYSSIZET, offsetof(cuproc_so, taken), READONLY,
     "how many calls this object handled itself (the rest went to the Python function): the driver calls made,"
     " or for the finalizer the ended buffers its class's tp_finalize let go"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef cuproc_so_getset[] = {   /* __dict__: functools.update_wrapper fills it */
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {"finalizes_class", cuproc_so_finalizes_class, NULL, "whether this front is its buffer class's tp_finalize", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot cuproc_so_slots[] = {
    {Py_tp_getset, (void *)cuproc_so_getset},
    {Py_tp_call, (void *)PyVectorcall_Call},
    {Py_tp_descr_get, (void *)cuproc_one_shot_get},   /* a method, as Function.launch is (fastpath_launch.c) */
    {Py_tp_traverse, (void *)cuproc_so_traverse},
    {Py_tp_clear, (void *)cuproc_so_clear},
    {Py_tp_dealloc, (void *)cuproc_front_dealloc},
    {Py_tp_members, (void *)cuproc_so_members},
    {Py_tp_methods, (void *)cuproc_so_methods},
    {Py_tp_doc, (void *)"alloc_async / DeviceBuffer.free_async with the common case in C; the rest goes to Python."},
    {0, NULL},
};

static PyType_Spec cuproc_so_spec = {
    "cuproc._fastpath_c.StreamOrdered", sizeof(cuproc_so), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR
        | Py_TPFLAGS_DISALLOW_INSTANTIATION,   /* made by make_stream_ordered only: never with NULL fields */
    cuproc_so_slots,
};

static PyTypeObject *cuproc_so_type;

static cuproc_so *cuproc_so_new(PyObject *const *objs, const Py_ssize_t *offsets, PyObject *slow, PyObject *name,
                                vectorcallfunc call)
{
    cuproc_so *self = PyObject_GC_New(cuproc_so, cuproc_so_type);
    if (self == NULL) return NULL;
    self->vectorcall = call;
    self->dict = NULL;
    self->slow = Py_NewRef(slow);
    cuproc_fn_init(&self->f, name, objs[1]);
    self->failed = Py_NewRef(objs[0]);
    self->stream_type = Py_NewRef(objs[2]); self->buffer_type = Py_NewRef(objs[3]);
    self->context_type = Py_NewRef(objs[4]); self->cstream_type = Py_NewRef(objs[5]);
    self->forked = Py_NewRef(objs[6]); self->exports = Py_NewRef(objs[7]); self->freed = Py_NewRef(objs[8]);
    self->off_driver = offsets[0]; self->off_ended = offsets[1]; self->off_context = offsets[2];
    self->off_address = offsets[3]; self->off_nbytes = offsets[4]; self->off_stream = offsets[5];
    self->off_pool = offsets[6]; self->off_last = offsets[7]; self->off_table = offsets[8];
    self->off_stream_context = offsets[9]; self->off_stream_handle = offsets[10]; self->off_key = offsets[11];
    self->taken = 0;
    PyObject_GC_Track(self);
    return self;
}

/* make_stream_ordered(alloc_slow, alloc_failed, alloc_pointer_of, free_slow, free_failed, free_pointer_of, finalizer,
 *     Stream, DeviceBuffer, Context, the ctype of CUstream, FORKED, EXPORTS, "freed",
 *     (the member descriptors of a DeviceBuffer's driver, ended, context, address, nbytes, stream, pool,
 *      last_stream, Context's stream_ordered, Stream's context and handle, and DeviceBuffer's claim_key))
 *   -> (alloc_async, free_async, __del__) */
static PyObject *cuproc_make_stream_ordered(PyObject *module, PyObject *args)
{
    PyObject *alloc_slow, *alloc_failed, *alloc_pointer_of, *free_slow, *free_failed, *free_pointer_of, *finalizer;
    PyObject *stream_type, *buffer_type, *context_type, *cstream_type, *forked, *exports, *freed;
    PyObject *members, *objs[9];
    Py_ssize_t offsets[12], i, shared;   /* shared: a slot's offset in Stream or Context, only checked */
    cuproc_so *alloc, *free_, *fin;
    PyObject *result;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOOOOOO!O!O!OO!O!UO!", &alloc_slow, &alloc_failed, &alloc_pointer_of,
                          &free_slow, &free_failed, &free_pointer_of, &finalizer, &PyType_Type, &stream_type, &PyType_Type,
                          &buffer_type, &PyType_Type, &context_type, &cstream_type,
                          &PyList_Type, &forked, &PyDict_Type, &exports, &freed, &PyTuple_Type, &members))
        return NULL;
    if (PyTuple_GET_SIZE(members) != 12 || PyList_GET_SIZE(forked) != 1 || !PyCallable_Check(alloc_slow)
        || !PyCallable_Check(free_slow) || !PyCallable_Check(alloc_failed) || !PyCallable_Check(free_failed)
        || !PyCallable_Check(alloc_pointer_of) || !PyCallable_Check(free_pointer_of) || !PyCallable_Check(finalizer)
        || ((PyTypeObject *)buffer_type)->tp_itemsize != 0) {
        PyErr_SetString(PyExc_ValueError, "make_stream_ordered: inconsistent arguments (a cuproc bug)");
        return NULL;
    }
    for (i = 0; i < 12; i++) {   /* eight slots of a DeviceBuffer, the Context's table, two of a Stream, the key */
        PyObject *owner = i < 8 || i == 11 ? buffer_type : i == 8 ? context_type : stream_type;
        if (cuproc_slot_offset(PyTuple_GET_ITEM(members, i), owner, &offsets[i], "make_stream_ordered") < 0)
            return NULL;
    }
    /* ended is read from Streams and Contexts too, and driver from Contexts: checked to be slots of theirs
     * as well (the same descriptor, so the same offset), or a read would fall outside a smaller object */
    if (cuproc_slot_offset(PyTuple_GET_ITEM(members, 1), stream_type, &shared, "make_stream_ordered") < 0
        || cuproc_slot_offset(PyTuple_GET_ITEM(members, 1), context_type, &shared, "make_stream_ordered") < 0
        || cuproc_slot_offset(PyTuple_GET_ITEM(members, 0), context_type, &shared, "make_stream_ordered") < 0)
        return NULL;
    objs[0] = alloc_failed; objs[1] = alloc_pointer_of; objs[2] = stream_type; objs[3] = buffer_type;
    objs[4] = context_type; objs[5] = cstream_type; objs[6] = forked; objs[7] = exports; objs[8] = freed;
    alloc = cuproc_so_new(objs, offsets, alloc_slow, cuproc_s_cuMemAllocAsync, cuproc_so_alloc);
    if (alloc == NULL) return NULL;
    objs[0] = free_failed;
    objs[1] = free_pointer_of;
    free_ = cuproc_so_new(objs, offsets, free_slow, cuproc_s_cuMemFreeAsync, cuproc_so_free);
    if (free_ == NULL) { Py_DECREF(alloc); return NULL; }
    fin = cuproc_so_new(objs, offsets, finalizer, cuproc_s_cuMemFreeAsync, cuproc_so_finalize);
    if (fin == NULL) { Py_DECREF(alloc); Py_DECREF(free_); return NULL; }
    result = PyTuple_Pack(3, (PyObject *)alloc, (PyObject *)free_, (PyObject *)fin);
    Py_DECREF(alloc);
    Py_DECREF(free_);
    Py_DECREF(fin);
    return result;
}

static PyMethodDef cuproc_make_stream_ordered_def = {
    "make_stream_ordered", cuproc_make_stream_ordered, METH_VARARGS,
    "alloc_async and DeviceBuffer.free_async in C (cuproc.device_memory builds the arguments).",
};

/* Called once through cffi (which released the GIL): put StreamOrdered and make_stream_ordered on the module. */
static int cuproc_install_memory(void)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc;
    if (cuproc_so_type == NULL) {
        cuproc_s_cuMemAllocAsync = PyUnicode_InternFromString("cuMemAllocAsync");
        cuproc_s_cuMemFreeAsync = PyUnicode_InternFromString("cuMemFreeAsync");
        cuproc_s_del = PyUnicode_InternFromString("__del__");
        if (cuproc_s_cuMemAllocAsync && cuproc_s_cuMemFreeAsync && cuproc_s_del) {
            cuproc_so_type = (PyTypeObject *)PyType_FromSpec(&cuproc_so_spec);
#if PY_VERSION_HEX >= 0x030C0000
            cuproc_so_watcher = PyDict_AddWatcher(cuproc_so_dict_changed);   /* -1: none free; looked up per call */
            if (cuproc_so_watcher < 0) PyErr_Clear();
#endif
        }
    }
    rc = cuproc_publish(&cuproc_make_stream_ordered_def, "StreamOrdered", cuproc_so_type);
    PyGILState_Release(gil);
    return rc;
}
