/* Per-tensor reads in C++ loops, for kept plans and the sender's inspection (see _flatten.py, _tensor_meta.py).
 *
 * A kept plan checks, on every put and every get into existing tensors,
 * that each planned tensor still lives where the plan found it. From
 * Python that is one data_ptr() call a tensor: about 75 ns at best
 * (map(torch.Tensor.data_ptr, ...)), 7.5 ms per 100k tensors, about a tenth
 * of a 1 GiB shm sync. Here the loop is C++ and each tensor costs a call of
 * torch's own reader, _torchinductor_pyobject_tensor_data_ptr (exported by
 * torch for the code torch.compile generates; its address comes from
 * Python, so this module does not link against torch).
 *
 * That reader throws a C++ exception for what has no data pointer (a sparse
 * tensor, a storage-less wrapper subclass swapped into a planned tensor):
 * the loop catches it and says where, and the caller asks Python's
 * data_ptr(), which raises the error it always raised. This is why the
 * file is C++: an exception must not unwind through C frames.
 *
 * slots_hold does the module check the same way: whether each planned
 * parameter or buffer is still the object in its module's dict.
 *
 * columns and differs read a tensor's address, dtype, sizes, strides and
 * flags through torch's C shim (aoti_torch_get_*, the ABI-stable C
 * functions libtorch exports for AOTInductor's generated code; their
 * addresses come from Python, see _tensor_meta.py), about 20 ns a tensor.
 * The shim takes an at::Tensor*. A tensor's Python object holds its
 * at::Tensor right after the object header (THPVariable in torch's
 * python_variable.h); bind() checks that on a sample tensor against
 * TensorBase's own _cdata getter (the TensorImpl address, which is all an
 * at::Tensor holds) and, where a torch lays its objects out otherwise,
 * the loops ask that getter per tensor instead (about 150 ns: it makes a
 * Python int). Every shim function catches torch's exceptions and returns
 * nonzero instead, so nothing unwinds through here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>


typedef void *(*data_ptr_fn)(PyObject *);

/* data_ptrs(reader, tensors, out) -> -1, or the index whose read raised.
 * reader: the address of torch's reader; tensors: a list of tensors (the
 * caller's, held for the call); out: a writable buffer of len(tensors)
 * int64. The GIL is held throughout (the list and the tensors cannot
 * change under the loop). */
static PyObject *data_ptrs(PyObject *self, PyObject *args)
{
    unsigned long long address;
    PyObject *tensors;
    Py_buffer out;
    (void)self;
    if (!PyArg_ParseTuple(args, "KO!w*", &address, &PyList_Type, &tensors, &out))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    if (address == 0 || out.len < n * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "data_ptrs: need a reader and %zd int64 slots, got %zd bytes", n, out.len);
        return NULL;
    }
    data_ptr_fn read = (data_ptr_fn)(uintptr_t)address;
    int64_t *o = (int64_t *)out.buf;
    Py_ssize_t i = 0;
    try {
        for (; i < n; i++)
            o[i] = (int64_t)(intptr_t)read(PyList_GET_ITEM(tensors, i));
    } catch (...) {
        PyBuffer_Release(&out);
        return PyLong_FromSsize_t(i);
    }
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(-1);
}

/* slots_hold(dicts, names, objects) -> -1, or the first i for which
 * dicts[i].get(names[i]) is not objects[i]. Three lists of one length. */
static PyObject *slots_hold(PyObject *self, PyObject *args)
{
    PyObject *dicts, *names, *objects;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &dicts, &PyList_Type, &names, &PyList_Type, &objects))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(objects);
    if (PyList_GET_SIZE(dicts) != n || PyList_GET_SIZE(names) != n) {
        PyErr_SetString(PyExc_ValueError, "slots_hold: dicts, names and objects differ in length");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(dicts, i);
        if (!PyDict_Check(d)) {
            PyErr_Format(PyExc_TypeError, "slots_hold: dicts[%zd] is not a dict", i);
            return NULL;
        }
        PyObject *now = PyDict_GetItemWithError(d, PyList_GET_ITEM(names, i)); /* borrowed */
        if (now == NULL && PyErr_Occurred())
            return NULL;
        if (now != PyList_GET_ITEM(objects, i))
            return PyLong_FromSsize_t(i);
    }
    return PyLong_FromSsize_t(-1);
}

