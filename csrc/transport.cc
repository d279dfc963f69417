#include "transport.h"

#include <cstdlib>
#include <string>

#include "mpi_check.h"

namespace pipesgd {
namespace {

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
  RingTransport transport;
  PSG_MPI_CHECK(MPI_Comm_size(node, &transport.node_ranks), -1);
  MPI_Group_free(&all);
  MPI_Group_free(&local);
  MPI_Comm_free(&node);
  const int mine = translated[0] != MPI_UNDEFINED && translated[1] != MPI_UNDEFINED &&
                   shared_memory_transport_allowed();
  // One segment size for the whole ring: shared memory only if every rank says so.
  int all_local = 0;
  PSG_MPI_CHECK(MPI_Allreduce(&mine, &all_local, 1, MPI_INT, MPI_MIN, comm), -1);
  transport.shared_memory = all_local != 0;
  return transport;
}

}  // namespace pipesgd
