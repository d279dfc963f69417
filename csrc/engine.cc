#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>

#include "allreduce/board.h"
#include "allreduce/ring.h"
#include "mpi_check.h"
#include "thread_sched.h"
#include "transport.h"

namespace pipesgd {
namespace {

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "unknown";
  }
}

}  // namespace

Engine::Engine(MPI_Comm comm, const EngineOptions& options) : config_(resolve_config(options)) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw std::runtime_error("pipesgd: MPI is not initialized");
  int provided = MPI_THREAD_SINGLE;
  PSG_MPI_CHECK(MPI_Query_thread(&provided), -1);
  if (provided < MPI_THREAD_MULTIPLE) {
    throw std::runtime_error(
        std::string("pipesgd needs MPI_THREAD_MULTIPLE (its communication thread calls MPI while "
                    "the program may use MPI too), but MPI was initialized with ") +
        thread_level_name(provided) +
        ". With mpi4py, leave mpi4py.rc.thread_level at its default 'multiple'; in C, use "
        "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...); check that your MPI library was built "
        "with thread support.");
  }
  MPI_Comm dup = MPI_COMM_NULL;
  PSG_MPI_CHECK(MPI_Comm_dup(comm, &dup), -1);
  // Collective: asked on every rank, whatever each rank's environment says.
  const RingTransport transport = describe_ring_transport(dup);
  const bool shared_memory = transport.shared_memory;
  // Links on the edges within a node, unless turned off; where MPI must not use shared
  // memory (OMPI_MCA_btl), only when asked for (shm_links = 1).
  const bool want_links = transport.ranks > 1 && transport.edges_on_node > 0 &&
                          (config_.shm_links == 1 ||
                           (config_.shm_links < 0 && transport.mpi_shared_memory_allowed));
  // Every edge within a node: the links' own segments. Some edges between nodes: those
  // set the pace, and the ring keeps the network's segments on every edge.
  const bool all_edges_linked = transport.edges_on_node == transport.ranks;
  // Each path its own segments and window (transport.h), unless the user set them.
  message_path_.window = config_.window != 0 ? config_.window
                         : shared_memory     ? kSharedMemoryWindow
                                             : kNetworkWindow;
  message_path_.segment_bytes =
      config_.segment_bytes != 0 ? config_.segment_bytes
      : shared_memory            ? shared_memory_segment_bytes(transport, message_path_.window)
                                 : kNetworkSegmentBytes;
  link_path_.window = config_.window != 0 ? config_.window
                     : all_edges_linked    ? kShmLinkWindow
                                           : message_path_.window;
  link_path_.segment_bytes = config_.segment_bytes != 0 ? config_.segment_bytes
                             : all_edges_linked         ? kShmLinkSegmentBytes
                                                        : message_path_.segment_bytes;
  // While the caller waits its core is idle, so the comm thread polls without napping:
  // over shared memory a segment follows within microseconds. Over a network it tests
  // and yields (never a bare spin, which would hold up the kernel's network work on that
  // core): a link that has idled bursts on a refilled token bucket faster than the naps'
  // back-off follows (docs/engine.md, "Polling", has the measurement).
  WaitedPolling while_waited = WaitedPolling::kSleep;
  if (config_.poll_while_waited != 0) {
    while_waited = shared_memory && transport.core_per_rank ? WaitedPolling::kSpin
                                                            : WaitedPolling::kYield;
  }
  ctx_ = std::make_unique<CommContext>(dup, config_, shared_memory, transport.core_per_rank,
                                       callers_waiting_, while_waited);
  rank_ = ctx_->rank();
  size_ = ctx_->size();
  if (want_links) {
    // Collective; every rank gets links or none, and without them MPI carries the data.
    std::string why_not;
    links_ = ShmLinks::create(ctx_->comm(), link_path_.segment_bytes,
                              std::max(link_path_.window, 2), transport.left_on_node,
                              transport.right_on_node, &why_not);
    if (!links_ && !why_not.empty()) {
      std::fprintf(stderr,
                   "pipesgd: rank %d: no shared-memory links (%s); ring segments go as MPI "
                   "messages (PIPESGD_SHM_LINKS=0 silences this)\n",
                   rank_, why_not.c_str());
    }
  }
  link_path_.links = links_.get();
  // All ranks on one node, with links: a board (collective; links_ is alike on every
  // rank). With three ranks or more, uncompressed operations up to the smallest
  // board_bytes of all ranks go through it; at p = 2 the ring too waits twice, and moves
  // fewer bytes. At any p it reduces shared buffers in place (shm_buffers.h).
  if (links_ != nullptr && all_edges_linked) {
    unsigned long long mine = transport.ranks >= 3 ? config_.board_bytes : 0, smallest = 0;
    PSG_MPI_CHECK(
        MPI_Allreduce(&mine, &smallest, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, ctx_->comm()), -1);
    std::string why_not;
    board_ = ShmBoard::create(ctx_->comm(), static_cast<std::size_t>(smallest), &why_not);
    if (board_) {
      shared_buffers_ = std::make_unique<SharedBuffers>(ctx_->comm());
    } else {
      std::fprintf(stderr, "pipesgd: rank %d: no shared-memory board (%s); small "
                   "operations take the ring\n", rank_, why_not.c_str());
    }
  }
  config_.board_bytes = board_ ? board_->capacity() : 0;
  // The caller's arrays on one node take whichever path ran them fastest (path_tuner.h);
  // a ring across nodes keeps its links.
  tune_paths_ = links_ != nullptr && config_.shm_links < 0 && all_edges_linked;
  // With a board, the caller's arrays may also be staged through a buffer every rank
  // maps (allreduce/board.h); the tuner times that path beside the ring's.
  // board_bytes = 0 asks for the ring alone.
  if (tune_paths_ && shared_buffers_ != nullptr && options.board_bytes > 0) {
    std::string why_not;
    stage_ = shared_buffers_->allocate_stage(kStagePieceBytes, &why_not);
    if (stage_ == nullptr && !why_not.empty()) {
      std::fprintf(stderr, "pipesgd: rank %d: no stage for the caller's arrays (%s); they "
                   "take the ring\n", rank_, why_not.c_str());
    }
  }
  tuner_ = PathTuner(stage_ != nullptr);
  const RingPath& shown = links_ ? link_path_ : message_path_;
  config_.segment_bytes = shown.segment_bytes;
  config_.window = shown.window;
  // On one node with a core per rank, each rank's comm thread gets a CPU of its own
  // (thread_sched.h: bind_comm_thread).
  if (shared_memory && transport.core_per_rank) {
    bind_to_node_rank_ = transport.node_rank;
    node_ranks_ = transport.node_ranks;
  }
  thread_ = std::thread([this] { comm_thread_main(); });
  comm_thread_ready_.get_future().wait();  // comm_cpu() is known from here on
}

