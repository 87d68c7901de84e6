// Internal to the CRC-32C: the pieces the portable file (crc32c.cpp) and the SSE4.2 file
// (crc32c_sse42.cpp, compiled with -msse4.2) share.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zerocore {
namespace crc32c_detail {

// Reflected CRC-32C polynomial.
constexpr uint32_t kPoly = 0x82F63B78u;

// A table applying `nbytes` zero bytes to a raw CRC register (the linear part of the CRC, no inversion):
// shift(crc) = t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24].
struct ShiftTable {
  uint32_t t[4][256];
  uint32_t apply(uint32_t crc) const {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
};
void make_shift_table(ShiftTable* table, uint64_t nbytes);

// The raw register (crc already inverted on entry, not inverted on exit) after data[0, nbytes).
uint32_t update_hw(uint32_t raw_crc, const unsigned char* data, size_t nbytes);  // needs SSE4.2

}  // namespace crc32c_detail
}  // namespace zerocore
