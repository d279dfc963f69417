#include "operation.h"

namespace pipesgd {

std::string Operation::describe() const {
  return "allreduce #" + std::to_string(seq) + " (" + std::to_string(count) + " x " +
         dtype_name(dtype) + ", " + reduce_op_name(op) + ", compression " +
         compression_name(compression) + ")";
}

namespace {

// Counts the calling thread as blocked for as long as it waits.
class WaitingCaller {
 public:
  explicit WaitingCaller(std::atomic<int>* count) : count_(count) {
    if (count_ != nullptr) count_->fetch_add(1, std::memory_order_relaxed);
  }
  ~WaitingCaller() {
    if (count_ != nullptr) count_->fetch_sub(1, std::memory_order_relaxed);
  }
  WaitingCaller(const WaitingCaller&) = delete;
  WaitingCaller& operator=(const WaitingCaller&) = delete;

 private:
  std::atomic<int>* count_;
};

}  // namespace

bool Operation::wait(double timeout_s) const {
  const WaitingCaller waiting(callers_waiting.get());
  std::unique_lock<std::mutex> lock(mutex_);
  auto finished_now = [this] {
    return status_ == OpStatus::kDone || status_ == OpStatus::kFailed;
  };
  if (timeout_s < 0) {
    cv_.wait(lock, finished_now);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), finished_now);
}

void Operation::count_caller_until_finished() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (counts_caller_ || status_ == OpStatus::kDone || status_ == OpStatus::kFailed) return;
  if (callers_waiting == nullptr) return;
  counts_caller_ = true;
  callers_waiting->fetch_add(1, std::memory_order_relaxed);
}

void Operation::finish_locked(OpStatus status) {
  status_ = status;
  if (counts_caller_) {
    counts_caller_ = false;
    callers_waiting->fetch_sub(1, std::memory_order_relaxed);
  }
}

void Operation::mark_running() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    status_ = OpStatus::kRunning;
  }
  started = std::chrono::steady_clock::now();
  phase.store("starting");
}

void Operation::complete() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finish_locked(OpStatus::kDone);
  }
  phase.store("done");
  waiting_on.store(-1);
  cv_.notify_all();
}

void Operation::fail(FailureKind kind, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (status_ == OpStatus::kDone || status_ == OpStatus::kFailed) return;
    finish_locked(OpStatus::kFailed);
    failure_ = kind;
    error_ = message;
  }
  phase.store("failed");
  cv_.notify_all();
}

}  // namespace pipesgd
