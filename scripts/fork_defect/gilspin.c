/* Native threads that loop PyGILState_Ensure(); PyGILState_Release();
   Each Ensure makes a thread state (takes HEAD_LOCK without the GIL). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
static volatile int stop_flag = 0;
static void *spin(void *arg) {
    (void)arg;
    while (!stop_flag) {
        PyGILState_STATE s = PyGILState_Ensure();
        PyGILState_Release(s);
    }
    return NULL;
}
static PyObject *start(PyObject *self, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    for (int i = 0; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, spin, NULL)) return PyErr_SetFromErrno(PyExc_OSError);
        pthread_detach(t);
    }
    Py_RETURN_NONE;
}
static PyObject *stop(PyObject *self, PyObject *args) { stop_flag = 1; Py_RETURN_NONE; }
static PyMethodDef methods[] = {{"start", start, METH_VARARGS, ""}, {"stop", stop, METH_NOARGS, ""}, {NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "gilspin", NULL, -1, methods};
PyMODINIT_FUNC PyInit_gilspin(void) { return PyModule_Create(&mod); }
