// tensor_parallel_test.cpp — one rank of tensor + sequence parallel (torchtitan's Llama plan):
// the option and its refusals, the rank's shards and every redistribution's buffer exactly,
// the embedding's whole-table gradient and the optimizer's copies of redistributed gradients.
// Their order against PyTorch itself is tests/models/check_tensor_parallel.py's.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "test_util.hpp"
#include "vramscope/instrumentation/peak_composition.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::nn {
namespace {

// tests/data/h100-parallel-2026-11-26/ref-llama-2layer.json: a two-layer Llama of odd sizes.
constexpr const char* kLlama = R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4,
  "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 1024,
  "rms_norm_eps": 1e-06, "tie_word_embeddings": false})";

using test::error_of;
using test::OneStep;

TrainConfig llama(const std::string& parallel,
                  const std::string& options = "batch=2,seq=256,attn=sdpa",
                  const std::string& parallel_options = "") {
  TrainConfig cfg;
  cfg.model = models::HfConfig::parse(kLlama, "ref-llama", "test");
  cfg.model_options = ModelOptions::parse(options);
  cfg.precision = Precision::BF16;
  cfg.device = "sim:h100-80g";
  cfg.steps = 1;
  cfg.parallel = parse_parallel(parallel, parallel_options);
  return cfg;
}


// Rank 0's bf16 shards at tp:2: embedding and lm_head 16000 x 512 each; per layer q 256 x 512,
// k and v 128 x 512, o 512 x 256, gate and up 688 x 512, down 512 x 688, two norms of 512; the
// final norm.
constexpr std::int64_t kLayerBytes =
    2 * (256 * 512 + 2 * 128 * 512 + 512 * 256 + 3 * 688 * 512 + 2 * 512);
constexpr std::int64_t kRankBytes = 2 * (2 * 16000 * 512) + 2 * kLayerBytes + 2 * 512;

TEST(TensorParallel, OptionsAndRefusals) {
  EXPECT_EQ(parallel_label(parse_parallel("tp:8")), "tp:8");
  EXPECT_EQ(parallel_label(parse_parallel("tp:8", "loss_parallel=false")),
            "tp:8 loss_parallel=false");
  EXPECT_NE(error_of([] {
              parse_parallel("fsdp:8", "loss_parallel=false");
            }).find("not an option of fsdp"),
            std::string::npos);
  EXPECT_EQ(parallel_label(parse_parallel("tp:8", "sequence_parallel=true,rank=3")), "tp:8 rank=3");
  EXPECT_NE(error_of([] {
              parse_parallel("tp:8", "sequence_parallel=false");
            }).find("foreach optimizers refuse"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("tp:8", "bucket_cap_mb=5"); }).find("not an option of tp"),
            std::string::npos);
  EXPECT_EQ(parallel_label(parse_parallel("fsdp:8xtp:8")), "fsdp:8xtp:8");
  EXPECT_EQ(parallel_label(parse_parallel("fsdp:8xtp:8",
                                          "sequence_parallel=true,reshard_after_forward=false")),
            "fsdp:8xtp:8 reshard_after_forward=false");
  EXPECT_EQ(parse_parallel("fsdp:4xtp:8").gpus(), 32u);
  EXPECT_NE(error_of([] {
              parse_parallel("ddp:2xtp:2");
            }).find("ddp with tensor parallel is not modelled"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("tp:2xfsdp:2"); }).find("tp innermost"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("fsdp:2xpp:4xtp:8"); }).find("pipeline stages outermost"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_parallel("tp:8", "reshard_after_forward=true");
            }).find("not an option of tp"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("fsdp:2xtp:0"); }).find("whole number from 1"),
            std::string::npos);

  const auto refused = [](TrainConfig cfg) { return error_of([&] { (void)train(cfg); }); };
  EXPECT_NE(refused(llama("tp:2", "batch=2,seq=255,attn=sdpa")).find("multiple of 2"),
            std::string::npos);
  EXPECT_NE(refused(llama("tp:16")).find("num_attention_heads 8 is not a multiple of 16"),
            std::string::npos);
  EXPECT_NE(refused(llama("tp:2", "batch=2,seq=256,attn=eager")).find("eager attention"),
            std::string::npos);
  EXPECT_NE(
      refused(llama("tp:2", "batch=2,seq=256,attn=sdpa,lora=8")).find("not a plain nn.Linear"),
      std::string::npos);
  TrainConfig sgd = llama("tp:2");
  sgd.optimizer.kind = OptimizerKind::SGD;
  EXPECT_NE(refused(sgd).find("adam"), std::string::npos);
  TrainConfig gpt2 = llama("tp:2");
  gpt2.model = models::find("gpt2");
  gpt2.model_options = ModelOptions::parse("batch=2,seq=256");
  EXPECT_NE(refused(gpt2).find("no model.embed_tokens"), std::string::npos);
  TrainConfig offload = llama("tp:2");
  offload.offload_activations = true;
  EXPECT_NE(refused(offload).find("--offload activations is not modelled"), std::string::npos);
  TrainConfig compute = llama("tp:2");
  compute.mode = ExecMode::Compute;
  EXPECT_NE(refused(compute).find("dry run only"), std::string::npos);
}

