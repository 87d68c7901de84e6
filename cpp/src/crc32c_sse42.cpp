// CRC-32C with the SSE4.2 crc32 instruction; compiled with -msse4.2 and called only on CPUs that have it.
//
// The instruction has a latency of 3 cycles and a throughput of 1 per cycle, so one dependent chain runs at
// a third of the speed the unit allows. Long inputs are therefore cut into blocks of 3 x kLong bytes whose
// thirds are summed as three independent chains; the first chain's register is then moved past the other
// two thirds with a precomputed zero-bytes shift table (crc(a + b) = shift_|b|(crc(a)) ^ crc_from_0(b)) and
// combined. The same again with 3 x kShort bytes, then one chain for the rest.
#include <nmmintrin.h>

#include <cstring>

#include "crc32c_internal.hpp"

namespace zerocore {
namespace crc32c_detail {
namespace {

constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;

struct Shifts {
  ShiftTable long_shift;
  ShiftTable short_shift;
  Shifts() {
    make_shift_table(&long_shift, kLong);
    make_shift_table(&short_shift, kShort);
  }
};

const Shifts& shifts() {
  static const Shifts instance;
  return instance;
}

inline uint64_t load64(const unsigned char* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof(word));
  return word;
}

// Three chains over blocks of 3 * block bytes while they last.
inline void three_streams(uint64_t& crc0, const unsigned char*& p, size_t& n, size_t block,
                          const ShiftTable& shift) {
  while (n >= 3 * block) {
    uint64_t crc1 = 0;
    uint64_t crc2 = 0;
    const unsigned char* const end = p + block;
    do {
      crc0 = _mm_crc32_u64(crc0, load64(p));
      crc1 = _mm_crc32_u64(crc1, load64(p + block));
      crc2 = _mm_crc32_u64(crc2, load64(p + 2 * block));
      p += 8;
    } while (p < end);
    crc0 = shift.apply(static_cast<uint32_t>(crc0)) ^ static_cast<uint32_t>(crc1);
    crc0 = shift.apply(static_cast<uint32_t>(crc0)) ^ static_cast<uint32_t>(crc2);
    p += 2 * block;
    n -= 3 * block;
  }
}

}  // namespace

uint32_t update_hw(uint32_t raw_crc, const unsigned char* p, size_t n) {
  uint64_t crc0 = raw_crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), *p++);
    --n;
  }
  if (n >= 3 * kShort) {
    const Shifts& s = shifts();
    three_streams(crc0, p, n, kLong, s.long_shift);
    three_streams(crc0, p, n, kShort, s.short_shift);
  }
  while (n >= 8) {
    crc0 = _mm_crc32_u64(crc0, load64(p));
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), *p++);
    --n;
  }
  return static_cast<uint32_t>(crc0);
}

}  // namespace crc32c_detail
}  // namespace zerocore
