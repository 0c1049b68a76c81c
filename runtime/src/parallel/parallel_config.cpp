// parallel_config.cpp — --parallel and --parallel-options: an engine and its arguments,
// by the engine's own names, checked.
#include <algorithm>
#include <array>
#include <cctype>
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

/// transformers' DistributedConfig passes reshard_after_forward itself under expert parallel
/// (distributed/fsdp.py): an option saying otherwise does not apply.
void refuse_reshard_under_expert_parallel(const ParallelConfig& config) {
  if (config.expert_parallel > 1 && (config.reshard_after_forward || config.reshard_after_forward_to != 0)) {
    throw Error("reshard_after_forward with expert parallel: transformers' DistributedConfig passes its own (True for "
                "the experts, the layers and the embedding, False for the final norm with lm_head)");
  }
}

bool parse_bool(std::string_view key, std::string_view value) {
  if (value == "true" || value == "True" || value == "1") return true;
  if (value == "false" || value == "False" || value == "0") return false;
  throw Error(std::string(key) + "=" + std::string(value) + ": expected true or false");
}

/// offload_policy (fsdp) and offload_optimizer (zero): cpu or none; `cpu_means` says what moves.
bool parse_offload(std::string_view key, std::string_view value, std::string_view cpu_means) {
  if (value == "cpu") return true;
  if (value == "none") return false;
  throw Error(std::string(key) + "=" + std::string(value) + ": expected cpu (" + std::string(cpu_means) + ") or none");
}

constexpr std::string_view kDdpOptions =
    "bucket_cap_mb, gradient_as_bucket_view, broadcast_buffers, init_sync, static_graph, find_unused_parameters";
constexpr std::string_view kFsdpOptions =
    "reshard_after_forward, param_dtype, reduce_dtype, offload_policy, pin_memory, init, ep_size, rank";
constexpr std::string_view kZeroOptions = "reduce_bucket_size, overlap_comm, offload_optimizer, pin_memory, rank";
constexpr std::string_view kTpOptions = "sequence_parallel, loss_parallel, rank";
constexpr std::string_view kDpOptions = "gpu";
constexpr std::string_view kPpOptions = "schedule, layers_per_stage, microbatches, return_outputs, stage";
constexpr std::string_view kZero3Options =
    "reduce_bucket_size, overlap_comm, stage3_prefetch_bucket_size, stage3_param_persistence_threshold, "
    "stage3_model_persistence_threshold, stage3_max_live_parameters, stage3_max_reuse_distance, sub_group_size, "
    "zero3_init_flag, offload_optimizer, offload_param, pin_memory, rank";

/// Stage 3's counts of elements, by DeepSpeed's config keys: where each goes and its least value.
struct Stage3Count {
  std::string_view key;
  double ParallelConfig::*field;
  double lowest;
};
constexpr Stage3Count kStage3Counts[] = {
    {"stage3_prefetch_bucket_size", &ParallelConfig::prefetch_bucket_size, 0},
    {"stage3_param_persistence_threshold", &ParallelConfig::param_persistence_threshold, 0},
    {"stage3_model_persistence_threshold", &ParallelConfig::model_persistence_threshold, 0},
    {"stage3_max_live_parameters", &ParallelConfig::max_live_parameters, 0},
    {"stage3_max_reuse_distance", &ParallelConfig::max_reuse_distance, 0},
    {"sub_group_size", &ParallelConfig::sub_group_size, 1},
};

const Stage3Count* stage3_count(std::string_view key) {
  for (const Stage3Count& count : kStage3Counts) {
    if (count.key == key) return &count;
  }
  return nullptr;
}

/// A count of elements as DeepSpeed's config takes it (5e8, 500000000): at least `lowest`,
/// at most `highest`, a power of ten (1e19 holds its sys.maxsize defaults), whole.
double parse_elements(std::string_view key, std::string_view value, double lowest, double highest = 1e19) {
  double n = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n, std::chars_format::general);
  if (value.empty() || ec != std::errc{} || end != value.data() + value.size() || !std::isfinite(n) || n < lowest ||
      n > highest) {
    throw Error(std::string(key) + "=" + std::string(value) + ": expected elements, from " +
                (lowest > 0 ? "1" : "0") + " to 1e" + std::to_string(std::lround(std::log10(highest))));
  }
  return std::floor(n);
}

