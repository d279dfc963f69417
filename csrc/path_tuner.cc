#include "path_tuner.h"

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
  const int j = c.timed ? trial - 2 * kWarmupsPerPath : trial;
  const bool links_turn = c.timed ? (j % 4 == 0 || j % 4 == 3) : j % 2 == 0;
  c.path = links_turn ? RingPathKind::kLinks : RingPathKind::kMessages;
  return c;
}

bool PathTuner::record(const Choice& choice, double seconds) {
  if (choice.size_class < 0) return false;
  ClassState& s = classes_[choice.size_class];
  if (s.decided) return false;
  if (choice.timed) s.seconds[static_cast<int>(choice.path)] += seconds;
  return ++s.trials == kTrials;
}

std::array<double, 2> PathTuner::totals(int size_class) const {
  const auto it = classes_.find(size_class);
  return it == classes_.end() ? std::array<double, 2>{0.0, 0.0} : it->second.seconds;
}

void PathTuner::decide(int size_class, const std::array<double, 2>& slowest_totals) {
  ClassState& s = classes_[size_class];
  s.decided = true;
  s.path = slowest_totals[1] < slowest_totals[0] ? RingPathKind::kMessages : RingPathKind::kLinks;
}

std::map<std::size_t, RingPathKind> PathTuner::decided() const {
  std::map<std::size_t, RingPathKind> out;
  for (const auto& [k, state] : classes_) {
    if (state.decided) out[std::size_t{1} << k] = state.path;
  }
  return out;
}

}  // namespace pipesgd
