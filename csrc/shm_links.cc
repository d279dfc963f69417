#include "shm_links.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>

#include "mpi_check.h"

namespace pipesgd {
namespace {

constexpr std::size_t kLine = 64;

// The inbox's first lines: the counters on lines of their own (the sender writes
// head, the receiver tail), then what the sender must know about the slots.
struct Control {
  alignas(kLine) std::atomic<std::uint64_t> head{0};  // messages published
  alignas(kLine) std::atomic<std::uint64_t> tail{0};  // messages released
  alignas(kLine) std::uint64_t slot_bytes = 0;
  std::uint64_t slots = 0;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory counters must be lock-free to work across processes");
static_assert(sizeof(ShmMessage) <= kLine, "a slot's message header fits one line");

constexpr std::size_t round_up(std::size_t x) { return (x + kLine - 1) / kLine * kLine; }
constexpr std::size_t kControlBytes = round_up(sizeof(Control));

Control* control(void* base) { return static_cast<Control*>(base); }
unsigned char* slot_at(void* base, std::size_t stride, std::uint64_t index, int slots) {
  return static_cast<unsigned char*>(base) + kControlBytes +
         static_cast<std::size_t>(index % static_cast<std::uint64_t>(slots)) * stride;
}

std::string inbox_name(std::uint64_t token, int rank) {
  char name[64];
  std::snprintf(name, sizeof name, "/pipesgd-%016llx-%d",
                static_cast<unsigned long long>(token), rank);
  return name;
}

std::string failure(const char* what, const std::string& name) {
  return std::string(what) + " " + name + ": " + std::strerror(errno);
}

// Creates and maps this rank's inbox; the memory is reserved up front, so a full
// /dev/shm fails here instead of with SIGBUS on first touch.
void* create_inbox(const std::string& name, std::size_t bytes, std::string* why_not) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why_not = failure("shm_open", name);
    return nullptr;
  }
  void* base = MAP_FAILED;
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    errno = err;
    *why_not = failure("posix_fallocate", name);
  } else {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) *why_not = failure("mmap", name);
  }
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return nullptr;
  }
  return base;
}

void* map_inbox(const std::string& name, std::size_t* bytes, std::string* why_not) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    *why_not = failure("shm_open", name);
    return nullptr;
  }
  struct stat st {};
  void* base = MAP_FAILED;
  if (fstat(fd, &st) != 0) {
    *why_not = failure("fstat", name);
  } else {
    *bytes = static_cast<std::size_t>(st.st_size);
    base = mmap(nullptr, *bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) *why_not = failure("mmap", name);
  }
  close(fd);
  return base == MAP_FAILED ? nullptr : base;
}

bool all_ranks(MPI_Comm comm, bool mine) {
  int ok = mine ? 1 : 0, all = 0;
  PSG_MPI_CHECK(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, comm), -1);
  return all != 0;
}

}  // namespace

std::unique_ptr<ShmLinks> ShmLinks::create(MPI_Comm comm, std::size_t slot_bytes, int slots,
                                           std::string* why_not) {
  int rank = 0, size = 1;
  PSG_MPI_CHECK(MPI_Comm_rank(comm, &rank), -1);
  PSG_MPI_CHECK(MPI_Comm_size(comm, &size), -1);
  // One name per engine: rank 0's process id, the time and a per-process counter.
  static std::atomic<std::uint64_t> engines{0};
  std::uint64_t token = 0;
  if (rank == 0) {
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    token = (static_cast<std::uint64_t>(getpid()) << 32) ^ static_cast<std::uint64_t>(now) ^
            (engines.fetch_add(1) << 56);
  }
  PSG_MPI_CHECK(MPI_Bcast(&token, 1, MPI_UINT64_T, 0, comm), -1);

  std::unique_ptr<ShmLinks> links(new ShmLinks());
  links->slots_ = slots;
  links->in_stride_ = kLine + round_up(slot_bytes);
  const std::string mine = inbox_name(token, rank);
  const std::size_t inbox_bytes =
      kControlBytes + static_cast<std::size_t>(slots) * links->in_stride_;
  links->inbox_.base = create_inbox(mine, inbox_bytes, why_not);
  if (links->inbox_.base != nullptr) {
    links->inbox_.bytes = inbox_bytes;
    Control* c = new (links->inbox_.base) Control();
    c->slot_bytes = slot_bytes;
    c->slots = static_cast<std::uint64_t>(slots);
  }
  if (!all_ranks(comm, links->inbox_.base != nullptr)) {
    if (links->inbox_.base != nullptr) shm_unlink(mine.c_str());
    if (why_not->empty()) *why_not = "another rank could not create its inbox";
    return nullptr;  // the destructor unmaps
  }
  const std::string right = inbox_name(token, (rank + 1) % size);
  links->outbox_.base = map_inbox(right, &links->outbox_.bytes, why_not);
  bool mapped = links->outbox_.base != nullptr;
  if (mapped) {
    const Control* c = control(links->outbox_.base);
    links->out_capacity_ = c->slot_bytes;
    links->out_stride_ = kLine + round_up(c->slot_bytes);
    mapped = static_cast<int>(c->slots) == slots &&
             kControlBytes + c->slots * links->out_stride_ <= links->outbox_.bytes;
    if (!mapped) *why_not = "the right neighbour's inbox has another layout";
  }
  // Every rank has mapped its right neighbour's inbox once this returns, so the
  // names can go: nothing is left behind in /dev/shm, whatever happens later.
  const bool ok = all_ranks(comm, mapped);
  shm_unlink(mine.c_str());
  if (!ok) {
    if (why_not->empty()) *why_not = "another rank could not map its right neighbour's inbox";
    return nullptr;
  }
  return links;
}

ShmLinks::~ShmLinks() {
  if (inbox_.base != nullptr) munmap(inbox_.base, inbox_.bytes);
  if (outbox_.base != nullptr) munmap(outbox_.base, outbox_.bytes);
}

bool ShmLinks::can_send() const {
  const std::uint64_t released = control(outbox_.base)->tail.load(std::memory_order_acquire);
  return sent_ - released < static_cast<std::uint64_t>(slots_);
}

void ShmLinks::send(const ShmMessage& message, const void* data) {
  unsigned char* slot = slot_at(outbox_.base, out_stride_, sent_, slots_);
  std::memcpy(slot, &message, sizeof message);
  if (message.bytes > 0) std::memcpy(slot + kLine, data, message.bytes);
  ++sent_;
  control(outbox_.base)->head.store(sent_, std::memory_order_release);
}

const ShmMessage* ShmLinks::peek() const {
  if (control(inbox_.base)->head.load(std::memory_order_acquire) <= received_) return nullptr;
  return reinterpret_cast<const ShmMessage*>(slot_at(inbox_.base, in_stride_, received_, slots_));
}

const unsigned char* ShmLinks::peek_data() const {
  return slot_at(inbox_.base, in_stride_, received_, slots_) + kLine;
}

void ShmLinks::release() {
  ++received_;
  control(inbox_.base)->tail.store(received_, std::memory_order_release);
}

}  // namespace pipesgd