/* The shim's functions, the tensor type and its _cdata getter, set once by bind(). */
typedef int32_t (*get_ptr_fn)(void *, void **);
typedef int32_t (*get_i32_fn)(void *, int32_t *);
typedef int32_t (*get_i64_fn)(void *, int64_t *);
typedef int32_t (*get_arr_fn)(void *, int64_t **);
typedef int32_t (*get_bool_fn)(void *, bool *);

static struct {
    get_ptr_fn data_ptr;
    get_i32_fn dtype;
    get_i64_fn dim;
    get_arr_fn sizes;
    get_arr_fn strides;
    get_bool_fn contiguous;
    get_i32_fn device_type;
    PyTypeObject *tensor_type;
    PyObject *cdata; /* TensorBase.__dict__["_cdata"], a getset descriptor */
    bool in_place; /* the at::Tensor sits right after the object header */
    bool (*is_neg)(const void *); /* at::native::is_neg(const at::Tensor&) (or at::_ops::is_neg::call), or NULL */
    bool (*is_conj)(const void *);
    PyTypeObject *plain[4]; /* exact types taken as tensors without a subtype walk (bind_plain) */
    void (*bump_version)(const void *); /* torch::autograd::impl::bump_version(const at::Tensor&), or NULL */
    /* Byte offsets in a TensorImpl of its StorageImpl pointer and its
     * version counter's pointer, found by bind_prefetch's caller on sample
     * tensors; -1: unknown. Used for prefetches only, which never fault:
     * a wrong offset costs speed, never correctness. */
    Py_ssize_t storage_at, version_at;
} shim;

static inline bool is_plain(PyTypeObject *type)
{
    for (int k = 0; k < 4 && shim.plain[k] != NULL; k++)
        if (type == shim.plain[k])
            return true;
    return false;
}

/* bind(addresses, tensor_type, cdata_getter, sample, sample_impl) ->
 * whether tensors are read in place (else through the getter): addresses
 * of aoti_torch_get_{data_ptr,dtype,dim,sizes,strides},
 * aoti_torch_is_contiguous and aoti_torch_get_device_type, in that order;
 * sample a tensor whose _cdata is sample_impl. */
static PyObject *bind(PyObject *self, PyObject *args)
{
    unsigned long long a[7], sample_impl;
    PyObject *type, *descr, *sample;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKKKKKK)O!OOK", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6], &PyType_Type, &type, &descr,
                          &sample, &sample_impl))
        return NULL;
    for (int k = 0; k < 7; k++)
        if (a[k] == 0) {
            PyErr_Format(PyExc_ValueError, "bind: address %d is 0", k);
            return NULL;
        }
    if (Py_TYPE(descr)->tp_descr_get == NULL || !PyObject_TypeCheck(sample, (PyTypeObject *)type)) {
        PyErr_SetString(PyExc_TypeError, "bind: need TensorBase's _cdata getter and a sample tensor");
        return NULL;
    }
    shim.data_ptr = (get_ptr_fn)(uintptr_t)a[0];
    shim.dtype = (get_i32_fn)(uintptr_t)a[1];
    shim.dim = (get_i64_fn)(uintptr_t)a[2];
    shim.sizes = (get_arr_fn)(uintptr_t)a[3];
    shim.strides = (get_arr_fn)(uintptr_t)a[4];
    shim.contiguous = (get_bool_fn)(uintptr_t)a[5];
    shim.device_type = (get_i32_fn)(uintptr_t)a[6];
    Py_INCREF(type);
    Py_INCREF(descr);
    Py_XDECREF((PyObject *)shim.tensor_type);
    Py_XDECREF(shim.cdata);
    shim.tensor_type = (PyTypeObject *)type;
    shim.cdata = descr;
    shim.in_place = sample_impl != 0 && *(void **)((char *)sample + sizeof(PyObject)) == (void *)(uintptr_t)sample_impl;
    return PyBool_FromLong(shim.in_place);
}

/* bind_bits(is_neg, is_conj): addresses of C++ functions of one const
 * at::Tensor& that libtorch exports: at::native::is_neg and is_conj (the
 * kernels, which read a bit of the tensor's dispatch key set: ~1 ns), or
 * else the operator entry points at::_ops::is_neg::call and is_conj::call
 * (through the dispatcher: ~20 ns, 2 ms of a 100k-tensor pass). Either
 * way columns says whether a tensor's bytes are its values without a
 * Python call a tensor (torch.Tensor.is_neg: ~0.4 us). 0, 0 unbinds them. */
