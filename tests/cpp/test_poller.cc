// The polling rule (poller.h) without MPI: when a wait spins, when it sleeps, how its
// sleeps back off within a streaming operation, and what a waiting thread asks for.
// Sleeps are checked from below (nanosleep never returns early), and from above only
// with margins of several times, so a loaded machine does not fail it.
#include <chrono>
#include <cstdio>
#include <stdexcept>

#include "expect.h"
#include "poller.h"

using namespace pipesgd;

namespace {

using Clock = Poller::Clock;

struct Wait {
  int checks = 0;        // failed tests
  double seconds = 0.0;  // the whole wait
};

// Waits until the `tests`-th test, with `mode` for every failed one.
Wait wait_for(Poller& poller, int tests, bool teaches,
              WaitedPolling mode = WaitedPolling::kSleep) {
  Wait w;
  int calls = 0;
  const auto t0 = Clock::now();
  poller.until([&] { return ++calls == tests; }, [&](Clock::time_point) { ++w.checks; },
               [&] { return mode; }, teaches);
  w.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return w;
}

void spins_right_after_progress() {
  Poller poller(/*spin_us=*/5'000'000, /*poll_us=*/200'000, 200'000, false);
  poller.note_progress();
  const Wait w = wait_for(poller, 1000, true);
  EXPECT(w.checks == 999, "every failed test but the last is checked");
  EXPECT(w.seconds < 0.2, "within spin_us of progress a failed test is not followed by a sleep");
}

void sleeps_poll_us_once_spin_us_passed() {
  Poller poller(/*spin_us=*/0, /*poll_us=*/20'000, 20'000, false);
  poller.note_progress();
  const Wait w = wait_for(poller, 4, false);
  EXPECT(w.checks == 3, "three failed tests");
  EXPECT(w.seconds >= 0.060, "each failed test is followed by poll_us of sleep");
}

void sleeps_back_off_only_while_streaming() {
  // poll_us 5 ms, up to 40 ms: four empty wakes sleep 5 + 10 + 20 + 40 ms when the
  // operation streams, 4 x 5 ms when it does not.
  Poller poller(0, 5'000, 40'000, false);
  poller.note_progress();
  poller.set_streaming(true);
  const Wait streaming = wait_for(poller, 5, true);
  EXPECT(streaming.seconds >= 0.075, "a streaming wait's sleeps double up to poll_max_us");
  poller.note_progress();  // a new operation starts from poll_us again, not streaming
  const Wait plain = wait_for(poller, 5, true);
  EXPECT(plain.seconds >= 0.020, "four sleeps of poll_us");
  EXPECT(plain.seconds < streaming.seconds, "a new operation's sleeps start at poll_us");
}

void a_late_peer_does_not_back_off() {
  // teaches = false (an operation's header): sleeps stay poll_us even while streaming,
  // 5 x 20 ms, where doubling would sleep 20 + 40 + 80 + 160 + 320 ms.
  Poller poller(0, 20'000, 1'000'000, false);
  poller.note_progress();
  poller.set_streaming(true);
  const Wait w = wait_for(poller, 6, false);
  EXPECT(w.seconds >= 0.1 && w.seconds < 0.5,
         "without teaching the sleep does not grow towards poll_max_us");
}

void a_waiting_thread_stops_the_sleeps() {
  Poller poller(0, 200'000, 200'000, false);
  poller.note_progress();
  const Wait spin = wait_for(poller, 50, true, WaitedPolling::kSpin);
  EXPECT(spin.checks == 49 && spin.seconds < 0.2, "kSpin: no sleep between tests");
  const Wait yield = wait_for(poller, 50, true, WaitedPolling::kYield);
  EXPECT(yield.checks == 49 && yield.seconds < 0.2, "kYield: no sleep between tests");
}

// Tests made by a 300 ms wait that a thread waits on (kYield) once it has lasted
// kLateNaps naps of 5 ms and 5 ms more.
int tests_once_late(Poller& poller, bool teaches) {
  const auto t0 = Clock::now();
  const auto since = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  const double late_s = Poller::kLateNaps * 5e-3 + 5e-3;
  int late = 0;
  poller.until([&] { const double t = since(); late += t > late_s; return t > 0.300; },
               [](Clock::time_point) {}, [] { return WaitedPolling::kYield; }, teaches);
  return late;
}

void a_late_peer_stops_the_yields() {
  // poll_us 5 ms: past kLateNaps naps' time a header's wait (not teaching) naps 5 ms
  // between tests, so at most 41 tests from then on (40 within the 300 ms, and the one
  // that ends it; nanosleep never returns early); a data wait keeps yielding.
  Poller poller(0, 5'000, 5'000, false);
  poller.note_progress();
  EXPECT(tests_once_late(poller, false) <= 41,
         "a peer late for kLateNaps naps' time: the wait naps poll_us instead of yielding");
  EXPECT(tests_once_late(poller, true) > 41, "a data wait keeps yielding while a thread waits");
}

void a_check_that_throws_ends_the_wait() {
  Poller poller(0, 1'000, 1'000, false);
  poller.note_progress();
  bool thrown = false;
  int checks = 0;
  try {
    poller.until([] { return false; },
                 [&](Clock::time_point) {
                   if (++checks == 3) throw std::runtime_error("peer failed");
                 },
                 [] { return WaitedPolling::kSleep; }, true);
  } catch (const std::runtime_error&) {
    thrown = true;
  }
  EXPECT(thrown && checks == 3, "the check's exception leaves the wait");
}

void woken_waits_spin_or_yield_then_doze() {
  Poller poller(/*spin_us=*/5'000'000, 1'000, 1'000, true);
  const auto sleep = [] { return WaitedPolling::kSleep; };
  const auto yield = [] { return WaitedPolling::kYield; };
  const auto none = [](Clock::time_point) {};
  poller.note_progress();
  int dozes = 0;
  int calls = 0;
  poller.until_woken([&] { return ++calls == 100; }, none, sleep,
                     [&] { ++dozes; return false; }, /*spin=*/true);
  EXPECT(dozes == 0, "within spin_us of progress a woken wait with a core spins");
  calls = 0;
  poller.until_woken([&] { return ++calls == 100; }, none, yield,
                     [&] { ++dozes; return false; }, /*spin=*/false);
  EXPECT(dozes == 0, "ranks sharing cores, a thread waiting: it yields within spin_us");
  calls = 0;
  poller.until_woken([&] { return ++calls == 3; }, none, sleep,
                     [&] { ++dozes; return false; }, /*spin=*/false);
  EXPECT(dozes == 2, "ranks sharing cores, nobody waiting: every failed test dozes");
  poller.until_woken([] { return false; }, none, sleep, [&] { return ++dozes == 5; }, false);
  EXPECT(dozes == 5, "a doze that finds the event ready ends the wait");

  Poller late(/*spin_us=*/0, 1'000, 1'000, true);
  late.note_progress();
  calls = dozes = 0;
  late.until_woken([&] { return ++calls == 3; }, none, yield,
                   [&] { ++dozes; return false; }, /*spin=*/false);
  EXPECT(dozes == 2, "past spin_us it dozes even while a thread waits");
}

}  // namespace

int main() {
  spins_right_after_progress();
  sleeps_poll_us_once_spin_us_passed();
  sleeps_back_off_only_while_streaming();
  a_late_peer_does_not_back_off();
  a_waiting_thread_stops_the_sleeps();
  a_late_peer_stops_the_yields();
  a_check_that_throws_ends_the_wait();
  woken_waits_spin_or_yield_then_doze();
  std::printf("poller: %d failures\n", selftest::failures);
  return selftest::failures == 0 ? 0 : 1;
}
