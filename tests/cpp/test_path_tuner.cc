// The path tuner's decisions, without MPI: which operations are tried on which path,
// which are timed, and that the agreed per-trial times decide (path_tuner.h).
#include <algorithm>
#include <array>
#include <vector>
#include <cstdio>
#include <cstdlib>

#include "expect.h"
#include "path_tuner.h"

using namespace pipesgd;

namespace {

constexpr std::size_t kMiB = 1u << 20;
constexpr PathKind L = PathKind::kLinks;
constexpr PathKind M = PathKind::kMessages;
constexpr PathKind S = PathKind::kStaged;

// What the agreement hands back where this rank is the only one: its own marks are the
// latest, and each operation starts at 0.
PathTuner::TrialTimes own_times(const PathTuner& tuner, int size_class) {
  return PathTuner::seconds_between(tuner.trial_marks(size_class));
}

// Runs a class's trials in `order` (the first `warmups` untimed, the rest timed), each
// path taking `seconds[path]` per operation; returns the times this rank would send to
// the agreement.
PathTuner::TrialTimes run_order(PathTuner& tuner, std::size_t bytes,
                                const std::vector<PathKind>& order, std::size_t warmups,
                                const std::array<double, 3>& seconds) {
  int size_class = -1;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const PathTuner::Choice c = tuner.choose(bytes, false);
    size_class = c.size_class;
    EXPECT(c.path == order[k], "the trials take the candidates in order");
    EXPECT(c.timed == (k >= warmups), "warm-ups are not timed");
    const bool last = tuner.record(c, 0.0, seconds[static_cast<std::size_t>(c.path)]);
    EXPECT(last == (k + 1 == order.size()), "the class is complete after its last trial");
  }
  return own_times(tuner, size_class);
}

// Runs a class's trials between links and messages, each taking `links_s` / `messages_s`
// per operation: a class's first trials warm each path up untimed (L M, then L M M L);
// later ones find them warm (L M M L).
PathTuner::TrialTimes run_trials(PathTuner& tuner, std::size_t bytes, double links_s,
                                 double messages_s) {
  std::size_t size_class = 1;
  while (2 * size_class <= bytes) size_class *= 2;
  const bool first = tuner.decided().count(size_class) == 0;
  const std::vector<PathKind> order =
      first ? std::vector<PathKind>{L, M, L, M, M, L} : std::vector<PathKind>{L, M, M, L};
  return run_order(tuner, bytes, order, first ? 2 : 0, {links_s, messages_s, 0.0});
}

}  // namespace