static PyObject *bind_bits(PyObject *self, PyObject *args)
{
    unsigned long long neg, conj;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK", &neg, &conj))
        return NULL;
    shim.is_neg = neg && conj ? (bool (*)(const void *))(uintptr_t)neg : NULL;
    shim.is_conj = neg && conj ? (bool (*)(const void *))(uintptr_t)conj : NULL;
    return PyBool_FromLong(shim.is_neg != NULL);
}

/* bind_plain(types): up to 4 tensor types (torch.Tensor, nn.Parameter)
 * that the loops take by their exact type, and first_not_plain asks for. */
static PyObject *bind_plain(PyObject *self, PyObject *args)
{
    PyObject *types;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &types))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(types);
    if (n > 4) {
        PyErr_Format(PyExc_ValueError, "bind_plain: at most 4 types, got %zd", n);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++)
        if (!PyType_Check(PyTuple_GET_ITEM(types, k)) || (shim.tensor_type != NULL &&
                                                          !PyType_IsSubtype((PyTypeObject *)PyTuple_GET_ITEM(types, k), shim.tensor_type))) {
            PyErr_SetString(PyExc_TypeError, "bind_plain: need tensor types (after bind)");
            return NULL;
        }
    for (int k = 0; k < 4; k++) {
        PyTypeObject *old = shim.plain[k];
        shim.plain[k] = NULL;
        Py_XDECREF((PyObject *)old);
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_INCREF(PyTuple_GET_ITEM(types, k));
        shim.plain[k] = (PyTypeObject *)PyTuple_GET_ITEM(types, k);
    }
    Py_RETURN_NONE;
}

/* first_not_plain(items) -> -1, or the first i whose exact type is none
 * of bind_plain's (a list of 100k: ~0.1 ms, against 1 ms for
 * set(map(type, items))). */
static PyObject *first_not_plain(PyObject *self, PyObject *args)
{
    PyObject *items;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &items))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!is_plain(Py_TYPE(PyList_GET_ITEM(items, i))))
            return PyLong_FromSsize_t(i);
    return PyLong_FromSsize_t(-1);
}

/* Whether obj is a tensor. The exact-type test first: PyObject_TypeCheck
 * walks torch.Tensor's MRO, a call of its own a tensor. */
static inline bool is_tensor(PyObject *obj)
{
    return is_plain(Py_TYPE(obj)) || PyObject_TypeCheck(obj, shim.tensor_type);
}

/* The tensor's at::Tensor*: in its object, or *slot holding the
 * TensorImpl address the getter gave. NULL: not a tensor, or the getter
 * raised (the error is cleared, the caller reports the index). */
static void *handle_of(PyObject *obj, void **slot)
{
    if (!is_tensor(obj))
        return NULL;
    if (shim.in_place)
        return (void *)((char *)obj + sizeof(PyObject));
    PyObject *addr = Py_TYPE(shim.cdata)->tp_descr_get(shim.cdata, obj, (PyObject *)Py_TYPE(obj));
    if (addr == NULL) {
        PyErr_Clear();
        return NULL;
    }
    *slot = PyLong_AsVoidPtr(addr);
    Py_DECREF(addr);
    if (*slot == NULL) {
        PyErr_Clear();
        return NULL;
    }
    return (void *)slot;
}

/* One tensor through the shim: 0, or nonzero where it has no such
 * reading (not a tensor, no storage, symbolic sizes). */
struct Reading {
    int64_t ptr, ndim;
    int32_t dtype, device;
    int64_t *sizes, *strides;
    bool contiguous;
};

static int read_one(PyObject *obj, Reading *r, bool flags)
{
    void *slot = NULL, *ptr = NULL;
    void *h = handle_of(obj, &slot);
    if (h == NULL)
        return 1;
    if (shim.data_ptr(h, &ptr) || shim.dtype(h, &r->dtype) || shim.dim(h, &r->ndim) || shim.sizes(h, &r->sizes) ||
        shim.strides(h, &r->strides))
        return 1;
    r->ptr = (int64_t)(intptr_t)ptr;
    if (flags && (shim.contiguous(h, &r->contiguous) || shim.device_type(h, &r->device)))
        return 1;
    if (flags && r->contiguous && shim.is_neg != NULL) {
        try {
            r->contiguous = !shim.is_neg(h) && !shim.is_conj(h);
        } catch (...) {
            return 1;
        }
    }
    return 0;
}