/// MixedPrecisionPolicy's dtypes: a floating type the runtime models.
DType parse_float_dtype(std::string_view key, std::string_view value) {
  DType dtype = DType::F32;
  try {
    dtype = parse_dtype(value);
  } catch (const Error&) {
    dtype = DType::U8;
  }
  if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16) {
    throw Error(std::string(key) + "=" + std::string(value) + ": expected bf16, f16 or f32");
  }
  return dtype;
}

std::size_t parse_count(std::string_view key, std::string_view value, std::size_t limit) {
  std::size_t n = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  if (value.empty() || ec != std::errc{} || end != value.data() + value.size() || n >= limit) {
    throw Error(std::string(key) + "=" + std::string(value) + ": expected a whole number below " +
                std::to_string(limit));
  }
  return n;
}

/// Each "key=value" of `options` (comma-separated, trimmed) handed to `take` in turn; a key at
/// most once. `keys` names the valid ones for the error of an item without "=".
template <class Take>
void for_each_option(std::string_view options, std::string_view keys, Take take) {
  std::vector<std::string_view> seen;
  for (std::size_t begin = 0; begin <= options.size();) {
    const std::size_t comma = std::min(options.find(',', begin), options.size());
    const std::string_view item = trim(options.substr(begin, comma - begin));
    begin = comma + 1;
    const std::size_t eq = item.find('=');
    if (item.empty() || eq == std::string_view::npos) {
      throw Error("'" + std::string(item) + "' is not key=value (keys: " + std::string(keys) + ")");
    }
    const std::string_view key = trim(item.substr(0, eq));
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) throw Error("'" + std::string(key) + "' is given twice");
    seen.push_back(key);
    take(key, trim(item.substr(eq + 1)));
    if (comma == options.size()) break;
  }
}

/// sequence_parallel=false: torchtitan's plan without SequenceParallel leaves the norms plain
/// tensors beside DTensor projections, and the foreach optimizers (the CUDA default) then raise
/// "got mixed torch.Tensor and DTensor" (torch 2.15).
void require_sequence_parallel(std::string_view key, std::string_view value) {
  if (!parse_bool(key, value)) {
    throw Error("sequence_parallel=false is not modelled: without it the norms stay plain tensors beside the "
                "DTensor projections, which PyTorch's foreach optimizers refuse (mixed torch.Tensor and DTensor)");
  }
}

/// pp:N's options, by torch.distributed.pipelining's names: the schedule class (as torchtitan's
/// pipeline_parallel_schedule names it), n_microbatches, step()'s return_outputs, and the stage.
ParallelConfig parse_pipeline_options(ParallelConfig config, std::string_view options) {
  if (trim(options).empty()) return config;
  for_each_option(options, kPpOptions, [&](std::string_view key, std::string_view value) {
    if (key == "schedule") {
      std::string name(value);
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      constexpr std::array kSchedules{PipelineSchedule::GPipe,
                                      PipelineSchedule::OneF1B,
                                      PipelineSchedule::Interleaved1F1B,
                                      PipelineSchedule::InterleavedZeroBubble,
                                      PipelineSchedule::ZBVZeroBubble,
                                      PipelineSchedule::DualPipeV};
      const auto named = std::find_if(kSchedules.begin(), kSchedules.end(),
                                      [&](PipelineSchedule s) { return schedule_name(s) == name; });
      if (named != kSchedules.end()) {
        config.schedule = *named;
      } else if (name == "loopedbfs") {
        throw Error("schedule=" + std::string(value) + " is not modelled yet; gpipe, 1f1b, interleaved1f1b, "
                    "interleavedzerobubble, zbvzerobubble and dualpipev are");
      } else {
        throw Error("schedule=" + std::string(value) + ": expected gpipe, 1f1b, interleaved1f1b, interleavedzerobubble, "
                    "zbvzerobubble or dualpipev (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, "
                    "ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)");
      }
    } else if (key == "layers_per_stage") {
      config.layers_per_stage = parse_count(key, value, kMaxMicrobatches + 1);
      if (config.layers_per_stage == 0) throw Error("layers_per_stage=0: a stage holds at least one layer");
    } else if (key == "microbatches") {
      config.microbatches = parse_count(key, value, kMaxMicrobatches + 1);
      if (config.microbatches == 0) throw Error("microbatches=0: a schedule runs at least one micro-batch");
    } else if (key == "return_outputs") {
      config.return_outputs = parse_bool(key, value);
    } else {
      // stage=S: checked against the stage count.
      std::size_t stage = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), stage);
      if (value.empty() || ec != std::errc{} || end != value.data() + value.size() || stage >= config.pipeline_parallel) {
        throw Error("stage=" + std::string(value) + ": pp:" + std::to_string(config.pipeline_parallel) +
                    " has stages 0 to " + std::to_string(config.pipeline_parallel - 1));
      }
      config.stage = stage;
      config.stage_chosen = true;
    }
  });
  return config;
}

