// replay_command.cpp — `vramscope replay`: one row per setting (and per peer)
// with the peaks, fragmentation and the first OOM; for a PyTorch snapshot
// under its recorded settings, the conformance with the recording.
#include "replay_command.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.hpp"
#include "model_args.hpp"  // integer_in
#include "replay_compare.hpp"
#include "sweep_export.hpp"  // csv_field
#include "table.hpp"
#include "usage_error.hpp"
#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/replay/replay.hpp"

#if defined(VRAMSCOPE_HAVE_CUB_PEER) && VRAMSCOPE_HAVE_CUB_PEER
#include "peers/peer_allocators.hpp"
#define VRAMSCOPE_REPLAY_CUB 1
#else
#define VRAMSCOPE_REPLAY_CUB 0
#endif

namespace mem::tools {
namespace {

struct ReplayArgs {
  std::string file;
  std::string device = "sim:a100-80g";
  std::vector<std::string> confs;
  std::vector<std::string> peers;
  std::string format = "table";
  int trace_device = -1;
  bool stop_at_oom = false;
  bool min_capacity = false;
  double memory_fraction = 0;  ///< --memory-fraction: set_per_process_memory_fraction (0: none)
};

struct Row {
  std::string label;  // "vramscope (default)", "cub-growth2"
  ReplayResult result;
  std::optional<CapacitySearch> smallest;  ///< --min-capacity: the smallest GPU that fits
  bool peer = false;                       ///< another allocator, not a setting
};

/// The run the others are compared with: the recorded setting's, else the first.
struct Baseline {
  std::size_t index = 0;
  std::string name;  // "recorded", or "first" when the trace carries no settings
};

std::string change_cell(const std::vector<Row>& rows, const Baseline& base, std::size_t i) {
  if (i == base.index) return base.name;
  if (rows[i].peer || !rows[i].result.supported || !rows[base.index].result.supported) return "—";
  return describe_change(change_against(rows[i].result, rows[base.index].result));
}

// The simulated GPUs at least `capacity` large, smallest first (at most three): what the
// smallest-GPU figure means in cards. Their CUDA contexts differ from the replayed device's.
std::string presets_with(std::size_t capacity) {
  std::vector<std::pair<std::size_t, std::string>> fit;
  for (const std::string& name : sim_preset_names()) {
    const std::size_t total = sim_preset(name).capacity;
    if (total >= capacity) fit.emplace_back(total, name);
  }
  std::sort(fit.begin(), fit.end());
  if (fit.empty()) return "no simulated GPU preset is that large";
  std::string out = "GPUs of that size or more: ";
  for (std::size_t i = 0; i < fit.size() && i < 3; ++i) {
    out += fmt::format("{}{} ({})", i ? ", " : "", fit[i].second, format_bytes(fit[i].first));
  }
  return out + (fit.size() > 3 ? fmt::format(" and {} larger", fit.size() - 3) : "") +
         " (check one with --device sim:NAME: contexts differ)";
}

std::string advice(const std::vector<Row>& rows, const Baseline& base) {
  std::vector<std::string> labels;
  std::vector<const ReplayResult*> runs;
  std::vector<std::size_t> smallest;  // --min-capacity's column, 0 where none
  bool searched = false;
  std::size_t index = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].peer) continue;
    if (i == base.index) index = runs.size();
    labels.push_back(rows[i].label);
    runs.push_back(&rows[i].result);
    searched = searched || rows[i].smallest.has_value();
    smallest.push_back(rows[i].smallest && rows[i].smallest->supported ? rows[i].smallest->capacity : 0);
  }
  if (runs.size() < 2 || !rows[base.index].result.supported) return "";
  return replay_advice(labels, runs, index, base.name, searched ? smallest : std::vector<std::size_t>{});
}

std::string oom_text(const ReplayResult& r) {
  if (!r.first_oom) return "none";
  return fmt::format("event {} ({})", r.first_oom->event_index, format_bytes(r.first_oom->requested));
}

