// nn_data_parallel_test.cpp — one GPU of torch.nn.DataParallel: the option and its refusals,
// the groups broadcast_coalesced and reduce_add_coalesced cut (take_tensors in C++ and in
// Python close them differently), what GPU 0 holds that the others do not, exact to the byte.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::nn {
namespace {

using test::error_of;
using test::OneStep;

/// Two linears, 1024 -> 2048 -> 1024 in f32: weights of 8 MiB each, biases of 8 and 4 KiB.
std::shared_ptr<const ModelSource> two_linears() {
  return models::ModelFile::parse(R"({
    "format": "vramscope-model", "version": 1, "name": "two-linears",
    "options": {"batch": 8}, "input": {"shape": ["batch", 1024]}, "loss": {"type": "mse"},
    "layers": [{"type": "Linear", "in_features": 1024, "out_features": 2048}, {"type": "ReLU"},
               {"type": "Linear", "in_features": 2048, "out_features": 1024}]})",
                                  "two-linears.json");
}

TrainConfig on_gpu(std::size_t gpu, const std::string& options = "batch=8") {
  TrainConfig cfg;
  cfg.model = two_linears();
  cfg.model_options = ModelOptions::parse(options);
  cfg.device = "sim:capacity=80GiB,context=0";
  cfg.steps = 1;
  cfg.parallel = parse_parallel("dp:2", "gpu=" + std::to_string(gpu));
  return cfg;
}

std::vector<std::string> logged(const Trainer& trainer) {
  std::vector<std::string> out;
  for (const CommunicationBuffer& b : trainer.communication_buffers()) {
    out.push_back(b.what + " " + std::to_string(b.bytes) + " @ " + b.allocated + " -> " + b.freed);
  }
  return out;
}

/// A two-layer bf16 Llama of hidden 256 and vocabulary 32,000 on `parallel`'s GPU 0.
TrainConfig tiny_llama(const std::string& options, const std::string& parallel) {
  TrainConfig cfg;
  cfg.model = models::HfConfig::parse(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": false})",
                                      "tiny-llama", "test");
  cfg.model_options = ModelOptions::parse(options);
  cfg.precision = Precision::BF16;
  cfg.device = "sim:capacity=80GiB,context=0";
  cfg.steps = 1;
  cfg.parallel = parse_parallel(parallel);
  return cfg;
}

constexpr std::size_t kW1 = 2048 * 1024 * 4, kB1 = 2048 * 4, kW2 = 1024 * 2048 * 4, kB2 = 1024 * 4;

TEST(NnDataParallel, OptionAndRefusals) {
  const ParallelConfig dp = parse_parallel("dp:4", "gpu=3");
  EXPECT_EQ(dp.engine, ParallelEngine::Dp);
  EXPECT_EQ(dp.world_size, 4u);
  EXPECT_EQ(dp.rank, 3u);
  EXPECT_EQ(parallel_label(dp), "dp:4 gpu=3");
  EXPECT_EQ(parallel_label(parse_parallel("dp:2")), "dp:2");
  EXPECT_NE(error_of([] { parse_parallel("dp:1"); }).find("calls the module as it is"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("dp:2", "gpu=2"); }).find("below 2"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("dp:2", "rank=1"); }).find("not an option of dp"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("dp:2xtp:2"); }).find("runs alone"), std::string::npos);

  const auto refused = [](const TrainConfig& cfg) { return error_of([&] { (void)train(cfg); }); };
  // torch.chunk of a batch of 1 over 2 GPUs leaves GPU 1 without a sample; 5 over 4 makes
  // pieces of 2, 2 and 1, and the fourth GPU idle.
  EXPECT_NE(refused(on_gpu(1, "batch=1")).find("gets none"), std::string::npos);
  TrainConfig four = on_gpu(0, "batch=5");
  four.parallel = parse_parallel("dp:4", "gpu=3");
  EXPECT_NE(refused(four).find("3 pieces of at most 2, and GPU 3 gets none"), std::string::npos);
  four.parallel = parse_parallel("dp:4", "gpu=2");
  EXPECT_NO_THROW((void)train(four));
  // save_on_cpu's hooks are thread-local, and parallel_apply runs each replica in a thread.
  TrainConfig offloading = on_gpu(0);
  offloading.offload_activations = true;
  EXPECT_NE(refused(offloading).find("thread of its own"), std::string::npos);
  TrainConfig input_grad = on_gpu(0);
  input_grad.input_requires_grad = true;
  EXPECT_NE(refused(input_grad).find("requires grad"), std::string::npos);
  TrainConfig computing = on_gpu(0);
  computing.mode = ExecMode::Compute;
  EXPECT_NE(refused(computing).find("dry run only"), std::string::npos);
}