Engine::~Engine() {
  try {
    shutdown(-1);
  } catch (...) {
    // Destructors must not throw; shutdown already failed what it could.
  }
}

std::shared_ptr<Operation> Engine::make_operation(void* data, std::size_t count, DType dtype,
                                                  ReduceOp op, Compression compression) const {
  if (count > 0 && data == nullptr) throw std::invalid_argument("allreduce: null buffer");
  if (compression != Compression::kNone && dtype != DType::kFloat32) {
    throw std::invalid_argument(std::string("compression '") + compression_name(compression) +
                                "' works on float32 only, got " + dtype_name(dtype) +
                                "; use compression='none' or convert the buffer to float32");
  }
  auto operation = std::make_shared<Operation>();
  operation->data = data;
  operation->count = count;
  operation->dtype = dtype;
  operation->op = op;
  operation->compression = compression;
  operation->callers_waiting = callers_waiting_;
  if (shared_buffers_ != nullptr && compression == Compression::kNone) {
    operation->shared = shared_buffers_->find(data, count * dtype_size(dtype));
  }
  return operation;
}

std::shared_ptr<SharedBuffer> Engine::shared_buffer(std::size_t bytes) {
  if (shared_buffers_ == nullptr) return nullptr;
  std::string why_not;
  auto buffer = shared_buffers_->allocate(bytes, &why_not);
  if (buffer == nullptr && !why_not.empty()) {
    std::fprintf(stderr, "pipesgd: rank %d: no shared buffer of %zu bytes (%s); the caller "
                 "allocates its own\n", rank_, bytes, why_not.c_str());
  }
  return buffer;
}

