// The engine: a duplicate of the user's communicator and one communication
// thread that alone calls MPI on it, running queued operations in order.
//
// Every rank must submit the same sequence of operations; the n-th submission
// on one rank meets the n-th on every other rank.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "allreduce/ring.h"
#include "allreduce/workspace.h"
#include "comm_context.h"
#include "engine_config.h"
#include "op_queue.h"
#include "path_tuner.h"
#include "operation.h"
#include "shm_board.h"
#include "shm_buffers.h"
#include "shm_links.h"

namespace pipesgd {

class Engine {
 public:
  // Collective over `comm` (it is duplicated). Throws std::invalid_argument naming an
  // option out of range or a malformed PIPESGD_* variable (engine_config.h).
  Engine(MPI_Comm comm, const EngineOptions& options);
  Engine(MPI_Comm comm, std::size_t segment_bytes, int window = 0)
      : Engine(comm, EngineOptions{segment_bytes, window}) {}
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // In-place allreduce of `count` elements at `data`; the caller keeps the
  // buffer alive until the returned operation has finished. `caller_waits`: the
  // caller will block on it next, so the comm thread polls as for a waited
  // operation from the start (a caller starved of its core on the way into
  // wait() must not leave the operation napping meanwhile).
  // `gated`: the buffer is not filled yet; the operation keeps its place in the order but
  // does not start before the caller's Operation::open_gate(). On one rank an ungated
  // operation with nothing ahead of it is returned finished.
  std::shared_ptr<Operation> allreduce(void* data, std::size_t count, DType dtype, ReduceOp op,
                                       Compression compression, bool caller_waits = false,
                                       bool gated = false);
  // The same for a caller that will block on it: when nothing is queued or running,
  // the calling thread runs the operation itself and returns it finished, saving the
  // two thread hand-offs (submit, completion) that small operations are dominated by.
  // Otherwise it is queued as allreduce(..., caller_waits = true) does.
  std::shared_ptr<Operation> allreduce_now(void* data, std::size_t count, DType dtype,
                                           ReduceOp op, Compression compression);

  // Collective: every rank, in the same order, with the same `bytes`. A zero-filled
  // buffer every rank of the node maps, on which uncompressed allreduces run in place
  // (shm_buffers.h); nullptr where the engine has no board (ranks on several nodes, no
  // shared-memory links) or the memory could not be mapped (said on stderr), and the
  // caller then allocates its own. Throws std::invalid_argument when ranks ask for
  // different sizes.
  std::shared_ptr<SharedBuffer> shared_buffer(std::size_t bytes);
  // Whether shared_buffer() can map memory every rank shares (one node, links).
  bool shares_memory() const { return shared_buffers_ != nullptr; }

  // Stops accepting work, lets queued operations finish for up to timeout_s
  // (negative: PIPESGD_SHUTDOWN_SECONDS), then fails what is left. Idempotent.
  void shutdown(double timeout_s);

  int rank() const { return rank_; }
  // Threads blocked on an operation, or about to be (caller_waits).
  int callers_waiting() const { return callers_waiting_->load(); }
  int size() const { return size_; }
  std::size_t segment_bytes() const { return config_.segment_bytes; }
  int window() const { return config_.window; }
  // The configuration in force: the options and the environment's, with what was chosen
  // per transport.
  const EngineConfig& config() const { return config_; }
  WaitedPolling polling_while_waited() const { return ctx_->while_waited(); }
  bool is_shut_down() const { return shut_down_.load(); }
  // Segments travel through shared-memory inboxes rather than MPI messages on some edge.
  bool uses_shm_links() const { return links_ != nullptr; }
  // Which of this rank's ring edges (from the left, to the right) are links.
  std::pair<bool, bool> linked_edges() const {
    return {links_ != nullptr && links_->reaches_left(),
            links_ != nullptr && links_->reaches_right()};
  }
  // Operations in the caller's memory are timed on the links, as MPI messages and on
  // the staged board, and take the fastest (path_tuner.h): per size class decided so
  // far, its smallest size in bytes and the path kept. Empty when not tuned. Waits for
  // a running operation.
  std::map<std::size_t, PathKind> tuned_paths();
  // The agreed seconds of each decided class's last trials, per path (path_tuner.h).
  std::map<std::size_t, PathTuner::PathTrials> tuned_trials();
  // How often a watched path fell behind and its class ran its trials early.
  int path_watch_retrials();
  // The CPU the comm thread is bound to, or -1 (thread_sched.h: bind_comm_thread).
  int comm_cpu() const { return comm_cpu_.load(); }

