// Python access to the pipeline's kernel: the submodule pipesgd._C.pipeline.
//
// The arrays are checked here (dtype, C-contiguity, length, writability, overlap), so a
// wrong call raises ValueError instead of touching memory it does not own; the GIL is
// released while the kernel runs.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "pipeline/scale_add.h"

namespace py = pybind11;

namespace pipesgd {
namespace {

const float* float_data(const py::array& a, const char* name) {
  if (!a.dtype().is(py::dtype::of<float>())) {
    throw py::value_error(std::string(name) + ": expected dtype float32, got " +
                          py::str(a.dtype()).cast<std::string>());
  }
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(name) + ": array must be C-contiguous");
  }
  if (reinterpret_cast<std::uintptr_t>(a.data()) % alignof(float) != 0) {
    throw py::value_error(std::string(name) + ": data is not aligned to 4 bytes");
  }
  return static_cast<const float*>(a.data());
}

void scale_add(py::array y, const py::array& x, float a, float b) {
  const float* xp = float_data(x, "x");
  auto* yp = const_cast<float*>(float_data(y, "y"));
  if (!y.writeable()) throw py::value_error("y: array is read-only");
  if (y.size() != x.size()) {
    throw py::value_error("y and x differ in length: " + std::to_string(y.size()) + " and " +
                          std::to_string(x.size()));
  }
  const auto y0 = reinterpret_cast<std::uintptr_t>(yp);
  const auto x0 = reinterpret_cast<std::uintptr_t>(xp);
  if (y.size() > 0 && y0 < x0 + static_cast<std::uintptr_t>(x.nbytes()) &&
      x0 < y0 + static_cast<std::uintptr_t>(y.nbytes())) {
    throw py::value_error("y and x must not overlap");
  }
  py::gil_scoped_release release;
  psg_scale_add_f32(yp, xp, static_cast<std::size_t>(y.size()), a, b);
}

}  // namespace

void bind_pipeline(py::module_& m) {
  py::module_ sub = m.def_submodule("pipeline", "The pipeline's elementwise kernel");
  sub.def("scale_add", &scale_add, py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b"),
          "y <- a * y + b * x in one pass (float32, C-contiguous, not overlapping).");
}

}  // namespace pipesgd