std::shared_ptr<Operation> Engine::allreduce(void* data, std::size_t count, DType dtype,
                                             ReduceOp op, Compression compression,
                                             bool caller_waits, bool gated) {
  auto operation = make_operation(data, count, dtype, op, compression);
  operation->gate_open.store(!gated);
  // One rank has nothing to exchange: the buffer is already the result, so with nothing
  // ahead of it the operation finishes here rather than waking the comm thread (a
  // hand-off of about 50 us each way).
  if (size_ == 1 && !gated && run_here_if_idle(*operation, caller_waits)) return operation;
  return enqueue(std::move(operation), caller_waits);
}

std::shared_ptr<Operation> Engine::enqueue(std::shared_ptr<Operation> operation,
                                           bool caller_waits) {
  {
    // Sequence numbers are assigned in queue order.
    std::lock_guard<std::mutex> lock(shutdown_mutex_);
    if (shut_down_.load()) {
      throw std::runtime_error("pipesgd engine is shut down; call pipesgd.init() again");
    }
    operation->seq = next_seq_.fetch_add(1);
    if (!queue_.push(operation)) throw std::runtime_error("pipesgd engine is shut down");
  }
  // Counted once queued (an operation refused above never finishes); the comm
  // thread reads the count at every poll, so a late start costs at most one nap.
  if (caller_waits) operation->count_caller_until_finished();
  return operation;
}

std::shared_ptr<Operation> Engine::allreduce_now(void* data, std::size_t count, DType dtype,
                                                 ReduceOp op, Compression compression) {
  auto operation = make_operation(data, count, dtype, op, compression);
  if (run_here_if_idle(*operation, /*caller_waits=*/true)) return operation;
  return enqueue(std::move(operation), /*caller_waits=*/true);
}

bool Engine::run_here_if_idle(Operation& operation, bool caller_waits) {
  // try_lock: if the comm thread is running something, the operation queues behind it.
  std::unique_lock<std::mutex> exec(exec_mutex_, std::try_to_lock);
  if (!exec.owns_lock()) return false;
  {
    std::lock_guard<std::mutex> lock(shutdown_mutex_);
    if (shut_down_.load()) {
      throw std::runtime_error("pipesgd engine is shut down; call pipesgd.init() again");
    }
    // Every earlier operation has run (a popped one not yet started counts as not):
    // this one is next in every rank's order, so this thread may run it.
    if (finished_.load() != next_seq_.load()) return false;
    operation.seq = next_seq_.fetch_add(1);
  }
  if (caller_waits) operation.count_caller_until_finished();
  execute(operation);
  return true;
}

void Engine::execute(Operation& op) {
  struct CountFinished {
    std::atomic<std::uint64_t>& finished;
    ~CountFinished() { finished.fetch_add(1); }
  } count_finished{finished_};
  op.mark_running();
  if (!poisoned_.empty()) {
    op.fail(FailureKind::kAborted, op.describe() + " was not run: " + poisoned_);
    return;
  }
  try {
    if (!op.gate_open.load(std::memory_order_acquire)) {
      ctx_->wait_until([&op] { return op.gate_open.load(std::memory_order_acquire); }, op,
                       rank_, "waiting for its buffer to be filled (open_gate)",
                       /*teaches_spin=*/false);
    }
    ctx_->note_progress();
    run_on_tuned_path(op);
    op.complete();
  } catch (const OpFailure& e) {
    op.fail(e.kind(), e.what());
    if (e.kind() != FailureKind::kInvalid) {
      poisoned_ = std::string("the engine stopped after an earlier failure: ") + e.what();
    }
  } catch (const std::exception& e) {
    const std::string message = op.describe() + " failed on rank " + std::to_string(rank_) +
                                ": " + e.what();
    op.fail(FailureKind::kMpi, message);
    poisoned_ = std::string("the engine stopped after an earlier failure: ") + message;
  }
}

std::map<std::size_t, PathKind> Engine::tuned_paths() {
  std::lock_guard<std::mutex> exec(exec_mutex_);
  return tuner_.decided();
}