std::string conformance_text(const ReplayResult& r) {
  if (!r.conformance_checked) return "";
  return fmt::format("segment_allocs {}/{}, blocks {}/{}", r.segment_allocs_reproduced,
                     r.segment_allocs_recorded, r.blocks_placed, r.allocs_checked);
}

nlohmann::json to_json(const Row& row) {
  const ReplayResult& r = row.result;
  nlohmann::json j = {
      {"label", row.label},
      {"config", r.config},
      {"device", r.device},
      {"supported", r.supported},
      {"events", r.events},
      {"allocs", r.allocs},
      {"frees", r.frees},
      {"unknown_frees", r.unknown_frees},
      {"peak_allocated_bytes", r.peak_allocated},
      {"peak_reserved_bytes", r.peak_reserved},
      {"peak_requested_bytes", r.peak_requested},
      {"peak_nvidia_smi_bytes", r.peak_device_used},
      {"reserved_per_requested", r.reserved_per_requested},
      {"reserved_unallocated_at_peak_bytes", r.reserved_unallocated_at_peak},
      {"largest_free_block_at_peak_bytes", r.largest_free_block_at_peak},
      {"fragmentation", r.fragmentation},
      {"device_allocs", r.segment_allocs},
      {"ooms", r.ooms},
  };
  if (!r.supported) j["unsupported_reason"] = r.unsupported_reason;
  if (row.smallest) {
    j["min_capacity"] = row.smallest->supported
                            ? nlohmann::json{{"capacity_bytes", row.smallest->capacity},
                                             {"unlimited_nvidia_smi_bytes", row.smallest->unlimited_device_used},
                                             {"peak_reserved_bytes", row.smallest->at_capacity.peak_reserved},
                                             {"replays", row.smallest->replays}}
                            : nlohmann::json{{"unsupported_reason", row.smallest->unsupported_reason}};
  }
  if (r.first_oom) {
    const ReplayOom& o = *r.first_oom;
    nlohmann::json segs = nlohmann::json::array();
    for (const ReplayOom::Segment& seg : o.fragmented) {
      nlohmann::json pins = nlohmann::json::array();
      for (const ReplayOom::Pin& p : seg.pins)
        pins.push_back({{"offset_bytes", p.offset}, {"size_bytes", p.size}, {"stack", p.stack}});
      segs.push_back({{"address", seg.address},
                      {"size_bytes", seg.size},
                      {"free_bytes", seg.free_bytes},
                      {"largest_free_bytes", seg.largest_free},
                      {"live_blocks", seg.live_blocks},
                      {"live_bytes", seg.live_bytes},
                      {"largest_live_blocks", pins}});
    }
    j["first_oom"] = {{"event_index", o.event_index},
                      {"requested_bytes", o.requested},
                      {"message", o.message},
                      {"largest_free_block_bytes", o.largest_free_block},
                      {"free_bytes", o.free_bytes},
                      {"fragmented_segments", segs}};
  }
  if (r.rebuilt_exactly || r.initial_segments > 0) {
    j["starting_state"] = {{"exact", r.rebuilt_exactly},
                           {"segments", r.initial_segments},
                           {"live_blocks", r.initial_blocks},
                           {"reserved_bytes", r.initial_reserved}};
  }
  if (r.conformance_checked) {
    nlohmann::json div = nlohmann::json::array();
    for (const ReplayDivergence& d : r.divergences) div.push_back({{"event_index", d.event_index}, {"what", d.what}});
    j["conformance"] = {{"segment_allocs_recorded", r.segment_allocs_recorded},
                        {"segment_allocs_reproduced", r.segment_allocs_reproduced},
                        {"allocs_checked", r.allocs_checked},
                        {"blocks_placed", r.blocks_placed},
                        {"final_segments_recorded", r.final_segments_recorded},
                        {"final_segments_matched", r.final_segments_matched},
                        {"divergences", r.divergence_count},
                        {"first_divergences", div}};
  }
  return j;
}

