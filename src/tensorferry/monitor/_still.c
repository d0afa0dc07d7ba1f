/* The agent's tick over many processes, its common case in C (see
 * _procfs_many.py, ManyReads.cheap_tick).
 *
 * Most watched processes stand still between two ticks: their stat reads
 * the same bytes, and their last record is handed out again. In Python that
 * case costs a pread call (argument parsing, a 16 KiB bytes object made and
 * shrunk), a bytes compare and a few attribute reads and appends: 1-3 us a
 * process with a cold cache, as much as the kernel's read itself. Here it
 * costs the read.
 *
 * still_many(pids, lasts, now, call, every, out, read_ats) -> list
 *
 *   pids      list of int: the processes, in order
 *   lasts     dict pid -> the backend's _Held (attributes handle, stat,
 *             reuse_until, sample, read_at)
 *   now       float: the tick's monotonic time
 *   call      int: the tick's number; every: int >= 1, or 0 when fds are
 *             not counted: a process whose (call + pid) % every == 0 has
 *             its fds counted this tick, which the caller does
 *   out, read_ats
 *             lists of len(pids): where the process at index i stands
 *             still, out[i] = its record and read_ats[i] = its status
 *             read time (the caller fills in the others)
 *
 * Returns [(i, raw), ...] for every process the caller must look at: raw is
 * stat as read here (bytes), or None where it was not read (no record yet,
 * no held file, the read failed: the caller reads it again and meets the
 * error itself). A process whose stat moved, whose status or command line
 * are due, or whose fds are counted this tick is returned with its raw.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <unistd.h>

/* stat is ~300 bytes; a longer read is handed to the caller, which reads
 * it whole (16 KiB). */
#define STAT_READ 4096

static PyObject *s_handle, *s_stat, *s_reuse_until, *s_sample, *s_read_at;

static int note(PyObject *todo, Py_ssize_t i, PyObject *raw)
{
    PyObject *item = Py_BuildValue("(nO)", i, raw ? raw : Py_None);
    if (item == NULL)
        return -1;
    int rc = PyList_Append(todo, item);
    Py_DECREF(item);
    return rc;
}

/* Set list[i] to value (a new reference is taken). */
static int put(PyObject *list, Py_ssize_t i, PyObject *value)
{
    Py_INCREF(value);
    return PyList_SetItem(list, i, value);
}

static PyObject *still_many(PyObject *self, PyObject *args)
{
    PyObject *pids, *lasts, *out, *read_ats;
    double now;
    long long call, every;
    if (!PyArg_ParseTuple(args, "O!O!dLLO!O!", &PyList_Type, &pids, &PyDict_Type, &lasts, &now, &call, &every,
                          &PyList_Type, &out, &PyList_Type, &read_ats))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(pids);
    if (PyList_GET_SIZE(out) != n || PyList_GET_SIZE(read_ats) != n || every < 0) {
        PyErr_SetString(PyExc_ValueError, "still_many: out and read_ats must be as long as pids, every >= 0");
        return NULL;
    }
    PyObject *todo = PyList_New(0);
    if (todo == NULL)
        return NULL;
    char buf[STAT_READ];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pid = PyList_GET_ITEM(pids, i);
        PyObject *last = PyDict_GetItemWithError(lasts, pid); /* borrowed */
        if (last == NULL) {
            if (PyErr_Occurred() || note(todo, i, NULL) < 0)
                goto fail;
            continue;
        }
        long long p = PyLong_AsLongLong(pid);
        if (p == -1 && PyErr_Occurred())
            goto fail;
        PyObject *handle = PyObject_GetAttr(last, s_handle);
        if (handle == NULL)
            goto fail;
        long fd = -1;
        if (PyTuple_Check(handle) && PyTuple_GET_SIZE(handle) >= 1) {
            fd = PyLong_AsLong(PyTuple_GET_ITEM(handle, 0));
        }
        Py_DECREF(handle);
        if (fd == -1 && PyErr_Occurred())
            goto fail;
        if (fd < 0) {
            if (note(todo, i, NULL) < 0)
                goto fail;
            continue;
        }
        ssize_t got = pread((int)fd, buf, STAT_READ, 0);
        if (got < 0 || got >= STAT_READ) {
            if (note(todo, i, NULL) < 0)
                goto fail;
            continue;
        }
        PyObject *old = PyObject_GetAttr(last, s_stat);
        if (old == NULL)
            goto fail;
        int same = PyBytes_Check(old) && PyBytes_GET_SIZE(old) == got && memcmp(PyBytes_AS_STRING(old), buf, (size_t)got) == 0;
        PyObject *raw = same ? old : NULL;
        if (!same) {
            Py_DECREF(old);
            raw = PyBytes_FromStringAndSize(buf, got);
            if (raw == NULL)
                goto fail;
        }
        int due = !same || (every > 0 && (call + p) % every == 0);
        if (!due) {
            PyObject *until = PyObject_GetAttr(last, s_reuse_until);
            if (until == NULL) {
                Py_DECREF(raw);
                goto fail;
            }
            double u = PyFloat_AsDouble(until);
            Py_DECREF(until);
            if (u == -1.0 && PyErr_Occurred()) {
                Py_DECREF(raw);
                goto fail;
            }
            due = now > u;
        }
        if (due) {
            int rc = note(todo, i, raw);
            Py_DECREF(raw);
            if (rc < 0)
                goto fail;
            continue;
        }
        Py_DECREF(raw);
        PyObject *sample = PyObject_GetAttr(last, s_sample);
        if (sample == NULL)
            goto fail;
        PyObject *read_at = PyObject_GetAttr(last, s_read_at);
        if (read_at == NULL) {
            Py_DECREF(sample);
            goto fail;
        }
        int rc = put(out, i, sample) | put(read_ats, i, read_at);
        Py_DECREF(sample);
        Py_DECREF(read_at);
        if (rc < 0)
            goto fail;
    }
    return todo;
fail:
    Py_DECREF(todo);
    return NULL;
}

static PyMethodDef methods[] = {
    {"still_many", still_many, METH_VARARGS,
     "still_many(pids, lasts, now, call, every, out, read_ats) -> [(i, raw)]: the still processes' records put in "
     "out/read_ats; the others returned for the caller."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorferry.monitor._still",
    "The agent's tick over still processes in C (see still_many).", -1, methods,
};

PyMODINIT_FUNC PyInit__still(void)
{
    s_handle = PyUnicode_InternFromString("handle");
    s_stat = PyUnicode_InternFromString("stat");
    s_reuse_until = PyUnicode_InternFromString("reuse_until");
    s_sample = PyUnicode_InternFromString("sample");
    s_read_at = PyUnicode_InternFromString("read_at");
    if (!s_handle || !s_stat || !s_reuse_until || !s_sample || !s_read_at)
        return NULL;
    return PyModule_Create(&module);
}
