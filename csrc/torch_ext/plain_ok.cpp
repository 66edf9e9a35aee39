// The fast path's per-call tensor test (flashkda_ext/fast_path.py, plain_ok) as a CPython function.
//
// DLPack does not carry a tensor's neg bit, requires_grad or inference flag into the TVM-FFI modules,
// so the fast path reads them in Python on every call: ~0.3-0.45 us a tensor on an H200 host, the
// whole growth of the fast path's cost since it began reading them. This reads the same flags
// through torch's C++ API in ~20 ns for ten tensors. It is the one source linked against torch
// (built by torch.utils.cpp_extension, flashkda_ext/flag_reader.py); the kernels stay torch-free.
//
// plain_ok(read: tuple, written: tuple) -> bool, the same answer as fast_path._py_plain_ok: every
// item is None or an exact torch.Tensor (no subclass) without a neg bit; under grad mode none
// requires grad; outside inference mode no written one is an inference tensor.
#include <Python.h>

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

bool tuple_ok(PyObject* items, bool grad, bool check_inference) {
  const Py_ssize_t n = PyTuple_GET_SIZE(items);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyTuple_GET_ITEM(items, i);
    if (x == Py_None) continue;
    if (Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return false;
    const at::Tensor& t = THPVariable_Unpack(x);
    if (t.is_neg() || (grad && t.requires_grad()) || (check_inference && t.is_inference())) return false;
  }
  return true;
}

PyObject* plain_ok(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "plain_ok(read, written): expected two tuples");
    return nullptr;
  }
  const bool inference = c10::InferenceMode::is_enabled();
  const bool grad = !inference && c10::GradMode::is_enabled();
  if (tuple_ok(args[0], grad, false) && tuple_ok(args[1], grad, !inference)) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyMethodDef kMethods[] = {
    {"plain_ok", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plain_ok)), METH_FASTCALL,
     "plain_ok(read, written) -> bool: the fast path's exact-type and flag test"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "flashkda_ext_plain_ok", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_flashkda_ext_plain_ok() { return PyModule_Create(&kModule); }