bool is_pipeline_option(std::string_view item) {
  const std::string_view key = trim(item.substr(0, item.find('=')));
  return key == "schedule" || key == "layers_per_stage" || key == "microbatches" || key == "return_outputs" ||
         key == "stage";
}

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
  // A mesh, outer to inner: "fsdp:8xtp:8" (a count, then x and the next engine's name).
  std::vector<std::string_view> dims;
  for (std::size_t start = 0, i = 1; i <= spec.size(); ++i) {
    if (i == spec.size() || (spec[i] == 'x' && spec[i - 1] >= '0' && spec[i - 1] <= '9' && i + 1 < spec.size() &&
                             spec[i + 1] >= 'a' && spec[i + 1] <= 'z')) {
      dims.push_back(spec.substr(start, i - start));
      start = i + 1;
    }
  }
  // Each dimension's "name:N", its count checked.
  const auto count_of = [](std::string_view dim, std::string_view name) {
    const std::size_t colon = dim.find(':');
    const std::string_view count = colon == std::string_view::npos ? std::string_view{} : dim.substr(colon + 1);
    std::size_t n = 0;
    const auto [end, ec] = std::from_chars(count.data(), count.data() + count.size(), n);
    if (count.empty() || ec != std::errc{} || end != count.data() + count.size() || n < 1 || n > kMaxWorldSize) {
      throw Error("'" + std::string(dim) + "': the number of GPUs must be a whole number from 1 to " +
                  std::to_string(kMaxWorldSize) + ", e.g. " + std::string(name) + ":8");
    }
    return n;
  };
  const auto name_of = [](std::string_view dim) { return dim.substr(0, dim.find(':')); };
  for (const std::string_view dim : dims) {
    if (name_of(dim) == "ep" && dims.size() > 1) {
      throw Error("'" + std::string(spec) + "': expert parallel is modelled alone, ep:N (transformers' "
                  "DistributedConfig(fsdp_size=N, ep_size=N)), or inside FSDP2's GPUs as fsdp:M with the option "
                  "ep_size=N (N dividing M); with tp, cp or pp it is not yet");
    }
  }
  if (name_of(dims.front()) == "ep") {
    // ep:N: FSDP2 over the N GPUs with each expert on one of them (efsdp = 1).
    const std::size_t ranks = count_of(dims.front(), "ep");
    if (ranks == 1) throw Error("'" + std::string(spec) + "': ep:1 splits no experts; give ep:2 or more");
    const std::string fsdp = "fsdp:" + std::to_string(ranks);
    ParallelConfig config = parse_parallel(fsdp, options);
    if (config.expert_parallel != 1 && config.expert_parallel != ranks) {
      throw Error("ep_size=" + std::to_string(config.expert_parallel) + ": ep:" + std::to_string(ranks) + " is " +
                  std::to_string(ranks) + " ranks of experts; give ep_size with fsdp:M instead");
    }
    config.expert_parallel = ranks;
    refuse_reshard_under_expert_parallel(config);
    return config;
  }
  if (name_of(dims.front()) == "pp") {
    // Pipeline stages outermost; inside each stage the rest of the mesh (fsdp:M, tp:K,
    // fsdp:MxTP:K) as it is parsed alone, the pipeline's options taken out of the list first.
    const std::size_t stages = count_of(dims.front(), "pp");
    if (stages == 1) {
      throw Error("'" + std::string(spec) + "': pp:1 is a single stage; give pp:2 or more (or leave pp out)");
    }
    std::string pipeline_options, inner_options;
    for (std::size_t begin = 0; begin < options.size();) {
      const std::size_t comma = std::min(options.find(',', begin), options.size());
      const std::string_view item = options.substr(begin, comma - begin);
      std::string& to = is_pipeline_option(item) ? pipeline_options : inner_options;
      if (!to.empty()) to += ',';
      to += item;
      begin = comma + 1;
    }
    const std::string_view inner = dims.size() > 1 ? spec.substr(dims[1].data() - spec.data()) : std::string_view{};
    if (inner.empty() && !trim(inner_options).empty()) {
      for_each_option(inner_options, kPpOptions, [&](std::string_view key, std::string_view) {
        throw Error("'" + std::string(key) + "' is not an option of pp (keys: " + std::string(kPpOptions) + ")");
      });
    }
    ParallelConfig config;
    try {
      if (!inner.empty()) config = parse_parallel(inner, inner_options);
    } catch (const Error& e) {
      const std::string what = e.what();
      if (what.find("is not an option of") == std::string::npos) throw;
      throw Error(what.substr(0, what.size() - 1) + "; pp's: " + std::string(kPpOptions) + ")");
    }
    if (config.context_parallel > 1 || config.expert_parallel > 1) {
      throw Error("'" + std::string(spec) + "': " + (config.context_parallel > 1 ? "context" : "expert") +
                  " parallel inside pipeline stages is not modelled yet");
    }
    if (config.engine != ParallelEngine::None && config.engine != ParallelEngine::Fsdp) {
      throw Error("'" + std::string(spec) + "': inside pipeline stages the meshes modelled are tp:K, fsdp:M and "
                  "fsdp:MxTP:K (torchtitan's layouts); " + std::string(name_of(dims[1])) + " is not yet");
    }
    config.pipeline_parallel = stages;
    config = parse_pipeline_options(config, pipeline_options);
    return config;
  }
  if (name_of(dims.back()) == "tp") {
    config.tensor_parallel = count_of(dims.back(), "tp");
    dims.pop_back();
  }
  if (!dims.empty() && name_of(dims.back()) == "cp") {
    // Context parallel inside FSDP2, as torchtitan lays it out (tensor parallel, if any,
    // innermost): cp:C alone is FSDP2 over the C GPUs (its dp_shard_cp mesh), fsdp:MxCP:C
    // shards over M x C.
    config.context_parallel = count_of(dims.back(), "cp");
    dims.pop_back();
    if (config.context_parallel == 1) throw Error("'" + std::string(spec) + "': cp:1 is no ring; give cp:2 or more");
    if (dims.empty()) {
      dims.push_back("fsdp:1");
    } else if (dims.size() > 1 || name_of(dims.front()) != "fsdp") {
      throw Error("'" + std::string(spec) + "': context parallel is modelled inside FSDP2 (cp:C, fsdp:MxCP:C, "
                  "with tp:K innermost, torchtitan's layout); " + std::string(name_of(dims.front())) +
                  " with cp is not yet");
    }
  }
  if (dims.size() > 1 || (!dims.empty() && name_of(dims.front()) == "tp")) {
    throw Error("'" + std::string(spec) + "': the meshes modelled are tp:N and fsdp:MxTP:N (FSDP2 over tensor "
                "parallel, torchtitan's 2-D layout, tp innermost), cp:C and fsdp:MxCP:C (context parallel inside "
                "FSDP2), pp:N, pp:NxTP:K, pp:NxFSDP:M and pp:NxFSDP:MxTP:K (pipeline stages outermost), and ep:N "
                "(expert parallel)");
  }
  const std::string_view dim = dims.empty() ? std::string_view{} : dims.front();
  const std::string_view engine = name_of(dim);
  if (engine == "fsdp1") {
    // Named by users, not simulated yet: say so rather than "unknown".
    throw Error("fsdp1 is not modelled yet; fsdp:N (FSDP2's fully_shard) shards parameters, gradients and "
                "optimizer state alike, and zero3:N is DeepSpeed's stage 3, which does too");
  }
  if (engine == "dp") {
    // torch.nn.DataParallel: one process over N GPUs, alone (it does not nest in meshes).
    if (config.tensor_parallel > 1) {
      throw Error("'" + std::string(spec) + "': dp (nn.DataParallel) runs alone, not in a mesh; give dp:N");
    }
    config.engine = ParallelEngine::Dp;
    config.world_size = count_of(dim, engine);
    if (config.world_size == 1) {
      throw Error("'" + std::string(spec) + "': nn.DataParallel over one GPU calls the module as it is; leave "
                  "--parallel out (or give dp:2 or more)");
    }
    if (no_options) return config;
    for_each_option(options, kDpOptions, [&](std::string_view key, std::string_view value) {
      if (key != "gpu") {
        throw Error("'" + std::string(key) + "' is not an option of dp (keys: " + std::string(kDpOptions) + ")");
      }
      config.rank = parse_count(key, value, config.world_size);
    });
    return config;
  }
  if (!dim.empty() && engine != "ddp" && engine != "fsdp" && engine != "zero1" && engine != "zero2" &&
      engine != "zero3") {
    throw Error("unknown engine '" + std::string(engine) +
                "'; expected dp:N (nn.DataParallel over N GPUs of one process), ddp:N (DistributedDataParallel "
                "on N GPUs), fsdp:N (FSDP2's fully_shard "
                "on N GPUs), zero1:N, zero2:N or zero3:N (DeepSpeed's ZeRO stage 1, 2 or 3), tp:N (tensor "
                "and sequence parallel over N GPUs), fsdp:MxTP:N, cp:N and fsdp:MxCP:N (context parallel), pp:N (pipeline stages on N GPUs), ep:N "
                "(expert parallel, a mixture of experts recorded with vramscope.export --expert-parallel N), or none");
  }
  if (!dim.empty() && config.tensor_parallel > 1 && engine != "fsdp") {
    throw Error("'" + std::string(spec) + "': " + std::string(engine) + " with tensor parallel is not modelled; "
                "fsdp:MxTP:N is (FSDP2 shards the tensor-parallel shards, torchtitan's 2-D layout)");
  }
  config.engine = dim.empty()         ? ParallelEngine::None
                  : engine == "ddp"   ? ParallelEngine::Ddp
                  : engine == "fsdp"  ? ParallelEngine::Fsdp
                  : engine == "zero1" ? ParallelEngine::Zero1
                  : engine == "zero2" ? ParallelEngine::Zero2
                                      : ParallelEngine::Zero3;
  const bool ddp = config.engine == ParallelEngine::Ddp;
  const bool stage3 = config.engine == ParallelEngine::Zero3;
  const bool zero = config.engine == ParallelEngine::Zero1 || config.engine == ParallelEngine::Zero2 || stage3;
  const bool tp = config.tensor_parallel > 1;
  const bool tp_only = dim.empty();
  const std::string keys = std::string(ddp      ? kDdpOptions
                                       : stage3 ? kZero3Options
                                       : zero   ? kZeroOptions
                                       : tp_only ? kTpOptions
                                                 : kFsdpOptions) +
                           (tp && !tp_only ? ", sequence_parallel, loss_parallel" : "") +
                           (config.context_parallel > 1 ? ", cp_rotate_method, cp_load_balance" : "");
  if (!dim.empty()) config.world_size = count_of(dim, engine) * config.context_parallel;
  if (config.context_parallel > 1 && config.world_size * config.tensor_parallel > kMaxWorldSize) {
    throw Error("'" + std::string(spec) + "': " + std::to_string(config.world_size * config.tensor_parallel) +
                " GPUs in all; the meshes modelled have at most " + std::to_string(kMaxWorldSize));
  }
  if (no_options) return config;

  for_each_option(options, keys, [&](std::string_view key, std::string_view value) {
    if (!ddp && key == "rank") {
      // The rank of the outer engine; of the tensor-parallel group when it is alone.
      config.rank = parse_count(key, value, tp_only ? config.tensor_parallel : config.world_size);
    } else if (config.context_parallel > 1 && key == "cp_rotate_method") {
      if (value != "allgather" && value != "alltoall") {
        throw Error("cp_rotate_method=" + std::string(value) + ": expected allgather (one all-gather of K and V, "
                    "the default) or alltoall (one all-to-all per step of the ring)");
      }
      config.cp_all_to_all = value == "alltoall";
    } else if (config.context_parallel > 1 && key == "cp_load_balance") {
      config.cp_load_balance = parse_bool(key, value);
    } else if (tp && key == "loss_parallel") {
      config.loss_parallel = parse_bool(key, value);
    } else if (tp_only && key != "sequence_parallel") {
      throw Error("'" + std::string(key) + "' is not an option of tp (keys: " + std::string(kTpOptions) + ")");
    } else if (tp && key == "sequence_parallel") {
      require_sequence_parallel(key, value);
    } else if (zero) {
      if (key == "reduce_bucket_size") {
        // DeepSpeed takes a number of elements (5e8 by default): decimal or scientific.
        config.reduce_bucket_size = parse_elements(key, value, 1, 1e12);
      } else if (key == "overlap_comm") {
        config.overlap_comm = parse_bool(key, value);
      } else if (key == "offload_optimizer") {
        config.cpu_offload = parse_offload(key, value,
                                           "the fp32 master weights, their gradients and Adam's state on the host, "
                                           "DeepSpeedCPUAdam stepping there");
      } else if (key == "pin_memory") {
        config.offload_pin_memory = parse_bool(key, value);
      } else if (key == "offload_param") {
        if (!stage3) {
          throw Error("offload_param is ZeRO stage 3's (its parameters' partitions on the host); stages 1 and 2 "
                      "keep every parameter whole on each GPU: give zero3:N, or offload_optimizer=cpu");
        }
        config.offload_param = parse_offload(key, value, "each parameter's partition on the host, copied to the GPU "
                                                         "for each gather");
      } else if (const Stage3Count* count = stage3 ? stage3_count(key) : nullptr) {
        config.*count->field = parse_elements(key, value, count->lowest);
      } else if (stage3 && key == "zero3_init_flag") {
        config.zero3_init = parse_bool(key, value);
      } else {
        throw Error("'" + std::string(key) + "' is not an option of " + std::string(engine) +
                    " (keys: " + std::string(stage3 ? kZero3Options : kZeroOptions) + ")");
      }
    } else if (!ddp) {
      if (key == "reshard_after_forward") {
        // A bool, or an int: the group size to reshard to, a factor of N (_fsdp_init.py,
        // _get_post_forward_mesh_info): 1 means False, N means True.
        std::size_t k = 0;
        const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), k);
        if (!value.empty() && ec == std::errc{} && end == value.data() + value.size()) {
          if (k < 1 || k > config.world_size || config.world_size % k != 0) {
            throw Error("reshard_after_forward=" + std::string(value) + ": as an int it should be a factor of " +
                        std::to_string(config.world_size) + " (the group size to reshard to)");
          }
          config.reshard_after_forward = k > 1;
          if (k > 1 && k < config.world_size) config.reshard_after_forward_to = k;
        } else {
          config.reshard_after_forward = parse_bool(key, value);
        }
      } else if (key == "param_dtype") {
        config.param_dtype = parse_float_dtype(key, value);
      } else if (key == "reduce_dtype") {
        config.reduce_dtype = parse_float_dtype(key, value);
      } else if (key == "offload_policy") {
        config.cpu_offload =
            parse_offload(key, value, "CPUOffloadPolicy: shards, gradients and the optimizer on the host");
      } else if (key == "pin_memory") {
        config.offload_pin_memory = parse_bool(key, value);
      } else if (key == "ep_size") {
        // DistributedConfig's ep_size: it must divide fsdp_size * tp_size (configuration_utils.py).
        const std::size_t n = parse_count(key, value, kMaxWorldSize + 1);
        if (n < 2 || config.world_size % n != 0) {
          throw Error("ep_size=" + std::string(value) + ": expected a divisor of " + std::to_string(config.world_size) +
                      " from 2 (the experts' ranks among FSDP2's; transformers' DistributedConfig)");
        }
        if (config.tensor_parallel > 1 || config.context_parallel > 1) {
          throw Error("ep_size with tp or cp is not modelled yet; expert parallel runs inside fsdp:M alone");
        }
        config.expert_parallel = n;
      } else if (key == "init") {
        if (value != "meta" && value != "cuda") {
          throw Error("init=" + std::string(value) +
                      ": expected meta (built on the meta device, materialized sharded) or cuda (built whole on "
                      "the GPU, then sharded)");
        }
        config.meta_init = value == "meta";
      } else {
        throw Error("'" + std::string(key) + "' is not an option of fsdp (keys: " + keys + ")");
      }
    } else if (key == "bucket_cap_mb") {
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
  });
  refuse_reshard_under_expert_parallel(config);
  if (!config.offload_pin_memory && !config.cpu_offload && !config.offload_param) {
    throw Error("pin_memory=false applies to what is offloaded: give offload_policy=cpu (fsdp), "
                "offload_optimizer=cpu (zero1, zero2, zero3) or offload_param=cpu (zero3) with it");
  }
  return config;
}