/* The TensorImpl of list item i, read in place; NULL: not a tensor. */
static inline char *impl_of(PyObject *tensors, Py_ssize_t i)
{
    PyObject *obj = PyList_GET_ITEM(tensors, i);
    return is_tensor(obj) ? *(char **)((char *)obj + sizeof(PyObject)) : NULL;
}

/* Each tensor's TensorImpl, and the object behind it a loop reads next
 * (its StorageImpl for the data pointer, or its version counter), is a
 * cache miss of its own after a step touched GiBs: in-place reads start
 * the loads of the tensors a few ahead, so their misses overlap (4x
 * faster for 10k tensors here): the Python object 16 ahead, the
 * TensorImpl 8 ahead, and, through the TensorImpl by then in cache, the
 * object behind it 4 ahead. behind: shim.storage_at, shim.version_at,
 * or -1 for none. */
static inline void prefetch_ahead(PyObject *tensors, Py_ssize_t i, Py_ssize_t n, Py_ssize_t behind)
{
    if (!shim.in_place)
        return;
    if (i + 16 < n)
        __builtin_prefetch((char *)PyList_GET_ITEM(tensors, i + 16) + sizeof(PyObject));
    if (i + 8 < n) {
        char *impl = impl_of(tensors, i + 8);
        if (impl != NULL) {
            __builtin_prefetch(impl);
            __builtin_prefetch(impl + 64);
            __builtin_prefetch(impl + 128);
        }
    }
    if (behind >= 0 && i + 4 < n) {
        char *impl = impl_of(tensors, i + 4);
        if (impl != NULL) {
            char *next = *(char **)(impl + behind);
            __builtin_prefetch(next);
            __builtin_prefetch(next + 64);
        }
    }
}

/* prefetch_ahead for bump_versions: a bump reads one word of the
 * TensorImpl (its version counter's pointer) and the counter, so only
 * those lines are fetched; the other two TensorImpl lines and the
 * counter's second would take miss buffers and bandwidth from the loads
 * that are needed. */
static inline void prefetch_for_bump(PyObject *tensors, Py_ssize_t i, Py_ssize_t n)
{
    if (!shim.in_place || shim.version_at < 0) {
        prefetch_ahead(tensors, i, n, shim.version_at);
        return;
    }
    if (i + 16 < n)
        __builtin_prefetch((char *)PyList_GET_ITEM(tensors, i + 16) + sizeof(PyObject));
    if (i + 8 < n) {
        char *impl = impl_of(tensors, i + 8);
        if (impl != NULL)
            __builtin_prefetch(impl + shim.version_at);
    }
    if (i + 4 < n) {
        char *impl = impl_of(tensors, i + 4);
        if (impl != NULL)
            __builtin_prefetch(*(char **)(impl + shim.version_at));
    }
}

/* bind_prefetch(storage_at, version_at): byte offsets in a TensorImpl of
 * its StorageImpl and version counter pointers (-1: unknown), each below
 * 192 (within any TensorImpl). */
static PyObject *bind_prefetch(PyObject *self, PyObject *args)
{
    Py_ssize_t storage_at, version_at;
    (void)self;
    if (!PyArg_ParseTuple(args, "nn", &storage_at, &version_at))
        return NULL;
    if (storage_at < -1 || storage_at > 184 || version_at < -1 || version_at > 184 || (storage_at > 0 && storage_at % 8) ||
        (version_at > 0 && version_at % 8)) {
        PyErr_Format(PyExc_ValueError, "bind_prefetch: offsets must be -1 or multiples of 8 below 192, got %zd and %zd",
                     storage_at, version_at);
        return NULL;
    }
    shim.storage_at = storage_at;
    shim.version_at = version_at;
    Py_RETURN_NONE;
}

static bool bound(void)
{
    if (shim.tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tensorferry.tensors._ptrs: bind() was not called");
        return false;
    }
    return true;
}

static bool fits(Py_buffer *b, Py_ssize_t n, Py_ssize_t itemsize, const char *what)
{
    if (b->len < n * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: need %zd bytes, got %zd", what, n * itemsize, b->len);
        return false;
    }
    return true;
}

/* bind_bump(address): torch::autograd::impl::bump_version(const
 * at::Tensor&), which libtorch exports (what torch.autograd.graph.
 * increment_version calls a tensor, after ~190 ns of its own argument
 * conversion); 0 unbinds it. */
