#include "transport.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

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

// The inode of this process's network namespace (0 if it cannot be read).
unsigned long network_namespace() {
  char link[64] = {};
  const ssize_t n = readlink("/proc/self/ns/net", link, sizeof link - 1);
  unsigned long inode = 0;
  if (n > 0 && std::sscanf(link, "net:[%lu]", &inode) == 1) return inode;
  return 0;
}

// The ranks of `host` (one MPI shared-memory node) in this rank's network namespace; each
// group takes the host rank of its first member as its colour.
MPI_Comm split_by_network_namespace(MPI_Comm host) {
  int host_rank = 0, host_size = 1;
  PSG_MPI_CHECK(MPI_Comm_rank(host, &host_rank), -1);
  PSG_MPI_CHECK(MPI_Comm_size(host, &host_size), -1);
  const unsigned long mine = network_namespace();
  std::vector<unsigned long> all(static_cast<std::size_t>(host_size));
  PSG_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_UNSIGNED_LONG, all.data(), 1, MPI_UNSIGNED_LONG,
                              host),
                -1);
  const int colour = static_cast<int>(std::find(all.begin(), all.end(), mine) - all.begin());
  MPI_Comm node = MPI_COMM_NULL;
  PSG_MPI_CHECK(MPI_Comm_split(host, colour, host_rank, &node), -1);
  return node;
}

}  // namespace

RingTransport describe_ring_transport(MPI_Comm comm) {
  int rank = 0, size = 1;
  PSG_MPI_CHECK(MPI_Comm_rank(comm, &rank), -1);
  PSG_MPI_CHECK(MPI_Comm_size(comm, &size), -1);
  // The host's ranks share its cores; a node's (the host's, in one network namespace)
  // reach each other through shared memory.
  MPI_Comm host = MPI_COMM_NULL;
  PSG_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host), -1);
  int node_ranks = 1, node_rank = 0;
  PSG_MPI_CHECK(MPI_Comm_size(host, &node_ranks), -1);
  PSG_MPI_CHECK(MPI_Comm_rank(host, &node_rank), -1);
  MPI_Comm node = split_by_network_namespace(host);
  MPI_Group all = MPI_GROUP_NULL, local = MPI_GROUP_NULL;
  PSG_MPI_CHECK(MPI_Comm_group(comm, &all), -1);
  PSG_MPI_CHECK(MPI_Comm_group(node, &local), -1);
  const int neighbours[2] = {(rank + size - 1) % size, (rank + 1) % size};
  int translated[2] = {MPI_UNDEFINED, MPI_UNDEFINED};
  PSG_MPI_CHECK(MPI_Group_translate_ranks(all, 2, neighbours, local, translated), -1);
  PSG_MPI_CHECK(MPI_Group_free(&all), -1);
  PSG_MPI_CHECK(MPI_Group_free(&local), -1);
  PSG_MPI_CHECK(MPI_Comm_free(&node), -1);
  PSG_MPI_CHECK(MPI_Comm_free(&host), -1);
  // One decision for the whole ring, so every rank cuts segments alike: shared memory
  // and a core per rank only if every rank says so, and the smallest L2 (an unknown
  // one counts as the largest possible).
  const long l2 = l2_cache_bytes();
  const bool left_on_node = translated[0] != MPI_UNDEFINED;
  const bool right_on_node = translated[1] != MPI_UNDEFINED;
  const bool allowed = shared_memory_transport_allowed();
  // The minimum over ranks of each, but the last: the sum (edges on a node).
  const long mine[5] = {left_on_node && right_on_node && allowed,
                        static_cast<unsigned>(node_ranks) <= std::thread::hardware_concurrency(),
                        l2 > 0 ? l2 : LONG_MAX, allowed, right_on_node};
  long agreed[4] = {0, 0, 0, 0};
  long edges_on_node = 0;
  PSG_MPI_CHECK(MPI_Allreduce(mine, agreed, 4, MPI_LONG, MPI_MIN, comm), -1);
  PSG_MPI_CHECK(MPI_Allreduce(&mine[4], &edges_on_node, 1, MPI_LONG, MPI_SUM, comm), -1);
  RingTransport transport;
  transport.ranks = size;
  transport.node_rank = node_rank;
  transport.node_ranks = node_ranks;
  transport.shared_memory = agreed[0] != 0;
  transport.mpi_shared_memory_allowed = agreed[3] != 0;
  transport.left_on_node = left_on_node;
  transport.right_on_node = right_on_node;
  transport.edges_on_node = static_cast<int>(edges_on_node);
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
