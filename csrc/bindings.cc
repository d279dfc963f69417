// The only file that knows Python: exposes the engine as pipesgd._C.
//
// Buffers cross as (address, count, dtype): pipesgd/engine.py validates numpy
// arrays and torch tensors and keeps them alive until their operation ends, so
// nothing here holds Python objects while the comm thread runs.
#include <mpi4py/mpi4py.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "dtype.h"
#include "engine.h"
#include "engine_config.h"
#include "operation.h"
#include "poller.h"

namespace py = pybind11;

namespace pipesgd {
void bind_compression(py::module_& m);
void bind_pipeline(py::module_& m);

namespace {

MPI_Comm communicator_from(const py::object& comm) {
  MPI_Comm* handle = PyMPIComm_Get(comm.ptr());
  if (handle == nullptr) throw py::error_already_set();
  if (*handle == MPI_COMM_NULL) throw std::invalid_argument("communicator is MPI.COMM_NULL");
  return *handle;
}

py::dict config_dict(const EngineConfig& c) {
  py::dict d;
  d["segment_bytes"] = c.segment_bytes;
  d["window"] = c.window;
  d["poll_us"] = c.poll_us;
  d["poll_max_us"] = c.poll_max_us;
  d["spin_us"] = c.spin_us;
  d["poll_while_waited"] = c.poll_while_waited;
  d["shm_links"] = c.shm_links;
  d["board_bytes"] = c.board_bytes;
  d["comm_slice_us"] = c.comm_slice_us;
  d["comm_nice"] = c.comm_nice;
  d["stall_seconds"] = c.stall_seconds;
  d["shutdown_seconds"] = c.shutdown_seconds;
  return d;
}

}  // namespace
}  // namespace pipesgd

