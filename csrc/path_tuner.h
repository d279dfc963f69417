// Which way a large operation travels between ranks of one node, learnt from the
// user's own operations.
//
// Over shared-memory links (shm_links.h) a segment is copied twice (into the
// neighbour's inbox, then out of it or while adding) and crosses from one core's cache
// to the other's; as MPI messages within a node it is copied once, by the kernel (Open
// MPI's CMA), which first pins the buffer's pages. Which costs less depends on the CPU
// and on how the buffer is backed (docs/engine.md, "Links or messages"): on an AMD EPYC
// VM the links were twice as fast at 16 MiB; on an Intel Sapphire Rapids VM messages
// were 1.2x faster from 8 MiB on huge-page buffers and level on 4 KiB pages, while
// the links won below 4 MiB everywhere. So the engine times both on the operations it is
// given and keeps the faster. Results do not depend on the choice: both paths sum every
// element in the same order (ring_layout.h does not depend on the segment size).
//
// Per size class (operations of [2^k, 2^(k+1)) bytes from kTunedFromBytes, uncompressed),
// the first kWarmupsPerPath operations on each path are not timed, the next
// kTimedPerPath on each path are, interleaved. Each timed operation counts at its
// shortest over the ranks: ranks reach an operation at different times (compute skew in a
// training loop), the early ones wait for the late one, and the last to arrive measures
// the transfer alone. The per-path sums of those decide, alike on every rank, and the
// class keeps the faster path for a while, then runs its trials again: which path is
// faster can change under a running process (on a VM, with whether its two virtual CPUs
// share an L3: docs/engine.md, "Counting launches"), and a decision taken in one state
// would otherwise hold in the other for the rest of a job. A class's first decision
// holds for kRetuneFirst operations, a changed one for kRetuneSoon, and each one the
// trials confirm for twice as long as the last, up to kRetuneEvery: three of every
// kRetuneEvery operations on the slower path cost well under 1 %.
//
// Between trials the class watches the path it kept: every kTimed operations the ranks
// agree on each one's shortest time, as for a trial, and when their median is more than
// kWatchMargin times the other path's time in the last trials, the trials run again at
// once. On a 2-core VM the links ran 3-5x slower for tens of operations at a time
// (spells in which MPI's messages slowed by a fifth), and waiting out kRetuneEvery
// operations kept them there; the spell over, kRetuneSoon brings them back.
// Everything else takes the links.
#pragma once

#include <array>
#include <cstddef>
#include <map>

namespace pipesgd {

enum class RingPathKind : int { kLinks = 0, kMessages = 1 };

class PathTuner {
 public:
  static constexpr std::size_t kTunedFromBytes = 4u << 20;
  static constexpr int kWarmupsPerPath = 1;
  static constexpr int kTimedPerPath = 2;  // even: see choose()
  static constexpr int kRetuneSoon = 16;    // operations between trials after a change
  static constexpr int kRetuneFirst = 64;   // after a class's first trials
  static constexpr int kRetuneEvery = 256;  // at the most
  static constexpr double kWatchMargin = 1.25;

  struct Choice {
    RingPathKind path = RingPathKind::kLinks;
    int size_class = -1;  // -1: not tuned (small, or compressed)
    bool timed = false;   // a trial whose time decides
  };

  // The path for an operation of `bytes` (before compression). Every rank asks with the
  // same operations in the same order and gets the same answers.
  Choice choose(std::size_t bytes, bool compressed) const;
  static constexpr int kTimed = 2 * kTimedPerPath;
  using TrialTimes = std::array<double, kTimed>;

  // Counts the operation choose() was asked for, with its seconds on this rank (every
  // operation of a tuned class is timed: trials and the watch). Returns true when the
  // class has kTimed times to agree on, after all its trials or a watch window: the
  // caller then takes each one's shortest time over the ranks (trial_times(), an
  // allreduce with MIN) and calls decide() with them.
  bool record(const Choice& choice, double seconds);
  // This rank's seconds of a class's timed trials or watched operations, in order.
  TrialTimes trial_times(int size_class) const;
  // After trials: keeps the faster path. After a watch window: starts the trials again
  // if the kept path has fallen behind the other one's last trial times.
  void decide(int size_class, const TrialTimes& shortest_over_ranks);
  // How many times a watch window has sent a class back to its trials (all classes).
  int watch_retrials() const { return watch_retrials_; }

  // The decided classes: 2^k (bytes) and the path kept (the last decision, while the
  // class runs its trials again).
  std::map<std::size_t, RingPathKind> decided() const;

 private:
  struct ClassState {
    int trials = 0;  // operations of the current trials counted so far
    TrialTimes seconds{};
    bool decided = false;       // the class is between trials
    bool ever_decided = false;  // `path` holds a decision
    int since_decided = 0;      // operations since the last decision
    int retune_after = kRetuneFirst;  // operations from this decision to the next trials
    RingPathKind path = RingPathKind::kLinks;
    double per_operation[2] = {0.0, 0.0};  // each path's mean agreed trial time
  };
  static constexpr int kTrials = 2 * kWarmupsPerPath + kTimed;
  // The path of timed trial j: links, messages, messages, links, ...
  static RingPathKind timed_path(int j) {
    return j % 4 == 0 || j % 4 == 3 ? RingPathKind::kLinks : RingPathKind::kMessages;
  }
  std::map<int, ClassState> classes_;
  int watch_retrials_ = 0;
};

}  // namespace pipesgd
