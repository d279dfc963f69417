// Self-test of the compression kernels (csrc/compress) and the pipeline's T2 kernels
// (csrc/pipeline), no MPI, no Python.
//
// Every kernel runs on odd and round sizes, at aligned and misaligned addresses,
// on exactly sized heap buffers, so a sanitizer build (-DPIPESGD_SANITIZE=ON) catches
// any read or write past a block. Values are checked against float64 arithmetic
// written out here, and the fused ring ops against the composition of the plain ones,
// byte for byte. Exit status: 0 if every check passed, 1 otherwise.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "compress/kernels.h"
#include "pipeline/t2_kernels.h"

namespace {

int g_failures = 0;
int g_checks = 0;

#define CHECK(cond, ...)                                                  \
  do {                                                                    \
    ++g_checks;                                                           \
    if (!(cond)) {                                                        \
      if (++g_failures <= 20) {                                           \
        std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
        std::fprintf(stderr, __VA_ARGS__);                                \
        std::fprintf(stderr, "\n");                                       \
      }                                                                   \
    }                                                                     \
  } while (0)

constexpr double kU = 1.0 / (1 << 24);  // float32 unit roundoff
// |x - decode(encode(x))| <= scale * (1/2 + 382 u): see pipesgd/compression.py.
constexpr double kQuant8HalfStep = 0.5 + 382 * kU;
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// A buffer of exactly `offset + n` elements whose usable part starts `offset` elements
// in, so the sanitizer sees any access past the end of the block.
template <typename T>
struct Block {
  std::vector<T> storage;
  std::size_t offset;
  Block(std::size_t n, std::size_t off) : storage(n + off), offset(off) {}
  T* data() { return storage.data() + offset; }
};

float quant8_scale(const void* wire) {
  float s;
  std::memcpy(&s, wire, sizeof s);
  return s;
}

const int8_t* quant8_q(const void* wire) {
  return reinterpret_cast<const int8_t*>(static_cast<const unsigned char*>(wire) + 4);
}

// A value mix with both signs, many magnitudes, exact zeros and tiny values.
std::vector<float> random_values(std::size_t n, std::mt19937& rng, float magnitude) {
  std::normal_distribution<float> normal(0.0f, magnitude);
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  if (n > 3) x[n / 3] = 0.0f;
  return x;
}

// Equal bits, or both NaN (payloads may differ).
bool same_float(float a, float b) {
  return bits_of(a) == bits_of(b) || (std::isnan(a) && std::isnan(b));
}

// decode_scaled(wire, factor) must equal decode(wire) * factor, rounded twice, bit for
// bit (the ring's average relies on it for power-of-two rank counts).
template <typename Decode, typename DecodeScaled>
void check_decode_scaled(Decode decode, DecodeScaled decode_scaled, std::size_t n,
                         const char* what) {
  Block<float> plain(n, 0), scaled(n, 1);
  decode(plain.data());
  for (float factor : {1.0f, 0.5f, 0.25f, 1.0f / 3.0f}) {
    decode_scaled(factor, scaled.data());
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(same_float(scaled.data()[i], plain.data()[i] * factor),
            "%s[%zu]: decode_scaled(%g) differs from decode * factor", what, i,
            static_cast<double>(factor));
    }
  }
}

