// gpu_reference_test.cpp — vramscope's predictions against what PyTorch 2.11 measured on a
// real H100 (../shared/gpu-reference/, its README says how each row was run), under the
// stack that reference ran: max allocated within 1% (or 16 MiB), allocated after the step
// within 4 MiB, max reserved within 3%. The figures not yet matched are listed in kOpen
// with the bound they hold today and what was found (docs/VALIDATION.md): a regression past
// that bound fails, and so does an open figure that comes within the target (drop it from
// the list). Skips where the reference files are absent.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "csv_rows.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::models {
namespace {

namespace fs = std::filesystem;
using test::read_csv;
constexpr double kMiB = 1024.0 * 1024.0;

fs::path reference_dir() {
  if (const char* env = std::getenv("VRAMSCOPE_GPU_REFERENCE")) return env;
  return VRAMSCOPE_GPU_REFERENCE;
}


enum class Figure { MaxAllocated, AllocatedAfter, MaxReserved, OutsideAllocator };

/// A figure that misses its target today: the bound it holds (percent, or MiB for the
/// allocated-after figure) and why (docs/VALIDATION.md, "Not yet matched").
struct Open {
  const char* id;
  Figure figure;
  double bound;
  const char* why;
};
constexpr Open kOpen[] = {
    {"L1-gc", Figure::MaxReserved, 7.0,
     "non-reentrant checkpointing: PyTorch reserves one more f32-logits-sized (1002 MiB) block; max "
     "allocated is exact, so the live bytes are right and the difference is where blocks land"},
    {"L1-ampbf16", Figure::MaxReserved, 4.5,
     "amp-bf16 built on the GPU: vramscope reserves about one f32-logits-sized block more"},
    {"Q05-full", Figure::AllocatedAfter, 5.0,
     "+4.4 MiB of block slack in the weights, gradients or Adam state of the tied-embedding model"},
    {"TV-vit", Figure::MaxAllocated, 2.0,
     "-61 MiB; the CPU's ViT under autocast keeps what vramscope keeps within 11 MiB at batch 8, so the "
     "gap is CUDA's (cuDNN's patch-embedding convolution or the SDPA kernel choice)"},
    {"TV-vit", Figure::MaxReserved, 5.5, "follows the max allocated gap"},
    {"TV-r50", Figure::MaxReserved, 6.5,
     "cuDNN's workspaces: the real snapshot shows 288 of them, up to 302 MiB, chosen by cuDNN's "
     "heuristics per shape (run_conv_plan); vramscope's convolutions take im2col columns instead"},
    {"mlp depth 256 width 512 b16384 f32, 2 steps segments 16", Figure::MaxAllocated, 2.5,
     "-49 MiB at 16 segments and -64 MiB without (within 1%): about two activations more on CUDA; the "
     "CPU's step keeps exactly what vramscope keeps"},
};

const Open* open_figure(const std::string& id, Figure figure) {
  for (const Open& o : kOpen) {
    if (id == o.id && figure == o.figure) return &o;
  }
  return nullptr;
}

/// One training run's figures, measured or predicted. outside: nvidia-smi's figure after
/// the step less what the allocator reserves (the CUDA context and the libraries' kernels).
struct StepFigures {
  std::int64_t max_allocated, allocated_after, max_reserved, outside;
};

std::int64_t number(const std::map<std::string, std::string>& row, const std::string& key) {
  return std::stoll(row.at(key));
}

/// What PyTorch reported for a reference row (both files share these columns).
StepFigures measured(const std::map<std::string, std::string>& row) {
  return {number(row, "max_allocated"), number(row, "allocated_after_step"), number(row, "max_reserved"),
          number(row, "nvidia_smi_after_step") - number(row, "reserved_after_step")};
}

StepFigures predict(nn::TrainConfig cfg) {
  cfg.device = "sim:h100-80g";
  cfg.stack = nn::Stack::parse("torch=2.11,transformers=5.17,peft=0.21");
  const nn::TrainReport r = nn::train(cfg);
  const nn::StepStats& last = r.steps.back();
  return {r.peak_allocated, last.allocated_end, r.peak_reserved, last.device_used_end - last.reserved_end};
}

/// One figure against its target, or against its open bound (which it must still miss the
/// target by: an open figure that meets the target is to be dropped from kOpen).
void expect_figure(const std::string& id, Figure figure, double error, double target, const std::string& what) {
  if (const Open* o = open_figure(id, figure)) {
    EXPECT_LE(std::abs(error), o->bound) << id << ": " << what << " regressed past its open bound (" << o->why << ")";
    EXPECT_GT(std::abs(error), target) << id << ": " << what << " now meets the target: drop it from kOpen";
    return;
  }
  EXPECT_LE(std::abs(error), target) << id << ": " << what;
}

/// Every figure against its tolerance; the message shows both sides in MiB.
void expect_close(const std::string& id, const StepFigures& m, const StepFigures& p) {
  const auto mib = [](std::int64_t b) { return static_cast<double>(b) / kMiB; };
  // The row as docs/VALIDATION.md tabulates it: measured / predicted, MiB.
  std::printf("  %-16s max alloc %9.0f / %9.0f (%+6.2f%%)  after %8.1f / %8.1f  max reserved %9.0f / %9.0f (%+6.2f%%)"
              "  smi-reserved %6.1f / %6.1f\n",
              id.c_str(), mib(m.max_allocated), mib(p.max_allocated),
              100.0 * static_cast<double>(p.max_allocated - m.max_allocated) / static_cast<double>(m.max_allocated),
              mib(m.allocated_after), mib(p.allocated_after), mib(m.max_reserved), mib(p.max_reserved),
              100.0 * static_cast<double>(p.max_reserved - m.max_reserved) / static_cast<double>(m.max_reserved),
              mib(m.outside), mib(p.outside));
  const auto percent = [](std::int64_t predicted, std::int64_t measured) {
    return 100.0 * static_cast<double>(predicted - measured) / static_cast<double>(measured);
  };
  const auto both = [&](const char* what, std::int64_t predicted, std::int64_t measured) {
    return std::string(what) + " " + std::to_string(mib(predicted)) + " MiB predicted, " +
           std::to_string(mib(measured)) + " MiB measured";
  };
  // Max allocated: 1%, or 16 MiB where that is more.
  const double peak_target = std::max(1.0, 100.0 * 16 * kMiB / static_cast<double>(m.max_allocated));
  expect_figure(id, Figure::MaxAllocated, percent(p.max_allocated, m.max_allocated), peak_target,
                both("max allocated", p.max_allocated, m.max_allocated));
  expect_figure(id, Figure::AllocatedAfter, mib(p.allocated_after - m.allocated_after), 4.0,
                both("allocated after the step", p.allocated_after, m.allocated_after));
  expect_figure(id, Figure::MaxReserved, percent(p.max_reserved, m.max_reserved), 3.0,
                both("max reserved", p.max_reserved, m.max_reserved));
  // The nvidia-smi view beyond the segments: the context and the libraries' kernels, within
  // 4 MiB (the further cuDNN kernels of the CNNs are not modelled).
  expect_figure(id, Figure::OutsideAllocator, mib(p.outside - m.outside), 4.0,
                both("nvidia-smi beyond the reserved segments", p.outside, m.outside));
}

TEST(GpuReference, TrainingStepsOfTransformersAndTorchvisionMatchTheH100) {
  const fs::path file = reference_dir() / "h100-2026-11-26-training-steps.csv";
  if (!fs::exists(file)) GTEST_SKIP() << file << " is absent";
  const auto rows = read_csv(file);
  ASSERT_GE(rows.size(), 12u);
  for (const auto& row : rows) {
    const std::string& id = row.at("id");
    SCOPED_TRACE(id);
    nn::TrainConfig cfg;
    const std::string& model = row.at("model");
    const std::string& dtype = row.at("dtype");
    cfg.model_options.batch = number(row, "batch");
    cfg.alloc_conf = row.at("alloc_conf");
    if (model.starts_with("llama") || model.starts_with("qwen")) {
      cfg.model = load_hf_config(std::string(VRAMSCOPE_SOURCE_DIR) + "/models/zoo/hf/" + model + ".json");
      cfg.model_options.seq = number(row, "seq");
      cfg.model_options.attention = row.at("attn");
      if (row.at("built_on") == "gpu") cfg.model_options.built_on = "gpu";
      if (row.at("gradient_checkpointing") != "none") cfg.model_options.checkpoint = row.at("gradient_checkpointing");
      if (row.at("lora") != "0") {
        cfg.model_options.lora = number(row, "lora");
        cfg.model_options.lora_targets = row.at("lora_targets");
      }
    } else {
      cfg.model = find(model);
    }
    // The reference's "amp" is autocast f16 (torch.autocast("cuda", torch.float16)).
    cfg.precision = nn::parse_precision(dtype);
    expect_close(id, measured(row), predict(cfg));
  }
}

TEST(GpuReference, TheMlpSweepRowsMatchTheH100) {
  const fs::path file = reference_dir() / "h100-2026-11-26-pytorch_sweep.csv";
  if (!fs::exists(file)) GTEST_SKIP() << file << " is absent";
  int checked = 0;
  for (const auto& row : read_csv(file)) {
    if (row.at("model") != "mlp" || row.at("allocator") != "torch") continue;
    const std::string id = row.at("run") + " segments " + row.at("segments");
    SCOPED_TRACE(id);
    nn::TrainConfig cfg;
    cfg.model = find("mlp");
    cfg.model_options = nn::ModelOptions::parse("depth=256,width=512,batch=16384");
    cfg.precision = nn::parse_precision(row.at("dtype"));
    cfg.segments = std::max<std::int64_t>(number(row, "segments"), 1);
    cfg.steps = static_cast<std::size_t>(number(row, "steps"));
    expect_close(id, measured(row), predict(cfg));
    ++checked;
  }
  EXPECT_EQ(checked, 2);
}

// An open figure names a row of the reference: a renamed or dropped row fails here rather
// than leaving a bound nothing checks.
TEST(GpuReference, EveryOpenFigureIsARowOfTheReference) {
  const fs::path steps = reference_dir() / "h100-2026-11-26-training-steps.csv";
  const fs::path sweep = reference_dir() / "h100-2026-11-26-pytorch_sweep.csv";
  if (!fs::exists(steps) || !fs::exists(sweep)) GTEST_SKIP() << "the reference files are absent";
  std::set<std::string> ids;
  for (const auto& row : read_csv(steps)) ids.insert(row.at("id"));
  for (const auto& row : read_csv(sweep)) ids.insert(row.at("run") + " segments " + row.at("segments"));
  for (const Open& o : kOpen) EXPECT_TRUE(ids.contains(o.id)) << o.id << " is no row of the reference";
}

// The H100 recording (tests/data/h100-parallel-2026-11-26): the defaults' run
// (parallel_reference.py) and the options' (its --variants, rank 0 each), their CSV rows (one
// per configuration and step) and their JSON configurations (buckets, FSDP groups).
struct ParallelRecording {
  fs::path dir = fs::path(VRAMSCOPE_SOURCE_DIR) / "tests/data/h100-parallel-2026-11-26";
  std::vector<std::map<std::string, std::string>> rows;
  nlohmann::json configs = nlohmann::json::object();
  ParallelRecording() {
    rows = read_csv(dir / "parallel_reference.csv");
    for (auto& row : read_csv(dir / "variants/parallel_variants.csv")) rows.push_back(std::move(row));
    for (const char* file : {"parallel_reference.json", "variants/parallel_variants.json"}) {
      std::ifstream json_file(dir / file);
      configs.update(nlohmann::json::parse(json_file).at("configs"));
    }
  }
  /// A configuration's rows, one per step.
  std::vector<std::map<std::string, std::string>> steps(const std::string& config) const {
    std::vector<std::map<std::string, std::string>> out;
    for (const auto& row : rows)
      if (row.at("config") == config) out.push_back(row);
    return out;
  }
  /// The recording's machine and stack, with `spec` and its options as the engine.
  static nn::TrainConfig config(const std::function<void(nn::TrainConfig&)>& setup, const char* spec,
                                const char* options) {
    nn::TrainConfig cfg;
    setup(cfg);
    cfg.device = "sim:h100-80g";
    cfg.stack = nn::Stack::parse("torch=2.11,transformers=5.17,peft=0.21");
    cfg.parallel = nn::parse_parallel(spec, options);
    return cfg;
  }
};

// Our own H100 recording of one rank of an 8-GPU job (tests/data/h100-parallel-2026-11-26,
// scripts/parallel_reference.py): PyTorch's fake process group with real CUDA tensors,
// PyTorch 2.11, three AdamW steps. DDP's buckets as its comm hook saw them (one of every
// gradient in the first backward, the rebuilt ones after), and the allocator's figures after
// wrapping and at each step, exact to the byte.
TEST(ParallelReference, DdpRanksMatchTheH100StepByStep) {
  const ParallelRecording recording;
  const fs::path& dir = recording.dir;
  const auto& configs = recording.configs;
  struct Case {
    std::string config;
    std::function<void(nn::TrainConfig&)> setup;
    // What the script holds that vramscope's step does not, at the peaks and after the step:
    // loss_fn computes cross_entropy(model(x), y), so the output dies inside it where
    // vramscope's step keeps `out = model(x)`; and the script's batch and loss are still
    // Python locals when it reads memory_allocated() after the step.
    std::int64_t output_bytes, locals_after_step;
    // What the recording holds from before the model: the llama run's snapshot begins with
    // a 4 B tensor torchaudio's kaldi.py made on import (transformers imports it).
    std::int64_t before_model;
    // Bytes the step's peaks may differ by: 0 where the model's own step is exact. The
    // decoder's step is exact only to the MiB (docs/VALIDATION.md): its SDPA backward takes
    // 16 KiB + 1 MiB where PyTorch's takes one 2,113,792 B workspace, and its forward's small
    // mask and position tensors differ; the buckets and what wrapping leaves are exact.
    std::int64_t step_tolerance, reserved_tolerance;
    // The broadcast copies the recording's snapshot shows (bytes as requested, in order):
    // the construction's of parameters and buffers, then each forward's of the buffers.
    std::vector<std::size_t> construction_copies, forward_copies;
  };
  const Case cases[] = {
      {"mlp-ddp-r0",
       [&](nn::TrainConfig& cfg) {
         cfg.model = ModelFile::load((dir / "ref-resmlp.json").string());
         cfg.model_options.batch = 64;
       },
       2560,                // a [64, 10] f32 output
       256000 + 512 + 512,  // x [64, 1000] f32, y [64] int64, the loss
       0,
       0,
       0,
       {48340612},
       {}},
      {"llama-ddp-r0",
       [&](nn::TrainConfig& cfg) {
         cfg.model = load_hf_config((dir / "ref-llama-2layer.json").string());
         cfg.model_options.batch = 2;
         cfg.model_options.seq = 256;
         cfg.model_options.attention = "sdpa";
         cfg.precision =
             nn::Precision::BF16;  // built under torch.set_default_dtype(torch.bfloat16)
       },
       0,                  // the causal LM's output object is dropped by both
       2 * 256 * 8 + 512,  // input_ids [2, 256] int64 (also the labels), the loss
       512,
       1 * 1024 * 1024,
       2 * 1024 * 1024,
       {77140992, 256},
       {256}},
      {"cnn-ddp-r0",
       [&](nn::TrainConfig& cfg) {
         cfg.model = ModelFile::load((dir / "ref-cnn.json").string());
         cfg.model_options.batch = 32;
       },
       1536,                              // the [32, 10] f32 output's block
       32 * 3 * 64 * 64 * 4 + 512 + 512,  // x, y [32] int64, the loss
       0,
       // The convolutions' own step is exact only to a few MiB on one GPU (cuDNN's
       // workspaces, chosen per shape, where vramscope takes im2col columns:
       // docs/VALIDATION.md): what DDP adds is checked exactly through its buffers.
       2 * 1024 * 1024,
       24 * 1024 * 1024,
       // f32 parameters and statistics, then the three int64 num_batches_tracked; each
       // forward the statistics (2 x 217 channels) and the counters.
       {355168, 24},
       {1736, 24}},
  };
  const struct {
    const char* suffix;   // of the recording's config name
    const char* options;  // DistributedDataParallel's arguments
  } engines[] = {{"ddp", ""},
                 {"ddp-gabv", "gradient_as_bucket_view=true"},
                 {"ddp-static", "static_graph=true"},
                 {"ddp-unused", "find_unused_parameters=true"}};
  std::size_t compared = 0;
  for (const Case& base : cases) {
    for (const auto& engine : engines) {
      Case c = base;
      c.config.replace(c.config.find("ddp"), 3, engine.suffix);
      SCOPED_TRACE(c.config);
      const auto steps = recording.steps(c.config);
      ASSERT_EQ(steps.size(), 3u);
      ++compared;
      // The buckets the comm hook reduced in each step's backward, in order.
      std::map<std::size_t, std::vector<std::size_t>> reduced;
      for (const auto& call : configs.at(c.config).at("bucket_calls")) {
        reduced[call.at("step").get<std::size_t>()].push_back(call.at("bytes").get<std::size_t>());
      }
      const nn::TrainConfig cfg = ParallelRecording::config(c.setup, "ddp:8", engine.options);
      auto device = make_device(cfg.device);
      CachingAllocator alloc{device};
      nn::Trainer trainer{cfg, alloc};
      EXPECT_EQ(alloc.stats().allocated_bytes[0].current + c.before_model,
                number(steps[0], "allocated_after_wrap"));
      EXPECT_EQ(alloc.stats().reserved_bytes[0].current, number(steps[0], "reserved_after_wrap"));
      for (std::size_t i = 0; i < 3; ++i) {
        const nn::StepStats s = trainer.step();
        const std::string step = "step " + std::to_string(i + 1);
        EXPECT_NEAR(static_cast<double>(s.peak_allocated - c.output_bytes + c.before_model),
                    static_cast<double>(number(steps[i], "max_allocated")),
                    static_cast<double>(c.step_tolerance))
            << step;
        EXPECT_NEAR(static_cast<double>(s.peak_reserved),
                    static_cast<double>(number(steps[i], "max_reserved")),
                    static_cast<double>(c.reserved_tolerance))
            << step;
        EXPECT_NEAR(static_cast<double>(s.allocated_end + c.locals_after_step + c.before_model),
                    static_cast<double>(number(steps[i], "allocated_after_step")),
                    static_cast<double>(c.step_tolerance))
            << step;
        EXPECT_EQ(trainer.ddp_bucket_bytes(), reduced[i + 1])
            << step;  // the buckets this backward reduced
      }
      std::vector<std::size_t> construction, forward;
      for (const nn::CommunicationBuffer& b : trainer.communication_buffers()) {
        if (b.what == "parameters and buffers broadcast copy") construction.push_back(b.bytes);
        if (b.what == "buffers broadcast copy" && b.allocated == "step 2 forward")
          forward.push_back(b.bytes);
      }
      EXPECT_EQ(construction, c.construction_copies);
      EXPECT_EQ(forward, c.forward_copies);
    }
  }
  EXPECT_EQ(compared, 12u);
}


// The same recording under FSDP2 (fully_shard on each block, then the root; PyTorch 2.11):
// every group's shards and all-gather output as FSDPState reported them, and the allocator's
// figures after wrapping and at each step, for rank 0 and the last rank (whose shards hold
// fewer rows of dim 0, so its optimizer states are smaller), with a MixedPrecisionPolicy and
// with reshard_after_forward=False.
TEST(ParallelReference, Fsdp2RanksMatchTheH100StepByStep) {
  const ParallelRecording recording;
  const fs::path& dir = recording.dir;
  const auto& configs = recording.configs;
  struct Case {
    std::string model;
    std::function<void(nn::TrainConfig&)> setup;
    std::int64_t output_bytes, locals_after_step, before_model;  // as in the DDP test above
    std::int64_t step_tolerance, reserved_tolerance;
  };
  const Case cases[] = {
      {"mlp",
       [&](nn::TrainConfig& cfg) {
         cfg.model = ModelFile::load((dir / "ref-resmlp.json").string());
         cfg.model_options.batch = 64;
       },
       2560, 256000 + 512 + 512, 0, 0, 0},
      {"llama",
       [&](nn::TrainConfig& cfg) {
         cfg.model = load_hf_config((dir / "ref-llama-2layer.json").string());
         cfg.model_options.batch = 2;
         cfg.model_options.seq = 256;
         cfg.model_options.attention = "sdpa";
         cfg.precision = nn::Precision::BF16;
       },
       0, 2 * 256 * 8 + 512, 512, 1 * 1024 * 1024, 2 * 1024 * 1024},
      {"cnn",
       [&](nn::TrainConfig& cfg) {
         cfg.model = ModelFile::load((dir / "ref-cnn.json").string());
         cfg.model_options.batch = 32;
       },
       1536, 32 * 3 * 64 * 64 * 4 + 512 + 512, 0, 2 * 1024 * 1024, 24 * 1024 * 1024},
  };
  const struct {
    const char* suffix;   // of the recording's config name
    const char* options;  // fully_shard's arguments (the script builds the model on the GPU)
    bool half_params;     // param_dtype=bf16: the all-gathers and the output are in bf16
    // With every parameter kept unsharded after forward, the step's peak comes at the loss,
    // where the output is alive in both and the script still holds the previous step's loss
    // (a [] f32 block of 512 B, until `loss = loss_fn(...)` rebinds it), from step 2 on.
    bool peak_at_loss;
  } engines[] = {{"fsdp2-r0", "init=cuda", false, false},
                 {"fsdp2-r7", "init=cuda,rank=7", false, false},
                 {"fsdp2-mp-r0", "init=cuda,param_dtype=bf16,reduce_dtype=f32", true, false},
                 {"fsdp2-keep-r0", "init=cuda,reshard_after_forward=false", false, true}};
  std::size_t compared = 0;
  for (const Case& base : cases) {
    for (const auto& engine : engines) {
      const std::string config = base.model + "-" + engine.suffix;
      SCOPED_TRACE(config);
      // PyTorch refused this one (BatchNorm's f32 statistics against bf16 inputs): nothing to compare.
      if (config == "cnn-fsdp2-mp-r0") continue;
      Case c = base;
      if (engine.half_params && c.output_bytes > 0) c.output_bytes = 1536;  // a [64, 10] bf16 output's block
      const auto steps = recording.steps(config);
      ASSERT_EQ(steps.size(), 3u);
      ++compared;
      const nn::TrainConfig cfg = ParallelRecording::config(c.setup, "fsdp:8", engine.options);
      auto device = make_device(cfg.device);
      CachingAllocator alloc{device};
      nn::Trainer trainer{cfg, alloc};
      // Each group's all-gather output, as FSDPState reported it (the script counts it in the
      // parameters' dtype: halved when a bf16 param_dtype casts f32 ones, as the snapshot shows).
      const bool cast_to_half = engine.half_params && base.model != "llama";
      std::vector<std::size_t> gathered;
      for (const auto& group : configs.at(config).at("fsdp_groups")) {
        gathered.push_back(group.at("all_gather_output_bytes").get<std::size_t>() / (cast_to_half ? 2 : 1));
      }
      EXPECT_EQ(alloc.stats().allocated_bytes[0].current + c.before_model,
                number(steps[0], "allocated_after_wrap"));
      EXPECT_EQ(alloc.stats().reserved_bytes[0].current, number(steps[0], "reserved_after_wrap"));
      for (std::size_t i = 0; i < 3; ++i) {
        const nn::StepStats s = trainer.step();
        const std::string step = "step " + std::to_string(i + 1);
        // (Step 1's peak is the optimizer's first, where the script's output is gone.)
        const std::int64_t script = engine.peak_at_loss && c.output_bytes > 0 && i > 0 ? 512 : -c.output_bytes;
        EXPECT_NEAR(static_cast<double>(s.peak_allocated + script + c.before_model),
                    static_cast<double>(number(steps[i], "max_allocated")),
                    static_cast<double>(c.step_tolerance))
            << step;
        EXPECT_NEAR(static_cast<double>(s.peak_reserved), static_cast<double>(number(steps[i], "max_reserved")),
                    static_cast<double>(c.reserved_tolerance))
            << step;
        EXPECT_NEAR(static_cast<double>(s.allocated_end + c.locals_after_step + c.before_model),
                    static_cast<double>(number(steps[i], "allocated_after_step")),
                    static_cast<double>(c.step_tolerance))
            << step;
      }
      std::vector<std::size_t> ours;
      for (const nn::CommunicationBuffer& b : trainer.communication_buffers()) {
        if (b.what.ends_with("all-gather output") && b.allocated == "step 1 forward") ours.push_back(b.bytes);
      }
      EXPECT_EQ(ours, gathered);  // the root's first, as its forward gathers it first
    }
  }
  EXPECT_EQ(compared, 11u);
}


/// A ZeRO buffer as the recordings and the comparisons write it: "what bytes made -> freed".
std::string buffer_line(const std::string& what, std::size_t bytes, const std::string& made, const std::string& freed) {
  return what + " " + std::to_string(bytes) + " " + made + " -> " + freed;
}

/// The recorded buffers that `keep` accepts (by name), in order.
std::vector<std::string> recorded_buffers(const nlohmann::json& recorded,
                                          const std::function<bool(const std::string&)>& keep) {
  std::vector<std::string> out;
  for (const auto& b : recorded.at("buffers")) {
    const std::string what = b.at("buffer").get<std::string>();
    if (keep(what)) {
      out.push_back(buffer_line(what, b.at("bytes").get<std::size_t>(), b.at("allocated").get<std::string>(),
                                b.at("freed").get<std::string>()));
    }
  }
  return out;
}

/// Three steps of `cfg` in bf16 on a simulated H100; the engine's buffers that `keep` accepts.
std::vector<std::string> simulated_buffers(nn::TrainConfig cfg, const std::function<bool(const std::string&)>& keep) {
  cfg.precision = nn::Precision::BF16;
  cfg.device = "sim:h100-80g";
  auto device = make_device(cfg.device);
  CachingAllocator alloc{device};
  nn::Trainer trainer{cfg, alloc};
  for (int i = 0; i < 3; ++i) (void)trainer.step();
  std::vector<std::string> out;
  for (const nn::CommunicationBuffer& b : trainer.communication_buffers()) {
    if (keep(b.what)) out.push_back(buffer_line(b.what, b.bytes, b.allocated, b.freed));
  }
  return out;
}

// DeepSpeed's ZeRO stage 1 and 2 on one rank, recorded on the CPU with DeepSpeed itself
// (tests/data/deepspeed-cpu-2026-11-26, scripts/zero_reference.py): every buffer its ZeRO
// code allocated, in order, with its bytes and the phases it lived between, equal to
// vramscope's for rank 0, rank 3 (with 4,000-element buckets: several per backward) and rank 7
// (whose partition ends in padding), under both stages; and with offload_optimizer to the CPU
// (DeepSpeedCPUAdam) for rank 0 of stage 1, rank 3 of stage 2 with small buckets and rank 7 of
// stage 2: the host buffers, the GPU's staging buffer, and each gradient's fp64 norm copy,
// inf/NaN check and fp32 copy on its way to the host.
TEST(ParallelReference, ZeroBuffersMatchDeepSpeedOnTheCpu) {
  const fs::path dir = fs::path(VRAMSCOPE_SOURCE_DIR) / "tests/data/deepspeed-cpu-2026-11-26";
  std::ifstream json_file(dir / "zero_reference.json");
  const nlohmann::json configs = nlohmann::json::parse(json_file).at("configs");
  std::size_t compared = 0;
  for (const auto& [name, recorded] : configs.items()) {
    SCOPED_TRACE(name);
    const std::string stage = std::to_string(recorded.at("stage").get<int>());
    std::string options = "rank=" + std::to_string(recorded.at("rank").get<int>());
    if (recorded.at("reduce_bucket_size").get<double>() != 5e8) {
      options += ",reduce_bucket_size=" + std::to_string(static_cast<long long>(recorded.at("reduce_bucket_size").get<double>()));
    }
    if (recorded.value("offload_optimizer", false)) options += ",offload_optimizer=cpu";
    nn::TrainConfig cfg;
    cfg.model = ModelFile::load((dir / "ref-zero-mlp.json").string());
    cfg.parallel = nn::parse_parallel("zero" + stage + ":8", options);
    const auto every = [](const std::string&) { return true; };
    EXPECT_EQ(simulated_buffers(cfg, every), recorded_buffers(recorded, every));
    ++compared;
  }
  EXPECT_EQ(compared, 9u);
}

// DeepSpeed's ZeRO stage 3 on one rank, recorded the same way (zero3_reference.json): the
// two MLPs (every parameter persistent; two weights over the persistence threshold) at the
// defaults, with a small bucket, persistence 0, reuse distance 0, prefetch 0; and a two-layer
// transformers Llama (its embedding and head over the threshold) with a small bucket, and with
// reuse distance 0 and a prefetch bucket smaller than the head, where the trace's order decides
// what is prefetched when; the same Llama with its head tied to the embedding (one Parameter,
// gathered around both modules), with every decoder layer checkpointed (the recompute's
// gathers in backward), and with PEFT's LoRA on top (frozen base weights held through the
// recompute by the module whose backward runs; compared as a multiset, see below), and with
// sub groups of 3,000 elements (the step's flattening and fp32 cast per sub group); and with
// offload_optimizer to the CPU on both MLPs and the Llama in sub groups (the master and each sub
// group's fp32 gradient on the host, each gradient partition's fp64 norm copy and fp32 copy in
// the backward, CPU Adam's moments, no step transients on the device). Every buffer of
// ZeRO-3's own, in order, with its bytes and the phases it lived between, over three steps:
// the partitions, the flat buffers, each module's gathers and the trace's prefetches from the
// second step, the reduce-scatters, the step's fp64 norm copies, flattened and fp32 gradients
// and the persistent parameters' gathers. Left out: the whole parameters and gradients (the
// model's and autograd's, not ZeRO's), and the scalars of the trace check and the norm.
TEST(ParallelReference, Zero3BuffersMatchDeepSpeedOnTheCpu) {
  const fs::path dir = fs::path(VRAMSCOPE_SOURCE_DIR) / "tests/data/deepspeed-cpu-2026-11-26";
  std::ifstream json_file(dir / "zero3_reference.json");
  const nlohmann::json configs = nlohmann::json::parse(json_file).at("configs");
  const std::set<std::string> modelled = {
      "bf16 parameter partition (ds_tensor)",
      "FusedAdam overflow flag",
      "inf_or_nan_tracker",
      "bf16 flat partition buffer (lp_param_buffer)",
      "bf16 flat partition buffer (param_groups_fp16_flat_cpu_memory)",
      "fp32 master conversion (before its clone)",
      "fp32 master partition",
      "fp32 gradient placeholder (initialize_optimizer_states)",
      "IPG bucket (reduce_bucket_size)",
      "gradient partitions (grad_partitions_flat_buffer)",
      "gathered parameter (blocking all_gather, N x partition)",
      "all-gather flat buffer (N x sum of partitions)",
      "gathered parameter (copy out of the flat buffer)",
      "gathered parameter (all_gather buffer, N x partition)",
      "reduce-scatter padding",
      "reduce-scatter buffer (N x sum of partitions, interleaved)",
      "flat bf16 gradient (flatten of the partitions)",
      "fp32 gradient partition",
      "exp_avg",
      "exp_avg_sq",
      "gathered parameter (blocking coalesced all_gather, N x partition)",
      "fp64 gradient partition (grad norm)",
      "fp32 gradient partition (host)",
      "fp32 gradient partition (to the host)",
  };
  std::size_t compared = 0;
  for (const auto& [name, recorded] : configs.items()) {
    SCOPED_TRACE(name);
    const nlohmann::json& settings = recorded.at("settings");
    const auto number = [&](const char* key) {
      return std::to_string(static_cast<long long>(settings.at(key).get<double>()));
    };
    const std::string options = "rank=" + std::to_string(recorded.at("rank").get<int>()) +
                                ",zero3_init_flag=false,reduce_bucket_size=" + number("reduce_bucket_size") +
                                ",stage3_prefetch_bucket_size=" + number("prefetch_bucket_size") +
                                ",stage3_param_persistence_threshold=" + number("param_persistence_threshold") +
                                ",stage3_max_reuse_distance=" + number("max_reuse_distance") +
                                (recorded.at("zero_optimization").contains("sub_group_size")
                                     ? ",sub_group_size=" + std::to_string(recorded.at("zero_optimization")
                                                                               .at("sub_group_size")
                                                                               .get<long long>())
                                     : std::string()) +
                                (recorded.at("zero_optimization").contains("offload_optimizer") ? ",offload_optimizer=cpu"
                                                                                                  : "") +
                                (recorded.at("zero_optimization").contains("offload_param") ? ",offload_param=cpu" : "");
    nn::TrainConfig cfg;
    const std::string model = recorded.at("model").get<std::string>();
    if (model.starts_with("llama")) {  // transformers' LlamaForCausalLM of this config, batch 4 x 16
      cfg.model = load_hf_config((dir / (model == "llama-tied" ? "ref-zero3-llama-tied.json" : "ref-zero3-llama.json")).string());
      cfg.model_options.batch = 4;
      cfg.model_options.seq = 16;
      cfg.model_options.attention = "sdpa";
      // gradient_checkpointing_enable(): each decoder layer recomputed in backward, its
      // modules' hooks (not the layer's) running again there.
      if (model == "llama-gc" || model == "llama-lora") cfg.model_options.checkpoint = "non-reentrant";
      if (model == "llama-lora") {  // PEFT's LoRA of rank 8 on q_proj and v_proj, dropout 0
        cfg.model_options.lora = 8;
        cfg.model_options.lora_dropout = 0.0;
      }
    } else {
      cfg.model = ModelFile::load((dir / (model == "big" ? "ref-zero-mlp-big.json" : "ref-zero-mlp.json")).string());
    }
    cfg.parallel = nn::parse_parallel("zero3:8", options);
    const auto is_modelled = [&](const std::string& what) { return modelled.count(what) != 0; };
    std::vector<std::string> ours = simulated_buffers(cfg, is_modelled);
    std::vector<std::string> theirs = recorded_buffers(recorded, is_modelled);
    if (model == "llama-lora") {
      // PEFT's wrapper reads lora_A's weight before calling lora_A, and ZeRO-3's parameter dict
      // gathers a parameter on access (a blocking all_gather, made an external parameter of the
      // wrapper): the same buffer, lifetime and phases, gathered a module earlier and named by
      // that call. vramscope gathers it at lora_A's call: compare the buffers as a multiset.
      for (std::string& t : theirs) {
        const std::string blocking = "gathered parameter (blocking all_gather, N x partition)";
        if (t.starts_with(blocking) && t.find("construction") == std::string::npos) {
          t.replace(0, blocking.size(), "gathered parameter (all_gather buffer, N x partition)");
        }
      }
      std::sort(ours.begin(), ours.end());
      std::sort(theirs.begin(), theirs.end());
    }
    // The first difference, with its neighbours: the lists run to a few hundred lines.
    const std::size_t n = std::min(ours.size(), theirs.size());
    std::size_t first = 0;
    while (first < n && ours[first] == theirs[first]) ++first;
    if (first < n || ours.size() != theirs.size()) {
      std::string context;
      for (std::size_t i = first > 2 ? first - 2 : 0; i < std::min(first + 3, std::max(ours.size(), theirs.size())); ++i) {
        context += "\n  #" + std::to_string(i) + " ours:   " + (i < ours.size() ? ours[i] : "-") +
                   "\n  #" + std::to_string(i) + " theirs: " + (i < theirs.size() ? theirs[i] : "-");
      }
      ADD_FAILURE() << "buffer " << first << " of " << theirs.size() << " differs (ours has " << ours.size() << ")"
                    << context;
    }
    ++compared;
  }
  EXPECT_EQ(compared, 23u);
}

}  // namespace
}  // namespace mem::models
