// What the zerocore-bench subcommands share: a small argument parser, a JSON writer, a text table and
// timing helpers. Hand-written so the harness needs nothing beyond the torch-free core.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace zerocore_bench {

// A bad command line: main prints it with the subcommand's usage and exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses "--name value", "--name=value" and "--flag"; "--help" / "-h" print the help. Every option has
// a default (the target's value before parsing), shown in the help.
class ArgParser {
 public:
  static constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

  ArgParser(std::string command, std::string summary);

  // default_text replaces the shown default when the target's initial value is only a placeholder. A value
  // outside [min_value, max_value] is a UsageError: options later narrowed to int are bounded here.
  void add_int(const std::string& name, int64_t* target, int64_t min_value, const std::string& help,
               const std::string& default_text = "", int64_t max_value = kNoMax);
  void add_string(const std::string& name, std::string* target, const std::string& help);
  // One of `choices`.
  void add_choice(const std::string& name, std::string* target, std::vector<std::string> choices,
                  const std::string& help);
  // Comma-separated integers, each in [min_value, max_value], e.g. "--threads 1,2".
  void add_int_list(const std::string& name, std::vector<int64_t>* target, int64_t min_value,
                    const std::string& help, int64_t max_value = kNoMax);
  // Comma-separated items, each one of `choices`, e.g. "--kernel copy,triad".
  void add_choice_list(const std::string& name, std::vector<std::string>* target, std::vector<std::string> choices,
                       const std::string& help);
  void add_flag(const std::string& name, bool* target, const std::string& help);

  // Parses args[first..]; returns false when the help was printed (the command should exit 0).
  // Throws UsageError for an unknown option, a missing or malformed value, or a positional argument.
  bool parse(int argc, char** argv, int first);
  // Whether the option was given on the command line.
  bool was_set(const std::string& name) const;
  const std::string& command() const { return command_; }
  void print_help(std::FILE* out) const;

 private:
  struct Option {
    std::string name;  // without the leading "--"
    std::string metavar;
    std::string help;
    std::string default_text;
    bool is_flag = false;
    std::function<void(const std::string&)> set;
    bool seen = false;
  };
  Option& add(const std::string& name, const std::string& metavar, const std::string& help,
              std::string default_text, std::function<void(const std::string&)> set);

  std::string command_;
  std::string summary_;
  std::vector<Option> options_;
};

// Strict integer parsing for option values; also accepts an exact float spelling such as "1e8".
int64_t parse_int(const std::string& option, const std::string& text);
std::vector<std::string> split_commas(const std::string& text);

// Writes one JSON document into a string; commas and nesting are tracked, names and strings escaped.
class JsonWriter {
 public:
  JsonWriter& begin_object(const std::string& key = "");
  JsonWriter& end_object();
  JsonWriter& begin_array(const std::string& key = "");
  JsonWriter& end_array();
  // Object members. Non-finite numbers are written as null (JSON has no NaN).
  JsonWriter& field_int(const std::string& key, int64_t value);
  JsonWriter& field_number(const std::string& key, double value);
  JsonWriter& field_string(const std::string& key, const std::string& value);
  JsonWriter& field_bool(const std::string& key, bool value);
  // Array elements.
  JsonWriter& item_int(int64_t value);
  JsonWriter& item_string(const std::string& value);
  const std::string& str() const { return out_; }

 private:
  void begin_value(const std::string& key);
  std::string out_;
  std::vector<bool> container_has_items_;
};

// A text table: columns sized to their widest cell, numbers right-aligned.
class Table {
 public:
  explicit Table(std::vector<std::string> headers);
  void add_row(std::vector<std::string> cells);
  void print(std::FILE* out, const std::string& indent = "") const;

 private:
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

// printf-style formatting into a std::string.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

struct Timing {
  std::vector<double> seconds;
  double best() const;
  double median() const;
};

// Runs fn once untimed unless warmup is false, then `repeats` timed calls.
Timing time_repeats(int64_t repeats, const std::function<void()>& fn, bool warmup = true);

// Thread count used when --threads is not given: the hardware's, at least 1.
int64_t default_threads();

// Bounds of options the commands narrow to int (ThreadPool sizes, repeat counts): checked when parsed, so
// a huge value is a usage error instead of a wrapped, negative count.
constexpr int64_t kMaxThreads = 1024;
constexpr int64_t kMaxRepeat = std::numeric_limits<int>::max();

// Subcommands: argv[0] is the subcommand name. Return the process exit status.
int layout_command(int argc, char** argv);
int stream_command(int argc, char** argv);
int adam_command(int argc, char** argv);

}  // namespace zerocore_bench