// The owner's hop (decode_add_encode_decode) must write the bytes of encode(decode +
// local), `composed`, and leave local = decode_scaled(those bytes), also with
// in_wire == out_wire. W is the wire's element type, `wire_elems` its length.
template <typename W, typename Owner, typename DecodeScaled>
void check_owner_hop(Owner owner, DecodeScaled decode_scaled, const W* in_wire,
                     const W* composed, std::size_t wire_elems, const float* local,
                     std::size_t n, const char* what) {
  for (float factor : {1.0f, 0.25f, 1.0f / 3.0f}) {
    Block<W> owner_wire(wire_elems, 1), in_copy(wire_elems, 0);
    Block<float> owned(n, 3), owned_in_place(n, 1), expected(n, 0);
    std::memcpy(owned.data(), local, 4 * n);
    std::memcpy(owned_in_place.data(), local, 4 * n);
    std::memcpy(in_copy.data(), in_wire, sizeof(W) * wire_elems);
    owner(in_wire, owned.data(), n, factor, owner_wire.data());
    owner(in_copy.data(), owned_in_place.data(), n, factor, in_copy.data());
    CHECK(std::memcmp(owner_wire.data(), composed, sizeof(W) * wire_elems) == 0,
          "%s: decode_add_encode_decode's wire differs from encode(decode + local)", what);
    CHECK(std::memcmp(in_copy.data(), composed, sizeof(W) * wire_elems) == 0,
          "%s: decode_add_encode_decode in place differs", what);
    decode_scaled(composed, n, factor, expected.data());
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(same_float(owned.data()[i], expected.data()[i]) &&
                same_float(owned_in_place.data()[i], expected.data()[i]),
            "%s[%zu]: decode_add_encode_decode(%g) differs from decode_scaled of its wire",
            what, i, static_cast<double>(factor));
    }
  }
}

// ---- trunc16 ----

void check_trunc16_roundtrip(const float* x, std::size_t n, const char* what) {
  Block<uint16_t> wire(n, 1);
  Block<float> back(n, 3);
  psg_trunc16_encode(x, n, wire.data());
  psg_trunc16_decode(wire.data(), n, back.data());
  check_decode_scaled([&](float* out) { psg_trunc16_decode(wire.data(), n, out); },
                      [&](float f, float* out) {
                        psg_trunc16_decode_scaled(wire.data(), n, f, out);
                      },
                      n, what);
  for (std::size_t i = 0; i < n; ++i) {
    uint32_t b = bits_of(x[i]);
    if (std::isnan(x[i])) {
      CHECK(wire.data()[i] == 0x7FC0, "%s: NaN must encode to 0x7FC0, got %#x", what,
            wire.data()[i]);
      CHECK(std::isnan(back.data()[i]), "%s: NaN must decode to NaN", what);
      continue;
    }
    CHECK(wire.data()[i] == (b >> 16), "%s[%zu]: %#x is not the upper half of %#x", what, i,
          wire.data()[i], b);
    CHECK(bits_of(back.data()[i]) == (b & 0xFFFF0000u), "%s[%zu]: decode is not a shift", what,
          i);
    if (std::isfinite(x[i]) && x[i] != 0.0f) {
      double rel = std::fabs(static_cast<double>(back.data()[i]) - x[i]);
      double bound = std::fpclassify(x[i]) == FP_SUBNORMAL ? std::ldexp(1.0, -133)
                                                            : std::ldexp(std::fabs(x[i]), -7);
      CHECK(rel < bound, "%s[%zu]: error %g >= %g", what, i, rel, bound);
    }
  }
}

void check_trunc16_fused(const float* in_values, const float* local, std::size_t n,
                         const char* what) {
  Block<uint16_t> in_wire(n, 0), fused(n, 1), composed(n, 0);
  Block<float> decoded(n, 1), sum(n, 0), fused_sum(n, 2), in_place(n, 1);
  psg_trunc16_encode(in_values, n, in_wire.data());
  psg_trunc16_decode(in_wire.data(), n, decoded.data());
  for (std::size_t i = 0; i < n; ++i) sum.data()[i] = decoded.data()[i] + local[i];
  psg_trunc16_encode(sum.data(), n, composed.data());

  psg_trunc16_decode_add_encode(in_wire.data(), local, n, fused.data());
  CHECK(std::memcmp(fused.data(), composed.data(), 2 * n) == 0,
        "%s: decode_add_encode differs from encode(decode + local)", what);

  psg_trunc16_decode_add(in_wire.data(), local, n, fused_sum.data());
  std::memcpy(in_place.data(), local, 4 * n);
  psg_trunc16_decode_add(in_wire.data(), in_place.data(), n, in_place.data());
  for (std::size_t i = 0; i < n; ++i) {
    bool same = same_float(fused_sum.data()[i], sum.data()[i]);
    CHECK(same, "%s[%zu]: decode_add differs from decode + local", what, i);
    same = same_float(in_place.data()[i], fused_sum.data()[i]);
    CHECK(same, "%s[%zu]: decode_add in place (out == local) differs", what, i);
  }

  check_owner_hop(psg_trunc16_decode_add_encode_decode, psg_trunc16_decode_scaled,
                  in_wire.data(), composed.data(), n, local, n, what);

  // Re-encoding in place (out_wire == in_wire) must give the same bytes.
  psg_trunc16_decode_add_encode(in_wire.data(), local, n, in_wire.data());
  CHECK(std::memcmp(in_wire.data(), composed.data(), 2 * n) == 0,
        "%s: decode_add_encode in place differs", what);
}