// GPU 0: broadcast_coalesced flattens the C++ take_tensors groups of several tensors (w1, b1
// and w2 reach 10 MiB together; b2 is a group alone, broadcast as it is), each freed at once;
// the reduction cuts the gradients by Python's _take_tensors ({w1, b1}, then {w2, b2}: a group
// closes before a tensor that would take it past 10 MiB), flattens each and reduces it into a
// new buffer whose views become the .grad.
TEST(NnDataParallel, GpuZeroFlattensToBroadcastAndReducesIntoNewGradients) {
  OneStep run(on_gpu(0));
  const std::vector<std::string> expected{
      "parameters flattened for the broadcast " + std::to_string(kW1 + kB1 + kW2) + " @ step 1 forward -> step 1 forward",
      // Gather's output, the training loop's `out`, until the step ends.
      "gathered output (the whole batch's) " + std::to_string(8 * 1024 * 4) + " @ step 1 forward -> step 1 optimizer",
      "gradients flattened for the reduce " + std::to_string(kW1 + kB1) + " @ step 1 backward -> step 1 backward",
      "reduced gradients (the parameters' .grad) " + std::to_string(kW1 + kB1) + " @ step 1 backward -> ",
      "gradients flattened for the reduce " + std::to_string(kW2 + kB2) + " @ step 1 backward -> step 1 backward",
      "reduced gradients (the parameters' .grad) " + std::to_string(kW2 + kB2) + " @ step 1 backward -> ",
  };
  EXPECT_EQ(logged(run.trainer), expected);
  // The next step's zero_grad(set_to_none=True) frees the reduced buffers.
  run.trainer.step();
  const auto after = logged(run.trainer);
  EXPECT_EQ(after[3], "reduced gradients (the parameters' .grad) " + std::to_string(kW1 + kB1) +
                          " @ step 1 backward -> step 2 forward");
  // The .grad of w1 and b1 share one buffer, w2's and b2's another.
  const auto params = run.trainer.model().parameters();
  ASSERT_EQ(params.size(), 4u);
  EXPECT_EQ(params[0].grad().storage(), params[1].grad().storage());
  EXPECT_EQ(params[2].grad().storage(), params[3].grad().storage());
  EXPECT_EQ(params[0].grad().storage()->nbytes(), kW1 + kB1);
  // GPU 0 keeps the module and Adam's two moments of every parameter.
  EXPECT_EQ(run.trainer.report().parameter_bytes, static_cast<std::int64_t>(kW1 + kB1 + kW2 + kB2));
}

// GPU 1: no module of its own; each forward receives the groups (a buffer each, b2's too) and
// a group goes once each of its parameters has its gradient; the gradients are flattened to
// be sent and then go too: after the step nothing of the model is left on it.
TEST(NnDataParallel, AReplicaReceivesTheGroupsAndKeepsNothing) {
  OneStep run(on_gpu(1));
  const std::vector<std::string> expected{
      "parameters received " + std::to_string(kW1 + kB1 + kW2) + " @ step 1 forward -> step 1 backward",
      "parameters received " + std::to_string(kB2) + " @ step 1 forward -> step 1 backward",
      "gradients flattened for the reduce " + std::to_string(kW1 + kB1) + " @ step 1 backward -> step 1 backward",
      "gradients flattened for the reduce " + std::to_string(kW2 + kB2) + " @ step 1 backward -> step 1 backward",
  };
  EXPECT_EQ(logged(run.trainer), expected);
  for (const Tensor& p : run.trainer.model().parameters()) EXPECT_FALSE(p.grad().defined());
  // Past the step: only what the first products loaded (cuBLAS's workspace) stays.
  OneStep gpu0(on_gpu(0));
  EXPECT_LT(run.stats.stats.allocated_bytes[0].current, gpu0.stats.stats.allocated_bytes[0].current);
  EXPECT_GE(gpu0.stats.stats.allocated_bytes[0].current - run.stats.stats.allocated_bytes[0].current,
            static_cast<std::int64_t>(3 * (kW1 + kB1 + kW2 + kB2)));  // weights, .grad, Adam's moments
}