static PyObject *bind_bump(PyObject *self, PyObject *args)
{
    unsigned long long address;
    (void)self;
    if (!PyArg_ParseTuple(args, "K", &address))
        return NULL;
    shim.bump_version = (void (*)(const void *))(uintptr_t)address;
    Py_RETURN_NONE;
}

/* bump_versions(tensors) -> -1, or the first i not bumped: bumps each
 * tensor's autograd version counter (views share their base's). A tensor
 * without a counter (made under inference_mode) makes torch throw; the
 * loop stops there and the caller hands the rest to torch, which says or
 * skips. The GIL is held throughout. */
static PyObject *bump_versions(PyObject *self, PyObject *args)
{
    PyObject *tensors;
    (void)self;
    if (!bound() || !PyArg_ParseTuple(args, "O!", &PyList_Type, &tensors))
        return NULL;
    if (shim.bump_version == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bump_versions: bind_bump() was not given torch's bump_version");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(tensors), i = 0;
    for (; i < n; i++) {
        void *slot = NULL;
        prefetch_for_bump(tensors, i, n);
        void *h = handle_of(PyList_GET_ITEM(tensors, i), &slot);
        if (h == NULL)
            break;
        try {
            shim.bump_version(h);
        } catch (...) {
            break;
        }
    }
    return PyLong_FromSsize_t(i < n ? i : (Py_ssize_t)-1);
}

/* columns(tensors, ptrs, dtypes, ndims, raw, devices[, numels[, plain_only]]) -> (i, sizes, strides).
 * Fills, per tensor, its data pointer (int64), dtype (the shim's int32
 * ScalarType), ndim (int64), whether its bytes are its values (uint8:
 * contiguous, and, where bind_bits was given, neither a negative nor a
 * conjugate view), device type (int32) and, where a numels buffer is
 * given, its number of elements (int64: the product of its sizes, which
 * a live tensor keeps in range; a Layout built from local tensors then
 * skips recomputing it, 2-3 ms per 100k); plain_only: a tensor whose
 * exact type is none of bind_plain's is one the pass cannot read (the
 * sender's inspection then takes its Python passes, which know subclasses),
 * and returns every size and every stride, tensor after tensor, as bytes
 * of int64; i is -1, or the index of the first tensor the shim could not
 * read (the columns are then filled up to it only). */
static PyObject *columns(PyObject *self, PyObject *args)
{
    PyObject *tensors;
    Py_buffer b[6];
    (void)self;
    b[5].obj = NULL;
    b[5].buf = NULL;
    b[5].len = 0;
    int plain_only = 0;
    if (!bound() || !PyArg_ParseTuple(args, "O!w*w*w*w*w*|w*p", &PyList_Type, &tensors, &b[0], &b[1], &b[2], &b[3], &b[4], &b[5],
                                      &plain_only))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    PyObject *result = NULL;
    if (fits(&b[0], n, 8, "columns ptrs") && fits(&b[1], n, 4, "columns dtypes") && fits(&b[2], n, 8, "columns ndims") &&
        fits(&b[3], n, 1, "columns contiguous") && fits(&b[4], n, 4, "columns devices") &&
        (b[5].buf == NULL || fits(&b[5], n, 8, "columns numels"))) {
        int64_t *ptrs = (int64_t *)b[0].buf, *ndims = (int64_t *)b[2].buf, *numels = (int64_t *)b[5].buf;
        int32_t *dtypes = (int32_t *)b[1].buf, *devices = (int32_t *)b[4].buf;
        uint8_t *contiguous = (uint8_t *)b[3].buf;
        /* Sizes and strides go straight into the bytes returned, grown
         * as needed and cut to length at the end: no vector copied into
         * them (at 100k tensors that copy and its pages were a tenth of
         * the pass). Views are of 1 or 2 dims mostly: room for 2 a tensor. */
        Py_ssize_t cap = 2 * n > 16 ? 2 * n : 16, at = 0, i = 0;
        PyObject *sizes = PyBytes_FromStringAndSize(NULL, cap * 8);
        PyObject *strides = sizes == NULL ? NULL : PyBytes_FromStringAndSize(NULL, cap * 8);
        bool ok = strides != NULL;
        for (; ok && i < n; i++) {
            Reading r;
            prefetch_ahead(tensors, i, n, shim.storage_at);
            PyObject *obj = PyList_GET_ITEM(tensors, i);
            if ((plain_only && !is_plain(Py_TYPE(obj))) || read_one(obj, &r, true))
                break;
            if (r.ndim > cap - at) {
                Py_ssize_t want = 2 * cap > at + r.ndim ? 2 * cap : at + r.ndim;
                if (_PyBytes_Resize(&sizes, want * 8) || _PyBytes_Resize(&strides, want * 8)) {
                    ok = false; /* _PyBytes_Resize freed what it could not grow */
                    break;
                }
                cap = want;
            }
            ptrs[i] = r.ptr;
            dtypes[i] = r.dtype;
            ndims[i] = r.ndim;
            contiguous[i] = r.contiguous;
            devices[i] = r.device;
            /* A loop, not memcpy: a call of its own for 8 or 16 bytes. */
            int64_t *sz = (int64_t *)PyBytes_AS_STRING(sizes) + at, *st = (int64_t *)PyBytes_AS_STRING(strides) + at;
            int64_t numel = 1;
            for (int64_t d = 0; d < r.ndim; d++) {
                sz[d] = r.sizes[d];
                st[d] = r.strides[d];
                numel *= r.sizes[d];
            }
            if (numels != NULL)
                numels[i] = numel;
            at += r.ndim;
        }
        if (ok && !_PyBytes_Resize(&sizes, at * 8) && !_PyBytes_Resize(&strides, at * 8)) {
            result = Py_BuildValue("(nNN)", i < n ? i : (Py_ssize_t)-1, sizes, strides);
            sizes = strides = NULL; /* N: the tuple holds them, or freed them */
        }
        Py_XDECREF(sizes);
        Py_XDECREF(strides);
    }
    for (int k = 0; k < 6; k++)
        if (k < 5 || b[k].obj != NULL)
            PyBuffer_Release(&b[k]);
    return result;
}

/* differs(tensors, ptrs, dtypes, ndims, sizes, strides) -> -1, or the
 * first i whose tensor is not as recorded by columns (address, dtype,
 * sizes and strides) or cannot be read. */
static PyObject *differs(PyObject *self, PyObject *args)
{
    PyObject *tensors;
    Py_buffer b[5];
    (void)self;
    if (!bound() || !PyArg_ParseTuple(args, "O!y*y*y*y*y*", &PyList_Type, &tensors, &b[0], &b[1], &b[2], &b[3], &b[4]))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tensors), found = -1;
    PyObject *result = NULL;
    if (fits(&b[0], n, 8, "differs ptrs") && fits(&b[1], n, 4, "differs dtypes") && fits(&b[2], n, 8, "differs ndims")) {
        const int64_t *ptrs = (const int64_t *)b[0].buf, *ndims = (const int64_t *)b[2].buf;
        const int32_t *dtypes = (const int32_t *)b[1].buf;
        const int64_t *sizes = (const int64_t *)b[3].buf, *strides = (const int64_t *)b[4].buf;
        Py_ssize_t total = b[3].len / 8, at = 0;
        if (b[4].len / 8 < total)
            total = b[4].len / 8;
        for (Py_ssize_t i = 0; i < n; i++) {
            Reading r;
            int64_t k = ndims[i];
            prefetch_ahead(tensors, i, n, shim.storage_at);
            if (read_one(PyList_GET_ITEM(tensors, i), &r, false) || r.ptr != ptrs[i] || r.dtype != dtypes[i] ||
                r.ndim != k || k > total - at || memcmp(r.sizes, sizes + at, k * 8) || memcmp(r.strides, strides + at, k * 8)) {
                found = i;
                break;
            }
            at += k;
        }
        result = PyLong_FromSsize_t(found);
    }
    for (int k = 0; k < 5; k++)
        PyBuffer_Release(&b[k]);
    return result;
}