int main() {
  {
    PathTuner tuner;
    // Small and compressed operations are never tried as messages.
    for (int i = 0; i < 10; ++i) {
      const PathTuner::Choice small = tuner.choose(4 * kMiB - 1, false);
      EXPECT(small.path == L && small.size_class < 0 && !small.timed, "small: links");
      EXPECT(!tuner.record(small, 0.0, 1.0), "small operations are not counted");
      const PathTuner::Choice packed = tuner.choose(64 * kMiB, true);
      EXPECT(packed.path == L && packed.size_class < 0, "compressed: links");
      tuner.record(packed, 0.0, 1.0);
    }
    EXPECT(tuner.decided().empty(), "nothing decided");
  }
  {
    PathTuner tuner;
    // Messages twice as fast: after the trials every operation of the class goes as
    // messages, untimed; 5 and 7.9 MiB are the 4 MiB class, 8 MiB is another.
    const PathTuner::TrialTimes times = run_trials(tuner, 5 * kMiB, 2.0, 1.0);
    EXPECT(times[0] == 2.0 && times[1] == 1.0 && times[2] == 1.0 && times[3] == 2.0,
           "the timed trials, in order: links, messages, messages, links");
    tuner.decide(22, times);
    const PathTuner::Choice after = tuner.choose(8 * kMiB - 1, false);
    EXPECT(after.path == M && !after.timed, "the 4 MiB class keeps the messages");
    EXPECT(!tuner.record(after, 0.0, 9.0),
           "a decided class agrees only every kWatched operations");
    EXPECT(tuner.choose(8 * kMiB, false).path == L, "the 8 MiB class starts its own trials");
    const auto decided = tuner.decided();
    EXPECT(decided.size() == 1 && decided.count(4 * kMiB) == 1 && decided.at(4 * kMiB) == M,
           "decided() names the 4 MiB class");
    const auto trials = tuner.last_trials();
    EXPECT(trials.size() == 1 && trials.count(4 * kMiB) == 1, "last_trials() names it too");
    const PathTuner::PathTrials& runs = trials.at(4 * kMiB);
    EXPECT((runs[0] == std::vector<double>{2.0, 2.0}) &&
               (runs[1] == std::vector<double>{1.0, 1.0}) && runs[2].empty(),
           "each candidate's timed runs, in the order they ran; none for a non-candidate");
  }
  {
    PathTuner tuner;
    // This rank found the messages faster, but the times over the ranks (what the
    // agreement hands every rank) decide: links 1 + 1.5, messages 2 + 2.
    run_trials(tuner, 16 * kMiB, 2.0, 1.0);
    tuner.decide(24, {1.0, 2.0, 2.0, 1.5});
    EXPECT(tuner.choose(16 * kMiB, false).path == L, "the agreed times decide");
    // A tie keeps the links.
    PathTuner tied;
    run_trials(tied, 16 * kMiB, 1.0, 1.0);
    tied.decide(24, {1.0, 1.0, 1.0, 1.0});
    EXPECT(tied.choose(16 * kMiB, false).path == L, "a tie keeps the links");
  }
  {
    PathTuner tuner;
    // Runs `n` operations of a decided class, each on `kept` and agreed as fast as the
    // trials found it; run_trials() after it checks that the trials start right then.
    auto hold = [&](int n, PathKind kept, double seconds) {
      for (int i = 1; i <= n; ++i) {
        const PathTuner::Choice c = tuner.choose(16 * kMiB, false);
        EXPECT(c.path == kept && !c.timed, "between trials the decision holds");
        if (tuner.record(c, 0.0, seconds)) {
          EXPECT(i % PathTuner::kWatched == 0, "the watch agrees every kWatched operations");
          tuner.decide(24, {seconds, seconds, seconds, seconds});
        }
      }
    };
    // A first decision holds for kRetuneFirst operations; each time the trials confirm
    // it, for twice as long, up to kRetuneEvery.
    tuner.decide(24, run_trials(tuner, 16 * kMiB, 2.0, 1.0));
    int expected = PathTuner::kRetuneFirst;
    for (int round = 0; round < 4; ++round) {
      hold(expected, M, 1.0);
      EXPECT(tuner.decided().at(16 * kMiB) == M, "while the trials run, the last decision shows");
      tuner.decide(24, run_trials(tuner, 16 * kMiB, 2.0, 1.0));
      expected = std::min(2 * expected, PathTuner::kRetuneEvery);
    }
    EXPECT(expected == PathTuner::kRetuneEvery, "the period has reached its longest");
    EXPECT(tuner.watch_retrials() == 0, "a steady path is never sent back early");
    // The machine changes under the job: the links win the next trials, and the class
    // follows, with the shortest period (a changed state may soon change back).
    hold(PathTuner::kRetuneEvery, M, 1.0);
    const PathTuner::TrialTimes again = run_trials(tuner, 16 * kMiB, 1.0, 2.0);
    EXPECT(again[0] == 1.0 && again[1] == 2.0, "the trials are timed afresh");
    tuner.decide(24, again);
    EXPECT(tuner.choose(16 * kMiB, false).path == L, "the class switches to the links");
    EXPECT(tuner.decided().at(16 * kMiB) == L, "and decided() says so");
    hold(PathTuner::kRetuneSoon, L, 1.0);
    tuner.decide(24, run_trials(tuner, 16 * kMiB, 1.0, 2.0));
    hold(2 * PathTuner::kRetuneSoon, L, 1.0);  // confirmed: twice as long
    tuner.decide(24, run_trials(tuner, 16 * kMiB, 1.0, 2.0));
  }
  {
    PathTuner tuner;
    // The links kept (1 against the messages' 2 per operation), then watched: every
    // kTimed operations the agreed times go to decide(). One slow operation in a window
    // is not a spell; a window whose median passes kWatchMargin x the messages' 2 sends
    // the class back to its trials at once, well before its period ends.
    tuner.decide(24, run_trials(tuner, 16 * kMiB, 1.0, 2.0));
    auto watch = [&](double seconds, PathKind kept) {
      for (int i = 0; i < PathTuner::kWatched; ++i) {
        const PathTuner::Choice c = tuner.choose(16 * kMiB, false);
        EXPECT(c.path == kept && !c.timed, "watched operations keep the decided path");
        const bool agree = tuner.record(c, 0.0, seconds);
        EXPECT(agree == (i == PathTuner::kWatched - 1), "one agreement per kWatched operations");
      }
      return own_times(tuner, 24);
    };
    EXPECT(watch(1.0, L)[0] == 1.0, "the watched times are this rank's");
    tuner.decide(24, {1.0, 9.0, 1.1, 1.0});
    EXPECT(tuner.watch_retrials() == 0, "one slow operation keeps the decision");
    watch(3.0, L);
    tuner.decide(24, {2.4, 2.6, 2.4, 2.4});
    EXPECT(tuner.watch_retrials() == 0, "a median within the margin keeps it");
    watch(3.0, L);
    tuner.decide(24, {3.0, 2.4, 2.6, 3.0});
    EXPECT(tuner.watch_retrials() == 1, "a median beyond 1.25 x the messages' time: trials");
    EXPECT(tuner.decided().at(16 * kMiB) == L, "while the trials run, the last decision shows");
    // In the spell the messages win the new trials; the watch now compares the
    // messages with the links' trial time.
    tuner.decide(24, run_trials(tuner, 16 * kMiB, 4.0, 2.2));
    EXPECT(tuner.choose(16 * kMiB, false).path == M, "the class switches to the messages");
    watch(2.2, M);
    tuner.decide(24, {2.2, 2.3, 2.2, 2.1});
    EXPECT(tuner.watch_retrials() == 1, "messages as fast as in their trials keep them");
  }
  {
    // With a stage, the staged board is a candidate from 64 KiB: below 4 MiB beside the
    // links alone (warm-ups L S, then L S S L), from 4 MiB beside both ring paths
    // (warm-ups L M S, then L M S S M L).
    PathTuner tuner(/*staged=*/true);
    EXPECT(tuner.choose(64 * 1024 - 1, false).size_class < 0, "below 64 KiB: not tuned");
    EXPECT(tuner.choose(64 * kMiB, true).size_class < 0, "compressed: not tuned");
    // A class's first trials: one warm-up per candidate, then the timed ones.
    auto trials = [&](std::size_t bytes, const std::vector<PathKind>& order,
                      const std::array<double, 3>& seconds) {
      return run_order(tuner, bytes, order, order.size() / 3, seconds);
    };
    const PathTuner::TrialTimes small = trials(kMiB, {L, S, L, S, S, L}, {2.0, 9.0, 1.0});
    EXPECT(small[0] == 2.0 && small[1] == 1.0 && small[2] == 1.0 && small[3] == 2.0 &&
               small[4] == 0.0,
           "1 MiB: links and staged, timed L S S L");
    tuner.decide(20, small);
    EXPECT(tuner.choose(kMiB, false).path == S, "the staged board wins the 1 MiB class");
    const PathTuner::TrialTimes large =
        trials(16 * kMiB, {L, M, S, L, M, S, S, M, L}, {3.0, 2.0, 4.0});
    EXPECT(large[0] == 3.0 && large[1] == 2.0 && large[2] == 4.0 && large[3] == 4.0 &&
               large[4] == 2.0 && large[5] == 3.0,
           "16 MiB: three candidates, timed L M S S M L");
    tuner.decide(24, large);
    EXPECT(tuner.choose(16 * kMiB, false).path == M, "the messages win the 16 MiB class");
    const auto decided = tuner.decided();
    EXPECT(decided.size() == 2 && decided.at(kMiB) == S && decided.at(16 * kMiB) == M,
           "decided() names both classes");
    // The watch compares the kept path with every other candidate: a median of 3.8 is
    // within 1.25 x the staged board's 4 but beyond 1.25 x the links' 3.
    for (int i = 0; i < PathTuner::kWatched; ++i) {
      tuner.record(tuner.choose(16 * kMiB, false), 0.0, 1.0);
    }
    tuner.decide(24, {3.8, 3.8, 3.8, 3.8});
    EXPECT(tuner.watch_retrials() == 1, "a kept path behind any other one: trials again");
  }
  {
    // A class whose operations take 0.1 ms agrees once per kWatchSeconds' worth of them
    // (20 operations), judging the last kWatched.
    PathTuner tuner(/*staged=*/true);
    for (int k = 0; k < 6; ++k) {
      const PathTuner::Choice c = tuner.choose(kMiB, false);
      tuner.record(c, 0.0, c.path == S ? 1e-4 : 2e-4);
    }
    tuner.decide(20, own_times(tuner, 20));
    EXPECT(tuner.choose(kMiB, false).path == S, "the staged board kept");
    int agreed_at = 0;
    for (int i = 1; i <= 40 && agreed_at == 0; ++i) {
      if (tuner.record(tuner.choose(kMiB, false), 0.0, i > 16 ? 5e-4 : 1e-4)) agreed_at = i;
    }
    EXPECT(agreed_at == 20, "the window is 2 ms of 0.1 ms operations");
    const PathTuner::TrialTimes last = own_times(tuner, 20);
    EXPECT(last[0] == 5e-4 && last[1] == 5e-4 && last[2] == 5e-4 && last[3] == 5e-4,
           "the window's last four operations are judged");
    tuner.decide(20, last);
    EXPECT(tuner.watch_retrials() == 1, "slower than the links' 0.2 ms: trials again");
  }
  {
    // Two ranks, as the engine's agreement sees them: each mark at its latest over the
    // ranks. The links' ranks end together; the staged board's a copy-back apart, and
    // its rank that arrived first waited 1 for the other. From the last start to the
    // last end the staged board takes 3 against the links' 2.5, though its quicker rank
    // was done 2 after its start.
    PathTuner a(/*staged=*/true), b(/*staged=*/true);
    const std::vector<PathKind> order = {L, S, L, S, S, L};
    for (std::size_t k = 0; k < order.size(); ++k) {
      const PathTuner::Choice ca = a.choose(kMiB, false), cb = b.choose(kMiB, false);
      EXPECT(ca.path == order[k] && cb.path == order[k], "both ranks try the same path");
      const double t = 10.0 * static_cast<double>(k);
      if (ca.path == L) {
        a.record(ca, t, t + 3.5);
        b.record(cb, t + 1.0, t + 3.5);
      } else {
        a.record(ca, t, t + 4.0);
        b.record(cb, t + 1.0, t + 3.0);
      }
    }
    PathTuner::TrialMarks latest{};
    const PathTuner::TrialMarks ma = a.trial_marks(20), mb = b.trial_marks(20);
    for (std::size_t j = 0; j < latest.size(); ++j) latest[j] = std::max(ma[j], mb[j]);
    const PathTuner::TrialTimes agreed = PathTuner::seconds_between(latest);
    EXPECT(agreed[0] == 2.5 && agreed[1] == 3.0 && agreed[2] == 3.0 && agreed[3] == 2.5,
           "each trial from the last rank's start to the last rank's end");
    a.decide(20, agreed);
    EXPECT(a.choose(kMiB, false).path == L, "the links, done first for the job, are kept");
  }
  std::printf("test_path_tuner: %d failures\n", selftest::failures);
  return selftest::failures == 0 ? 0 : 1;
}