std::map<std::size_t, PathTuner::PathTrials> Engine::tuned_trials() {
  std::lock_guard<std::mutex> exec(exec_mutex_);
  return tuner_.last_trials();
}

int Engine::path_watch_retrials() {
  std::lock_guard<std::mutex> exec(exec_mutex_);
  return tuner_.watch_retrials();
}

void Engine::run_on_tuned_path(Operation& op) {
  if (board_ != nullptr) {
    announce_operation(*board_, op);
    if (board_takes(*board_, op)) {
      board_allreduce(*ctx_, *board_, op, board_rounds_);
      return;
    }
  }
  if (!tune_paths_) {
    ring_allreduce(*ctx_, workspace_, op, links_ ? link_path_ : message_path_);
    return;
  }
  // The agreement a class asked for after the last operation runs here, before this
  // one's choice: the operation that asked is already reported done, and its ranks'
  // wait on each other here overlaps their wait at this operation's start. Every rank
  // runs the same operations, so all agree at the same one.
  if (agree_class_ >= 0) {
    agree_on_path_times(agree_class_, op);
    agree_class_ = -1;
  }
  const PathTuner::Choice choice =
      tuner_.choose(op.count * dtype_size(op.dtype), op.compression != Compression::kNone);
  if (choice.size_class < 0) {  // small or compressed: the links, untimed
    ring_allreduce(*ctx_, workspace_, op, link_path_);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  if (choice.path == PathKind::kStaged) {
    staged_board_allreduce(*ctx_, *board_, *stage_, op, board_rounds_);
  } else {
    ring_allreduce(*ctx_, workspace_, op,
                   choice.path == PathKind::kMessages ? message_path_ : link_path_);
  }
  // steady_clock is CLOCK_MONOTONIC, one clock for every process of the node: the
  // agreement compares the ranks' marks (path_tuner.h).
  const auto seconds = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  };
  if (tuner_.record(choice, seconds(start), seconds(std::chrono::steady_clock::now()))) {
    agree_class_ = choice.size_class;
  }
}

void Engine::agree_on_path_times(int size_class, Operation& op) {
  // Each trial or watched operation from the last rank's start to the last rank's end
  // (path_tuner.h). Every rank decides alike.
  PathTuner::TrialMarks mine = tuner_.trial_marks(size_class), latest{};
  MPI_Request req = MPI_REQUEST_NULL;
  const int left = (rank_ + size_ - 1) % size_;
  PSG_MPI_CHECK(MPI_Iallreduce(mine.data(), latest.data(), static_cast<int>(mine.size()),
                               MPI_DOUBLE, MPI_MAX, ctx_->comm(), &req),
                -1);
  ctx_->wait(req, op, left, "agreeing with every rank on the fastest path", false);
  tuner_.decide(size_class, PathTuner::seconds_between(latest));
}

void Engine::comm_thread_main() {
  tune_comm_thread(config_.comm_slice_us, config_.comm_nice);
  if (bind_to_node_rank_ >= 0) comm_cpu_.store(bind_comm_thread(bind_to_node_rank_, node_ranks_));
  comm_thread_ready_.set_value();
  while (auto op = queue_.pop()) {
    std::lock_guard<std::mutex> exec(exec_mutex_);
    execute(*op);
  }
  std::lock_guard<std::mutex> exec(exec_mutex_);  // a caller may still run one
  ctx_->close(/*clean=*/poisoned_.empty());
  drained_.set_value();
}

void Engine::shutdown(double timeout_s) {
  std::lock_guard<std::mutex> lock(shutdown_mutex_);
  if (shut_down_.exchange(true)) return;
  if (timeout_s < 0) timeout_s = config_.shutdown_seconds;
  queue_.close();
  auto drained = drained_.get_future();
  if (drained.wait_for(std::chrono::duration<double>(timeout_s)) != std::future_status::ready) {
    ctx_->request_abort("was aborted by shutdown() after " + std::to_string(timeout_s) + " s");
    if (links_) links_->wake_self();
    if (board_) board_->wake_self();
  }
  thread_.join();
  if (shared_buffers_) shared_buffers_->close();
}

}  // namespace pipesgd
