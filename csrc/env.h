// Every environment variable pipesgd reads, in one place.
#pragma once

#include <cstddef>

namespace pipesgd {

struct EnvConfig {
  // Bytes of one ring segment: the unit of overlap between transfer and
  // reduction. 0: chosen per transport (see transport.h).
  std::size_t segment_bytes = 0;
  // Receives kept posted ahead of the one being reduced (2 = double buffering).
  // 0: chosen per transport (see transport.h).
  int window = 0;
  // While MPI has work in flight the comm thread tests, then sleeps this long:
  // spinning in MPI_Wait* steals the compute thread's core when ranks share cores.
  int poll_us = 50;
  // Within one operation the sleep doubles after each wake that found nothing, up
  // to this: on a slow link a wake then finds a segment or two ready instead of
  // none (comm_context.h). Every operation starts again at poll_us.
  int poll_max_us = 200;
  // ...except right after a request completed: the next one is often about to
  // complete too, so for this long the comm thread tests without sleeping.
  int spin_us = 100;
  // While a thread of this process is blocked waiting for an operation, poll
  // without sleeping: spin if the node has a core per rank (the waiter's core is
  // idle, and naps only add a descheduled peer's lateness; MPI's blocking
  // collectives spin too), else test and sched_yield, as Open MPI does when
  // oversubscribed. Shared memory only. 0: always sleep between tests.
  int poll_while_waited = 1;
  // EEVDF slice the comm thread asks for (thread_sched.h); 0: the kernel's default.
  int comm_slice_us = 100;
  // Nice value of the comm thread (thread_sched.h); 0: the process's own.
  int comm_nice = 0;
  // Between ranks that share a node, send segments through shared-memory inboxes
  // (shm_links.h) instead of MPI messages. 1: always; 0: never (MPI messages, Open
  // MPI's CMA); unset (-1): the links, and large operations whichever way
  // was faster on the first of their size (path_tuner.h).
  int shm_links = -1;
  // A stall warning is printed when one operation waits longer than this.
  double stall_seconds = 60.0;
  // shutdown() lets in-flight operations finish for this long, then fails them.
  double shutdown_seconds = 10.0;
};

// PIPESGD_SEGMENT_BYTES, PIPESGD_RING_WINDOW, PIPESGD_POLL_US, PIPESGD_POLL_MAX_US,
// PIPESGD_SPIN_US, PIPESGD_POLL_WHILE_WAITED, PIPESGD_SHM_LINKS,
// PIPESGD_COMM_SLICE_US, PIPESGD_COMM_NICE,
// PIPESGD_STALL_SECONDS, PIPESGD_SHUTDOWN_SECONDS.
EnvConfig read_env_config();

}  // namespace pipesgd
