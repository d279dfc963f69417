// How a thread waits for what another thread or process will do: one rule for the comm
// thread's MPI waits (CommContext), its waits on a shared-memory link's doorbell, and
// Python's polite waits (pipesgd.polling, through the binding), so PIPESGD_SPIN_US and
// PIPESGD_POLL_US mean the same everywhere.
//
// The rule:
// - Spin: right after progress the next event usually follows within microseconds
//   (shared memory: the next segment), so for spin_us after the last progress a failed
//   test is followed at once by the next, as long as the last wait that polled ended
//   within spin_us.
// - Sleep: otherwise test, then sleep. Spinning takes a core from the ranks that
//   compute when ranks share cores, and over TCP Open MPI moves data only inside MPI
//   calls, so a spinning rank also holds up the peers whose transfers it waits for.
// - Back off: within a streaming operation (several segments per ring step, arriving at
//   a slow link's pace) the sleep doubles after each empty wake, up to poll_max_us, so a
//   wake finds a segment or two ready instead of none: on an emulated 1 Gbit/s link the
//   comm thread's CPU per 16 MiB allreduce went from 28 ms to 15 (quant8 10 -> 7.5) in the
//   same time. Each operation starts at poll_us again, so small ones keep their latency.
// - Waited: while a thread of the process is blocked on an operation, the caller may ask
//   for no sleep at all (its core is idle; a nap only adds a descheduled peer's
//   lateness), with or without sched_yield (WaitedPolling).
// - Late: a peer that has not started for kLateNaps naps' time (an operation's header)
//   is late, not skewed: a wait that would yield (ranks share cores, or a network) naps
//   poll_us between tests instead, so a nap adds at most 1/kLateNaps of the wait.
//   Yielding through a late peer takes the CPU of the ranks that compute beside it (a
//   pipeline's replica waiting a period for its peer in every update; docs/engine.md,
//   "Polling", has the measurement).
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>

namespace pipesgd {

// Tells the core this is a spin-wait: a sibling hardware thread gets its execution
// resources, and leaving the loop does not flush the pipeline.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void sleep_for_us(int us);

// How a wait polls while a thread of its process is blocked waiting for the operation.
enum class WaitedPolling : int {
  kSleep = 0,  // as at any other time
  kSpin = 1,   // test without pause: the node has a core per rank
  kYield = 2,  // test, then sched_yield: ranks share cores, and the one this thread
               // yields to is most likely a peer the ring waits on
};
const char* waited_polling_name(WaitedPolling polling);

class Poller {
 public:
  using Clock = std::chrono::steady_clock;

  // judge_by_last_test: decide whether spinning pays by when the awaited event had
  // happened at the latest (the last failed test plus the sleep asked for after it), not
  // by the wall clock. Over shared memory a sleep that overran (a busy VM's
  // nanosleep(50 us) can take 200 us) must not teach "do not spin", or the next sleeps
  // overrun too: at p = 2 one 8 MiB allreduce in seven took twice as long. Over a network
  // the wall clock is the link's pace, and judging by it spends 15-27 % less CPU per
  // operation (bench/allreduce.py --netem, cpu column).
  Poller(int spin_us, int poll_us, int poll_max_us, bool judge_by_last_test)
      : spin_(spin_us), late_after_(static_cast<long>(kLateNaps) * poll_us), poll_us_(poll_us),
        poll_max_us_(poll_max_us), judge_by_last_test_(judge_by_last_test),
        sleep_us_(poll_us), max_sleep_us_(poll_us) {}

  // A new operation starts: its first events usually follow at once.
  void note_progress() {
    last_progress_ = Clock::now();
    sleep_us_ = max_sleep_us_ = poll_us_;
  }
  // Whether the operation streams: then its sleeps may grow up to poll_max_us.
  void set_streaming(bool streaming) { max_sleep_us_ = streaming ? poll_max_us_ : poll_us_; }

