// zerocore-bench: microbenchmarks of the torch-free core. One subcommand per kernel; a table by default,
// one JSON object on stdout with --json. Exit status: 0 done, 1 failed while running, 2 bad command line.
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "bench_common.hpp"
#include "zerocore/error.hpp"

namespace zerocore_bench {
int aio_command(int argc, char** argv);       // bench_aio.cpp
int quantize_command(int argc, char** argv);  // bench_quantize.cpp
}  // namespace zerocore_bench

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);
};

constexpr Subcommand kSubcommands[] = {
    {"layout", "build a FlatLayout of many tensors and query rank pieces", zerocore_bench::layout_command},
    {"stream", "memory bandwidth: copy, triad and the Adam-shaped stream", zerocore_bench::stream_command},
    {"adam", "time zerocore::adam_step against the Adam-shaped stream roofline", zerocore_bench::adam_command},
    {"aio", "file bandwidth of the AsyncIO engine against the disk's own, and crc32c", zerocore_bench::aio_command},
    {"quantize", "int8/int4 quantize and dequantize GB/s against the copy stream roofline",
     zerocore_bench::quantize_command},
};

void print_usage(std::FILE* out) {
  std::fprintf(out, "usage: zerocore-bench <command> [options]\n\ncommands:\n");
  for (const Subcommand& sub : kSubcommands) std::fprintf(out, "  %-8s %s\n", sub.name, sub.summary);
  std::fprintf(out, "\nRun 'zerocore-bench <command> --help' for the options of one command.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage(stderr);
    return 2;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    print_usage(stdout);
    return 0;
  }
  for (const Subcommand& sub : kSubcommands) {
    if (name != sub.name) continue;
    try {
      return sub.run(argc - 1, argv + 1);
    } catch (const zerocore_bench::UsageError& e) {
      std::fprintf(stderr, "zerocore-bench %s: %s\nRun 'zerocore-bench %s --help' for its options.\n", sub.name,
                   e.what(), sub.name);
      return 2;
    } catch (const zerocore::InvalidArgument& e) {
      // The core validates what the command line fed it (a SIMD path, an alignment): still the caller's input.
      std::fprintf(stderr, "zerocore-bench %s: %s\n", sub.name, e.what());
      return 2;
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "zerocore-bench %s: out of memory; try fewer elements\n", sub.name);
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "zerocore-bench %s: %s\n", sub.name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "zerocore-bench: unknown command '%s'\n\n", name.c_str());
  print_usage(stderr);
  return 2;
}
