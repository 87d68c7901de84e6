// CRC-32C: the portable slicing-by-8 implementation, the GF(2) shift operators that combine CRCs, and the
// run-time choice of the SSE4.2 path (crc32c_sse42.cpp). See zerocore/crc32c.hpp.
#include "zerocore/crc32c.hpp"

#include <array>
#include <cstring>

#include "crc32c_internal.hpp"
#include "zerocore/simd.hpp"

namespace zerocore {
namespace crc32c_detail {
namespace {

// kSlices[k][b]: the raw register after the byte b followed by k zero bytes, from a zero register.
struct SliceTables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr SliceTables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t crc = b;
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPoly : 0u);
      t[0][b] = crc;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
    }
  }
};
constexpr SliceTables kSlices;

uint32_t update_portable(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = kSlices.t;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    --n;
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, sizeof(word));
    word ^= crc;
    crc = t[7][word & 0xff] ^ t[6][(word >> 8) & 0xff] ^ t[5][(word >> 16) & 0xff] ^ t[4][(word >> 24) & 0xff] ^
          t[3][(word >> 32) & 0xff] ^ t[2][(word >> 40) & 0xff] ^ t[1][(word >> 48) & 0xff] ^ t[0][word >> 56];
    p += 8;
    n -= 8;
  }
#endif
  while (n > 0) {
    crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    --n;
  }
  return crc;
}

// GF(2) 32x32 matrices as 32 columns: mat[i] is the image of bit i.
using Matrix = std::array<uint32_t, 32>;

uint32_t times(const Matrix& mat, uint32_t vec) {
  uint32_t sum = 0;
  for (int i = 0; vec != 0; ++i, vec >>= 1) {
    if (vec & 1u) sum ^= mat[i];
  }
  return sum;
}

Matrix square(const Matrix& mat) {
  Matrix sq;
  for (int i = 0; i < 32; ++i) sq[i] = times(mat, mat[i]);
  return sq;
}

// The operator applying `nbytes` zero bytes to a raw register.
Matrix zeros_operator(uint64_t nbytes) {
  Matrix power;  // one zero byte, then squared: 2, 4, 8, ... zero bytes
  for (int i = 0; i < 32; ++i) {
    uint32_t crc = 1u << i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPoly : 0u);
    power[i] = crc;
  }
  Matrix result;
  for (int i = 0; i < 32; ++i) result[i] = 1u << i;  // identity
  while (nbytes != 0) {
    if (nbytes & 1u) {
      Matrix next;
      for (int i = 0; i < 32; ++i) next[i] = times(power, result[i]);
      result = next;
    }
    nbytes >>= 1;
    if (nbytes != 0) power = square(power);
  }
  return result;
}

}  // namespace

void make_shift_table(ShiftTable* table, uint64_t nbytes) {
  const Matrix op = zeros_operator(nbytes);
  for (uint32_t b = 0; b < 256; ++b) {
    for (int k = 0; k < 4; ++k) table->t[k][b] = times(op, b << (8 * k));
  }
}

}  // namespace crc32c_detail

uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t crc) {
  return ~crc32c_detail::update_portable(~crc, static_cast<const unsigned char*>(data), nbytes);
}

bool crc32c_hardware_available() {
#if defined(ZEROCORE_HAVE_SSE42)
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

bool crc32c_uses_hardware() {
  return crc32c_hardware_available() && active_simd_path() != SimdPath::kScalar;
}

uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc) {
#if defined(ZEROCORE_HAVE_SSE42)
  if (crc32c_uses_hardware()) {
    return ~crc32c_detail::update_hw(~crc, static_cast<const unsigned char*>(data), nbytes);
  }
#endif
  return crc32c_portable(data, nbytes, crc);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t length_b) {
  // crc(a + b) = zeros(length_b)(crc(a)) ^ crc(b): the inversions at both ends cancel (as in zlib).
  return crc32c_detail::times(crc32c_detail::zeros_operator(length_b), crc_a) ^ crc_b;
}

}  // namespace zerocore
