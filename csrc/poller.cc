#include "poller.h"

#include <time.h>

namespace pipesgd {

const char* waited_polling_name(WaitedPolling polling) {
  switch (polling) {
    case WaitedPolling::kSpin: return "spin";
    case WaitedPolling::kYield: return "yield";
    case WaitedPolling::kSleep: break;
  }
  return "sleep";
}

void sleep_for_us(int us) {
  if (us <= 0) return;
  timespec ts{};
  ts.tv_sec = us / 1000000;
  ts.tv_nsec = static_cast<long>(us % 1000000) * 1000L;
  nanosleep(&ts, nullptr);
}

}  // namespace pipesgd
