// Scheduling hints for the comm thread (Linux; no-ops elsewhere).
#pragma once

namespace pipesgd {

// Names the calling thread "pipesgd-comm" and asks the kernel to treat it as
// latency-sensitive:
// - timer slack of 1 us, so its short polling sleeps are not stretched by the
//   default 50 us;
// - an EEVDF slice request of `slice_us` (Linux >= 6.12; 0 keeps the default).
//   A thread asking for a short slice gets an early deadline and preempts a
//   compute thread as soon as it wakes, instead of queueing behind it for a
//   full slice. When ranks share cores, that queueing delayed every ring step
//   by about 1.5 ms at p = 2 and 6.5 ms at p = 4 on 2 cores.
// - a nice value of `nice` when it is not 0: below 0 the comm thread wins the
//   core from the compute threads more often when ranks share cores, so a ring
//   step waits less for its CPU. Lowering nice needs CAP_SYS_NICE (or root);
//   without it the thread keeps the process's nice.
// These are hints: older kernels accept and ignore the slice, and a refusal
// (a seccomp filter, missing privileges) leaves the defaults.
void tune_comm_thread(int slice_us, int nice);

// Binds the calling thread to the `node_rank`-th CPU this process may run on, when the
// process may run on at least `node_ranks` CPUs (the launcher did not bind the ranks
// apart). Returns that CPU, or -1 if the thread was left where it was. Ranks of one
// node get different CPUs, so their comm threads can never queue on the same one:
// a futex wake-up that pulls a sleeping comm thread onto its waker's CPU made whole
// stretches of small allreduces 3-30x slower (docs/engine.md).
int bind_comm_thread(int node_rank, int node_ranks);

}  // namespace pipesgd