/* Raw reads: a kept plan's check without the shim (raw_words,
 * raw_differs). The shim's five calls a tensor, each with its own checks
 * and exception guard, are most of a check's CPU (35 ns a tensor of 75,
 * 100k tensors after a step: 7.5 ms a put and a get); reading the fields
 * themselves costs the cache misses only. Where they lie in a TensorImpl
 * and a StorageImpl is learned by _raw.py on sample tensors and checked
 * there against what torch says (bind_raw); a plan records each tensor's
 * words as the shim's columns are recorded, and checks them against the
 * columns once (a disagreement turns raw reads off for that plan).
 *
 * A tensor's record: its StorageImpl's first three DataPtr words (the
 * data, its deleter, its context: a copy-on-write clone or another
 * allocation changes one), its storage offset, its dtype's 16-bit
 * TypeMeta index (-1: not read raw: no storage, or sizes kept out of
 * line). Its sizes and strides are compared with the recorded columns.
 * Words that are the same mean the same address, dtype, sizes and
 * strides; words that differ are only a reason to ask torch (the caller
 * then reads that one tensor through the shim). */
static struct {
    bool bound;
    Py_ssize_t data_at;   /* the DataPtr's data word in a StorageImpl */
    Py_ssize_t offset_at; /* storage_offset_ in a TensorImpl */
    Py_ssize_t dtype_at;  /* data_type_'s 16-bit index in a TensorImpl */
    Py_ssize_t sizes_at;  /* SizesAndStrides' size_ (ndim) in a TensorImpl; sizes, then strides, inline after it */
    Py_ssize_t inline_dims;
} raw;

