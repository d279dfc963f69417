// A board in shared memory where every rank of one node posts its part of a small
// operation and reads the others' (allreduce/board.h runs operations on it).
//
// Each rank has two slots, used by turns (round r in slot r % 2), so a rank may post its
// next round while others still read this one. A rank writes round r only once every
// rank has finished reading round r - 2 (read_by), and says its slot holds a stage of
// round r by storing r + 1 in that slot's counter for the stage after the bytes
// (release), so a reader that sees the counter (acquire) sees the bytes. A round is
// numbered, not the operation: a staged operation takes several (allreduce/board.h).
//
// Besides, every rank announces the header of each operation it starts (whichever
// algorithm runs it) in a note others may read at any time, so a rank posting to the
// board can tell that another rank submitted something else for the same sequence
// number instead of waiting for it forever.
//
// Waiting sleeps on the rank's own doorbell (shm_region.h); whoever posts or finishes
// reading rings every rank that sleeps.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "shm_region.h"

namespace pipesgd {

class ShmBoard final : public Doorbell {
 public:
  // Bytes a note holds (an operation's header).
  static constexpr std::size_t kNoteBytes = 64;

  // Collective over `comm`, whose ranks must all be on one node. Slots of
  // `capacity_bytes` each. Returns nullptr on every rank if any rank could not map the
  // board; `why_not` says what failed on this rank.
  static std::unique_ptr<ShmBoard> create(MPI_Comm comm, std::size_t capacity_bytes,
                                          std::string* why_not);
  ~ShmBoard() override;
  ShmBoard(const ShmBoard&) = delete;
  ShmBoard& operator=(const ShmBoard&) = delete;

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  std::size_t capacity() const { return capacity_; }

  // This rank's note: `bytes` (at most kNoteBytes) from `note`.
  void announce(const void* note, std::size_t bytes);
  // Copies rank `q`'s note into `out` (kNoteBytes); false if it has none yet or it was
  // being rewritten.
  bool read_note(int q, void* out) const;

  // The slot of rank `q` for `round`: kNoteBytes of header, then capacity() bytes.
  unsigned char* slot(int q, std::uint64_t round) const;
  // What a slot holds of an operation: the rank's data, then its reduced chunk too.
  enum class Stage : int { kData = 0, kReduced = 1 };
  // Says this rank's slot for `round` holds `stage` of that round, and rings every
  // sleeper.
  void post(std::uint64_t round, Stage stage);
  // Whether rank `q`'s slot for `round` holds `stage` of that round.
  bool posted(int q, std::uint64_t round, Stage stage) const;
  // Says this rank has read every slot of rounds [0, rounds), and rings every sleeper.
  void finish_reading(std::uint64_t rounds);
  // How many rounds rank `q` has finished reading.
  std::uint64_t read_by(int q) const;

  bool sleep_unless(const std::function<bool()>& ready, int timeout_us) override;
  void wake_self() override;

 private:
  ShmBoard() = default;
  struct RankControl;
  RankControl* control(int q) const;
  void ring_everyone();

  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  int rank_ = 0;
  int ranks_ = 1;
  std::size_t capacity_ = 0;
  std::size_t stride_ = 0;  // one slot, header included
};

}  // namespace pipesgd
