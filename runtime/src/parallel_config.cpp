// parallel_config.cpp — --parallel and --parallel-options: an engine and its arguments,
// by the engine's own names, checked.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/data_parallel.hpp"

namespace mem::nn {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool parse_bool(std::string_view key, std::string_view value) {
  if (value == "true" || value == "True" || value == "1") return true;
  if (value == "false" || value == "False" || value == "0") return false;
  throw Error(std::string(key) + "=" + std::string(value) + ": expected true or false");
}

constexpr std::string_view kDdpOptions =
    "bucket_cap_mb, gradient_as_bucket_view, broadcast_buffers, init_sync, static_graph, find_unused_parameters";

}  // namespace

ParallelConfig parse_parallel(std::string_view spec, std::string_view options) {
  ParallelConfig config;
  spec = trim(spec);
  const bool no_options = trim(options).empty();
  if (spec.empty() || spec == "none") {
    if (!no_options) {
      throw Error("'" + std::string(options) + "' are options of an engine: give one, e.g. ddp:8");
    }
    return config;
  }
  const std::size_t colon = spec.find(':');
  const std::string_view engine = spec.substr(0, colon);
  if (engine != "ddp") {
    throw Error("unknown engine '" + std::string(engine) +
                "'; expected ddp:N (DistributedDataParallel on N GPUs) or none");
  }
  config.engine = ParallelEngine::Ddp;
  const std::string_view count = colon == std::string_view::npos ? std::string_view{} : spec.substr(colon + 1);
  std::size_t n = 0;
  const auto [end, ec] = std::from_chars(count.data(), count.data() + count.size(), n);
  if (count.empty() || ec != std::errc{} || end != count.data() + count.size() || n < 1 || n > kMaxWorldSize) {
    throw Error("'" + std::string(spec) + "': the number of GPUs must be a whole number from 1 to " +
                std::to_string(kMaxWorldSize) + ", e.g. ddp:8");
  }
  config.world_size = n;
  if (no_options) return config;

  std::vector<std::string_view> seen;
  for (std::size_t start = 0; start <= options.size();) {
    const std::size_t comma = std::min(options.find(',', start), options.size());
    const std::string_view item = trim(options.substr(start, comma - start));
    start = comma + 1;
    const std::size_t eq = item.find('=');
    if (item.empty() || eq == std::string_view::npos) {
      throw Error("'" + std::string(item) + "' is not key=value (keys: " + std::string(kDdpOptions) + ")");
    }
    const std::string_view key = trim(item.substr(0, eq));
    const std::string_view value = trim(item.substr(eq + 1));
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      throw Error("'" + std::string(key) + "' is given twice");
    }
    seen.push_back(key);
    if (key == "bucket_cap_mb") {
      // DDP takes a float of MiB (distributed.py: int(bucket_cap_mb * 1024 * 1024)); decimal only.
      double mb = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), mb, std::chars_format::general);
      if (value.empty() || ec != std::errc{} || end != value.data() + value.size() || !std::isfinite(mb) || mb <= 0 ||
          mb > 1 << 20) {
        throw Error("bucket_cap_mb=" + std::string(value) + ": expected MiB, more than 0 and at most 1048576");
      }
      config.bucket_cap_mb = mb;
    } else if (key == "gradient_as_bucket_view") {
      config.gradient_as_bucket_view = parse_bool(key, value);
    } else if (key == "broadcast_buffers") {
      config.broadcast_buffers = parse_bool(key, value);
    } else if (key == "init_sync") {
      config.init_sync = parse_bool(key, value);
    } else if (key == "static_graph") {
      config.static_graph = parse_bool(key, value);
    } else if (key == "find_unused_parameters") {
      config.find_unused_parameters = parse_bool(key, value);
    } else {
      throw Error("'" + std::string(key) + "' is not an option of ddp (keys: " + std::string(kDdpOptions) + ")");
    }
    if (comma == options.size()) break;
  }
  return config;
}

std::string parallel_label(const ParallelConfig& config) {
  if (!config.enabled()) return "none";
  std::string out = "ddp:" + std::to_string(config.world_size);
  const ParallelConfig defaults;
  std::string options;
  const auto add = [&](const std::string& item) { options += (options.empty() ? " " : ",") + item; };
  if (config.bucket_cap_mb) {
    char buffer[32];
    const auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, *config.bucket_cap_mb);
    add("bucket_cap_mb=" + std::string(buffer, ec == std::errc{} ? end : buffer));
  }
  if (config.gradient_as_bucket_view) add("gradient_as_bucket_view=true");
  if (!config.broadcast_buffers) add("broadcast_buffers=false");
  if (!config.init_sync) add("init_sync=false");
  if (config.static_graph) add("static_graph=true");
  if (config.find_unused_parameters) add("find_unused_parameters=true");
  return out + options;
}

}  // namespace mem::nn