void test_trunc16(const std::vector<std::size_t>& sizes, std::mt19937& rng) {
  CHECK(psg_trunc16_wire_bytes(5) == 10, "wire bytes");
  for (std::size_t n : sizes) {
    for (std::size_t off : {0, 1, 3}) {
      Block<float> x(n, off), local(n, (off + 1) % 4);
      auto xs = random_values(n, rng, 3.0f);
      auto ls = random_values(n, rng, 1e-3f);
      std::memcpy(x.data(), xs.data(), 4 * n);
      std::memcpy(local.data(), ls.data(), 4 * n);
      check_trunc16_roundtrip(x.data(), n, "trunc16 random");
      check_trunc16_fused(x.data(), local.data(), n, "trunc16 fused");
    }
  }
  const float denormal = std::numeric_limits<float>::denorm_min();
  std::vector<float> special = {0.0f,  -0.0f,  1.0f,           -1.0f,
                                kInf,  -kInf,  kNaN,           -kNaN,
                                float_of(0x7F800001u),  // NaN with only a low payload bit
                                float_of(0xFF800123u),  // negative NaN, low payload
                                denormal, -3 * denormal, std::numeric_limits<float>::min(),
                                std::numeric_limits<float>::max(), 1.0f + 1.0f / 128,
                                -3.14159265f};
  check_trunc16_roundtrip(special.data(), special.size(), "trunc16 special");
  std::vector<float> others(special.size(), 1.0f);
  check_trunc16_fused(special.data(), others.data(), special.size(), "trunc16 special fused");
  // Overflow of the sum gives Inf, like float32 addition.
  std::vector<float> big = {std::numeric_limits<float>::max()};
  Block<uint16_t> w(1, 0), out(1, 0);
  psg_trunc16_encode(big.data(), 1, w.data());
  psg_trunc16_decode_add_encode(w.data(), big.data(), 1, out.data());
  CHECK(out.data()[0] == 0x7F80, "max + max must encode +Inf, got %#x", out.data()[0]);
}

// ---- quant8 ----

// Checks one encoded block against float64 arithmetic: the scale, the per-element
// error bound, the integer range, and the special blocks.
void check_quant8_block(const float* x, std::size_t n, const void* wire, const float* back,
                        const char* what) {
  double max_abs = 0.0;
  bool finite = true;
  for (std::size_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    max_abs = std::fmax(max_abs, std::fabs(static_cast<double>(x[i])));
  }
  float scale = quant8_scale(wire);
  const int8_t* q = quant8_q(wire);
  if (!finite) {
    CHECK(std::isnan(scale), "%s: non-finite block needs scale NaN, got %g", what, scale);
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(std::isnan(back[i]), "%s[%zu]: non-finite block must decode to NaN", what, i);
    }
    return;
  }
  if (max_abs == 0.0) {
    CHECK(bits_of(scale) == 0, "%s: zero block needs scale +0, got %g", what, scale);
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(back[i] == 0.0f && q[i] == 0, "%s[%zu]: zero block must decode to 0", what, i);
    }
    return;
  }
  // scale is max/127 rounded up: 127 * scale >= max, and the float below is too small;
  // unless 127 * that would overflow float32, then it is rounded down.
  double lower = static_cast<double>(float_of(bits_of(scale) - 1));
  double upper = static_cast<double>(float_of(bits_of(scale) + 1));
  const double fmax = std::numeric_limits<float>::max();
  bool rounded_up = 127.0 * scale >= max_abs && 127.0 * lower < max_abs;
  bool rounded_down = 127.0 * scale <= fmax && 127.0 * upper > fmax && 127.0 * upper >= max_abs;
  CHECK(rounded_up || rounded_down, "%s: scale %a is not max/127 = %a rounded up", what,
        static_cast<double>(scale), max_abs / 127);
  for (std::size_t i = 0; i < n; ++i) {
    CHECK(q[i] >= -127 && q[i] <= 127, "%s[%zu]: q = %d outside [-127, 127]", what, i, q[i]);
    double err = std::fabs(static_cast<double>(back[i]) - x[i]);
    CHECK(err <= scale * kQuant8HalfStep, "%s[%zu]: |%a - %a| > scale/2 = %a", what, i,
          static_cast<double>(back[i]), static_cast<double>(x[i]), scale * 0.5);
  }
}