  // Tests `test()` until it returns true. After each failed test calls `check(now)` (which
  // may throw to end the wait), then spins, sleeps or yields as the rule and `mode()` (a
  // WaitedPolling, kSleep unless a thread waits) say.
  // `teaches`: the wait's length says how fast events follow each other, so it may
  // teach whether spinning pays and let the sleep back off; false for a wait as long as a
  // peer is late (an operation's header), which keeps sleeping poll_us, so the operation
  // starts as soon as the peer does.
  template <typename Test, typename Check, typename Mode>
  void until(Test test, Check check, Mode mode, bool teaches) {
    const auto began = Clock::now();
    auto latest_done = began;  // the last failed test, plus the sleep asked for after it
    for (bool polled = false, slept = false;; polled = true) {
      if (test()) {
        completed(began, latest_done, polled && teaches);
        return;
      }
      if (slept && teaches) sleep_us_ = std::min(2 * sleep_us_, max_sleep_us_);
      const auto missed = Clock::now();
      check(missed);
      WaitedPolling idle = mode();
      if (idle == WaitedPolling::kYield && late(began, missed, teaches)) {
        idle = WaitedPolling::kSleep;
      }
      int asked_us = 0;
      if (idle == WaitedPolling::kSleep && !spins(missed)) {
        asked_us = teaches ? sleep_us_ : poll_us_;
        sleep_for_us(asked_us);
      }
      if (idle == WaitedPolling::kYield) sched_yield();
      slept = asked_us > 0;
      latest_done = missed + std::chrono::microseconds(asked_us);
    }
  }

  // Tests `ready()` until true, calling `check(now)` after each failed test. While
  // progress is recent (within spin_us) it spins if `spin` (every rank has a core), or
  // yields if `mode()` says kYield (ranks share cores and a thread of the process waits:
  // the thread it yields to is most likely a peer whose segment it waits for; sleeping
  // instead cost each ring step a wake-up, and 4 ranks on 2 cores ran 64 KiB at half
  // MPI's speed). Otherwise it calls `doze()`, which sleeps until woken or a timeout and
  // says whether ready() holds. Never a timed nap: on a push link a nap adds the
  // neighbour's lateness, and it never spins or yields for long: that takes the CPU time
  // of a neighbour that is late.
  template <typename Ready, typename Check, typename Mode, typename Doze>
  void until_woken(Ready ready, Check check, Mode mode, Doze doze, bool spin) {
    for (;;) {
      if (ready()) break;
      const auto now = Clock::now();
      check(now);
      if (now - last_progress_ < spin_) {
        if (spin) {
          cpu_relax();
          continue;
        }
        if (mode() == WaitedPolling::kYield) {
          sched_yield();
          continue;
        }
      }
      if (doze()) break;
    }
    last_progress_ = Clock::now();
  }

  // Naps a late peer's wait is past before it stops yielding (poller.h's header).
  static constexpr int kLateNaps = 20;

 private:
  // Whether a wait begun at `began` has waited for a late peer (not `teaches`: an
  // operation's header) longer than kLateNaps naps of poll_us.
  bool late(Clock::time_point began, Clock::time_point now, bool teaches) const {
    return !teaches && poll_us_ > 0 && now - began > late_after_;
  }
  bool spins(Clock::time_point now) const {
    return spinning_pays_ && now - last_progress_ <= spin_;
  }
  void completed(Clock::time_point began, Clock::time_point latest_done, bool polled) {
    const auto now = Clock::now();
    if (polled) spinning_pays_ = (judge_by_last_test_ ? latest_done : now) - began <= spin_;
    last_progress_ = now;
  }

  const std::chrono::microseconds spin_;
  const std::chrono::microseconds late_after_;  // kLateNaps naps of poll_us
  const int poll_us_;
  const int poll_max_us_;
  const bool judge_by_last_test_;
  Clock::time_point last_progress_{};
  bool spinning_pays_ = true;  // the last wait that polled ended within spin_us
  int sleep_us_;               // this operation's sleep, poll_us .. max_sleep_us_
  int max_sleep_us_;           // poll_max_us for streaming operations, else poll_us
};

}  // namespace pipesgd
