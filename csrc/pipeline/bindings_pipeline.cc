// Python access to the pipeline's kernels: the submodule pipesgd._C.pipeline.
//
// The arrays are checked here (dtype, C-contiguity, length, writability, overlap), so a
// wrong call raises ValueError instead of touching memory it does not own; the GIL is
// released while the kernel runs.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <cstddef>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include "array_checks.h"
#include "pipeline/t2_kernels.h"

namespace py = pybind11;

namespace pipesgd {
namespace {

// Every array of one call has the same length and no two share memory.
void check_together(std::initializer_list<std::pair<const py::array*, const char*>> arrays) {
  const auto& [first, first_name] = *arrays.begin();
  for (const auto& [a, name] : arrays) {
    if (a->size() != first->size()) {
      throw py::value_error(std::string(first_name) + " and " + name + " differ in length: " +
                            std::to_string(first->size()) + " and " + std::to_string(a->size()));
    }
  }
  if (first->size() == 0) return;
  for (auto i = arrays.begin(); i != arrays.end(); ++i) {
    for (auto j = std::next(i); j != arrays.end(); ++j) {
      check_disjoint(*i->first, i->second, *j->first, j->second);
    }
  }
}

float* writable_data(py::array& a, const char* name) {
  return checked_data<float>(a, static_cast<std::size_t>(a.size()), name, true);
}

const float* float_data(const py::array& a, const char* name) {
  return checked_data<float>(a, static_cast<std::size_t>(a.size()), name, false);
}

void scale_add(py::array y, const py::array& x, float a, float b) {
  const float* xp = float_data(x, "x");
  float* yp = writable_data(y, "y");
  check_together({{&y, "y"}, {&x, "x"}});
  py::gil_scoped_release release;
  psg_scale_add_f32(yp, xp, static_cast<std::size_t>(y.size()), a, b);
}

void sgd_t2_step(py::array w, const py::array& g, std::optional<py::array> buf, py::array u,
                 const psg_sgd_t2& s) {
  float* wp = writable_data(w, "w");
  const float* gp = float_data(g, "g");
  float* up = writable_data(u, "u");
  float* bp = nullptr;
  if (buf) {
    bp = writable_data(*buf, "buf");
    check_together({{&w, "w"}, {&g, "g"}, {&u, "u"}, {&*buf, "buf"}});
  } else {
    if (s.momentum != 0.0f) throw py::value_error("momentum needs a buffer (buf)");
    check_together({{&w, "w"}, {&g, "g"}, {&u, "u"}});
  }
  py::gil_scoped_release release;
  psg_sgd_t2_step_f32(wp, gp, bp, up, static_cast<std::size_t>(w.size()), &s);
}

}  // namespace

void bind_pipeline(py::module_& m) {
  py::module_ sub = m.def_submodule("pipeline", "The pipeline's kernels (PipeMare's T2)");
  sub.def("scale_add", &scale_add, py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b"),
          "y <- a * y + b * x in one pass (float32, C-contiguous, not overlapping).");
  sub.def(
      "sgd_t2_step",
      [](py::array w, const py::array& g, std::optional<py::array> buf, py::array u, float lr,
         float weight_decay, float momentum, float dampening, bool first, float u_scale,
         float w_old_scale, float w_new_scale) {
        sgd_t2_step(std::move(w), g, std::move(buf), std::move(u),
                    psg_sgd_t2{lr, weight_decay, momentum, dampening, first ? 1 : 0, u_scale,
                               w_old_scale, w_new_scale});
      },
      py::arg("w"), py::arg("g"), py::arg("buf"), py::arg("u"), py::kw_only(), py::arg("lr"),
      py::arg("weight_decay"), py::arg("momentum"), py::arg("dampening"), py::arg("first"),
      py::arg("u_scale"), py::arg("w_old_scale"), py::arg("w_new_scale"),
      "torch.optim.SGD's step on w (buf: its momentum buffer, or None without momentum), "
      "then u <- u_scale*u + w_old_scale*w_old + w_new_scale*w_new, in one pass.");
}

}  // namespace pipesgd
