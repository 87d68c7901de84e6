#include "bench_common.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdlib>
#include <thread>
#include <utility>

namespace zerocore_bench {

// ---------------------------------------------------------------------------------------------------------
// Argument parsing
// ---------------------------------------------------------------------------------------------------------

int64_t parse_int(const std::string& option, const std::string& text) {
  const auto bad = [&] { return UsageError("--" + option + " expects an integer, got '" + text + "'"); };
  if (text.empty()) throw bad();
  errno = 0;
  char* end = nullptr;
  const long long as_int = std::strtoll(text.c_str(), &end, 10);
  if (errno == 0 && *end == '\0') return as_int;
  // "1e8" is easier to type than 100000000; accept it when it names an integer exactly.
  errno = 0;
  const double as_double = std::strtod(text.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(as_double) || as_double != std::floor(as_double) ||
      std::fabs(as_double) > 9.0e18) {
    throw bad();
  }
  return static_cast<int64_t>(as_double);
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

namespace {

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string joined;
  for (size_t i = 0; i < items.size(); ++i) joined += (i ? separator : "") + items[i];
  return joined;
}

void check_choice(const std::string& option, const std::string& value, const std::vector<std::string>& choices) {
  if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
    throw UsageError("--" + option + " must be one of " + join(choices, "|") + ", got '" + value + "'");
  }
}

}  // namespace

ArgParser::ArgParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

ArgParser::Option& ArgParser::add(const std::string& name, const std::string& metavar, const std::string& help,
                                  std::string default_text, std::function<void(const std::string&)> set) {
  options_.push_back(Option{name, metavar, help, std::move(default_text), false, std::move(set)});
  return options_.back();
}

void ArgParser::add_int(const std::string& name, int64_t* target, int64_t min_value, const std::string& help,
                        const std::string& default_text, int64_t max_value) {
  add(name, "N", help, default_text.empty() ? std::to_string(*target) : default_text, [=](const std::string& text) {
    const int64_t value = parse_int(name, text);
    if (value < min_value) {
      throw UsageError("--" + name + " must be >= " + std::to_string(min_value) + ", got " + text);
    }
    if (value > max_value) {
      throw UsageError("--" + name + " must be at most " + std::to_string(max_value) + ", got " + text);
    }
    *target = value;
  });
}

void ArgParser::add_string(const std::string& name, std::string* target, const std::string& help) {
  add(name, "TEXT", help, *target, [=](const std::string& text) { *target = text; });
}

void ArgParser::add_choice(const std::string& name, std::string* target, std::vector<std::string> choices,
                           const std::string& help) {
  add(name, join(choices, "|"), help, *target, [=](const std::string& text) {
    check_choice(name, text, choices);
    *target = text;
  });
}

void ArgParser::add_int_list(const std::string& name, std::vector<int64_t>* target, int64_t min_value,
                             const std::string& help, int64_t max_value) {
  std::vector<std::string> defaults;
  for (int64_t value : *target) defaults.push_back(std::to_string(value));
  add(name, "N[,N...]", help, join(defaults, ","), [=](const std::string& text) {
    std::vector<int64_t> values;
    for (const std::string& item : split_commas(text)) {
      const int64_t value = parse_int(name, item);
      if (value < min_value) {
        throw UsageError("--" + name + " values must be >= " + std::to_string(min_value) + ", got " + item);
      }
      if (value > max_value) {
        throw UsageError("--" + name + " values must be at most " + std::to_string(max_value) + ", got " + item);
      }
      values.push_back(value);
    }
    *target = values;
  });
}

void ArgParser::add_choice_list(const std::string& name, std::vector<std::string>* target,
                                std::vector<std::string> choices, const std::string& help) {
  add(name, join(choices, ",") + " (any of)", help, join(*target, ","), [=](const std::string& text) {
    std::vector<std::string> values = split_commas(text);
    for (const std::string& value : values) check_choice(name, value, choices);
    *target = values;
  });
}

void ArgParser::add_flag(const std::string& name, bool* target, const std::string& help) {
  add(name, "", help, "", [=](const std::string&) { *target = true; }).is_flag = true;
}

bool ArgParser::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      print_help(stdout);
      return false;
    }
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      throw UsageError("unexpected argument '" + arg + "' (options start with --)");
    }
    const size_t equals = arg.find('=');
    const std::string name = arg.substr(2, equals == std::string::npos ? std::string::npos : equals - 2);
    auto option = std::find_if(options_.begin(), options_.end(), [&](const Option& o) { return o.name == name; });
    if (option == options_.end()) throw UsageError("unknown option '--" + name + "'");
    if (option->is_flag) {
      if (equals != std::string::npos) throw UsageError("--" + name + " takes no value");
      option->set("");
    } else if (equals != std::string::npos) {
      option->set(arg.substr(equals + 1));
    } else {
      if (i + 1 >= argc) throw UsageError("--" + name + " needs a value");
      option->set(argv[++i]);
    }
    option->seen = true;
  }
  return true;
}

bool ArgParser::was_set(const std::string& name) const {
  for (const Option& option : options_) {
    if (option.name == name) return option.seen;
  }
  return false;
}