#define RAW_WORDS 5

/* bind_raw(data_at, offset_at, dtype_at, sizes_at, inline_dims): the
 * offsets _raw.py found (the StorageImpl pointer is bind_prefetch's
 * storage_at); data_at < 0 unbinds. */
static PyObject *bind_raw(PyObject *self, PyObject *args)
{
    Py_ssize_t d, o, t, z, k;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnn", &d, &o, &t, &z, &k))
        return NULL;
    raw.bound = false;
    if (d < 0)
        Py_RETURN_FALSE;
    /* Within the 192 bytes every TensorImpl has (and a StorageImpl's first 48). */
    if (!shim.in_place || shim.storage_at < 0 || d % 8 || d > 24 || o % 8 || o < 0 || o > 184 || t % 2 || t < 0 || t > 190 ||
        z % 8 || z < 0 || k < 1 || k > 8 || z + 8 + 16 * k > 192) {
        PyErr_Format(PyExc_ValueError, "bind_raw: offsets out of range (%zd, %zd, %zd, %zd, %zd)", d, o, t, z, k);
        return NULL;
    }
    raw.data_at = d;
    raw.offset_at = o;
    raw.dtype_at = t;
    raw.sizes_at = z;
    raw.inline_dims = k;
    raw.bound = true;
    Py_RETURN_TRUE;
}

/* A tensor's record into rec; returns its ndim as the TensorImpl holds it. */
static inline int64_t read_raw(const char *impl, int64_t *rec)
{
    const char *st = *(const char *const *)(impl + shim.storage_at);
    int64_t ndim = *(const int64_t *)(impl + raw.sizes_at);
    if (st == NULL || ndim < 0 || ndim > raw.inline_dims) {
        rec[0] = rec[1] = rec[2] = rec[3] = 0;
        rec[4] = -1;
        return ndim;
    }
    const int64_t *data = (const int64_t *)(st + raw.data_at);
    rec[0] = data[0];
    rec[1] = data[1];
    rec[2] = data[2];
    rec[3] = *(const int64_t *)(impl + raw.offset_at);
    rec[4] = *(const uint16_t *)(impl + raw.dtype_at);
    return ndim;
}

/* raw_words(tensors, out) -> -1, or the first i that is no tensor: each
 * tensor's RAW_WORDS record into out (int64). */
static PyObject *raw_words(PyObject *self, PyObject *args)
{
    PyObject *tensors;
    Py_buffer out;
    (void)self;
    if (!raw.bound) {
        PyErr_SetString(PyExc_RuntimeError, "raw_words: bind_raw() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!w*", &PyList_Type, &tensors, &out))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tensors), i = 0;
    if (fits(&out, n, 8 * RAW_WORDS, "raw_words out")) {
        int64_t *rec = (int64_t *)out.buf;
        for (; i < n; i++) {
            char *impl = impl_of(tensors, i);
            if (impl == NULL)
                break;
            read_raw(impl, rec + RAW_WORDS * i);
        }
    }
    PyBuffer_Release(&out);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(i < n ? i : (Py_ssize_t)-1);
}

/* raw_differs(tensors, records, ndims, sizes, strides, start, at) -> -1,
 * or the first i >= start whose words are not as recorded (or that has
 * no record to compare, or is no tensor): at is where tensor start's
 * sizes begin in sizes and strides. */