 private:
  void comm_thread_main();
  // Runs `op`; the caller holds exec_mutex_.
  void execute(Operation& op);
  // A validated operation on `data`, not yet numbered or queued.
  std::shared_ptr<Operation> make_operation(void* data, std::size_t count, DType dtype,
                                            ReduceOp op, Compression compression) const;
  // Runs `op` on the board where it fits, else around the ring on the links or as MPI
  // messages or staged on the board, as the tuner says, and teaches the tuner.
  void run_on_tuned_path(Operation& op);
  // Times each timed operation of `size_class` from the last rank's start to the last
  // rank's end and hands them to the tuner (an allreduce with MAX of the ranks' marks;
  // `op` names the wait).
  void agree_on_path_times(int size_class, Operation& op);
  // Runs `operation` on this thread, numbered next, if nothing is queued or running;
  // false (and nothing done) otherwise.
  bool run_here_if_idle(Operation& operation, bool caller_waits);
  // Gives `operation` its sequence number and queues it for the comm thread.
  std::shared_ptr<Operation> enqueue(std::shared_ptr<Operation> operation, bool caller_waits);

  EngineConfig config_;
  int rank_ = 0;
  int size_ = 1;
  // Threads blocked in an operation's wait(); while there are any, the comm thread
  // polls as CommContext::while_waited() says instead of napping.
  std::shared_ptr<std::atomic<int>> callers_waiting_ = std::make_shared<std::atomic<int>>(0);
  std::unique_ptr<CommContext> ctx_;
  std::unique_ptr<ShmLinks> links_;
  RingPath link_path_;     // through links_, when there are links
  RingPath message_path_;  // as MPI messages
  bool tune_paths_ = false;  // links, and PIPESGD_SHM_LINKS unset
  // Every rank on one node with links: small operations go through the board.
  std::unique_ptr<ShmBoard> board_;
  std::uint64_t board_rounds_ = 0;  // under exec_mutex_: operations the board has run
  // Where there is a board: buffers every rank maps, reduced in place on the board.
  std::unique_ptr<SharedBuffers> shared_buffers_;
  // Where the paths are tuned: this rank's part holds a piece of a caller's array on
  // the staged board (allreduce/board.h).
  std::shared_ptr<SharedBuffer> stage_;
  // 512 KiB: pieces of 256 KiB to 1 MiB ran level on a VM with 1 MiB of L2 per core,
  // 2 MiB slower (docs/engine.md, "The caller's arrays, staged").
  static constexpr std::size_t kStagePieceBytes = 512u << 10;
  PathTuner tuner_;          // under exec_mutex_
  int agree_class_ = -1;     // under exec_mutex_: a class whose times await agreement
  Workspace workspace_;
  OpQueue queue_;
  std::atomic<std::uint64_t> next_seq_{0};
  std::atomic<std::uint64_t> finished_{0};  // operations run to their end, either way
  // Held while an operation runs, by the comm thread or by a caller of allreduce_now(),
  // so the communicator, the links and the workspace have one user at a time.
  std::mutex exec_mutex_;
  std::string poisoned_;  // under exec_mutex_: why the engine can no longer run operations
  std::promise<void> drained_;
  std::promise<void> comm_thread_ready_;
  int bind_to_node_rank_ = -1;  // bind the comm thread to this node rank's CPU; -1: do not
  int node_ranks_ = 1;
  std::atomic<int> comm_cpu_{-1};
  std::thread thread_;
  std::mutex shutdown_mutex_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace pipesgd
