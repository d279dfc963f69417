// Checks of the NumPy arrays the kernel bindings receive (binding layer only): a wrong
// call raises ValueError naming the argument instead of touching memory it does not own.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace pipesgd {

// Pointer to the data of `a`, after checking it is a C-contiguous, aligned array of
// `expected` elements of T (writable if `writable`).
template <typename T>
T* checked_data(const pybind11::array& a, std::size_t expected, const char* name,
                bool writable) {
  namespace py = pybind11;
  if (!a.dtype().is(py::dtype::of<T>())) {
    throw py::value_error(std::string(name) + ": expected dtype " +
                          py::str(py::dtype::of<T>()).cast<std::string>() + ", got " +
                          py::str(a.dtype()).cast<std::string>());
  }
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(name) + ": array must be C-contiguous");
  }
  if (static_cast<std::size_t>(a.size()) != expected) {
    throw py::value_error(std::string(name) + ": expected " + std::to_string(expected) +
                          " elements, got " + std::to_string(a.size()));
  }
  if (writable && !a.writeable()) {
    throw py::value_error(std::string(name) + ": array is read-only");
  }
  auto* ptr = static_cast<T*>(const_cast<void*>(a.data()));
  if (reinterpret_cast<std::uintptr_t>(ptr) % alignof(T) != 0) {
    throw py::value_error(std::string(name) + ": data is not aligned to " +
                          std::to_string(alignof(T)) + " bytes");
  }
  return ptr;
}

// A kernel that writes one array while reading another needs them apart.
inline void check_disjoint(const pybind11::array& a, const char* a_name,
                           const pybind11::array& b, const char* b_name) {
  auto begin = [](const pybind11::array& x) {
    return reinterpret_cast<std::uintptr_t>(x.data());
  };
  auto end = [&](const pybind11::array& x) {
    return begin(x) + static_cast<std::uintptr_t>(x.nbytes());
  };
  if (begin(a) < end(b) && begin(b) < end(a)) {
    throw pybind11::value_error(std::string(a_name) + " and " + b_name + " must not overlap");
  }
}

}  // namespace pipesgd
