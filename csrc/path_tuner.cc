#include "path_tuner.h"

#include <algorithm>

namespace pipesgd {
namespace {

int floor_log2(std::size_t x) {
  int k = -1;
  for (; x != 0; x >>= 1) ++k;
  return k;
}

}  // namespace

PathTuner::Choice PathTuner::choose(std::size_t bytes, bool compressed) const {
  Choice c;
  // The links carry compressed data in a quarter or half of the bytes, where they win.
  if (compressed || bytes < kTunedFromBytes) return c;
  c.size_class = floor_log2(bytes);
  const auto it = classes_.find(c.size_class);
  const int trial = it == classes_.end() ? 0 : it->second.trials;
  if (it != classes_.end() && it->second.decided) {
    c.path = it->second.path;
    return c;
  }
  c.timed = trial >= 2 * kWarmupsPerPath;
  // Warm-ups alternate; timed trials go links, messages, messages, links, ... so that a
  // trend (the first operations on a fresh buffer are slower) weighs on both alike.
  if (c.timed) {
    c.path = timed_path(trial - 2 * kWarmupsPerPath);
  } else {
    c.path = trial % 2 == 0 ? RingPathKind::kLinks : RingPathKind::kMessages;
  }
  return c;
}

bool PathTuner::record(const Choice& choice, double seconds) {
  if (choice.size_class < 0) return false;
  ClassState& s = classes_[choice.size_class];
  if (s.decided) {
    // Every rank counts the same operations, so all agree on the same ones.
    if (++s.since_decided == s.retune_after) {
      s.decided = false;
      s.trials = 0;
      return false;
    }
    s.seconds[static_cast<std::size_t>((s.since_decided - 1) % kTimed)] = seconds;
    return s.since_decided % kTimed == 0;
  }
  if (choice.timed) s.seconds[static_cast<std::size_t>(s.trials - 2 * kWarmupsPerPath)] = seconds;
  return ++s.trials == kTrials;
}

PathTuner::TrialTimes PathTuner::trial_times(int size_class) const {
  const auto it = classes_.find(size_class);
  return it == classes_.end() ? TrialTimes{} : it->second.seconds;
}

void PathTuner::decide(int size_class, const TrialTimes& shortest_over_ranks) {
  ClassState& s = classes_[size_class];
  if (s.decided) {  // a watch window: the median, so one slow operation is not a spell
    TrialTimes sorted = shortest_over_ranks;
    std::sort(sorted.begin(), sorted.end());
    const double median = 0.5 * (sorted[kTimed / 2 - 1] + sorted[kTimed / 2]);
    const int other = 1 - static_cast<int>(s.path);
    if (median > kWatchMargin * s.per_operation[other]) {
      s.decided = false;
      s.trials = 0;
      ++watch_retrials_;
    }
    return;
  }
  double total[2] = {0.0, 0.0};  // links, messages
  for (int j = 0; j < kTimed; ++j) {
    total[static_cast<int>(timed_path(j))] += shortest_over_ranks[static_cast<std::size_t>(j)];
  }
  const RingPathKind faster = total[1] < total[0] ? RingPathKind::kMessages : RingPathKind::kLinks;
  if (!s.ever_decided) {
    s.retune_after = kRetuneFirst;
  } else if (faster == s.path) {
    s.retune_after = std::min(2 * s.retune_after, kRetuneEvery);
  } else {
    s.retune_after = kRetuneSoon;
  }
  s.decided = s.ever_decided = true;
  s.since_decided = 0;
  s.path = faster;
  for (int path = 0; path < 2; ++path) s.per_operation[path] = total[path] / kTimedPerPath;
}

std::map<std::size_t, RingPathKind> PathTuner::decided() const {
  std::map<std::size_t, RingPathKind> out;
  for (const auto& [k, state] : classes_) {
    if (state.ever_decided) out[std::size_t{1} << k] = state.path;
  }
  return out;
}

}  // namespace pipesgd