static PyObject *raw_differs(PyObject *self, PyObject *args)
{
    PyObject *tensors;
    Py_buffer b[4];
    Py_ssize_t start, at;
    (void)self;
    if (!raw.bound) {
        PyErr_SetString(PyExc_RuntimeError, "raw_differs: bind_raw() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!y*y*y*y*nn", &PyList_Type, &tensors, &b[0], &b[1], &b[2], &b[3], &start, &at))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tensors), found = -1;
    PyObject *result = NULL;
    if (fits(&b[0], n, 8 * RAW_WORDS, "raw_differs records") && fits(&b[1], n, 8, "raw_differs ndims")) {
        const int64_t *recs = (const int64_t *)b[0].buf, *ndims = (const int64_t *)b[1].buf;
        const int64_t *sizes = (const int64_t *)b[2].buf, *strides = (const int64_t *)b[3].buf;
        Py_ssize_t total = b[2].len / 8 < b[3].len / 8 ? b[2].len / 8 : b[3].len / 8;
        for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
            prefetch_ahead(tensors, i, n, shim.storage_at);
            const char *impl = impl_of(tensors, i);
            const int64_t *rec = recs + RAW_WORDS * i;
            int64_t now[RAW_WORDS], k = ndims[i];
            if (impl == NULL || at < 0 || k > total - at) {
                found = i;
                break;
            }
            bool same = read_raw(impl, now) == k && now[4] >= 0 && now[0] == rec[0] && now[1] == rec[1] && now[2] == rec[2] &&
                        now[3] == rec[3] && now[4] == rec[4];
            const int64_t *sz = (const int64_t *)(impl + raw.sizes_at + 8), *st = sz + raw.inline_dims;
            /* A loop, not memcmp: a call of its own for 8 or 16 bytes. */
            for (int64_t d = 0; same && d < k; d++)
                same = sz[d] == sizes[at + d] && st[d] == strides[at + d];
            if (!same) {
                found = i;
                break;
            }
            at += k;
        }
        result = PyLong_FromSsize_t(found);
    }
    for (int k = 0; k < 4; k++)
        PyBuffer_Release(&b[k]);
    return result;
}

static PyMethodDef methods[] = {
    {"data_ptrs", data_ptrs, METH_VARARGS,
     "data_ptrs(reader, tensors, out): each tensor's data pointer into out (int64); -1, or the index of a tensor the reader refused."},
    {"slots_hold", slots_hold, METH_VARARGS,
     "slots_hold(dicts, names, objects): -1 if each dicts[i].get(names[i]) is objects[i], else the first i that is not."},
    {"bind", bind, METH_VARARGS, "bind(addresses, tensor_type, cdata_getter, sample, sample_impl): the shim functions columns and differs call; whether tensors are read in place."},
    {"bind_bits", bind_bits, METH_VARARGS, "bind_bits(is_neg, is_conj): torch's operator entry points columns calls."},
    {"bind_plain", bind_plain, METH_VARARGS, "bind_plain(types): the exact tensor types the loops take without a subtype walk."},
    {"bind_prefetch", bind_prefetch, METH_VARARGS, "bind_prefetch(storage_at, version_at): where a TensorImpl points to what the loops prefetch."},
    {"bind_bump", bind_bump, METH_VARARGS, "bind_bump(address): torch's bump_version, which bump_versions calls (0 unbinds)."},
    {"bind_raw", bind_raw, METH_VARARGS, "bind_raw(data_at, offset_at, dtype_at, sizes_at, inline_dims): where raw_words and raw_differs read (data_at < 0 unbinds)."},
    {"raw_words", raw_words, METH_VARARGS, "raw_words(tensors, out): -1, or the first item that is no tensor; each tensor's raw record into out."},
    {"raw_differs", raw_differs, METH_VARARGS, "raw_differs(tensors, records, ndims, sizes, strides, start, at): -1, or the first i >= start not as recorded."},
    {"bump_versions", bump_versions, METH_VARARGS, "bump_versions(tensors): -1, or the first tensor whose version counter was not bumped."},
    {"first_not_plain", first_not_plain, METH_VARARGS, "first_not_plain(items): -1, or the first item whose exact type bind_plain was not given."},
    {"columns", columns, METH_VARARGS,
     "columns(tensors, ptrs, dtypes, ndims, raw, devices[, numels[, plain_only]]) -> (i, sizes, strides): each tensor's reading into the columns."},
    {"differs", differs, METH_VARARGS,
     "differs(tensors, ptrs, dtypes, ndims, sizes, strides): -1, or the first tensor not as recorded."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorferry.tensors._ptrs",
    "Per-tensor reads as C++ loops: data pointers, module slots, addresses, dtypes, sizes and strides.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ptrs(void)
{
    shim.storage_at = shim.version_at = -1;
    return PyModule_Create(&module);
}
