#include "transport.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <thread>

#include "mpi_check.h"

namespace pipesgd {
namespace {

// This core's L2 cache in bytes, or 0 if the C library cannot tell.
long l2_cache_bytes() {
#ifdef _SC_LEVEL2_CACHE_SIZE
  return std::max(sysconf(_SC_LEVEL2_CACHE_SIZE), 0L);
#else
  return 0;
#endif
}

// Open MPI's BTL selection, when set, says whether shared memory is allowed.
bool shared_memory_transport_allowed() {
  const char* btl = std::getenv("OMPI_MCA_btl");
  if (btl == nullptr || *btl == '\0') return true;
  const std::string list(btl);
  const bool names_sm = list.find("sm") != std::string::npos ||
                        list.find("vader") != std::string::npos;
  return list[0] == '^' ? !names_sm : names_sm;
}

}  // namespace

RingTransport describe_ring_transport(MPI_Comm comm) {
  int rank = 0, size = 1;
  PSG_MPI_CHECK(MPI_Comm_rank(comm, &rank), -1);
  PSG_MPI_CHECK(MPI_Comm_size(comm, &size), -1);
  MPI_Comm node = MPI_COMM_NULL;
  PSG_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), -1);
  MPI_Group all = MPI_GROUP_NULL, local = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &all);
  MPI_Comm_group(node, &local);
  const int neighbours[2] = {(rank + size - 1) % size, (rank + 1) % size};
  int translated[2] = {MPI_UNDEFINED, MPI_UNDEFINED};
  MPI_Group_translate_ranks(all, 2, neighbours, local, translated);
  int node_ranks = 1, node_rank = 0;
  PSG_MPI_CHECK(MPI_Comm_size(node, &node_ranks), -1);
  PSG_MPI_CHECK(MPI_Comm_rank(node, &node_rank), -1);
  MPI_Group_free(&all);
  MPI_Group_free(&local);
  MPI_Comm_free(&node);
  // One decision for the whole ring, so every rank cuts segments alike: shared memory
  // and a core per rank only if every rank says so, and the smallest L2 (an unknown
  // one counts as the largest possible).
  const long l2 = l2_cache_bytes();
  const long mine[3] = {
      translated[0] != MPI_UNDEFINED && translated[1] != MPI_UNDEFINED &&
          shared_memory_transport_allowed(),
      static_cast<unsigned>(node_ranks) <= std::thread::hardware_concurrency(),
      l2 > 0 ? l2 : LONG_MAX};
  long agreed[3] = {0, 0, 0};
  PSG_MPI_CHECK(MPI_Allreduce(mine, agreed, 3, MPI_LONG, MPI_MIN, comm), -1);
  RingTransport transport;
  transport.ranks = size;
  transport.node_rank = node_rank;
  transport.node_ranks = node_ranks;
  transport.shared_memory = agreed[0] != 0;
  transport.core_per_rank = agreed[1] != 0;
  transport.l2_cache_bytes = agreed[2] == LONG_MAX ? 0 : static_cast<std::size_t>(agreed[2]);
  return transport;
}

std::size_t shared_memory_segment_bytes(const RingTransport& transport, int window) {
  if (!transport.core_per_rank || transport.l2_cache_bytes == 0) {
    return kMaxSharedMemorySegmentBytes;
  }
  constexpr std::size_t kPage = 4096;
  const std::size_t fit =
      transport.l2_cache_bytes / static_cast<std::size_t>(std::max(window, 1)) / kPage * kPage;
  return std::clamp(fit, kMinSharedMemorySegmentBytes, kMaxSharedMemorySegmentBytes);
}

}  // namespace pipesgd
