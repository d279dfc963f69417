// What the ring's links are made of, to pick a segment size that suits them.
#pragma once

#include <mpi.h>

#include <cstddef>

namespace pipesgd {

// Segment sizes per transport. Over shared memory each message pays a rendezvous,
// and one thread per rank both copies (CMA) and adds, so smaller segments buy no
// overlap; but each segment is copied into a receive slot and then added, and the
// slots (window x segment) should still be in L2 for the add. So with a core per rank
// a segment is L2 / window, within [256 KiB, 1 MiB]: on a 1 MiB L2, 512 KiB segments
// were 1-5 % faster than 1 MiB at 8 MiB, p = 2, in each of seven runs of 60-150
// interleaved rounds (even at 16 MiB), and 1 MiB took 0.87 -> 0.94 of MPI's speed
// against 256 KiB on an earlier VM. With ranks sharing cores every switch between
// them refills the cache anyway and costs a time slice, so segments are 1 MiB (p = 4
// on 2 cores: 1 MiB 6-13 % faster than 512 KiB).
// Over TCP, Open MPI sends messages up to its
// 64 KiB eager limit (header included) at once, but a larger one waits for a
// clear-to-send that queues behind the data flowing the other way on the same
// connection, which halved a 2-rank ring's throughput on emulated 1 Gbit/s
// links; 60 KiB segments stay eager (bench/allreduce.py --netem).
constexpr std::size_t kMinSharedMemorySegmentBytes = 256 * 1024;
constexpr std::size_t kMaxSharedMemorySegmentBytes = 1024 * 1024;
constexpr std::size_t kNetworkSegmentBytes = 60 * 1024;

// Receives posted ahead of the one being reduced. Over shared memory the receiver
// itself copies each segment (CMA) whenever MPI progresses, so every posted receive
// may land before its turn to be added: 8 posted segments of 256 KiB were more than
// a core's L2 holds, and the 8 MiB allreduce ran slower than with 2 (bench/allreduce.py).
// A network segment arrives at the link's pace, and more in flight keep it busy.
constexpr int kSharedMemoryWindow = 2;
constexpr int kNetworkWindow = 8;

// Over shared-memory links (shm_links.h) the window is the number of inbox slots,
// and a sender copies a segment out as soon as a slot is free. Four slots of
// 256 KiB took an 8 MiB allreduce from 2.4 to 1.6 ms at p = 4 on 2 cores (two
// rounds each of 30 repetitions) and matched two of 512 KiB at p = 2.
constexpr std::size_t kShmLinkSegmentBytes = 256 * 1024;
constexpr int kShmLinkWindow = 4;

struct RingTransport {
  // This rank's ring neighbours are on its node and MPI may use shared memory to
  // reach them (Open MPI's OMPI_MCA_btl can exclude it, as a network emulator
  // does); true only if it holds for every rank, so the ring cuts segments alike.
  bool shared_memory = false;
  // MPI may use shared memory on every rank (OMPI_MCA_btl does not exclude it).
  bool mpi_shared_memory_allowed = false;
  // This rank's left and right neighbours share its node, and how many of the ring's
  // edges join two ranks of one node (all of them: `ranks`).
  bool left_on_node = false;
  bool right_on_node = false;
  int edges_on_node = 0;
  // Every node has a core for each of its ranks.
  bool core_per_rank = false;
  // The smallest per-core L2 cache of all ranks; 0 if no rank could tell.
  std::size_t l2_cache_bytes = 0;
  // Ranks in the ring.
  int ranks = 1;
  // This rank's place among the ranks of its host (they share its cores), and how many
  // there are.
  int node_rank = 0;
  int node_ranks = 1;
};

// The shared-memory segment for `transport` and `window` (see above); the same on
// every rank, as long as `window` is.
std::size_t shared_memory_segment_bytes(const RingTransport& transport, int window);

// Collective over `comm`. A node is what MPI calls one (MPI_COMM_TYPE_SHARED), split by
// network namespace: ranks in namespaces of their own (bench/netem.py --nodes) are
// separate nodes, as their network says; on a cluster the two are the same.
RingTransport describe_ring_transport(MPI_Comm comm);

}  // namespace pipesgd