std::string_view schedule_name(PipelineSchedule schedule) noexcept {
  switch (schedule) {
    case PipelineSchedule::GPipe: return "gpipe";
    case PipelineSchedule::OneF1B: return "1f1b";
    case PipelineSchedule::Interleaved1F1B: return "interleaved1f1b";
    case PipelineSchedule::InterleavedZeroBubble: return "interleavedzerobubble";
    case PipelineSchedule::ZBVZeroBubble: return "zbvzerobubble";
    case PipelineSchedule::DualPipeV: return "dualpipev";
  }
  return "1f1b";
}

bool multi_stage(PipelineSchedule schedule) noexcept {
  return schedule != PipelineSchedule::GPipe && schedule != PipelineSchedule::OneF1B;
}

bool v_shaped(PipelineSchedule schedule) noexcept {
  return schedule == PipelineSchedule::ZBVZeroBubble || schedule == PipelineSchedule::DualPipeV;
}

std::size_t pipeline_stage_of(PipelineSchedule schedule, std::size_t ranks, std::size_t rank, std::size_t k) noexcept {
  // stage_ids_this_rank: "loop" r, r + P, ...; "v" r and 2P - 1 - r.
  return v_shaped(schedule) && k == 1 ? 2 * ranks - 1 - rank : rank + k * ranks;
}

