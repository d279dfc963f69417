// The header a ring operation sends its right neighbour ahead of the data (and a board
// operation posts beside its data: board.h): what this rank submitted, so a rank that
// submitted something else is caught before any data is read into memory sized for
// another operation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "operation.h"

namespace pipesgd {

struct RingHeader {
  std::uint64_t magic;
  std::uint64_t seq;
  std::uint64_t count;
  std::int32_t dtype;
  std::int32_t op;
  std::int32_t compression;
  std::int32_t rank;
  std::uint64_t segment_elems;  // ranks must cut segments alike; 0: not cut (board.h)
  std::uint64_t shared_id;      // 1 + the shared buffer's number (shm_buffers.h); 0: none
  std::uint64_t shared_offset;  // of the data in that buffer's parts
};

RingHeader make_ring_header(const Operation& op, int rank, std::size_t segment_elems);

// Whether the left neighbour's header describes the same operation as this rank's.
bool ring_headers_match(const RingHeader& mine, const RingHeader& theirs);

// The error every rank reports when rank `rank`'s peer `peer` submitted `theirs`
// (nullptr: what arrived was no header) against its own `mine`; `relation` names the
// peer's place, as "its left neighbour " (empty: none).
std::string ring_mismatch_message(const RingHeader& mine, const RingHeader* theirs, int rank,
                                  int peer, const char* relation = "its left neighbour ");

}  // namespace pipesgd
