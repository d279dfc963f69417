#include "shm_board.h"

#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <new>

#include "mpi_check.h"

namespace pipesgd {
namespace {

constexpr std::size_t kLine = 64;
constexpr std::size_t kPair = 2 * kLine;  // lines the prefetchers move together
constexpr std::size_t kNoteWords = ShmBoard::kNoteBytes / sizeof(std::uint64_t);
constexpr std::size_t round_up(std::size_t x, std::size_t to) { return (x + to - 1) / to * to; }

}  // namespace

// Each counter on lines of its own: its writer is one rank, its readers all the others.
struct ShmBoard::RankControl {
  alignas(kPair) std::atomic<std::uint64_t> posted[2][2] = {};  // [slot][stage]: round + 1
  alignas(kPair) std::atomic<std::uint64_t> read{0};         // rounds finished reading
  alignas(kPair) BellWord bell;
  // The note, under a sequence lock: odd while being rewritten.
  alignas(kPair) std::atomic<std::uint64_t> note_version{0};
  std::atomic<std::uint64_t> note[kNoteWords] = {};
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory counters must be lock-free to work across processes");

std::unique_ptr<ShmBoard> ShmBoard::create(MPI_Comm comm, std::size_t capacity_bytes,
                                           std::string* why_not) {
  std::unique_ptr<ShmBoard> board(new ShmBoard());
  PSG_MPI_CHECK(MPI_Comm_rank(comm, &board->rank_), -1);
  PSG_MPI_CHECK(MPI_Comm_size(comm, &board->ranks_), -1);
  board->capacity_ = capacity_bytes;
  board->stride_ = kNoteBytes + round_up(capacity_bytes, kLine);
  const auto p = static_cast<std::size_t>(board->ranks_);
  const std::size_t bytes =
      round_up(p * sizeof(RankControl), kPair) + 2 * p * board->stride_;
  const std::string name = shared_region_name(shared_region_token(comm), "board", 0);
  if (board->rank_ == 0) {
    board->base_ = create_shared_region(name, bytes, why_not);
    if (board->base_ != nullptr) {
      board->bytes_ = bytes;
      for (int q = 0; q < board->ranks_; ++q) new (board->control(q)) RankControl();
    }
  }
  if (!on_all_ranks(comm, board->rank_ != 0 || board->base_ != nullptr)) {
    if (why_not->empty()) *why_not = "rank 0 could not create the board";
    return nullptr;
  }
  if (board->rank_ != 0) {
    board->base_ = map_shared_region(name, &board->bytes_, why_not);
    if (board->base_ != nullptr && board->bytes_ != bytes) {
      *why_not = "the board has another size than this rank expects";
      munmap(board->base_, board->bytes_);
      board->base_ = nullptr;
    }
  }
  // Every rank has mapped the board once this returns, so its name can go.
  const bool ok = on_all_ranks(comm, board->base_ != nullptr);
  if (board->rank_ == 0) shm_unlink(name.c_str());
  if (!ok) {
    if (why_not->empty()) *why_not = "another rank could not map the board";
    return nullptr;
  }
  return board;
}

ShmBoard::~ShmBoard() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

ShmBoard::RankControl* ShmBoard::control(int q) const {
  return static_cast<RankControl*>(base_) + q;
}

unsigned char* ShmBoard::slot(int q, std::uint64_t round) const {
  const std::size_t controls =
      round_up(static_cast<std::size_t>(ranks_) * sizeof(RankControl), kPair);
  const std::size_t index = 2 * static_cast<std::size_t>(q) + static_cast<std::size_t>(round % 2);
  return static_cast<unsigned char*>(base_) + controls + index * stride_;
}

void ShmBoard::announce(const void* note, std::size_t bytes) {
  std::uint64_t words[kNoteWords] = {};
  std::memcpy(words, note, bytes < kNoteBytes ? bytes : kNoteBytes);
  RankControl* c = control(rank_);
  const std::uint64_t version = c->note_version.load(std::memory_order_relaxed);
  c->note_version.store(version + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (std::size_t i = 0; i < kNoteWords; ++i) c->note[i].store(words[i], std::memory_order_relaxed);
  c->note_version.store(version + 2, std::memory_order_release);
}

bool ShmBoard::read_note(int q, void* out) const {
  const RankControl* c = control(q);
  const std::uint64_t before = c->note_version.load(std::memory_order_acquire);
  if (before == 0 || before % 2 != 0) return false;  // never announced, or being rewritten
  std::uint64_t words[kNoteWords];
  for (std::size_t i = 0; i < kNoteWords; ++i) words[i] = c->note[i].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (c->note_version.load(std::memory_order_relaxed) != before) return false;
  std::memcpy(out, words, kNoteBytes);
  return true;
}

void ShmBoard::post(std::uint64_t round, Stage stage) {
  control(rank_)->posted[round % 2][static_cast<int>(stage)].store(round + 1,
                                                                  std::memory_order_release);
  ring_everyone();
}

bool ShmBoard::posted(int q, std::uint64_t round, Stage stage) const {
  return control(q)->posted[round % 2][static_cast<int>(stage)].load(
             std::memory_order_acquire) == round + 1;
}

void ShmBoard::finish_reading(std::uint64_t rounds) {
  control(rank_)->read.store(rounds, std::memory_order_release);
  ring_everyone();
}

std::uint64_t ShmBoard::read_by(int q) const {
  return control(q)->read.load(std::memory_order_acquire);
}

void ShmBoard::ring_everyone() {
  for (int q = 0; q < ranks_; ++q) {
    if (q != rank_) ring_bell(&control(q)->bell);
  }
}

bool ShmBoard::sleep_unless(const std::function<bool()>& ready, int timeout_us) {
  return sleep_on_bell(&control(rank_)->bell, ready, timeout_us);
}

void ShmBoard::wake_self() { wake_bell(&control(rank_)->bell); }

}  // namespace pipesgd
