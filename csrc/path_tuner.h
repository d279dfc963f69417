// Which way an uncompressed operation in the caller's memory travels between ranks of
// one node, learnt from the user's own operations.
//
// Three paths can carry it:
// - the links (shm_links.h): a ring whose segments are copied into the neighbour's
//   inbox, then out of it or while adding; each crosses from one core's cache to the
//   other's;
// - MPI messages: the same ring, each segment copied once, by the kernel (Open MPI's
//   CMA), which first pins the buffer's pages;
// - the staged board (allreduce/board.h): the array copied piece by piece into this
//   rank's part of a buffer every rank maps, reduced there in place with two waits per
//   piece, and copied back.
// Which costs least depends on the CPU, on how the buffer is backed and, on a VM, on
// the state its virtual CPUs are in for the life of a process (docs/engine.md, "Links
// or messages", "The caller's arrays, staged"): on an AMD EPYC VM the links were twice
// as fast as messages at 16 MiB in one state, the staged board twice as fast as both
// from 1 to 8 MiB in the other; on an Intel Sapphire Rapids VM messages were 1.2x faster
// from 8 MiB on huge-page buffers. So the engine times the paths on the operations it is
// given and keeps the fastest. Results do not depend on the choice beyond summation
// order: the links and messages sum every element in the same order (ring_layout.h), the
// board in rank order, and every rank takes the same path for the same operation.
//
// Per size class (operations of [2^k, 2^(k+1)) bytes from kTunedFromBytes, uncompressed),
// the candidates are the links and, where the engine has a stage, the staged board;
// from kMessagesFromBytes MPI's messages too. A class's first trials start with
// kWarmupsPerPath untimed operations on each candidate (later trials find the paths
// warm); then kTimedPerPath on each are timed, in the order a b c c b a (a b b a for
// two), so that a trend over the first runs of a fresh buffer weighs on every candidate
// alike. Each timed operation counts from the last rank's start to the last rank's end,
// on the one monotonic clock the node's ranks share: ranks reach an operation at
// different times (compute skew in a training loop) and the early ones wait for the late
// one, which no path shortens; and the operation is over for the job when its last rank
// is done, which on the staged board is a copy-back after the first.
// The per-path sums of those decide, alike on every rank, and the class keeps
// the fastest path for a while, then runs its trials again: which path is fastest can
// change under a running process, and a decision taken in one state would otherwise
// hold in the other for the rest of a job. A class's first decision holds for
// kRetuneFirst operations, a changed one for kRetuneSoon, and each one the trials
// confirm for twice as long as the last, up to kRetuneEvery: the trials' operations on
// slower paths cost well under 1 % at that period.
//
// Between trials the class watches the path it kept: at the end of each window the ranks
// agree on the time of each of its last kWatched operations, as for a trial, and when
// their median is more than kWatchMargin times another path's time in the last trials,
// the trials run again at once. A window is kWatched operations, or as many as take
// kWatchSeconds on the kept path: an agreement costs tens of microseconds, a sixth of a
// 64 KiB operation, so small classes agree less often. On a 2-core VM the links ran
// 3-5x slower for tens of operations at a time (spells in which MPI's messages slowed by
// a fifth), and waiting out kRetuneEvery operations kept them there; the spell over,
// kRetuneSoon brings them back.
// Everything else (small, compressed) takes the links.
#pragma once

#include <array>
#include <cstddef>
#include <map>
#include <vector>

namespace pipesgd {

enum class PathKind : int { kLinks = 0, kMessages = 1, kStaged = 2 };
constexpr int kPathKinds = 3;
const char* path_name(PathKind path);  // "links", "messages", "staged"

class PathTuner {
 public:
  static constexpr std::size_t kTunedFromBytes = 64u << 10;
  // Below this, messages lost to the links on every CPU tried (docs/engine.md).
  static constexpr std::size_t kMessagesFromBytes = 4u << 20;
  static constexpr int kWarmupsPerPath = 1;
  static constexpr int kTimedPerPath = 2;  // the order a b c c b a needs two
  static constexpr int kWatched = 4;        // operations judged per watch window
  static constexpr double kWatchSeconds = 2e-3;  // a watch window lasts at least this
  static constexpr int kRetuneSoon = 16;    // operations between trials after a change
  static constexpr int kRetuneFirst = 64;   // after a class's first trials
  static constexpr int kRetuneEvery = 256;  // at the most
  static constexpr double kWatchMargin = 1.25;
  // Enough for the trials of every candidate, or a watch window.
  static constexpr int kMaxTimed = kTimedPerPath * kPathKinds;
  using TrialTimes = std::array<double, kMaxTimed>;