void print(const ReplayArgs& args, const AllocationTrace& trace, const std::vector<Row>& rows, const Baseline& base) {
  if (args.format == "json") {
    nlohmann::json j = {{"trace", trace.source},
                        {"format", std::string(trace_format_name(trace.format))},
                        {"events", trace.events.size()},
                        {"trace_device", trace.device},  // the recorded GPU replayed
                        {"device", args.device},
                        {"runs", nlohmann::json::array()}};
    if (!rows.empty()) j["assumptions"] = rows.front().result.assumptions;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      nlohmann::json run = to_json(rows[i]);
      if (i == base.index) {
        run["baseline"] = base.name;
      } else if (!rows[i].peer && rows[i].result.supported && rows[base.index].result.supported) {
        const ReplayChange c = change_against(rows[i].result, rows[base.index].result);
        run["vs_baseline"] = {{"peak_reserved_bytes", c.reserved},
                              {"peak_nvidia_smi_bytes", c.device_used},
                              {"device_allocs", c.device_allocs},
                              {"oom", c.oom}};
      }
      j["runs"].push_back(std::move(run));
    }
    if (const std::string a = advice(rows, base); !a.empty()) j["advice"] = a.substr(std::string("advice: ").size());
    std::cout << j.dump(2) << "\n";
    return;
  }
  if (args.format == "csv") {
    std::cout << "label,config,peak_allocated_bytes,peak_reserved_bytes,peak_requested_bytes,"
                 "peak_nvidia_smi_bytes,reserved_per_requested,fragmentation,"
                 "largest_free_block_at_peak_bytes,device_allocs,first_oom_event,"
                 "segment_allocs_reproduced,segment_allocs_recorded,blocks_placed,allocs_checked,"
                 "min_capacity_bytes,baseline,vs_peak_reserved_bytes,vs_peak_nvidia_smi_bytes,vs_device_allocs\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& row = rows[i];
      const ReplayResult& r = row.result;
      std::string vs = ",,";
      if (i != base.index && !row.peer && r.supported && rows[base.index].result.supported) {
        const ReplayChange c = change_against(r, rows[base.index].result);
        vs = fmt::format("{},{},{}", c.reserved, c.device_used, c.device_allocs);
      }
      std::cout << fmt::format(
          "{},{},{},{},{},{},{:.4f},{:.4f},{},{},{},{},{},{},{},{},{},{}\n", csv_field(row.label),
          csv_field(r.config), r.peak_allocated, r.peak_reserved, r.peak_requested, r.peak_device_used,
          r.reserved_per_requested, r.fragmentation, r.largest_free_block_at_peak, r.segment_allocs,
          r.first_oom ? std::to_string(r.first_oom->event_index) : "",
          r.conformance_checked ? std::to_string(r.segment_allocs_reproduced) : "",
          r.conformance_checked ? std::to_string(r.segment_allocs_recorded) : "",
          r.conformance_checked ? std::to_string(r.blocks_placed) : "",
          r.conformance_checked ? std::to_string(r.allocs_checked) : "",
          row.smallest && row.smallest->supported ? std::to_string(row.smallest->capacity) : "",
          i == base.index ? base.name : "", vs);
    }
    return;
  }
  std::cout << fmt::format("Replay of {} ({}, {} events) on {}\n", trace.source,
                           trace_format_name(trace.format), trace.events.size(), args.device);
  if (!rows.empty() && !rows.front().result.assumptions.empty())
    std::cout << "  device assumptions: " << rows.front().result.assumptions << "\n";
  const bool smallest = std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.smallest.has_value(); });
  std::vector<Column> cols{{"run", Align::Left},
           {"max allocated"},
           {"max reserved"},
           {"max nvidia-smi"},
           {"reserved/requested"},
           {"fragmentation"},
           {"cudaMalloc"},
           {"first OOM", Align::Left}};
  if (smallest) cols.push_back({"smallest GPU"});
  cols.push_back({"vs " + base.name, Align::Left});
  cols.push_back({"matches recording", Align::Left});
  Table t{cols};
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    const ReplayResult& r = row.result;
    if (!r.supported) {
      std::vector<std::string> cells{row.label, "—", "—", "—", "—", "—", "—", "—"};
      if (smallest) cells.push_back("—");
      cells.push_back("—");
      cells.push_back("not replayed: " + r.unsupported_reason);
      t.add_row(std::move(cells));
      continue;
    }
    std::vector<std::string> cells{row.label, human_bytes(r.peak_allocated), human_bytes(r.peak_reserved),
                                   human_bytes(r.peak_device_used), fmt::format("{:.3f}", r.reserved_per_requested),
                                   row.label.rfind("cub", 0) == 0 ? "—" : fmt::format("{:.1f}%", 100 * r.fragmentation),
                                   std::to_string(r.segment_allocs), oom_text(r)};
    if (smallest) {
      cells.push_back(!row.smallest ? "—"
                      : row.smallest->supported ? format_bytes(row.smallest->capacity)
                                                : "none");
    }
    cells.push_back(change_cell(rows, base, i));
    cells.push_back(conformance_text(r));
    t.add_row(std::move(cells));
  }
  std::cout << t.render("  ");
  if (base.name == "recorded") {
    std::cout << "  every run starts from the recorded state (the snapshot's segments and live blocks); \"vs recorded\"\n"
                 "  is max reserved, max nvidia-smi and cudaMalloc calls against the recorded setting's run"
              << (trace.allocator_conf_known ? "" : "\n  (the snapshot carries no allocator settings: recorded with the defaults, assumed)")
              << "\n";
  }
  // The answer first: the advice, then what explains the figures, the divergences last.
  if (const std::string a = advice(rows, base); !a.empty()) std::cout << "  " << a << "\n";
  for (const Row& row : rows) {
    const ReplayResult& r = row.result;
    if (!r.first_oom || row.label.rfind("cub", 0) == 0) continue;
    const ReplayOom& o = *r.first_oom;
    std::cout << fmt::format("  {}: first OOM at event {}: asked {}; {} reserved but free, the largest free block {}{}\n",
                             row.label, o.event_index, format_bytes(o.requested), format_bytes(o.free_bytes),
                             format_bytes(o.largest_free_block),
                             o.free_bytes >= o.requested ? " (enough memory in all, but fragmented)" : "");
    for (const ReplayOom::Segment& seg : o.fragmented) {
      std::cout << fmt::format("    segment {} of {}: {} free (largest {}), pinned by {} live block{} of {}\n",
                               format_address(seg.address), format_bytes(seg.size), format_bytes(seg.free_bytes),
                               format_bytes(seg.largest_free), seg.live_blocks, seg.live_blocks == 1 ? "" : "s",
                               format_bytes(seg.live_bytes));
      for (std::size_t k = 0; k < seg.pins.size() && k < 2; ++k) {  // the largest; JSON has up to 4
        const ReplayOom::Pin& p = seg.pins[k];
        std::cout << fmt::format("      {} at +{}{}\n", format_bytes(p.size), format_bytes(p.offset),
                                 p.stack.empty() ? "" : ", allocated in " + p.stack);
      }
    }
  }
  if (args.memory_fraction == 0) {
    for (const Row& row : rows) {
      if (row.result.config.find("garbage_collection_threshold") != std::string::npos) {
        std::cout << fmt::format(
            "  {}: garbage_collection_threshold acts only under a memory fraction "
            "(torch.cuda.set_per_process_memory_fraction); without --memory-fraction it changes nothing here\n",
            row.label);
      }
    }
  }
  if (smallest) {
    std::cout << "  smallest GPU: the least capacity (CUDA context included, in steps of the driver's\n"
                 "  granularity) on which the trace replays with no OOM under the row's setting, found by\n"
                 "  bisecting replays; the allocator frees its cache and retries under pressure, so it\n"
                 "  can be below max nvidia-smi.\n";
    std::map<std::size_t, std::size_t> capacities;  // smallest GPU -> rows that need it
    for (const Row& row : rows) {
      if (row.smallest && !row.smallest->supported)
        std::cout << fmt::format("  {}: no smallest GPU: {}\n", row.label, row.smallest->unsupported_reason);
      if (row.smallest && row.smallest->supported) ++capacities[row.smallest->capacity];
    }
    for (const auto& [capacity, n] : capacities) {
      std::cout << fmt::format("  {}{}: {}\n", format_bytes(capacity), capacities.size() > 1 || n < rows.size()
                                                                            ? fmt::format(" ({} run{})", n, n == 1 ? "" : "s")
                                                                            : "",
                               presets_with(capacity));
    }
  }
  for (const Row& row : rows) {
    const ReplayResult& r = row.result;
    if (r.unknown_frees > 0)
      std::cout << fmt::format("  {}: {} frees of blocks allocated before the trace began were skipped\n",
                               row.label, r.unknown_frees);
    for (const ReplayDivergence& d : r.divergences)
      std::cout << fmt::format("  {}: event {}: {}\n", row.label, d.event_index, d.what);
    if (r.divergence_count > r.divergences.size())
      std::cout << fmt::format("  {}: ... {} divergences in all\n", row.label, r.divergence_count);
  }
}

