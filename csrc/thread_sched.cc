#include "thread_sched.h"

#ifdef __linux__
#include <sched.h>
#include <sys/resource.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#endif

namespace pipesgd {
namespace {

#ifdef __linux__
// struct sched_attr of the sched_setattr(2) ABI (glibc before 2.41 has no
// wrapper, and <linux/sched/types.h> clashes with <sched.h>).
struct SchedAttr {
  std::uint32_t size;
  std::uint32_t sched_policy;
  std::uint64_t sched_flags;
  std::int32_t sched_nice;
  std::uint32_t sched_priority;
  std::uint64_t sched_runtime;
  std::uint64_t sched_deadline;
  std::uint64_t sched_period;
  std::uint32_t sched_util_min;
  std::uint32_t sched_util_max;
};
#endif

}  // namespace

void tune_comm_thread(int slice_us, int nice) {
#ifdef __linux__
  prctl(PR_SET_NAME, "pipesgd-comm", 0UL, 0UL, 0UL);  // as top -H and /proc show it
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
  // On Linux a thread id names one thread to setpriority; a refusal (lowering
  // nice without CAP_SYS_NICE) keeps the process's nice.
  if (nice != 0) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice);
  if (slice_us <= 0) return;
  SchedAttr attr{};
  if (syscall(SYS_sched_getattr, 0, &attr, sizeof attr, 0) != 0) return;
  if (attr.sched_policy != SCHED_OTHER) return;  // the user chose a policy: keep it
  attr.size = sizeof attr;
  attr.sched_runtime = static_cast<std::uint64_t>(slice_us) * 1000ULL;
  syscall(SYS_sched_setattr, 0, &attr, 0);
#else
  (void)slice_us;
  (void)nice;
#endif
}

int bind_comm_thread(int node_rank, int node_ranks) {
#ifdef __linux__
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return -1;
  if (node_ranks < 1 || CPU_COUNT(&allowed) < node_ranks) return -1;
  int seen = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed) || seen++ != node_rank) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    return sched_setaffinity(0, sizeof one, &one) == 0 ? cpu : -1;
  }
  return -1;
#else
  (void)node_rank;
  (void)node_ranks;
  return -1;
#endif
}

}  // namespace pipesgd
