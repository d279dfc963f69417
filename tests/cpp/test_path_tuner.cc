// The path tuner's decisions, without MPI: which operations are tried on which path,
// which are timed, and that the agreed per-trial times decide (path_tuner.h).
#include <cstdio>
#include <cstdlib>

#include "expect.h"
#include "path_tuner.h"

using namespace pipesgd;

namespace {

constexpr std::size_t kMiB = 1u << 20;
constexpr RingPathKind L = RingPathKind::kLinks;
constexpr RingPathKind M = RingPathKind::kMessages;

// Runs a class's trials, each path taking `links_s` / `messages_s` per operation, and
// returns the trial times this rank would send to the agreement.
PathTuner::TrialTimes run_trials(PathTuner& tuner, std::size_t bytes, double links_s,
                                 double messages_s) {
  const RingPathKind order[] = {L, M, L, M, M, L};
  const bool timed[] = {false, false, true, true, true, true};
  int k = 0;
  for (; k < 6; ++k) {
    const PathTuner::Choice c = tuner.choose(bytes, false);
    EXPECT(c.path == order[k], "trial order is warm-ups L M, then L M M L");
    EXPECT(c.timed == timed[k], "warm-ups are not timed");
    const bool last = tuner.record(c, c.path == L ? links_s : messages_s);
    EXPECT(last == (k == 5), "the class is complete after its sixth trial");
    if (last) return tuner.trial_times(c.size_class);
  }
  return {};
}

}  // namespace

int main() {
  {
    PathTuner tuner;
    // Small and compressed operations are never tried as messages.
    for (int i = 0; i < 10; ++i) {
      const PathTuner::Choice small = tuner.choose(4 * kMiB - 1, false);
      EXPECT(small.path == L && small.size_class < 0 && !small.timed, "small: links");
      EXPECT(!tuner.record(small, 1.0), "small operations are not counted");
      const PathTuner::Choice packed = tuner.choose(64 * kMiB, true);
      EXPECT(packed.path == L && packed.size_class < 0, "compressed: links");
      tuner.record(packed, 1.0);
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
    EXPECT(!tuner.record(after, 9.0), "a decided class learns nothing between its trials");
    EXPECT(tuner.choose(8 * kMiB, false).path == L, "the 8 MiB class starts its own trials");
    const auto decided = tuner.decided();
    EXPECT(decided.size() == 1 && decided.count(4 * kMiB) == 1 && decided.at(4 * kMiB) == M,
           "decided() names the 4 MiB class");
  }
  {
    PathTuner tuner;
    // This rank found the messages faster, but the shortest times over the ranks (what
    // the agreement hands every rank) decide: links 1 + 1.5, messages 2 + 2.
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
    // The machine changes under the job: messages win the first trials, the links the
    // ones kRetuneEvery operations later, and the class follows.
    tuner.decide(24, run_trials(tuner, 16 * kMiB, 2.0, 1.0));
    for (int i = 1; i < PathTuner::kRetuneEvery; ++i) {
      const PathTuner::Choice c = tuner.choose(16 * kMiB, false);
      EXPECT(c.path == M && !c.timed, "between trials the decision holds");
      EXPECT(!tuner.record(c, 1.0), "and nothing is learnt");
    }
    tuner.record(tuner.choose(16 * kMiB, false), 1.0);  // the kRetuneEvery-th
    EXPECT(tuner.decided().at(16 * kMiB) == M, "while the trials run, the last decision shows");
    const PathTuner::TrialTimes again = run_trials(tuner, 16 * kMiB, 1.0, 2.0);
    EXPECT(again[0] == 1.0 && again[1] == 2.0, "the second trials are timed afresh");
    tuner.decide(24, again);
    EXPECT(tuner.choose(16 * kMiB, false).path == L, "the class switches to the links");
    EXPECT(tuner.decided().at(16 * kMiB) == L, "and decided() says so");
  }
  std::printf("test_path_tuner: %d failures\n", selftest::failures);
  return selftest::failures == 0 ? 0 : 1;
}