// A redistribution's transient buffers (the stacked all-gather, the reduce-scatter's staged
// input) are communication buffers at a peak; what it hands the module is its activation.
TEST(TensorParallel, TransientBuffersAreCommunication) {
  EXPECT_EQ(memory_kind(intern_context("DTensor model.layers.0.mlp input all-gather output",
                                       Phase::Forward)),
            MemoryKind::Communication);
  EXPECT_EQ(memory_kind(intern_context("model.layers.0.mlp", Phase::Forward)),
            MemoryKind::Activations);
}

TEST(TensorParallel, ShardsAndBuffersExactly) {
  const TrainConfig cfg = llama("tp:2", "batch=2,seq=256,attn=sdpa", "loss_parallel=false");
  OneStep run(cfg);
  Trainer& trainer = run.trainer;
  const TrainReport r = trainer.report();
  EXPECT_EQ(r.parameter_bytes, kRankBytes);
  EXPECT_EQ(r.parameter_bytes, 38'573'056);
  EXPECT_EQ(r.optimizer_state_bytes, 2 * kRankBytes);
  // The embedding's .grad is the whole table (DTensor's Replicate).
  EXPECT_EQ(trainer.model().parameters().front().grad().nbytes(), 32000u * 512 * 2);

  const auto buffers = trainer.communication_buffers();
  ASSERT_EQ(buffers.size(), 43u);  // 22 forward, 21 backward
  const std::size_t full = 2 * 256 * 512 * 2, local = full / 2, logits = 2 * 256 * 16000 * 2;
  EXPECT_EQ(buffers[0].what, "model.embed_tokens output reduce-scatter input");
  EXPECT_EQ(buffers[0].bytes, full);
  EXPECT_EQ(buffers[0].freed, "step 1 forward");
  EXPECT_EQ(buffers[1].what, "model.embed_tokens output reduce-scatter output");
  EXPECT_EQ(buffers[1].bytes, local);
  EXPECT_EQ(buffers[2].what, "model.layers.0.self_attn input all-gather output");
  EXPECT_EQ(buffers[3].what, "model.layers.0.self_attn input all-gather cat");
  EXPECT_EQ(buffers[20].what, "lm_head output all-gather output");
  EXPECT_EQ(buffers[20].bytes, 2 * logits);  // the ranks' pieces stacked on dim 0
  EXPECT_EQ(buffers[21].bytes, 2 * logits);  // then catted on the vocabulary
  EXPECT_EQ(buffers[22].what, "lm_head output (backward) chunk");
  EXPECT_EQ(buffers[22].bytes, logits);
  EXPECT_EQ(buffers[22].allocated, "step 1 backward");
  EXPECT_EQ(buffers.back().what, "model.embed_tokens output (backward) all-gather cat");
  std::size_t total = 0;
  for (const auto& b : buffers) total += b.bytes;
  // 22 forward: 2 x (embedding: full + local) ... counted by kind: 5 reduce-scatters (2 per
  // layer + the embedding) of full + local, 5 all-gathers (2 per layer + lm_head's input) of
  // full + full, lm_head's output 2 x 2 logits; backward the reverse of each plus the chunk.
  const std::size_t forward = 5 * (full + local) + 5 * (2 * full) + 4 * logits;
  const std::size_t backward = logits + 5 * (full + local) + 5 * (2 * full);
  EXPECT_EQ(total, forward + backward);
}