PYBIND11_MODULE(_C, m) {
  using namespace pipesgd;
  if (import_mpi4py() < 0) throw py::error_already_set();
  m.doc() = "pipesgd's compiled engine: ring-AllReduce on a communication thread";

  m.def(
      "env_config", [] { return config_dict(read_env_config()); },
      "The configuration an engine would start from: the defaults with the five PIPESGD_* "
      "environment variables applied (0 where chosen per transport); ValueError naming a "
      "malformed variable.");

  m.def(
      "buffer_address",
      [](py::handle obj) {
        // The buffer protocol, not numpy's ctypes attribute: 0.07 us against 0.8, paid
        // by every operation (pipesgd/buffers.py has checked the array already).
        Py_buffer view;
        if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
          throw py::error_already_set();
        }
        const auto address = reinterpret_cast<std::uintptr_t>(view.buf);
        PyBuffer_Release(&view);
        return address;
      },
      py::arg("obj"),
      "Address of a writable, C-contiguous buffer (a numpy array) through the buffer "
      "protocol.");

  m.def(
      "polite_wait",
      [](const py::function& test, int spin_us, int poll_us, double timeout_s) {
        if (spin_us < 0 || poll_us < 0) {
          throw std::invalid_argument("polite_wait: spin_us and poll_us must be >= 0");
        }
        struct TimedOut {};
        Poller poller(spin_us, poll_us, poll_us, /*judge_by_last_test=*/false);
        poller.note_progress();
        const auto began = Poller::Clock::now();
        const auto limit = std::chrono::duration<double>(timeout_s);
        py::gil_scoped_release unlocked;  // sleeps let the other Python threads run
        try {
          poller.until(
              [&] {
                py::gil_scoped_acquire locked;
                return test().cast<bool>();
              },
              [&](Poller::Clock::time_point now) {
                if (timeout_s >= 0 && now - began > limit) throw TimedOut{};
              },
              [] { return WaitedPolling::kSleep; }, /*teaches=*/false);
        } catch (const TimedOut&) {
          return false;
        }
        return true;
      },
      py::arg("test"), py::arg("spin_us"), py::arg("poll_us"), py::arg("timeout_s") = -1.0,
      "Calls test() until it returns True, by the comm thread's rule (csrc/poller.h): "
      "without pause for spin_us, then sleeping poll_us between calls, the GIL released "
      "while asleep. False if timeout_s (>= 0) passed first.");

  py::enum_<FailureKind>(m, "FailureKind")
      .value("NONE", FailureKind::kNone)
      .value("MISMATCH", FailureKind::kMismatch)
      .value("ABORTED", FailureKind::kAborted)
      .value("MPI", FailureKind::kMpi)
      .value("INVALID", FailureKind::kInvalid);

  py::class_<Operation, std::shared_ptr<Operation>>(m, "Operation")
      .def_readonly("seq", &Operation::seq)
      .def("wait", &Operation::wait, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>(),
           "Block until finished or timeout_s elapses (negative: forever); True if finished.")
      .def("done", &Operation::finished)
      .def("failed", [](const Operation& op) { return op.status() == OpStatus::kFailed; })
      .def("failure", &Operation::failure)
      .def("error", &Operation::error)
      .def("describe", &Operation::describe)
      .def("open_gate", &Operation::open_gate,
           "Let a gated operation start: its buffer is filled.")
      .def_property_readonly("waiting_on", [](const Operation& op) { return op.waiting_on.load(); })
      .def_property_readonly("phase",
                             [](const Operation& op) { return std::string(op.phase.load()); });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const py::object& comm, std::size_t segment_bytes, int window,
                       int comm_nice, int comm_slice_us, int poll_max_us,
                       bool poll_while_waited, std::size_t board_bytes) {
             MPI_Comm c = communicator_from(comm);
             const EngineOptions options{segment_bytes, window,      comm_nice,
                                         comm_slice_us, poll_max_us, poll_while_waited,
                                         board_bytes};
             py::gil_scoped_release release;
             return std::make_unique<Engine>(c, options);
           }),
           py::arg("comm"), py::arg("segment_bytes") = 0, py::arg("window") = 0,
           py::arg("comm_nice") = EngineOptions{}.comm_nice,
           py::arg("comm_slice_us") = EngineOptions{}.comm_slice_us,
           py::arg("poll_max_us") = EngineOptions{}.poll_max_us,
           py::arg("poll_while_waited") = EngineOptions{}.poll_while_waited,
           py::arg("board_bytes") = EngineOptions{}.board_bytes)
      .def(
          "allreduce",
          [](Engine& e, std::uintptr_t address, std::size_t count, const std::string& dtype,
             const std::string& op, const std::string& compression, bool caller_waits,
             bool gated) {
            return e.allreduce(reinterpret_cast<void*>(address), count, parse_dtype(dtype),
                               parse_reduce_op(op), parse_compression(compression),
                               caller_waits, gated);
          },
          py::arg("address"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("compression"), py::arg("caller_waits") = false, py::arg("gated") = false)
      .def(
          "allreduce_now",
          [](Engine& e, std::uintptr_t address, std::size_t count, const std::string& dtype,
             const std::string& op, const std::string& compression) {
            const DType t = parse_dtype(dtype);
            const ReduceOp o = parse_reduce_op(op);
            const Compression c = parse_compression(compression);
            std::shared_ptr<Operation> operation;
            {
              py::gil_scoped_release release;
              operation = e.allreduce_now(reinterpret_cast<void*>(address), count, t, o, c);
              operation->wait(-1.0);  // at once unless it was queued behind others
            }
            // One call and nothing built on success: the whole of a small operation's
            // cost outside the ring is Python's and the binding's.
            if (operation->status() != OpStatus::kFailed) return py::object(py::none());
            return py::cast(operation);
          },
          py::arg("address"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("compression"),
          "Run the allreduce on this thread when nothing is queued, else queue it and wait "
          "for it: None once it succeeded, else the failed Operation.")
      .def(
          "shared_buffer",
          [](Engine& e, std::size_t bytes) -> py::object {
            std::shared_ptr<SharedBuffer> buffer;
            {
              py::gil_scoped_release release;  // collective
              buffer = e.shared_buffer(bytes);
            }
            if (buffer == nullptr) return py::none();
            // The array keeps the mapping alive, whatever becomes of the engine.
            auto* keep = new std::shared_ptr<SharedBuffer>(buffer);
            py::capsule owner(keep, [](void* p) {
              delete static_cast<std::shared_ptr<SharedBuffer>*>(p);
            });
            return py::array_t<std::uint8_t>({bytes}, {std::size_t{1}}, buffer->mine(), owner);
          },
          py::arg("bytes"),
          "Collective: a zero-filled uint8 array every rank of the node maps, reduced in "
          "place by allreduce; None where the engine cannot share memory.")
      .def("shutdown", &Engine::shutdown, py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("callers_waiting", &Engine::callers_waiting)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("segment_bytes", &Engine::segment_bytes)
      .def_property_readonly("window", &Engine::window)
      .def_property_readonly("shm_links", &Engine::uses_shm_links)
      .def_property_readonly("shares_memory", &Engine::shares_memory)
      .def_property_readonly("board_bytes",
                             [](const Engine& e) { return e.config().board_bytes; })
      .def_property_readonly("linked_edges",
                             [](const Engine& e) {
                               const auto [left, right] = e.linked_edges();
                               return py::make_tuple(left, right);
                             })
      .def("path_watch_retrials",
           [](Engine& e) {
             py::gil_scoped_release release;  // waits for a running operation
             return e.path_watch_retrials();
           })
      .def("tuned_paths",
           [](Engine& e) {
             std::map<std::size_t, PathKind> decided;
             {
               py::gil_scoped_release release;  // waits for a running operation
               decided = e.tuned_paths();
             }
             py::dict d;
             for (const auto& [bytes, path] : decided) d[py::int_(bytes)] = path_name(path);
             return d;
           })
      .def("tuned_trials",
           [](Engine& e) {
             std::map<std::size_t, PathTuner::PathTrials> trials;
             {
               py::gil_scoped_release release;  // waits for a running operation
               trials = e.tuned_trials();
             }
             py::dict d;
             for (const auto& [bytes, per_path] : trials) {
               py::dict paths;
               for (int k = 0; k < kPathKinds; ++k) {
                 const auto& seconds = per_path[static_cast<std::size_t>(k)];
                 if (seconds.empty()) continue;
                 py::list runs;
                 for (double t : seconds) runs.append(t);
                 paths[path_name(static_cast<PathKind>(k))] = runs;
               }
               d[py::int_(bytes)] = paths;
             }
             return d;
           })
      .def_property_readonly("comm_cpu", &Engine::comm_cpu)
      .def_property_readonly("config", [](const Engine& e) { return config_dict(e.config()); })
      .def_property_readonly(
          "polling_while_waited",
          [](const Engine& e) { return std::string(waited_polling_name(e.polling_while_waited())); })
      .def_property_readonly("is_shut_down", &Engine::is_shut_down);

  bind_compression(m);
  bind_pipeline(m);
}