// torch.chunk's pieces: 7 samples over 2 GPUs are 4 and 3. GPU 0's forward peaks in
// replicate(), with the batch whole on it (input and target, 7 x 4 KiB each) and the flattened
// copy of the group of w1, b1 and w2; GPU 1 receives that group and b2's, and copies its 3
// samples in.
TEST(NnDataParallel, EachGpuHoldsItsPieceOfTheBatch) {
  OneStep gpu0(on_gpu(0, "batch=7"));
  EXPECT_EQ(gpu0.stats.forward.peak_allocated - gpu0.stats.forward.allocated_begin,
            static_cast<std::int64_t>(2 * 7 * 4096 + kW1 + kB1 + kW2));
  OneStep gpu1(on_gpu(1, "batch=7"));
  const std::int64_t received = static_cast<std::int64_t>(kW1 + kB1 + kW2 + kB2);
  EXPECT_GE(gpu1.stats.forward.peak_allocated - gpu1.stats.forward.allocated_begin, received + 3 * 4096);
  // Its parameters are the replica's, received each forward: as many bytes as GPU 0's.
  EXPECT_EQ(gpu1.trainer.report().parameter_bytes, received);
}

// A transformers LM called with its labels computes its loss in each replica; DataParallel
// gathers the output object: every replica's scalar loss into a vector of N on GPU 0, and the
// logits of the whole batch there too, which go when Trainer.compute_loss returns the loss
// alone (training_step then takes its mean). Over four GPUs those bf16 logits are twice what
// a replica's loss keeps of its own (its quarter in f32), and GPU 0's forward peaks there.
TEST(NnDataParallel, ALanguageModelsLossesAndLogitsAreGatheredOnGpuZero) {
  TrainConfig cfg = tiny_llama("batch=8,seq=128,attn=sdpa", "dp:4");
  OneStep gpu0(cfg);
  std::vector<std::string> gathered;
  for (const std::string& line : logged(gpu0.trainer)) {
    if (line.starts_with("gathered")) gathered.push_back(line);
  }
  const std::int64_t logits = 8LL * 128 * 32000 * 2;  // the whole batch's, bf16
  EXPECT_EQ(gathered, (std::vector<std::string>{
                          "gathered output (the whole batch's) " + std::to_string(logits) +
                              " @ step 1 forward -> step 1 forward",
                          "gathered losses (one per GPU) 16 @ step 1 forward -> step 1 forward"}));
  cfg.parallel = parse_parallel("dp:4", "gpu=3");
  OneStep gpu3(cfg);
  for (const std::string& line : logged(gpu3.trainer)) EXPECT_FALSE(line.starts_with("gathered")) << line;
  // Apart from GPU 3's received replica, GPU 0's forward peaks higher: at the gather, with the
  // whole batch's logits (the replica's loss temporaries, an f32 copy of its quarter, gone).
  const auto forward_growth = [](const OneStep& r) {
    return r.stats.forward.peak_allocated - r.stats.forward.allocated_begin;
  };
  EXPECT_GT(forward_growth(gpu0) - (forward_growth(gpu3) - gpu3.trainer.report().parameter_bytes), logits / 4);
}

// PEFT's LoRA under DataParallel: the frozen base weights are broadcast with the rest, and
// their copies' gradients, undefined, are materialized as zeros and reduced like the others;
// the sums of the frozen ones are dropped at once, the adapters' become their .grad.
TEST(NnDataParallel, FrozenParametersAreReducedAsZerosAndDropped) {
  TrainConfig cfg = tiny_llama("batch=4,seq=128,attn=sdpa,lora=8", "dp:2");
  OneStep gpu0(cfg);
  std::int64_t all = 0, trained = 0, reduced = 0, kept = 0;
  for (const Tensor& p : gpu0.trainer.model().body().parameters()) {  // frozen ones too
    all += static_cast<std::int64_t>(p.nbytes());
    if (p.requires_grad()) trained += static_cast<std::int64_t>(p.nbytes());
    EXPECT_EQ(p.grad().defined(), p.requires_grad());
  }
  for (const CommunicationBuffer& b : gpu0.trainer.communication_buffers()) {
    if (!b.what.starts_with("reduced gradients")) continue;
    reduced += static_cast<std::int64_t>(b.bytes);
    if (b.freed.empty()) {
      kept += static_cast<std::int64_t>(b.bytes);
    } else {
      EXPECT_EQ(b.freed, "step 1 backward");  // a frozen group's sum
    }
  }
  EXPECT_EQ(reduced, all);      // every parameter's gradient summed
  EXPECT_EQ(kept, trained);     // the adapters' (one group of f32, apart from the bf16 base)
  EXPECT_LT(trained * 100, all);
}

}  // namespace
}  // namespace mem::nn
