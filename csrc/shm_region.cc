#include "shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "mpi_check.h"

namespace pipesgd {
namespace {

std::string failure(const char* what, const std::string& name) {
  return std::string(what) + " " + name + ": " + std::strerror(errno);
}

// Shared (not process-private) futex operations: the word lives in a mapping that
// other processes share. Elsewhere than Linux a sleep is a short nap.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, int timeout_us) {
  timespec ts{};
  ts.tv_sec = timeout_us / 1000000;
  ts.tv_nsec = static_cast<long>(timeout_us % 1000000) * 1000L;
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr,
          0);
#else
  (void)word;
  (void)expected;
  ts.tv_sec = 0;
  ts.tv_nsec = 50000L;
  nanosleep(&ts, nullptr);
#endif
}

void futex_wake(std::atomic<std::uint32_t>* word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

}  // namespace

std::uint64_t shared_region_token(MPI_Comm comm) {
  int rank = 0;
  PSG_MPI_CHECK(MPI_Comm_rank(comm, &rank), -1);
  static std::atomic<std::uint64_t> regions{0};
  std::uint64_t token = 0;
  if (rank == 0) {
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    token = (static_cast<std::uint64_t>(getpid()) << 32) ^ static_cast<std::uint64_t>(now) ^
            (regions.fetch_add(1) << 56);
  }
  PSG_MPI_CHECK(MPI_Bcast(&token, 1, MPI_UINT64_T, 0, comm), -1);
  return token;
}

std::string shared_region_name(std::uint64_t token, const char* what, int index) {
  char name[64];
  std::snprintf(name, sizeof name, "/pipesgd-%016llx-%s%d",
                static_cast<unsigned long long>(token), what, index);
  return name;
}

void* create_shared_region(const std::string& name, std::size_t bytes, std::string* why_not) {
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

void* map_shared_region(const std::string& name, std::size_t* bytes, std::string* why_not) {
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

bool on_all_ranks(MPI_Comm comm, bool mine) {
  int ok = mine ? 1 : 0, all = 0;
  PSG_MPI_CHECK(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, comm), -1);
  return all != 0;
}

void ring_bell(BellWord* b) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (b->sleeping.load(std::memory_order_relaxed) == 0) return;
  b->bell.fetch_add(1, std::memory_order_release);
  futex_wake(&b->bell);
}

bool sleep_on_bell(BellWord* b, const std::function<bool()>& ready, int timeout_us) {
  const std::uint32_t rung = b->bell.load(std::memory_order_acquire);
  b->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (ready()) {
    b->sleeping.store(0, std::memory_order_relaxed);
    return true;
  }
  futex_wait(&b->bell, rung, timeout_us);
  b->sleeping.store(0, std::memory_order_relaxed);
  return false;
}

void wake_bell(BellWord* b) {
  b->bell.fetch_add(1, std::memory_order_release);
  futex_wake(&b->bell);
}

}  // namespace pipesgd