// loss_parallel (torchtitan's default): lm_head's logits stay the rank's vocabulary, so the
// gather of its output and its backward chunk are gone, and the loss's [tokens, V / N] f32
// tensors are the only ones of the vocabulary's width: the f32 logits, x - max, exp, the
// log-probabilities in forward; zeros, exp, the sum and the product in backward.
TEST(TensorParallel, LossParallelKeepsTheLogitsSharded) {
  const TrainConfig cfg = llama("tp:4");
  OneStep run(cfg);
  Trainer& trainer = run.trainer;
  const StepStats& with = run.stats;
  EXPECT_EQ(trainer.communication_buffers().size(), 40u);
  for (const auto& b : trainer.communication_buffers())
    EXPECT_EQ(b.what.find("lm_head output"), std::string::npos);
  // Gathered, every GPU holds the whole logits: in the loss's backward the bf16 logits, the
  // f32 log-probabilities and their gradient of all 32000 entries; sharded over 4 ranks, four
  // f32 tensors of 8000. The peak falls by more than the whole bf16 logits.
  const TrainReport gathered =
      train(llama("tp:4", "batch=2,seq=256,attn=sdpa", "loss_parallel=false"));
  const std::int64_t whole = 2 * 256 * 32000;
  EXPECT_GT(gathered.peak_allocated - with.peak_allocated, whole * 2);
}

// FSDP2 over tensor parallel (torchtitan's 2-D mesh): FSDP shards the rank's tensor-parallel
// shards, and the gradients of another placement (the embedding's whole table, the norms'
// Partial ones) are redistributed before its reduce-scatter, so the optimizer copies nothing.
TEST(TensorParallel, FsdpShardsTheTensorParallelShards) {
  const TrainConfig cfg = llama("fsdp:2xtp:2");
  OneStep run(cfg);
  Trainer& trainer = run.trainer;
  EXPECT_EQ(trainer.report().parameter_bytes, kRankBytes / 2);  // every row splits evenly
  const auto buffers = trainer.communication_buffers();
  const auto find = [&](const std::string& what) -> const CommunicationBuffer* {
    for (const auto& b : buffers) {
      if (b.what == what) return &b;
    }
    return nullptr;
  };
  // The root group: the embedding's and lm_head's 16000 rows and the final norm, gathered.
  const CommunicationBuffer* root = find("root all-gather output");
  ASSERT_NE(root, nullptr);
  EXPECT_EQ(root->bytes, 2u * 16000 * 512 * 2 + 512 * 2);
  const CommunicationBuffer* layer0 = find("model.layers.0 all-gather output");
  ASSERT_NE(layer0, nullptr);
  EXPECT_EQ(layer0->bytes, static_cast<std::size_t>(kLayerBytes));
  const CommunicationBuffer* table = find("model.embed_tokens gradient redistributed");
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(table->bytes, 16000u * 512 * 2);  // the rank's rows of the whole-table gradient
  const CommunicationBuffer* norm = find("model.layers.0.input_layernorm gradient redistributed");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->bytes, 512u * 2);
  EXPECT_NE(find("model.layers.0.self_attn input all-gather output"),
            nullptr);  // tensor parallel's, after
}

}  // namespace
}  // namespace mem::nn