  // `staged`: the engine has a stage, so the staged board is a candidate.
  explicit PathTuner(bool staged = false) : staged_(staged) {}

  struct Choice {
    PathKind path = PathKind::kLinks;
    int size_class = -1;  // -1: not tuned (small, or compressed)
    bool timed = false;   // a trial whose time decides
  };

  // The path for an operation of `bytes` (before compression). Every rank asks with the
  // same operations in the same order and gets the same answers.
  Choice choose(std::size_t bytes, bool compressed) const;
  // The paths a class's trials try, in their timed order's first half; held in place,
  // not allocated, as choose() runs on every operation.
  struct Candidates {
    std::array<PathKind, kPathKinds> paths{};
    int n = 0;
    const PathKind* begin() const { return paths.data(); }
    const PathKind* end() const { return paths.data() + n; }
    int size() const { return n; }
    PathKind operator[](int i) const { return paths[static_cast<std::size_t>(i)]; }
  };
  Candidates candidates(int size_class) const;

  // Each timed operation's start (the first kMaxTimed entries) and end (the rest), in
  // seconds on the node's monotonic clock.
  using TrialMarks = std::array<double, 2 * kMaxTimed>;

  // Counts the operation choose() was asked for, with when it started and ended on this
  // rank (every operation of a tuned class is timed: trials and the watch). Returns true
  // when the class has times to agree on, after all its trials or a watch window: the
  // caller then takes each mark at its latest over the ranks (trial_marks(), an
  // allreduce with MAX) and calls decide() with seconds_between() of them.
  bool record(const Choice& choice, double start_s, double end_s);
  // This rank's marks of a class's timed trials or watched operations, in order (unused
  // entries 0).
  TrialMarks trial_marks(int size_class) const;
  // Each operation's seconds from the last rank's start to the last rank's end, from the
  // marks at their latest over the ranks.
  static TrialTimes seconds_between(const TrialMarks& latest);
  // With the agreed seconds (seconds_between()): after trials, keeps the fastest path;
  // after a watch window, starts the trials again if the kept path has fallen behind
  // another one's last trial times.
  void decide(int size_class, const TrialTimes& agreed);
  // How many times a watch window has sent a class back to its trials (all classes).
  int watch_retrials() const { return watch_retrials_; }

  // The decided classes: 2^k (bytes) and the path kept (the last decision, while the
  // class runs its trials again).
  std::map<std::size_t, PathKind> decided() const;
  // The agreed seconds of each decided class's last timed trials, per candidate in the
  // order they ran (empty for a path that is not a candidate): what the last decision
  // was taken on, to tell a pick the machine made from one the trials' noise made.
  using PathTrials = std::array<std::vector<double>, kPathKinds>;
  std::map<std::size_t, PathTrials> last_trials() const;

 private:
  struct ClassState {
    int trials = 0;  // operations of the current trials counted so far
    TrialMarks marks{};
    bool decided = false;       // the class is between trials
    bool ever_decided = false;  // `path` holds a decision
    int since_decided = 0;      // operations since the last decision
    int retune_after = kRetuneFirst;  // operations from this decision to the next trials
    PathKind path = PathKind::kLinks;
    std::array<double, kPathKinds> per_operation{};  // each candidate's mean trial time
    TrialTimes last_trials{};  // the agreed seconds the last decision was taken on
    int watch_every = kWatched;  // operations per watch window (watch_window, at decide())
  };
  // Operations per watch window of a decided class (the same on every rank: the agreed
  // trial times decide it).
  static int watch_window(const ClassState& s);
  // The path of timed trial j among `n` candidates: a b c c b a.
  PathKind timed_path(int size_class, int j) const;
  bool staged_;
  std::map<int, ClassState> classes_;
  int watch_retrials_ = 0;
};

}  // namespace pipesgd
