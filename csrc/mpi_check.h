// Every MPI return code is checked and turned into an exception naming the call and the peer.
#pragma once

#include <mpi.h>

#include <stdexcept>
#include <string>

namespace pipesgd {

class MpiError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

[[noreturn]] inline void throw_mpi_error(const char* call, int peer, int code) {
  std::string msg = std::string(call) + " failed";
  if (peer >= 0) msg += " (peer rank " + std::to_string(peer) + ")";
  throw MpiError(msg + ": " + mpi_error_string(code));
}

}  // namespace pipesgd

// PSG_MPI_CHECK(MPI_Isend(...), peer): throws MpiError naming the call and the peer.
#define PSG_MPI_CHECK(expr, peer)                                        \
  do {                                                                   \
    const int psg_rc_ = (expr);                                          \
    if (psg_rc_ != MPI_SUCCESS) ::pipesgd::throw_mpi_error(#expr, (peer), psg_rc_); \
  } while (0)