void run(const ReplayArgs& args) {
  if (args.format != "table" && args.format != "csv" && args.format != "json")
    throw UsageError("--format: '" + args.format + "' is not one of table, csv, json");
  std::vector<AllocatorConfig> configs;
  for (const std::string& c : args.confs)
    configs.push_back(as_usage("--alloc-conf", [&] { return AllocatorConfig::parse(c); }));
  if (configs.empty()) configs.emplace_back();
  const auto device = as_usage("--device", [&] { return make_device(args.device); });
  if (args.min_capacity && !device->info().simulated) {
    throw UsageError("--min-capacity: bisects a simulated device's capacity; give --device sim:<preset> (" +
                     device->info().name + " is a real GPU)");
  }
  for (const std::string& p : args.peers) {
    if (p != "cub" && p != "cub-default" && p != "cub-growth2")
      throw UsageError("--peer: '" + p + "' is not one of cub (both bin layouts), cub-default, cub-growth2");
    if (!VRAMSCOPE_REPLAY_CUB)
      throw UsageError("--peer " + p + ": this build has no CUB peer (it needs the CUDA toolkit's "
                       "headers, for replay/peers)");
  }

  AllocationTrace trace;
  try {
    trace = load_trace(args.file, args.trace_device);
  } catch (const Error& e) {
    // A trace that cannot be read is bad input, as a malformed model file is: exit 2.
    throw UsageError(one_line(e.what()));
  }
  if (args.trace_device >= 0 && (trace.format == TraceFormat::HistoryCsv || trace.format == TraceFormat::RmmCsv)) {
    throw UsageError("--trace-device: chooses a GPU of a PyTorch snapshot, which records each GPU's trace; " +
                     args.file + " is a " + std::string(trace_format_name(trace.format)) + " (one allocator's log)");
  }

  // The recorded setting is the baseline: replayed first when not asked for.
  // A snapshot without allocator_settings (PyTorch before 2.1) was recorded with the defaults
  // unless PYTORCH_CUDA_ALLOC_CONF said otherwise; the note under the table says so.
  Baseline base{0, "first"};
  if (trace.format == TraceFormat::PyTorchSnapshot) {
    try {
      const AllocatorConfig recorded =
          trace.allocator_conf_known ? AllocatorConfig::parse(trace.allocator_conf) : AllocatorConfig{};
      const auto at = std::find(configs.begin(), configs.end(), recorded);
      base.index = at == configs.end() ? 0 : static_cast<std::size_t>(at - configs.begin());
      if (at == configs.end()) configs.insert(configs.begin(), recorded);
      base.name = "recorded";
    } catch (const Error&) {
      // settings this allocator does not read: compare with the first run
    }
  }

  std::vector<Row> rows;
  for (const AllocatorConfig& config : configs) {
    ReplayOptions opt;
    opt.config = config;
    opt.device = args.device;
    opt.stop_at_oom = args.stop_at_oom;
    opt.memory_fraction = args.memory_fraction;
    const std::string conf = config.to_string();
    Row row{"vramscope (" + (conf.empty() ? std::string("default") : conf) + ")", replay(trace, opt), std::nullopt};
    if (args.min_capacity) row.smallest = smallest_capacity(trace, opt);
    rows.push_back(std::move(row));
  }
#if VRAMSCOPE_REPLAY_CUB
  for (const std::string& p : args.peers) {
    std::vector<bench::CubBins> layouts;
    if (p == "cub" || p == "cub-default") layouts.push_back(bench::CubBins::Default);
    if (p == "cub" || p == "cub-growth2") layouts.push_back(bench::CubBins::Growth2);
    for (bench::CubBins bins : layouts) {
      auto device = std::dynamic_pointer_cast<SimDevice>(make_device(args.device));
      if (!device) throw UsageError("--peer: CUB runs on a simulated device; give --device sim:...");
      bench::CubReplayTarget target{device, bins};
      rows.push_back({target.name(), replay_on(trace, target), std::nullopt, true});
    }
  }
#endif
  print(args, trace, rows, base);
}

}  // namespace

