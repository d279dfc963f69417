// Small operations on one node through a shared-memory board (shm_board.h):
//   1. every rank posts its header and data in its slot;
//   2. once every rank has posted the same operation, rank r sums chunk r of all the
//      slots in rank order (as ring_layout.h cuts chunks), and posts it in its slot;
//   3. every rank copies each other chunk from its owner's slot.
// Each element is summed once, by one rank, in a fixed order, then copied byte for byte,
// so every rank ends bitwise identical. Two waits where the ring's 2(p - 1) steps each
// wait for a neighbour; but each rank reads and writes about four times the buffer
// where the ring's sends and receives come to 4(p - 1)/p of it, so only small
// operations take it (docs/engine.md, "Small operations: the board").
// An operation on a buffer every rank maps (shm_buffers.h) runs the same two waits with
// no copies, at any size: the slots hold only its header, rank r sums chunk r where the
// data lies and writes the sums into every rank's part, so each rank reads its buffer's
// size once and writes it once.
// A caller's array too large for the board's slots may be staged: copied piece by piece
// into this rank's part of a shared buffer the engine keeps for it, reduced in place
// there (this rank's chunk summed straight into the array) and the other chunks copied
// back (docs/engine.md, "The caller's arrays, staged").
#pragma once

#include <cstdint>

#include "comm_context.h"
#include "operation.h"
#include "shm_board.h"
#include "shm_buffers.h"

namespace pipesgd {

// Announces `op` on `board` (shm_board.h): every rank calls it for every operation it
// starts on an engine with a board, whichever algorithm runs it, so that ranks that
// submitted something else are caught.
void announce_operation(ShmBoard& board, const Operation& op);

// Whether the board runs `op`: uncompressed, and in a shared buffer or at most
// board.capacity() bytes.
bool board_takes(const ShmBoard& board, const Operation& op);

// Runs `op` (one the board takes) as the board's round `rounds` (0, 1, ...: the same on
// every rank), and counts it. Throws OpFailure on mismatch, abort or a peer's failure.
void board_allreduce(CommContext& ctx, ShmBoard& board, Operation& op, std::uint64_t& rounds);

// Runs `op` (uncompressed, in the caller's memory, of any size) through `stage`, a
// shared buffer of the same size on every rank, one round of the board per part's worth
// of elements, from round `rounds`, and counts them.
void staged_board_allreduce(CommContext& ctx, ShmBoard& board, const SharedBuffer& stage,
                            Operation& op, std::uint64_t& rounds);

}  // namespace pipesgd
