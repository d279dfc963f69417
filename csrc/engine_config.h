// The engine's configuration: what the environment may set, what the constructor may
// set, and what is chosen per transport, resolved once per engine (Engine::config()).
#pragma once

#include <cstddef>

namespace pipesgd {

// What an Engine's constructor takes. 0 for segment_bytes and window: chosen per transport
// (transport.h).
struct EngineOptions {
  // Bytes of one ring segment: the unit of overlap between transfer and reduction.
  std::size_t segment_bytes = 0;
  // Receives kept posted ahead of the one being reduced, or slots of an inbox.
  int window = 0;
  // Nice value of the comm thread (thread_sched.h); 0: the process's own.
  int comm_nice = 0;
  // EEVDF slice the comm thread asks for (thread_sched.h); 0: the kernel's default.
  int comm_slice_us = 100;
  // Within one operation the comm thread's sleep between tests doubles after each wake
  // that found nothing, up to this: on a slow link a wake then finds a segment or two
  // ready instead of none (poller.h). Every operation starts again at poll_us.
  int poll_max_us = 200;
  // While a thread of this process is blocked waiting for an operation, poll without
  // sleeping: spin if the node has a core per rank (the waiter's core is idle, and naps
  // only add a descheduled peer's lateness; MPI's blocking collectives spin too), else
  // test and sched_yield, as Open MPI does when oversubscribed. Shared memory only.
  bool poll_while_waited = true;
  // When three ranks or more are all on one node: uncompressed operations up to this many
  // bytes (the smallest over the ranks) go through the shared-memory board
  // (allreduce/board.h); the rest take the ring, or where it is faster the board staged
  // (path_tuner.h). 256 KiB: up to where the board was faster than the ring at p = 3
  // and 4 (docs/engine.md, "Small operations: the board"). 0: the caller's arrays take
  // the ring alone, at any p.
  std::size_t board_bytes = 256 * 1024;
};

struct EngineConfig {
  // From EngineOptions, with segment_bytes and window filled in per transport.
  std::size_t segment_bytes = 0;
  int window = 0;
  int comm_nice = 0;
  int comm_slice_us = 100;
  int poll_max_us = 200;
  int poll_while_waited = 1;
  // From EngineOptions where the engine's board takes copied operations (three ranks or
  // more, all on one node, links mapped), else 0.
  std::size_t board_bytes = 0;

  // From the environment (read_env_config), the five variables that earn their place:
  // PIPESGD_SPIN_US and PIPESGD_POLL_US, which the Python side's waits read too (a value
  // means the same there); PIPESGD_SHM_LINKS, the transport; PIPESGD_STALL_SECONDS and
  // PIPESGD_SHUTDOWN_SECONDS, how long a job may wait.
  //
  // While MPI has work in flight the comm thread tests, then sleeps this long:
  // spinning in MPI_Wait* steals the compute thread's core when ranks share cores.
  int poll_us = 50;
  // ...except right after a request completed: the next one is often about to
  // complete too, so for this long the comm thread tests without sleeping.
  int spin_us = 100;
  // Between ranks that share a node, send segments through shared-memory inboxes
  // (shm_links.h) instead of MPI messages. 1: always, even where Open MPI is kept off
  // shared memory (OMPI_MCA_btl); 0: never (MPI messages, Open MPI's CMA); unset (-1):
  // the links, and on a ring within one node the caller's arrays whichever way ran the
  // first of their size fastest: links, messages or staged on the board (path_tuner.h).
  int shm_links = -1;
  // A stall warning is printed when one operation waits longer than this.
  double stall_seconds = 60.0;
  // shutdown() lets in-flight operations finish for this long, then fails them.
  double shutdown_seconds = 10.0;
};

// The defaults with the environment's five variables applied. Throws
// std::invalid_argument naming a malformed variable.
EngineConfig read_env_config();

// read_env_config() with `options` applied. Throws std::invalid_argument naming an
// option out of range.
EngineConfig resolve_config(const EngineOptions& options);

}  // namespace pipesgd
