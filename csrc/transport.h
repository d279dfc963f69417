// What the ring's links are made of, to pick a segment size that suits them.
#pragma once

#include <mpi.h>

#include <cstddef>

namespace pipesgd {

// Segment sizes per transport. Shared memory moves big segments fastest: each
// message pays a rendezvous, and one thread per rank both copies (CMA) and adds,
// so smaller segments buy no overlap there. Against 256 KiB, 1 MiB segments took
// 8 MiB allreduces from 0.87 to 0.94 of MPI's speed at p = 2 and from 0.66-0.78
// to 0.82-0.87 at p = 4 (median of 60 interleaved rounds, engines side by side).
// Over TCP, Open MPI sends messages up to its
// 64 KiB eager limit (header included) at once, but a larger one waits for a
// clear-to-send that queues behind the data flowing the other way on the same
// connection, which halved a 2-rank ring's throughput on emulated 1 Gbit/s
// links; 60 KiB segments stay eager (bench/allreduce.py --netem).
constexpr std::size_t kSharedMemorySegmentBytes = 1024 * 1024;
constexpr std::size_t kNetworkSegmentBytes = 60 * 1024;

// Receives posted ahead of the one being reduced. Over shared memory the receiver
// itself copies each segment (CMA) whenever MPI progresses, so every posted receive
// may land before its turn to be added: 8 posted segments of 256 KiB were more than
// a core's L2 holds, and the 8 MiB allreduce ran slower than with 2 (BENCHMARKS.md).
// A network segment arrives at the link's pace, and more in flight keep it busy.
constexpr int kSharedMemoryWindow = 2;
constexpr int kNetworkWindow = 8;

struct RingTransport {
  // This rank's ring neighbours are on its node and MPI may use shared memory to
  // reach them (Open MPI's OMPI_MCA_btl can exclude it, as a network emulator
  // does); true only if it holds for every rank, so the ring cuts segments alike.
  bool shared_memory = false;
  // Ranks of the communicator on this rank's node.
  int node_ranks = 1;
};

// Collective over `comm`.
RingTransport describe_ring_transport(MPI_Comm comm);

}  // namespace pipesgd
