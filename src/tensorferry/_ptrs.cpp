/* Per-tensor reads in one C++ loop, for kept plans (see _tensors.py).
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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

static PyMethodDef methods[] = {
    {"data_ptrs", data_ptrs, METH_VARARGS,
     "data_ptrs(reader, tensors, out): each tensor's data pointer into out (int64); -1, or the index of a tensor the reader refused."},
    {"slots_hold", slots_hold, METH_VARARGS,
     "slots_hold(dicts, names, objects): -1 if each dicts[i].get(names[i]) is objects[i], else the first i that is not."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorferry._ptrs",
    "Kept plans' per-tensor checks as C++ loops: tensors' data pointers, module slots.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ptrs(void)
{
    return PyModule_Create(&module);
}