void check_quant8_roundtrip(const float* x, std::size_t n, std::size_t wire_off,
                            const char* what) {
  Block<unsigned char> wire(psg_quant8_wire_bytes(n), wire_off);
  Block<float> back(n, 1);
  psg_quant8_encode(x, n, wire.data());
  psg_quant8_decode(wire.data(), n, back.data());
  check_quant8_block(x, n, wire.data(), back.data(), what);
  check_decode_scaled([&](float* out) { psg_quant8_decode(wire.data(), n, out); },
                      [&](float f, float* out) {
                        psg_quant8_decode_scaled(wire.data(), n, f, out);
                      },
                      n, what);
}

void check_quant8_fused(const float* in_values, const float* local, std::size_t n,
                        std::size_t wire_off, const char* what) {
  std::size_t bytes = psg_quant8_wire_bytes(n);
  Block<unsigned char> in_wire(bytes, wire_off), fused(bytes, 3), composed(bytes, 0);
  Block<float> decoded(n, 0), sum(n, 1), scratch(n, 0), fused_sum(n, 0), in_place(n, 2);
  psg_quant8_encode(in_values, n, in_wire.data());
  psg_quant8_decode(in_wire.data(), n, decoded.data());
  for (std::size_t i = 0; i < n; ++i) sum.data()[i] = decoded.data()[i] + local[i];
  psg_quant8_encode(sum.data(), n, composed.data());

  psg_quant8_decode_add_encode(in_wire.data(), local, n, scratch.data(), fused.data());
  CHECK(std::memcmp(fused.data(), composed.data(), bytes) == 0,
        "%s: decode_add_encode differs from encode(decode + local)", what);
  Block<float> back(n, 0);
  psg_quant8_decode(fused.data(), n, back.data());
  check_quant8_block(sum.data(), n, fused.data(), back.data(), what);

  psg_quant8_decode_add(in_wire.data(), local, n, fused_sum.data());
  std::memcpy(in_place.data(), local, 4 * n);
  psg_quant8_decode_add(in_wire.data(), in_place.data(), n, in_place.data());
  for (std::size_t i = 0; i < n; ++i) {
    bool same = same_float(fused_sum.data()[i], sum.data()[i]);
    CHECK(same, "%s[%zu]: decode_add differs from decode + local", what, i);
    same = same_float(in_place.data()[i], fused_sum.data()[i]);
    CHECK(same, "%s[%zu]: decode_add in place (out == local) differs", what, i);
  }

  check_owner_hop(psg_quant8_decode_add_encode_decode, psg_quant8_decode_scaled,
                  in_wire.data(), composed.data(), bytes, local, n, what);

  // Requantising in place (out_wire == in_wire) must give the same bytes.
  psg_quant8_decode_add_encode(in_wire.data(), local, n, scratch.data(), in_wire.data());
  CHECK(std::memcmp(in_wire.data(), composed.data(), bytes) == 0,
        "%s: decode_add_encode in place differs", what);
}