void add_replay_command(CLI::App& app) {
  auto args = std::make_shared<ReplayArgs>();
  CLI::App* cmd = app.add_subcommand(
      "replay",
      "Replay a recorded allocation trace (PyTorch memory snapshot pickle, vramscope history "
      "CSV, RMM log CSV) under one or more allocator settings and through CUB: peaks, "
      "fragmentation, the first OOM, and for a snapshot its match with the recording");
  cmd->add_option("file", args->file, "trace file")->required();
  cmd->add_option("--device", args->device,
                  "device to replay on: sim:<preset>, sim:capacity=...,context=..., cuda, auto")
      ->capture_default_str();
  cmd->add_option("-a,--alloc-conf", args->confs,
                  "allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax; repeat to compare side by "
                  "side (\"\" is PyTorch's default)")
      ->allow_extra_args(false);
  cmd->add_option("--peer", args->peers, "also replay through a peer: cub, cub-default, cub-growth2")
      ->allow_extra_args(false);
  cmd->add_option("--format", args->format, "table, csv or json")->capture_default_str();
  cmd->add_option("--trace-device", args->trace_device,
                  "which GPU's trace of a multi-GPU snapshot, 0 or more (default: the busiest)")
      ->check(integer_in(0, 1 << 20))  // written in full: 0x1 is refused as --batch's hex is
      ->type_name("N");
  cmd->add_flag("--stop-at-oom", args->stop_at_oom, "stop at the first allocation that does not fit");
  cmd->add_option("--memory-fraction", args->memory_fraction,
                  "replay under torch.cuda.set_per_process_memory_fraction(F), 0 < F <= 1: the allocator "
                  "refuses to reserve past F of the device, and garbage_collection_threshold acts")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            char* end = nullptr;
            const double f = std::strtod(text.c_str(), &end);
            const bool whole = !text.empty() && end == text.c_str() + text.size();
            return whole && f > 0 && f <= 1 ? std::string{}
                                            : "\"" + text + "\" is not a fraction above 0 and at most 1";
          },
          ""))
      ->type_name("F");
  cmd->add_flag("--min-capacity", args->min_capacity,
                "also find, for each setting, the smallest GPU the trace fits on: the least capacity of "
                "--device (same context and granularity) with no OOM, by bisecting replays");
  cmd->callback([args] { run(*args); });
}

}  // namespace mem::tools
