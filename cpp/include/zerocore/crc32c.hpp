// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4, Btrfs, RocksDB and
// Google's crc32c library: crc32c("123456789") == 0xE3069283.
//
// The value is chainable like zlib's crc32: crc32c(b, nb, crc32c(a, na)) == crc32c(a + b, na + nb), with 0 the
// value of no bytes. Two implementations give identical results: the SSE4.2 crc32 instruction on three
// interleaved streams (x86-64 CPUs with SSE4.2), and a portable slicing-by-8 table walk. crc32c() takes the
// instruction unless the CPU lacks it or the SIMD path is forced to "scalar" (zerocore::force_simd_path), so
// tests and benchmarks can compare the two.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zerocore {

// CRC-32C of data[0, nbytes), continuing from `crc` (the value returned for the bytes before).
uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc = 0);

// The portable table-driven implementation, whatever the CPU.
uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t crc = 0);

// Whether this build and CPU have the instruction path; and whether crc32c() takes it now (not when the
// SIMD path is forced to "scalar").
bool crc32c_hardware_available();
bool crc32c_uses_hardware();

// The CRC-32C of a + b from crc_a = crc32c(a), crc_b = crc32c(b) and the length of b, without the data.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t length_b);

}  // namespace zerocore
