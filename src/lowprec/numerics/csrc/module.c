/*
 * module.c: the shell that makes the kernel a CPython extension module, only so that setuptools
 * compiles it at install time; it is called through ctypes (lowprec/numerics/kernel/, which
 * checks lp_abi_version; the GIL is released during a call). The other files hold the work.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

int lp_abi_version(void) { return 6; }

static struct PyModuleDef lp_module = {PyModuleDef_HEAD_INIT, "_qkernel",
                                       "lowprec quantization kernel (called through ctypes)", -1,
                                       NULL};

PyMODINIT_FUNC PyInit__qkernel(void) { return PyModule_Create(&lp_module); }
