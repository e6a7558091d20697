/* ucl._engine: the thin C layer. Parse arguments, release the GIL, do the work, return.
   Docstrings, argument checks and error mapping live in the Python wrappers (ucl/_native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "crc32c.h"

/* crc32c(buffer, value=0) -> int */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &value)) return NULL;
    uint32_t crc;
    if (view.len >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        crc = ucl_crc32c(value, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = ucl_crc32c(value, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_crc32c_hw(PyObject *self, PyObject *noargs) { return PyBool_FromLong(ucl_crc32c_hw()); }

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, NULL},
    {"crc32c_hw", py_crc32c_hw, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "ucl._engine", NULL, -1, methods};

PyMODINIT_FUNC PyInit__engine(void) { return PyModule_Create(&moduledef); }
