// Python access to the compression kernels: the submodule pipesgd._C.compression.
//
// Thin, allocation-free wrappers: every output buffer is passed in by the caller
// (pipesgd/compression.py allocates them), sizes are taken from the float array, and
// the GIL is released while a kernel runs. Arrays are checked here too (dtype,
// C-contiguity, alignment, writability, length) so a wrong call raises ValueError
// instead of touching memory it does not own.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "array_checks.h"
#include "compress/kernels.h"

namespace py = pybind11;

namespace pipesgd {
namespace {

std::size_t float_count(const py::array& a, const char* name) {
  checked_data<float>(a, static_cast<std::size_t>(a.size()), name, false);
  return static_cast<std::size_t>(a.size());
}

// The owner's fused hop of a mode whose wire for n elements is wire_len(n) Wire elements:
// out_wire = encode(decode(in_wire) + local); local = decode(out_wire) * factor.
template <typename Wire, typename Kernel>
void bind_owner_hop(py::module_& m, const char* name, Kernel kernel,
                    std::size_t (*wire_len)(std::size_t)) {
  m.def(
      name,
      [kernel, wire_len](const py::array& in_wire, const py::array& local, float factor,
                         const py::array& out_wire) {
        std::size_t n = float_count(local, "local");
        const Wire* pi = checked_data<Wire>(in_wire, wire_len(n), "in_wire", false);
        float* pl = checked_data<float>(local, n, "local", true);
        Wire* po = checked_data<Wire>(out_wire, wire_len(n), "out_wire", true);
        check_disjoint(local, "local", in_wire, "in_wire");
        check_disjoint(local, "local", out_wire, "out_wire");
        py::gil_scoped_release release;
        kernel(pi, pl, n, factor, po);
      },
      py::arg("in_wire"), py::arg("local"), py::arg("factor"), py::arg("out_wire"),
      "out_wire = encode(decode(in_wire) + local); local = decode(out_wire) * factor");
}

void bind_trunc16(py::module_& m) {
  m.def("trunc16_wire_bytes", &psg_trunc16_wire_bytes, py::arg("n"));
  m.def(
      "trunc16_encode",
      [](const py::array& x, const py::array& wire) {
        std::size_t n = float_count(x, "x");
        const float* px = checked_data<float>(x, n, "x", false);
        auto* pw = checked_data<std::uint16_t>(wire, n, "wire", true);
        py::gil_scoped_release release;
        psg_trunc16_encode(px, n, pw);
      },
      py::arg("x"), py::arg("wire"), "wire[uint16, n] = upper 16 bits of x[float32, n]");
  m.def(
      "trunc16_decode",
      [](const py::array& wire, const py::array& out) {
        std::size_t n = float_count(out, "out");
        const auto* pw = checked_data<std::uint16_t>(wire, n, "wire", false);
        float* po = checked_data<float>(out, n, "out", true);
        py::gil_scoped_release release;
        psg_trunc16_decode(pw, n, po);
      },
      py::arg("wire"), py::arg("out"), "out[float32, n] = decode(wire[uint16, n])");
  m.def(
      "trunc16_decode_add_encode",
      [](const py::array& in_wire, const py::array& local, const py::array& out_wire) {
        std::size_t n = float_count(local, "local");
        const auto* pi = checked_data<std::uint16_t>(in_wire, n, "in_wire", false);
        const float* pl = checked_data<float>(local, n, "local", false);
        auto* po = checked_data<std::uint16_t>(out_wire, n, "out_wire", true);
        py::gil_scoped_release release;
        psg_trunc16_decode_add_encode(pi, pl, n, po);
      },
      py::arg("in_wire"), py::arg("local"), py::arg("out_wire"),
      "out_wire = encode(decode(in_wire) + local)");
  m.def(
      "trunc16_decode_add",
      [](const py::array& in_wire, const py::array& local, const py::array& out) {
        std::size_t n = float_count(local, "local");
        const auto* pi = checked_data<std::uint16_t>(in_wire, n, "in_wire", false);
        const float* pl = checked_data<float>(local, n, "local", false);
        float* po = checked_data<float>(out, n, "out", true);
        py::gil_scoped_release release;
        psg_trunc16_decode_add(pi, pl, n, po);
      },
      py::arg("in_wire"), py::arg("local"), py::arg("out"),
      "out = decode(in_wire) + local (out may be local)");
  bind_owner_hop<std::uint16_t>(m, "trunc16_decode_add_encode_decode",
                                psg_trunc16_decode_add_encode_decode,
                                [](std::size_t n) { return n; });
}

void bind_quant8(py::module_& m) {
  m.def("quant8_wire_bytes", &psg_quant8_wire_bytes, py::arg("n"));
  m.def(
      "quant8_encode",
      [](const py::array& x, const py::array& wire) {
        std::size_t n = float_count(x, "x");
        const float* px = checked_data<float>(x, n, "x", false);
        auto* pw = checked_data<std::uint8_t>(wire, psg_quant8_wire_bytes(n), "wire", true);
        py::gil_scoped_release release;
        psg_quant8_encode(px, n, pw);
      },
      py::arg("x"), py::arg("wire"), "wire[uint8, 4 + n] = [scale][int8 q] of x[float32, n]");
  m.def(
      "quant8_decode",
      [](const py::array& wire, const py::array& out) {
        std::size_t n = float_count(out, "out");
        const auto* pw = checked_data<std::uint8_t>(wire, psg_quant8_wire_bytes(n), "wire", false);
        float* po = checked_data<float>(out, n, "out", true);
        py::gil_scoped_release release;
        psg_quant8_decode(pw, n, po);
      },
      py::arg("wire"), py::arg("out"), "out[float32, n] = q * scale");
  m.def(
      "quant8_decode_add_encode",
      [](const py::array& in_wire, const py::array& local, const py::array& scratch,
         const py::array& out_wire) {
        std::size_t n = float_count(local, "local");
        std::size_t bytes = psg_quant8_wire_bytes(n);
        const auto* pi = checked_data<std::uint8_t>(in_wire, bytes, "in_wire", false);
        const float* pl = checked_data<float>(local, n, "local", false);
        float* ps = checked_data<float>(scratch, n, "scratch", true);
        auto* po = checked_data<std::uint8_t>(out_wire, bytes, "out_wire", true);
        py::gil_scoped_release release;
        psg_quant8_decode_add_encode(pi, pl, n, ps, po);
      },
      py::arg("in_wire"), py::arg("local"), py::arg("scratch"), py::arg("out_wire"),
      "out_wire = encode(decode(in_wire) + local); scratch holds n float32");
  m.def(
      "quant8_decode_add",
      [](const py::array& in_wire, const py::array& local, const py::array& out) {
        std::size_t n = float_count(local, "local");
        const auto* pi =
            checked_data<std::uint8_t>(in_wire, psg_quant8_wire_bytes(n), "in_wire", false);
        const float* pl = checked_data<float>(local, n, "local", false);
        float* po = checked_data<float>(out, n, "out", true);
        py::gil_scoped_release release;
        psg_quant8_decode_add(pi, pl, n, po);
      },
      py::arg("in_wire"), py::arg("local"), py::arg("out"),
      "out = decode(in_wire) + local (out may be local)");
  bind_owner_hop<std::uint8_t>(m, "quant8_decode_add_encode_decode",
                               psg_quant8_decode_add_encode_decode, psg_quant8_wire_bytes);
}

}  // namespace

void bind_compression(py::module_& m) {
  py::module_ sub = m.def_submodule(
      "compression", "Compression kernels on preallocated numpy buffers (see pipesgd.compression)");
  bind_trunc16(sub);
  bind_quant8(sub);
}

}  // namespace pipesgd
