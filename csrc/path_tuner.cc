#include "path_tuner.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pipesgd {
namespace {

int floor_log2(std::size_t x) {
  int k = -1;
  for (; x != 0; x >>= 1) ++k;
  return k;
}

// Untimed operations before the timed trials of a class with `n` candidates: its first
// trials warm every path up; later ones find them warm.
int warmups(bool tried_before, int n) {
  return tried_before ? 0 : n * PathTuner::kWarmupsPerPath;
}

}  // namespace

const char* path_name(PathKind path) {
  switch (path) {
    case PathKind::kLinks:
      return "links";
    case PathKind::kMessages:
      return "messages";
    case PathKind::kStaged:
      return "staged";
  }
  return "?";
}

PathTuner::Candidates PathTuner::candidates(int size_class) const {
  Candidates out;
  out.paths[static_cast<std::size_t>(out.n++)] = PathKind::kLinks;
  if ((std::size_t{1} << size_class) >= kMessagesFromBytes) {
    out.paths[static_cast<std::size_t>(out.n++)] = PathKind::kMessages;
  }
  if (staged_) out.paths[static_cast<std::size_t>(out.n++)] = PathKind::kStaged;
  return out;
}

PathKind PathTuner::timed_path(int size_class, int j) const {
  const Candidates c = candidates(size_class);
  const int n = c.size();
  return c[j < n ? j : 2 * n - 1 - j];
}

PathTuner::Choice PathTuner::choose(std::size_t bytes, bool compressed) const {
  Choice c;
  // The links carry compressed data in a quarter or half of the bytes, where they win.
  if (compressed || bytes < kTunedFromBytes) return c;
  c.size_class = floor_log2(bytes);
  const auto it = classes_.find(c.size_class);
  if (it != classes_.end() && it->second.decided) {
    c.path = it->second.path;
    return c;
  }
  const Candidates paths = candidates(c.size_class);
  const int n = paths.size();
  if (n < 2) {  // nothing to choose between
    c.size_class = -1;
    return c;
  }
  const int trial = it == classes_.end() ? 0 : it->second.trials;
  const int untimed = warmups(it != classes_.end() && it->second.ever_decided, n);
  c.timed = trial >= untimed;
  c.path = c.timed ? timed_path(c.size_class, trial - untimed) : paths[trial % n];
  return c;
}

bool PathTuner::record(const Choice& choice, double start_s, double end_s) {
  if (choice.size_class < 0) return false;
  ClassState& s = classes_[choice.size_class];
  const auto mark = [&s, start_s, end_s](int slot) {
    s.marks[static_cast<std::size_t>(slot)] = start_s;
    s.marks[static_cast<std::size_t>(kMaxTimed + slot)] = end_s;
  };
  if (s.decided) {
    // Every rank counts the same operations, so all agree on the same ones.
    if (++s.since_decided == s.retune_after) {
      s.decided = false;
      s.trials = 0;
      s.marks = {};
      return false;
    }
    mark((s.since_decided - 1) % kWatched);
    return s.since_decided % s.watch_every == 0;
  }
  const int n = candidates(choice.size_class).size();
  const int untimed = warmups(s.ever_decided, n);
  if (choice.timed) mark(s.trials - untimed);
  return ++s.trials == untimed + n * kTimedPerPath;
}

int PathTuner::watch_window(const ClassState& s) {
  const double per_operation = s.per_operation[static_cast<std::size_t>(s.path)];
  if (!(per_operation > 0.0)) return kWatched;
  return std::max(kWatched, static_cast<int>(std::ceil(kWatchSeconds / per_operation)));
}

PathTuner::TrialMarks PathTuner::trial_marks(int size_class) const {
  const auto it = classes_.find(size_class);
  return it == classes_.end() ? TrialMarks{} : it->second.marks;
}

PathTuner::TrialTimes PathTuner::seconds_between(const TrialMarks& latest) {
  TrialTimes out{};
  for (std::size_t j = 0; j < out.size(); ++j) out[j] = latest[kMaxTimed + j] - latest[j];
  return out;
}

void PathTuner::decide(int size_class, const TrialTimes& agreed) {
  ClassState& s = classes_[size_class];
  const Candidates paths = candidates(size_class);
  if (s.decided) {  // a watch window: the median, so one slow operation is not a spell
    std::array<double, kWatched> sorted{};
    std::copy_n(agreed.begin(), kWatched, sorted.begin());
    std::sort(sorted.begin(), sorted.end());
    const double median = 0.5 * (sorted[kWatched / 2 - 1] + sorted[kWatched / 2]);
    for (PathKind other : paths) {
      if (other == s.path) continue;
      if (median > kWatchMargin * s.per_operation[static_cast<std::size_t>(other)]) {
        s.decided = false;
        s.trials = 0;
        s.marks = {};
        ++watch_retrials_;
        return;
      }
    }
    return;
  }
  std::array<double, kPathKinds> total{};
  const int n = paths.size();
  for (int j = 0; j < n * kTimedPerPath; ++j) {
    total[static_cast<std::size_t>(timed_path(size_class, j))] +=
        agreed[static_cast<std::size_t>(j)];
  }
  // The fastest; a tie keeps the earlier candidate (the links first).
  PathKind fastest = paths[0];
  for (PathKind path : paths) {
    if (total[static_cast<std::size_t>(path)] < total[static_cast<std::size_t>(fastest)]) {
      fastest = path;
    }
  }
  if (!s.ever_decided) {
    s.retune_after = kRetuneFirst;
  } else if (fastest == s.path) {
    s.retune_after = std::min(2 * s.retune_after, kRetuneEvery);
  } else {
    s.retune_after = kRetuneSoon;
  }
  s.decided = s.ever_decided = true;
  s.last_trials = agreed;
  s.since_decided = 0;
  s.path = fastest;
  s.marks = {};
  s.per_operation.fill(std::numeric_limits<double>::infinity());  // not a candidate
  for (PathKind path : paths) {
    s.per_operation[static_cast<std::size_t>(path)] =
        total[static_cast<std::size_t>(path)] / kTimedPerPath;
  }
  s.watch_every = watch_window(s);
}

std::map<std::size_t, PathKind> PathTuner::decided() const {
  std::map<std::size_t, PathKind> out;
  for (const auto& [k, state] : classes_) {
    if (state.ever_decided) out[std::size_t{1} << k] = state.path;
  }
  return out;
}

std::map<std::size_t, PathTuner::PathTrials> PathTuner::last_trials() const {
  std::map<std::size_t, PathTrials> out;
  for (const auto& [k, state] : classes_) {
    if (!state.ever_decided) continue;
    PathTrials& per_path = out[std::size_t{1} << k];
    for (int j = 0; j < candidates(k).size() * kTimedPerPath; ++j) {
      per_path[static_cast<std::size_t>(timed_path(k, j))].push_back(
          state.last_trials[static_cast<std::size_t>(j)]);
    }
  }
  return out;
}

}  // namespace pipesgd
