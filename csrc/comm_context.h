// The comm thread's view of MPI: its communicator, tags, the control channel that
// spreads a failure to every rank, and its waits, which poll by the one rule of
// poller.h and watch for failures, an abort and stalls while they poll.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_config.h"
#include "operation.h"
#include "poller.h"
#include "shm_region.h"

namespace pipesgd {

// Thrown inside an algorithm to end the operation with a given failure kind.
class OpFailure : public std::runtime_error {
 public:
  OpFailure(FailureKind kind, const std::string& message)
      : std::runtime_error(message), kind_(kind) {}
  FailureKind kind() const { return kind_; }

 private:
  FailureKind kind_;
};

class CommContext {
 public:
  // Takes ownership of `comm` (already duplicated by the caller). `shared_memory`:
  // the ring's neighbours are reached through shared memory (transport.h);
  // `core_per_rank`: every rank of the node has a core of its own.
  // `callers_waiting`: how many threads are blocked waiting for an operation; while
  // any is, polling does `while_waited` instead of sleeping.
  CommContext(MPI_Comm comm, const EngineConfig& config, bool shared_memory, bool core_per_rank,
              std::shared_ptr<const std::atomic<int>> callers_waiting,
              WaitedPolling while_waited);
  ~CommContext();
  CommContext(const CommContext&) = delete;
  CommContext& operator=(const CommContext&) = delete;

  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const EngineConfig& config() const { return config_; }
  WaitedPolling while_waited() const { return while_waited_; }

  // Tags: per sequence number (mod the tag range) one header tag and one data
  // tag per ring step, so a failed operation's stray messages never match a
  // later one, and segments of different steps never match each other's receives.
  int header_tag(std::uint64_t seq) const;
  int data_tag(std::uint64_t seq, int step) const;

  // Polls until `req` completes. Throws OpFailure if a peer broadcast a failure,
  // if abort() was called, or if MPI fails. Prints a stall warning once per op.
  // teaches_spin = false for a wait whose length says how late the peer started,
  // not how fast the link is (an operation's header): one late peer must not put
  // a shared-memory ring to sleep between segments.
  void wait(MPI_Request& req, Operation& op, int peer, const char* phase,
            bool teaches_spin = true);
  // Polls `ready` (which may test MPI requests and make progress itself) as wait() polls
  // one request.
  void wait_until(const std::function<bool()>& ready, Operation& op, int peer,
                  const char* phase, bool teaches_spin = true);
  // Waits until `ready` returns true; `ready` may make progress itself (copy out what
  // the right neighbour has room for). For spin_us after the last progress it tests
  // without pause when every rank has a core, or tests and yields when ranks share
  // cores and a thread of the process waits; then it sleeps on the doorbell of a
  // shared-memory transport, which a peer rings when it publishes or frees a slot
  // (shm_links.h, shm_board.h). Never a timed nap: a nap adds the peer's lateness, a spin
  // takes its CPU time.
  void wait_on_bell(Doorbell& doorbell, const std::function<bool()>& ready, Operation& op,
                    int peer, const char* phase);

  // Tells every other rank that `op` failed with `message` (non-blocking sends).
  void broadcast_failure(const Operation& op, const std::string& message);
  // Throws OpFailure(kMismatch) if a peer reported the failure of `op` or of
  // an earlier operation. A report about a later operation (a fast peer may
  // already be there) is kept until this rank reaches it.
  void check_control(const Operation& op);

  // A new operation starts: its first messages usually arrive at once.
  void note_progress() { poller_.note_progress(); }
  // The operation streams: each ring step moves several segments, which arrive
  // at the link's pace, so its waits may sleep up to poll_max_us and a wake
  // finds one or two ready. Otherwise a segment arrives when the peer gets to
  // it, and a longer sleep is only latency (256 KiB quant8 at p = 4 on 2 cores,
  // one segment per step: 1.3 -> 2-2.8 ms).
  void set_streaming(bool streaming) { poller_.set_streaming(streaming); }

  // Requested by the engine at shutdown: makes the current wait fail.
  void request_abort(const std::string& reason);
  // Drops what is still posted after a failure: receives are cancelled, sends
  // are freed and left to MPI (cancelling sends is deprecated since MPI 4.0).
  void release_requests(std::vector<MPI_Request>& reqs, bool cancel);
  // Frees the communicator once no operation is in flight.
  void close(bool clean);

 private:
  void post_control_receive();
  // Throws if a peer reported a failure or abort() was called; warns once of a stall.
  void check_health(Operation& op, int peer, const char* phase,
                    std::chrono::steady_clock::time_point now);
  // How this wait polls while `callers_waiting_` says a thread of the process waits.
  WaitedPolling idle_mode() const;

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  int tag_period_ = 1;
  int tags_per_op_ = 3;
  EngineConfig config_;
  bool core_per_rank_;
  std::shared_ptr<const std::atomic<int>> callers_waiting_;
  WaitedPolling while_waited_;
  MPI_Request control_req_ = MPI_REQUEST_NULL;
  std::vector<char> control_buf_;
  std::vector<MPI_Request> control_sends_;
  std::deque<std::string> control_send_bufs_;
  bool have_pending_failure_ = false;  // a peer's report about a later operation
  std::uint64_t pending_failure_seq_ = 0;
  std::string pending_failure_;  // stable addresses for pending sends
  std::atomic<bool> abort_requested_{false};
  std::mutex abort_mutex_;
  std::string abort_reason_;
  Poller poller_;
  bool stall_warned_ = false;
  std::uint64_t stall_seq_ = UINT64_MAX;
};

}  // namespace pipesgd
