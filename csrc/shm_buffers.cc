#include "shm_buffers.h"

#include <sys/mman.h>
#include <unistd.h>

#include <iterator>
#include <stdexcept>

#include "mpi_check.h"
#include "shm_region.h"

namespace pipesgd {
namespace {

std::size_t page_bytes() {
  const long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<std::size_t>(page) : 4096;
}

}  // namespace

SharedBuffer::SharedBuffer(void* base, std::size_t mapped, std::uint64_t id, int rank,
                           int ranks, std::size_t part_bytes, std::size_t stride)
    : base_(base),
      mapped_(mapped),
      id_(id),
      rank_(rank),
      ranks_(ranks),
      part_bytes_(part_bytes),
      stride_(stride) {}

SharedBuffer::~SharedBuffer() { munmap(base_, mapped_); }

unsigned char* SharedBuffer::part(int q) const {
  return static_cast<unsigned char*>(base_) + static_cast<std::size_t>(q) * stride_;
}

SharedBuffers::SharedBuffers(MPI_Comm comm) {
  PSG_MPI_CHECK(MPI_Comm_dup(comm, &comm_), -1);
  PSG_MPI_CHECK(MPI_Comm_rank(comm_, &rank_), -1);
  PSG_MPI_CHECK(MPI_Comm_size(comm_, &ranks_), -1);
  token_ = shared_region_token(comm_);
}

SharedBuffers::~SharedBuffers() { close(); }

void SharedBuffers::close() {
  std::lock_guard<std::mutex> lock(allocate_mutex_);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

std::shared_ptr<SharedBuffer> SharedBuffers::allocate(std::size_t bytes, std::string* why_not) {
  std::lock_guard<std::mutex> lock(allocate_mutex_);
  auto buffer = map_region(bytes, "buffer", next_id_, why_not);
  if (buffer == nullptr) return nullptr;
  ++next_id_;
  std::lock_guard<std::mutex> live(live_mutex_);
  for (auto it = live_.begin(); it != live_.end();) {
    it = it->second.expired() ? live_.erase(it) : std::next(it);
  }
  live_[reinterpret_cast<std::uintptr_t>(buffer->mine())] = buffer;
  return buffer;
}

std::shared_ptr<SharedBuffer> SharedBuffers::allocate_stage(std::size_t bytes,
                                                            std::string* why_not) {
  std::lock_guard<std::mutex> lock(allocate_mutex_);
  return map_region(bytes, "stage", next_stage_id_++, why_not);
}

std::shared_ptr<SharedBuffer> SharedBuffers::map_region(std::size_t bytes, const char* kind,
                                                        std::uint64_t id,
                                                        std::string* why_not) {
  if (comm_ == MPI_COMM_NULL) throw std::runtime_error("pipesgd engine is shut down");
  // Every rank the same size, or every rank the same error (the smallest and the largest).
  unsigned long long sizes[2] = {bytes, ~static_cast<unsigned long long>(bytes)}, agreed[2];
  PSG_MPI_CHECK(MPI_Allreduce(sizes, agreed, 2, MPI_UNSIGNED_LONG_LONG, MPI_MIN, comm_), -1);
  const unsigned long long smallest = agreed[0], largest = ~agreed[1];
  if (smallest != largest) {
    throw std::invalid_argument("shared buffer: the ranks asked for different sizes (" +
                                std::to_string(smallest) + " to " + std::to_string(largest) +
                                " bytes); every rank must allocate the same buffers in the "
                                "same order");
  }
  if (bytes == 0) return nullptr;  // on every rank: nothing to share
  const std::size_t page = page_bytes();
  const std::size_t stride = (bytes + page - 1) / page * page;
  const std::size_t total = stride * static_cast<std::size_t>(ranks_);
  const std::string name = shared_region_name(token_, kind, static_cast<int>(id));
  void* base = nullptr;
  std::size_t mapped = total;
  if (rank_ == 0) base = create_shared_region(name, total, why_not);  // zero-filled
  if (!on_all_ranks(comm_, rank_ != 0 || base != nullptr)) {
    if (why_not->empty()) *why_not = "rank 0 could not create the region";
    return nullptr;
  }
  if (rank_ != 0) {
    base = map_shared_region(name, &mapped, why_not);
    if (base != nullptr && mapped != total) {
      *why_not = "the region has another size than this rank expects";
      munmap(base, mapped);
      base = nullptr;
    }
  }
  // Every rank has mapped it once this returns, so its name can go.
  const bool ok = on_all_ranks(comm_, base != nullptr);
  if (rank_ == 0) shm_unlink(name.c_str());
  if (!ok) {
    if (base != nullptr) munmap(base, mapped);
    if (why_not->empty()) *why_not = "another rank could not map the region";
    return nullptr;
  }
  return std::make_shared<SharedBuffer>(base, mapped, id, rank_, ranks_, bytes, stride);
}

SharedPlace SharedBuffers::find(const void* data, std::size_t bytes) const {
  // Compared as addresses: pointers into different objects have no order in C++.
  const auto at = reinterpret_cast<std::uintptr_t>(data);
  std::lock_guard<std::mutex> lock(live_mutex_);
  auto after = live_.upper_bound(at);  // the first part starting beyond `data`
  if (after == live_.begin()) return {};
  const auto& [from, weak] = *std::prev(after);
  auto buffer = weak.lock();
  if (!buffer) return {};
  const std::size_t size = buffer->part_bytes();
  if (at - from > size || bytes > size - (at - from)) return {};
  return SharedPlace{std::move(buffer), static_cast<std::size_t>(at - from)};
}

}  // namespace pipesgd
