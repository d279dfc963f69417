// FIFO of submitted operations: the submitting thread pushes, the comm thread pops.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>

#include "operation.h"

namespace pipesgd {

class OpQueue {
 public:
  // False if the queue is closed (the engine is shutting down).
  bool push(std::shared_ptr<Operation> op) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) return false;
      ops_.push_back(std::move(op));
    }
    cv_.notify_one();
    return true;
  }

  // Blocks while empty and open; nullptr once closed and drained.
  std::shared_ptr<Operation> pop() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return closed_ || !ops_.empty(); });
    if (ops_.empty()) return nullptr;
    auto op = std::move(ops_.front());
    ops_.pop_front();
    return op;
  }

  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Operation>> ops_;
  bool closed_ = false;
};

}  // namespace pipesgd
