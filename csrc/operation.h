// One queued collective: what to do, and the state a waiting Python thread sees.
//
// The submitting thread creates it and waits on it; the comm thread alone runs
// it and publishes progress (which rank it waits on) and the outcome.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "dtype.h"
#include "shm_buffers.h"

namespace pipesgd {

enum class OpStatus : int { kQueued = 0, kRunning = 1, kDone = 2, kFailed = 3 };

// Why an operation failed; the binding maps each to a Python exception type.
enum class FailureKind : int {
  kNone = 0,
  kMismatch = 1,   // ranks submitted different operations for one sequence number
  kAborted = 2,    // the engine shut down, or an earlier failure poisoned it
  kMpi = 3,        // an MPI call failed
  kInvalid = 4,    // arguments rejected by the comm thread
};

struct Operation {
  // What to do (immutable after submission).
  std::uint64_t seq = 0;
  void* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kAverage;
  Compression compression = Compression::kNone;
  // Where `data` lies in a buffer every rank maps (uncompressed operations only; the
  // board then reduces it in place): set at submission.
  SharedPlace shared;
  // The engine's count of threads blocked in wait() (shared: a handle may outlive it).
  std::shared_ptr<std::atomic<int>> callers_waiting;
  // False for a gated operation until open_gate(): its buffer was still being filled
  // (a device-to-host copy in flight) when it was queued, so when its turn comes the
  // comm thread waits for the gate before it reads the buffer.
  std::atomic<bool> gate_open{true};
  void open_gate() { gate_open.store(true, std::memory_order_release); }

  // Progress, written by the comm thread, read by waiters for timeout messages.
  std::atomic<int> waiting_on{-1};
  std::atomic<const char*> phase{"queued"};
  std::chrono::steady_clock::time_point started;  // comm thread only

  std::string describe() const;  // "allreduce #3 (1000 x float32, sum, compression none)"

  OpStatus status() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return status_;
  }
  bool finished() const {
    const OpStatus s = status();
    return s == OpStatus::kDone || s == OpStatus::kFailed;
  }
  // Blocks until finished or timeout_s elapses (negative: no limit). True if finished.
  bool wait(double timeout_s) const;
  // Counts a caller in `callers_waiting` from now until the operation finishes.
  void count_caller_until_finished();
  FailureKind failure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return failure_;
  }
  std::string error() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  void mark_running();
  void complete();
  void fail(FailureKind kind, const std::string& message);

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  OpStatus status_ = OpStatus::kQueued;
  FailureKind failure_ = FailureKind::kNone;
  std::string error_;
  bool counts_caller_ = false;  // count_caller_until_finished() is in effect

  void finish_locked(OpStatus status);  // status_ = status, and stop counting the caller
};

}  // namespace pipesgd