void test_quant8(const std::vector<std::size_t>& sizes, std::mt19937& rng) {
  CHECK(psg_quant8_wire_bytes(5) == 9, "wire bytes");
  for (std::size_t n : sizes) {
    for (std::size_t off : {0, 1, 3}) {
      Block<float> x(n, off), local(n, (off + 2) % 4);
      auto xs = random_values(n, rng, 2.0f);
      auto ls = random_values(n, rng, 0.5f);
      std::memcpy(x.data(), xs.data(), 4 * n);
      std::memcpy(local.data(), ls.data(), 4 * n);
      check_quant8_roundtrip(x.data(), n, off, "quant8 random");
      check_quant8_fused(x.data(), local.data(), n, off, "quant8 fused");
    }
  }

  const float denormal = std::numeric_limits<float>::denorm_min();
  const float fmax = std::numeric_limits<float>::max();
  for (std::size_t n : {std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{300}}) {
    std::vector<float> v(n);
    // zeros (with a negative zero), and NaN / Inf at the start, middle and end
    for (std::size_t i = 0; i < n; ++i) v[i] = i % 2 ? -0.0f : 0.0f;
    check_quant8_roundtrip(v.data(), n, 1, "quant8 zeros");
    for (float bad : {kNaN, kInf, -kInf}) {
      for (std::size_t where : {std::size_t{0}, n / 2, n - 1}) {
        for (std::size_t i = 0; i < n; ++i) v[i] = 0.25f * static_cast<float>(i);
        v[where] = bad;
        check_quant8_roundtrip(v.data(), n, 0, "quant8 non-finite");
        std::vector<float> ones(n, 1.0f);
        check_quant8_fused(v.data(), ones.data(), n, 1, "quant8 non-finite fused");
        check_quant8_fused(ones.data(), v.data(), n, 2, "quant8 non-finite local");
      }
    }
    // denormal maxima: max/127 underflows to 0 or to a coarse denormal scale
    for (float tiny : {denormal, 3 * denormal, 200 * denormal, 1e-40f, 1e-38f}) {
      for (std::size_t i = 0; i < n; ++i) {
        v[i] = tiny * static_cast<float>(i % 5) * (i % 2 ? -1.0f : 1.0f) / 4.0f;
      }
      v[n - 1] = -tiny;
      check_quant8_roundtrip(v.data(), n, 3, "quant8 denormal");
      check_quant8_fused(v.data(), v.data(), n, 0, "quant8 denormal fused");
    }
    // huge values: the scale is near FLT_MAX / 127; the fused sum overflows to NaN block
    for (std::size_t i = 0; i < n; ++i) v[i] = fmax * (i % 2 ? -1.0f : 0.5f);
    v[0] = fmax;
    check_quant8_roundtrip(v.data(), n, 0, "quant8 huge");
    check_quant8_fused(v.data(), v.data(), n, 0, "quant8 overflowing sum");
  }
  // ties: x/scale exactly k + 1/2 rounds to nearest (either neighbour is within scale/2)
  std::vector<float> ties = {127.0f, 0.5f, 1.5f, -2.5f, 63.5f, -126.5f};
  check_quant8_roundtrip(ties.data(), ties.size(), 0, "quant8 ties");

  // n = 0 writes only the scale (0) and touches no element
  Block<unsigned char> empty(4, 0);
  psg_quant8_encode(nullptr, 0, empty.data());
  CHECK(quant8_scale(empty.data()) == 0.0f, "empty block scale");
}

