// Makes the extension importable as `moepack._C`; importing it runs the TORCH_LIBRARY
// registrations in ops.cpp. The module itself has no Python functions.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "moepack._C", "moepack native ops (torch.ops.moepack)", -1,
                                   nullptr};
  return PyModule_Create(&def);
}