std::size_t pipeline_rank_of(PipelineSchedule schedule, std::size_t ranks, std::size_t stage) noexcept {
  // generate_stage_to_rank_mapping(style="v") for ZBV and DualPipeV, "loop" for the others.
  if (v_shaped(schedule) && stage >= ranks) return 2 * ranks - 1 - stage;
  return stage % ranks;
}

std::string parallel_label(const ParallelConfig& config) {
  if (!config.enabled()) return "none";
  if (config.pipeline_parallel > 1) {
    // "pp:N", then the stage's mesh and its options as they read alone, then the pipeline's.
    ParallelConfig inner = config;
    inner.pipeline_parallel = 1;
    const std::string within = inner.enabled() ? parallel_label(inner) : std::string{};
    const std::size_t space = within.find(' ');
    std::string out = "pp:" + std::to_string(config.pipeline_parallel) + (within.empty() ? "" : "x" + within.substr(0, space));
    std::string options = space == std::string::npos ? std::string{} : within.substr(space);
    const auto add = [&](const std::string& item) { options += (options.empty() ? " " : ",") + item; };
    if (config.schedule != PipelineSchedule::OneF1B) add("schedule=" + std::string(schedule_name(config.schedule)));
    if (config.layers_per_stage != 0) add("layers_per_stage=" + std::to_string(config.layers_per_stage));
    if (config.microbatches != 0) add("microbatches=" + std::to_string(config.microbatches));
    if (!config.return_outputs) add("return_outputs=false");
    if (config.stage != 0) add("stage=" + std::to_string(config.stage));
    return out + options;
  }
  const bool ddp = config.engine == ParallelEngine::Ddp;
  if (config.engine == ParallelEngine::Dp) {
    return "dp:" + std::to_string(config.world_size) + (config.rank != 0 ? " gpu=" + std::to_string(config.rank) : "");
  }
  const char* names[] = {"none:", "ddp:", "fsdp:", "zero1:", "zero2:", "zero3:"};
  std::string out = config.engine == ParallelEngine::None
                        ? std::string{}
                        : names[static_cast<int>(config.engine)] + std::to_string(config.world_size);
  if (config.context_parallel > 1) {
    const std::size_t shard = config.world_size / config.context_parallel;
    out = (shard > 1 ? "fsdp:" + std::to_string(shard) + "x" : std::string{}) + "cp:" + std::to_string(config.context_parallel);
  }
  if (config.tensor_parallel > 1) out += (out.empty() ? "tp:" : "xtp:") + std::to_string(config.tensor_parallel);
  if (config.expert_parallel > 1 && config.expert_parallel == config.world_size) out = "ep:" + std::to_string(config.world_size);
  std::string options;
  const auto add = [&](const std::string& item) { options += (options.empty() ? " " : ",") + item; };
  if (config.engine == ParallelEngine::Zero1 || config.engine == ParallelEngine::Zero2 ||
      config.engine == ParallelEngine::Zero3) {
    const ParallelConfig defaults;
    const auto elements = [&](const char* key, double value, double default_value) {
      if (value != default_value) add(std::string(key) + "=" + std::to_string(static_cast<unsigned long long>(value)));
    };
    elements("reduce_bucket_size", config.reduce_bucket_size, defaults.reduce_bucket_size);
    if (config.overlap_comm) add(std::string("overlap_comm=") + (*config.overlap_comm ? "true" : "false"));
    for (const Stage3Count& count : kStage3Counts) {
      elements(count.key.data(), config.*count.field, defaults.*count.field);
    }
    if (!config.zero3_init) add("zero3_init_flag=false");
    if (config.cpu_offload) add("offload_optimizer=cpu");
    if (config.offload_param) add("offload_param=cpu");
    if (!config.offload_pin_memory) add("pin_memory=false");
    if (config.rank != 0) add("rank=" + std::to_string(config.rank));
    return out + options;
  }
  if (config.tensor_parallel > 1 && !config.loss_parallel) add("loss_parallel=false");
  if (config.cp_all_to_all) add("cp_rotate_method=alltoall");
  if (!config.cp_load_balance) add("cp_load_balance=false");
  if (config.engine == ParallelEngine::None) {
    if (config.rank != 0) add("rank=" + std::to_string(config.rank));
    return out + options;
  }
  if (!ddp) {
    if (config.reshard_after_forward_to != 0) {
      add("reshard_after_forward=" + std::to_string(config.reshard_after_forward_to));
    } else if (config.reshard_after_forward) {
      add(std::string("reshard_after_forward=") + (*config.reshard_after_forward ? "true" : "false"));
    }
    if (config.param_dtype) add("param_dtype=" + std::string(dtype_name(*config.param_dtype)));
    if (config.reduce_dtype) add("reduce_dtype=" + std::string(dtype_name(*config.reduce_dtype)));
    if (config.cpu_offload) add("offload_policy=cpu");
    if (!config.offload_pin_memory) add("pin_memory=false");
    if (!config.meta_init) add("init=cuda");
    if (config.expert_parallel > 1 && config.expert_parallel != config.world_size) {
      add("ep_size=" + std::to_string(config.expert_parallel));
    }
    if (config.rank != 0) add("rank=" + std::to_string(config.rank));
    return out + options;
  }
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
