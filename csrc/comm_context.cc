#include "comm_context.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include "mpi_check.h"

namespace pipesgd {
namespace {

constexpr int kControlTag = 1;
constexpr int kFirstOpTag = 2;
constexpr int kControlBytes = 4096;
// Longest sleep on a doorbell between checks of the control channel.
constexpr int kLinkSleepUs = 1000;

}  // namespace

CommContext::CommContext(MPI_Comm comm, const EngineConfig& config, bool shared_memory,
                         bool core_per_rank,
                         std::shared_ptr<const std::atomic<int>> callers_waiting,
                         WaitedPolling while_waited)
    : comm_(comm), config_(config), core_per_rank_(core_per_rank),
      callers_waiting_(std::move(callers_waiting)), while_waited_(while_waited),
      control_buf_(kControlBytes),
      poller_(config.spin_us, config.poll_us, config.poll_max_us,
              /*judge_by_last_test=*/shared_memory) {
  PSG_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), -1);
  PSG_MPI_CHECK(MPI_Comm_rank(comm_, &rank_), -1);
  PSG_MPI_CHECK(MPI_Comm_size(comm_, &size_), -1);
  void* attr = nullptr;
  int found = 0;
  PSG_MPI_CHECK(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &attr, &found), -1);
  const int tag_ub = found ? *static_cast<int*>(attr) : 32767;
  tags_per_op_ = 1 + 2 * std::max(1, size_ - 1);  // header + one per ring step
  tag_period_ = std::max(1, (tag_ub - kFirstOpTag) / tags_per_op_);
  if (size_ > 1) post_control_receive();
}

CommContext::~CommContext() = default;

int CommContext::header_tag(std::uint64_t seq) const {
  return kFirstOpTag +
         tags_per_op_ * static_cast<int>(seq % static_cast<std::uint64_t>(tag_period_));
}

int CommContext::data_tag(std::uint64_t seq, int step) const {
  return header_tag(seq) + 1 + step;
}

void CommContext::post_control_receive() {
  PSG_MPI_CHECK(MPI_Irecv(control_buf_.data(), kControlBytes, MPI_CHAR, MPI_ANY_SOURCE,
                          kControlTag, comm_, &control_req_),
                -1);
}

void CommContext::check_control(const Operation& op) {
  if (!have_pending_failure_ && control_req_ != MPI_REQUEST_NULL) {
    int arrived = 0;
    MPI_Status status;
    PSG_MPI_CHECK(MPI_Test(&control_req_, &arrived, &status), -1);
    if (arrived) {
      int len = 0;
      MPI_Get_count(&status, MPI_CHAR, &len);
      // Message layout: the failed operation's sequence number, then the text.
      std::uint64_t seq = 0;
      const std::size_t bytes = static_cast<std::size_t>(std::max(len, 0));
      if (bytes >= sizeof seq) std::memcpy(&seq, control_buf_.data(), sizeof seq);
      have_pending_failure_ = true;
      pending_failure_seq_ = seq;
      pending_failure_.assign(control_buf_.data() + std::min(bytes, sizeof seq),
                              bytes - std::min(bytes, sizeof seq));
      // Keep listening: a second peer may report the same failure.
      post_control_receive();
    }
  }
  if (have_pending_failure_ && pending_failure_seq_ <= op.seq) {
    throw OpFailure(FailureKind::kMismatch, pending_failure_);
  }
}

void CommContext::broadcast_failure(const Operation& op, const std::string& message) {
  std::string packet(sizeof op.seq, '\0');
  std::memcpy(packet.data(), &op.seq, sizeof op.seq);
  packet += message.substr(0, kControlBytes - sizeof op.seq);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    control_send_bufs_.push_back(packet);
    control_sends_.push_back(MPI_REQUEST_NULL);
    const std::string& buf = control_send_bufs_.back();
    // Failure reporting is best effort: the local operation fails regardless.
    MPI_Isend(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, peer, kControlTag, comm_,
              &control_sends_.back());
  }
}

void CommContext::request_abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    abort_reason_ = reason;
  }
  abort_requested_.store(true);
}

void CommContext::check_health(Operation& op, int peer, const char* phase,
                               std::chrono::steady_clock::time_point now) {
  check_control(op);
  if (abort_requested_.load()) {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    throw OpFailure(FailureKind::kAborted,
                    op.describe() + " " + abort_reason_ + " while waiting for rank " +
                        std::to_string(peer) + " (" + phase + ")");
  }
  if (stall_seq_ != op.seq) {
    stall_seq_ = op.seq;
    stall_warned_ = false;
  }
  if (!stall_warned_) {
    const double waited = std::chrono::duration<double>(now - op.started).count();
    if (waited > config_.stall_seconds) {
      stall_warned_ = true;
      std::fprintf(stderr,
                   "pipesgd: rank %d: %s has waited %.0f s for rank %d (%s); check that every "
                   "rank submits the same operations in the same order "
                   "(PIPESGD_STALL_SECONDS=%.0f)\n",
                   rank_, op.describe().c_str(), waited, peer, phase, config_.stall_seconds);
      std::fflush(stderr);
    }
  }
}

WaitedPolling CommContext::idle_mode() const {
  if (while_waited_ == WaitedPolling::kSleep) return WaitedPolling::kSleep;
  return callers_waiting_->load(std::memory_order_relaxed) > 0 ? while_waited_
                                                               : WaitedPolling::kSleep;
}

void CommContext::wait(MPI_Request& req, Operation& op, int peer, const char* phase,
                       bool teaches_spin) {
  wait_until(
      [&] {
        int done = 0;
        PSG_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE), peer);
        return done != 0;
      },
      op, peer, phase, teaches_spin);
}

void CommContext::wait_until(const std::function<bool()>& ready, Operation& op, int peer,
                             const char* phase, bool teaches_spin) {
  op.waiting_on.store(peer);
  op.phase.store(phase);
  poller_.until(
      ready, [&](Poller::Clock::time_point now) { check_health(op, peer, phase, now); },
      [this] { return idle_mode(); }, teaches_spin);
}

void CommContext::wait_on_bell(Doorbell& doorbell, const std::function<bool()>& ready,
                               Operation& op, int peer, const char* phase) {
  op.waiting_on.store(peer);
  op.phase.store(phase);
  // The doorbell wakes it at once; the timeout only bounds how late it notices a
  // peer's failure report, an abort or a stall.
  poller_.until_woken(
      ready, [&](Poller::Clock::time_point now) { check_health(op, peer, phase, now); },
      [this] { return idle_mode(); }, [&] { return doorbell.sleep_unless(ready, kLinkSleepUs); },
      /*spin=*/core_per_rank_);
}

void CommContext::release_requests(std::vector<MPI_Request>& reqs, bool cancel) {
  for (MPI_Request& req : reqs) {
    if (req == MPI_REQUEST_NULL) continue;
    int done = 0;
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (done) continue;
    if (cancel) MPI_Cancel(&req);
    MPI_Request_free(&req);
  }
  reqs.clear();
}

void CommContext::close(bool clean) {
  if (control_req_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&control_req_);
    MPI_Wait(&control_req_, MPI_STATUS_IGNORE);
  }
  release_requests(control_sends_, false);
  if (clean && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

}  // namespace pipesgd