// y <- a*y + b*x with each product rounded to float32 before the sum, as the kernel
// promises (no FMA), so the result is compared bit for bit.
void test_scale_add(const std::vector<std::size_t>& sizes, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (std::size_t n : sizes) {
    for (std::size_t off : {0, 1}) {
      Block<float> y(n, off), x(n, 1 - off), expected(n, 0);
      for (std::size_t i = 0; i < n; ++i) {
        y.data()[i] = normal(rng);
        x.data()[i] = normal(rng);
      }
      for (auto [a, b] : {std::pair{0.75f, -1.5f}, std::pair{1.0f, 0.3f}}) {
        for (std::size_t i = 0; i < n; ++i) {
          volatile float ay = a * y.data()[i];  // volatile: two roundings, as promised
          volatile float bx = b * x.data()[i];
          expected.data()[i] = ay + bx;
        }
        psg_scale_add_f32(y.data(), x.data(), n, a, b);
        for (std::size_t i = 0; i < n; ++i) {
          CHECK(same_float(y.data()[i], expected.data()[i]), "scale_add n=%zu [%zu]: %g != %g",
                n, i, static_cast<double>(y.data()[i]), static_cast<double>(expected.data()[i]));
        }
      }
    }
  }
  psg_scale_add_f32(nullptr, nullptr, 0, 2.0f, 3.0f);  // n = 0 touches nothing
}

// SGD's step fused with T2's update of u, against the same arithmetic written out one
// rounding at a time (volatile keeps the compiler from fusing it), for no momentum, a
// fresh momentum buffer and a running one.
void test_sgd_t2_step(const std::vector<std::size_t>& sizes, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Case {
    float momentum;
    int first;
  };
  for (std::size_t n : sizes) {
    for (Case c : {Case{0.0f, 0}, Case{0.9f, 1}, Case{0.9f, 0}}) {
      const psg_sgd_t2 s{0.05f, 1e-3f, c.momentum, 0.1f, c.first, 0.8f, 0.35f, 0.45f};
      Block<float> w(n, 1), g(n, 0), buf(n, 1), u(n, 0);
      std::vector<float> w_want(n), buf_want(n), u_want(n);
      for (std::size_t i = 0; i < n; ++i) {
        w.data()[i] = normal(rng);
        g.data()[i] = normal(rng);
        buf.data()[i] = normal(rng);
        u.data()[i] = normal(rng);
        volatile float wd_w = s.weight_decay * w.data()[i];
        volatile float d = g.data()[i] + wd_w;
        buf_want[i] = buf.data()[i];
        if (c.momentum != 0.0f) {
          if (c.first) {
            buf_want[i] = d;
          } else {
            volatile float kept = c.momentum * buf.data()[i];
            volatile float added = (1.0f - s.dampening) * d;
            buf_want[i] = kept + added;
          }
          d = buf_want[i];
        }
        volatile float step = -s.lr * d;
        w_want[i] = w.data()[i] + step;
        volatile float us = s.u_scale * u.data()[i];
        volatile float wo = s.w_old_scale * w.data()[i];
        volatile float partial = us + wo;
        volatile float wn = s.w_new_scale * w_want[i];
        u_want[i] = partial + wn;
      }
      psg_sgd_t2_step_f32(w.data(), g.data(), c.momentum != 0.0f ? buf.data() : nullptr,
                          u.data(), n, &s);
      for (std::size_t i = 0; i < n; ++i) {
        CHECK(same_float(w.data()[i], w_want[i]) && same_float(u.data()[i], u_want[i]) &&
                  same_float(buf.data()[i], buf_want[i]),
              "sgd_t2_step n=%zu momentum=%g first=%d [%zu]", n,
              static_cast<double>(c.momentum), c.first, i);
      }
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(12345);
  const std::vector<std::size_t> sizes = {1,   2,   3,   7,    15,   16,   17,   63,  64,
                                          65,  255, 256, 257,  511,  1000, 1023, 1025,
                                          2047, 4097, 65537, 100003};
  test_trunc16(sizes, rng);
  test_quant8(sizes, rng);
  test_scale_add(sizes, rng);
  test_sgd_t2_step(sizes, rng);
  if (g_failures != 0) {
    std::fprintf(stderr, "test_kernels: %d of %d checks FAILED\n", g_failures, g_checks);
    return 1;
  }
  std::printf("test_kernels: all %d checks passed\n", g_checks);
  return 0;
}