void ArgParser::print_help(std::FILE* out) const {
  std::fprintf(out, "usage: zerocore-bench %s [options]\n\n%s\n\noptions:\n", command_.c_str(), summary_.c_str());
  for (const Option& option : options_) {
    std::string left = "  --" + option.name + (option.metavar.empty() ? "" : " " + option.metavar);
    std::fprintf(out, "%s\n      %s", left.c_str(), option.help.c_str());
    if (!option.is_flag && !option.default_text.empty()) {
      std::fprintf(out, " (default: %s)", option.default_text.c_str());
    }
    std::fprintf(out, "\n");
  }
  std::fprintf(out, "  --help, -h\n      show this help\n");
}

// ---------------------------------------------------------------------------------------------------------
// JSON
// ---------------------------------------------------------------------------------------------------------

namespace {

std::string json_quote(const std::string& text) {
  std::string quoted = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"': quoted += "\\\""; break;
      case '\\': quoted += "\\\\"; break;
      case '\n': quoted += "\\n"; break;
      case '\t': quoted += "\\t"; break;
      default:
        if (c < 0x20) {
          quoted += format("\\u%04x", c);
        } else {
          quoted += static_cast<char>(c);
        }
    }
  }
  return quoted + "\"";
}

std::string json_number(double value) {
  // Ten significant digits: more than any timing here resolves, without %.17g's 0.10000000000000001 noise.
  return std::isfinite(value) ? format("%.10g", value) : "null";
}

}  // namespace

void JsonWriter::begin_value(const std::string& key) {
  if (!container_has_items_.empty()) {
    if (container_has_items_.back()) out_ += ',';
    container_has_items_.back() = true;
  }
  if (!key.empty()) out_ += json_quote(key) + ':';
}

JsonWriter& JsonWriter::begin_object(const std::string& key) {
  begin_value(key);
  out_ += '{';
  container_has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  out_ += '}';
  container_has_items_.pop_back();
  return *this;
}

JsonWriter& JsonWriter::begin_array(const std::string& key) {
  begin_value(key);
  out_ += '[';
  container_has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  out_ += ']';
  container_has_items_.pop_back();
  return *this;
}

JsonWriter& JsonWriter::field_int(const std::string& key, int64_t value) {
  begin_value(key);
  out_ += std::to_string(value);
  return *this;
}

JsonWriter& JsonWriter::field_number(const std::string& key, double value) {
  begin_value(key);
  out_ += json_number(value);
  return *this;
}

JsonWriter& JsonWriter::field_string(const std::string& key, const std::string& value) {
  begin_value(key);
  out_ += json_quote(value);
  return *this;
}

JsonWriter& JsonWriter::field_bool(const std::string& key, bool value) {
  begin_value(key);
  out_ += value ? "true" : "false";
  return *this;
}

JsonWriter& JsonWriter::item_int(int64_t value) { return field_int("", value); }
JsonWriter& JsonWriter::item_string(const std::string& value) { return field_string("", value); }

// ---------------------------------------------------------------------------------------------------------
// Table, formatting, timing
// ---------------------------------------------------------------------------------------------------------

Table::Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}

void Table::add_row(std::vector<std::string> cells) {
  cells.resize(headers_.size());
  rows_.push_back(std::move(cells));
}

void Table::print(std::FILE* out, const std::string& indent) const {
  std::vector<size_t> widths(headers_.size());
  for (size_t c = 0; c < headers_.size(); ++c) {
    widths[c] = headers_[c].size();
    for (const auto& row : rows_) widths[c] = std::max(widths[c], row[c].size());
  }
  auto is_number = [](const std::string& cell) {
    return !cell.empty() && cell.find_first_not_of("0123456789.-+e%") == std::string::npos;
  };
  auto print_row = [&](const std::vector<std::string>& cells, bool header) {
    std::string line = indent;
    for (size_t c = 0; c < cells.size(); ++c) {
      const std::string pad(widths[c] - cells[c].size(), ' ');
      line += (c ? "  " : "") + (!header && is_number(cells[c]) ? pad + cells[c] : cells[c] + pad);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::fprintf(out, "%s\n", line.c_str());
  };
  print_row(headers_, true);
  for (const auto& row : rows_) print_row(row, false);
}

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  const int length = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string text(length > 0 ? static_cast<size_t>(length) : 0, '\0');
  if (length > 0) std::vsnprintf(&text[0], text.size() + 1, fmt, args);
  va_end(args);
  return text;
}

double Timing::best() const { return seconds.empty() ? 0.0 : *std::min_element(seconds.begin(), seconds.end()); }

double Timing::median() const {
  if (seconds.empty()) return 0.0;
  std::vector<double> sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  return n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
}

Timing time_repeats(int64_t repeats, const std::function<void()>& fn, bool warmup) {
  if (warmup) fn();
  Timing timing;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    timing.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return timing;
}

int64_t default_threads() { return std::max<int64_t>(1, std::thread::hardware_concurrency()); }

}  // namespace zerocore_bench
