// pipeline_parallel_test.cpp — one rank of pipeline parallel (torch.distributed.pipelining's
// GPipe and 1F1B over torchtitan's split of a decoder): the option and its refusals, the split
// and the schedules' orders as PyTorch runs them, the stage's parameters, and the micro-batches
// in flight exactly. Their buffers, in order, against PyTorch itself are
// tests/models/check_pipeline_parallel.py's.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::nn {
namespace {

// The two-layer Llama of tests/data/h100-parallel-2026-11-26 with four layers.
constexpr const char* kLlama = R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4,
  "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 32000, "max_position_embeddings": 1024,
  "rms_norm_eps": 1e-06, "tie_word_embeddings": false})";

using test::error_of;
using test::OneStep;

TrainConfig llama(const std::string& parallel_options, const std::string& options = "batch=4,seq=128,attn=sdpa",
                  const std::string& parallel = "pp:2") {
  TrainConfig cfg;
  cfg.model = models::HfConfig::parse(kLlama, "ref-llama", "test");
  cfg.model_options = ModelOptions::parse(options);
  cfg.precision = Precision::BF16;
  cfg.device = "sim:h100-80g";
  cfg.steps = 1;
  cfg.parallel = parse_parallel(parallel, parallel_options);
  return cfg;
}

std::string order(const std::vector<PipelineAction>& actions) {
  std::string out;
  for (const PipelineAction& a : actions) {
    if (!out.empty()) out += ' ';
    out += "FBIW"[static_cast<int>(a.compute)];
    out += std::to_string(a.microbatch);
  }
  return out;
}

TEST(PipelineParallel, OptionsAndRefusals) {
  EXPECT_EQ(parallel_label(parse_parallel("pp:4")), "pp:4");
  EXPECT_EQ(parallel_label(parse_parallel("pp:4", "schedule=GPipe,microbatches=8,stage=3,return_outputs=false")),
            "pp:4 schedule=gpipe,microbatches=8,return_outputs=false,stage=3");
  EXPECT_EQ(parse_parallel("pp:4").gpus(), 4u);
  EXPECT_EQ(parse_parallel("pp:4", "schedule=InterleavedZeroBubble").schedule, PipelineSchedule::InterleavedZeroBubble);
  EXPECT_EQ(parallel_label(parse_parallel("pp:4", "schedule=ZBVZeroBubble")), "pp:4 schedule=zbvzerobubble");
  EXPECT_EQ(parse_parallel("pp:4", "schedule=DualPipeV").schedule, PipelineSchedule::DualPipeV);
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "schedule=LoopedBFS"); }).find("not modelled yet"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "schedule=2f2b"); }).find("expected gpipe, 1f1b, interleaved1f1b"),
            std::string::npos);
  EXPECT_EQ(parallel_label(parse_parallel("pp:4xtp:2", "schedule=Interleaved1F1B,layers_per_stage=3")),
            "pp:4xtp:2 schedule=interleaved1f1b,layers_per_stage=3");
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "layers_per_stage=0"); }).find("at least one layer"), std::string::npos);
  EXPECT_EQ(parallel_label(parse_parallel("pp:2xfsdp:2", "schedule=interleaved1f1b")), "pp:2xfsdp:2 schedule=interleaved1f1b");
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "microbatches=0"); }).find("at least one"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "stage=4"); }).find("has stages 0 to 3"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("pp:1"); }).find("single stage"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "microbatches=1025"); }).find("below 1025"), std::string::npos);
  EXPECT_TRUE(parse_parallel("pp:4", "stage = 0").stage_chosen);
  EXPECT_FALSE(parse_parallel("pp:4").stage_chosen);
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "bucket_cap_mb=5"); }).find("not an option of pp"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("pp:4xddp:8"); }).find("inside pipeline stages"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("pp:4xzero3:8"); }).find("inside pipeline stages"), std::string::npos);
  // The stage's mesh reads as it does alone, the pipeline's options after its own.
  EXPECT_EQ(parallel_label(parse_parallel("pp:4xtp:8", "loss_parallel=false,stage=2,rank=5")),
            "pp:4xtp:8 loss_parallel=false,rank=5,stage=2");
  EXPECT_EQ(parse_parallel("pp:4xtp:8").gpus(), 32u);
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "loss_parallel=false"); }).find("not an option of pp"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("pp:4xtp:2", "rank=2"); }).find("below 2"), std::string::npos);
  EXPECT_NE(error_of([] { parse_parallel("pp:4", "stage=1,stage=2"); }).find("twice"), std::string::npos);

  // What the schedules and PipelineStage refuse, and what is not modelled, before anything is made.
  const auto refused = [](const TrainConfig& cfg) { return error_of([&] { (void)train(cfg); }); };
  EXPECT_NE(refused(llama("microbatches=1")).find("must be at least the number of stages"), std::string::npos);
  EXPECT_NE(refused(llama("microbatches=3")).find("do not divide the batch"), std::string::npos);
  EXPECT_NE(refused(llama("microbatches=8")).find("at least one sample each"), std::string::npos);
  TrainConfig offloading = llama("");
  offloading.offload_activations = true;
  EXPECT_NE(refused(offloading).find("--offload activations"), std::string::npos);
  // The batch as micro-batches of one sample each: bounded by what a schedule is modelled with.
  EXPECT_NE(refused(llama("", "batch=2048,seq=128,attn=sdpa")).find("give microbatches=M"), std::string::npos);
  // Tied embeddings would put one weight on the first and the last stage.
  TrainConfig tied = llama("");
  std::string tied_json = kLlama;
  const std::string untied = "\"tie_word_embeddings\": false";
  tied_json.replace(tied_json.find(untied), untied.size(), "\"tie_word_embeddings\": true");
  tied.model = models::HfConfig::parse(tied_json, "ref-llama-tied", "test");
  EXPECT_NE(refused(tied).find("tied embeddings"), std::string::npos);
  // FSDP2 over four interleaved stages per rank (six layers, one a stage, on two ranks): the
  // runtime's window of three reshards a stage and gathers it again; three stay gathered.
  TrainConfig four = llama("schedule=interleaved1f1b,microbatches=4,layers_per_stage=1", "batch=4,seq=128,attn=sdpa",
                           "pp:2xfsdp:2");
  std::string six = kLlama;
  const std::string layers = "\"num_hidden_layers\": 4";
  six.replace(six.find(layers), layers.size(), "\"num_hidden_layers\": 6");
  four.model = models::HfConfig::parse(six, "ref-llama-6", "test");
  EXPECT_EQ(refused(four), "(no error)");
  EXPECT_EQ(refused(llama("schedule=interleaved1f1b,microbatches=4,layers_per_stage=1", "batch=4,seq=128,attn=sdpa",
                          "pp:2xfsdp:2")),
            "(no error)");
  TrainConfig beyond = llama("");
  beyond.parallel.stage = 2;  // set directly, past what the parser checks
  EXPECT_NE(refused(beyond).find("has stages 0 to 1"), std::string::npos);
  TrainConfig mlp;
  mlp.model = models::find("mlp");
  mlp.parallel = parse_parallel("pp:2");
  EXPECT_NE(refused(mlp).find("transformers decoder"), std::string::npos);
  TrainConfig computing = llama("");
  computing.mode = ExecMode::Compute;
  EXPECT_NE(refused(computing).find("dry run only"), std::string::npos);
}

TEST(PipelineParallel, TorchtitansSplit) {
  // generate_llm_fqn_per_model_part(8, 32): 34 effective layers, 4 per stage and 2 more for the
  // first two; the embedding and norm + lm_head take one each.
  const auto split = pipeline_split(32, 8);
  ASSERT_EQ(split.size(), 8u);
  EXPECT_EQ(split[0], (std::pair<std::size_t, std::size_t>{0, 4}));
  EXPECT_EQ(split[1], (std::pair<std::size_t, std::size_t>{4, 9}));
  EXPECT_EQ(split[2], (std::pair<std::size_t, std::size_t>{9, 13}));
  EXPECT_EQ(split[7], (std::pair<std::size_t, std::size_t>{29, 32}));
  // Four layers over four stages: 2 + 2 + 1 + 1 effective; the last stage is norm and lm_head alone.
  EXPECT_EQ(pipeline_split(4, 4),
            (std::vector<std::pair<std::size_t, std::size_t>>{{0, 1}, {1, 3}, {3, 4}, {4, 4}}));
  EXPECT_NE(error_of([] { pipeline_split(1, 4); }).find("leave a stage empty"), std::string::npos);
}

TEST(PipelineParallel, SchedulesRunInPyTorchsOrder) {
  // As torch 2.15 executed them, P = 4, M = 8 (forward_one_chunk / backward_one_chunk calls).
  EXPECT_EQ(order(pipeline_actions(PipelineSchedule::OneF1B, 4, 0, 8)),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(order(pipeline_actions(PipelineSchedule::OneF1B, 4, 1, 8)),
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(order(pipeline_actions(PipelineSchedule::OneF1B, 4, 3, 8)),
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  EXPECT_EQ(order(pipeline_actions(PipelineSchedule::GPipe, 4, 2, 3)), "F0 F1 F2 B0 B1 B2");
}

std::string interleaved(std::size_t ranks, std::size_t rank, std::size_t microbatches, std::size_t per_rank,
                        PipelineSchedule schedule = PipelineSchedule::Interleaved1F1B) {
  std::string out;
  bool closing = false;  // DualPipeV's OVERLAP_F_B in parentheses
  for (const PipelineAction& a : pipeline_actions(schedule, ranks, rank, microbatches, per_rank)) {
    if (!out.empty()) out += ' ';
    if (a.overlapped) out += '(';
    out += "FBIW"[static_cast<int>(a.compute)] + std::to_string(a.microbatch) + "s" + std::to_string(a.stage);
    if (closing) out += ')';
    closing = a.overlapped;
  }
  return out;
}

TEST(PipelineParallel, InterleavedRunsInPyTorchsOrder) {
  // ScheduleInterleaved1F1B(...).pipeline_order[rank] in torch 2.15, Nones left out: depth first,
  // rank 0 of 4 warms up with (V - 1) x 4 + 2 x 3 forwards, the last rank with 4.
  EXPECT_EQ(interleaved(4, 0, 8, 2),
            "F0s0 F1s0 F2s0 F3s0 F0s4 F1s4 F2s4 F3s4 F4s0 F5s0 F6s0 B0s4 F7s0 B1s4 F4s4 B2s4 F5s4 B3s4 F6s4 B0s0 "
            "F7s4 B1s0 B2s0 B3s0 B4s4 B5s4 B6s4 B7s4 B4s0 B5s0 B6s0 B7s0");
  EXPECT_EQ(interleaved(4, 3, 8, 2),
            "F0s3 F1s3 F2s3 F3s3 F0s7 B0s7 F1s7 B1s7 F2s7 B2s7 F3s7 B3s7 F4s3 B0s3 F5s3 B1s3 F6s3 B2s3 F7s3 B3s3 "
            "F4s7 B4s7 F5s7 B5s7 F6s7 B6s7 F7s7 B7s7 B4s3 B5s3 B6s3 B7s3");
  // Fewer micro-batches than ranks: one round of 2; three stages per rank.
  EXPECT_EQ(interleaved(3, 1, 2, 2), "F0s1 F1s1 F0s4 F1s4 B0s4 B1s4 B0s1 B1s1");
  EXPECT_EQ(interleaved(2, 0, 4, 3),
            "F0s0 F1s0 F0s2 F1s2 F0s4 F1s4 F2s0 B0s4 F3s0 B1s4 F2s2 B0s2 F3s2 B1s2 F2s4 B0s0 F3s4 B1s0 B2s4 B3s4 "
            "B2s2 B3s2 B2s0 B3s0");
  // Flexible rounds: 5 micro-batches on 4 ranks make 1 round of 5; 6 on 4 make 1 round of 6;
  // 10 on 4 make 2 rounds of 5; 9 on 4 would be 2 rounds, which 9 is not a multiple of.
  EXPECT_NO_THROW(pipeline_actions(PipelineSchedule::Interleaved1F1B, 4, 0, 10, 2));
  EXPECT_NE(error_of([] { pipeline_actions(PipelineSchedule::Interleaved1F1B, 4, 0, 9, 2); }).find("rounds"),
            std::string::npos);
}

TEST(PipelineParallel, ZeroBubbleSchedulesRunInPyTorchsOrder) {
  // _calculate_single_rank_operations of ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and
  // ScheduleDualPipeV
  // in torch 2.15, Nones left out: I is the input's half of a backward, W the weights'.
  constexpr auto zb1p = PipelineSchedule::InterleavedZeroBubble;
  // ZB1P warms up with one forward less per rank than interleaved 1F1B; rank r runs its first
  // W r backwards after its first I.
  EXPECT_EQ(interleaved(4, 0, 8, 2, zb1p),
            "F0s0 F1s0 F2s0 F3s0 F0s4 F1s4 F2s4 F3s4 I0s4 W0s4 F4s0 I1s4 W1s4 F5s0 I2s4 W2s4 F6s0 I3s4 W3s4 F7s0 "
            "I0s0 W0s0 F4s4 I1s0 W1s0 F5s4 I2s0 W2s0 F6s4 I3s0 W3s0 F7s4 I4s4 W4s4 I5s4 W5s4 I6s4 W6s4 I7s4 W7s4 "
            "I4s0 W4s0 I5s0 W5s0 I6s0 W6s0 I7s0 W7s0");
  EXPECT_EQ(interleaved(4, 3, 8, 2, zb1p),
            "F0s3 F1s3 F2s3 F3s3 F0s7 I0s7 F1s7 I1s7 F2s7 I2s7 F3s7 I3s7 W0s7 F4s3 I0s3 W1s7 F5s3 I1s3 W2s7 F6s3 "
            "I2s3 W3s7 F7s3 I3s3 W0s3 F4s7 I4s7 W1s3 F5s7 I5s7 W2s3 F6s7 I6s7 W3s3 F7s7 I7s7 W4s7 I4s3 W5s7 I5s3 "
            "W6s7 I6s3 W7s7 I7s3 W4s3 W5s3 W6s3 W7s3");
  // ZBV: rank r holds stages r and 2P - 1 - r; with fewer micro-batches than 2P - 1 the schedule
  // drops the ones past M.
  constexpr auto zbv = PipelineSchedule::ZBVZeroBubble;
  EXPECT_EQ(interleaved(2, 0, 4, 2, zbv),
            "F0s0 F1s0 F2s0 F0s3 I0s3 W0s3 F1s3 I1s3 W1s3 F3s0 I0s0 W0s0 F2s3 I2s3 W2s3 I1s0 W1s0 F3s3 I3s3 W3s3 "
            "I2s0 W2s0 I3s0 W3s0");
  EXPECT_EQ(interleaved(2, 1, 4, 2, zbv),
            "F0s1 F0s2 F1s1 F1s2 I0s2 W0s2 F2s1 I0s1 W0s1 F2s2 I1s2 W1s2 F3s1 I1s1 W1s1 F3s2 I2s2 W2s2 I2s1 I3s2 "
            "I3s1 W2s1 W3s2 W3s1");
  EXPECT_EQ(interleaved(3, 1, 2, 2, zbv), "F0s1 F1s1 F0s4 F1s4 I0s4 W0s4 I1s4 W1s4 I0s1 W0s1 I1s1 W1s1");
  // DualPipeV: ZBV's V, a forward and a whole backward overlapped in the steady state, the last
  // backwards split, their W from a queue.
  constexpr auto dualpipev = PipelineSchedule::DualPipeV;
  EXPECT_EQ(interleaved(2, 0, 4, 2, dualpipev),
            "F0s0 F1s0 F2s0 F0s3 I0s3 W0s3 F1s3 (F3s0 B1s3) (F2s3 B0s0) B2s3 (F3s3 B1s0) B3s3 I2s0 W2s0 I3s0 W3s0");
  EXPECT_EQ(interleaved(2, 1, 4, 2, dualpipev),
            "F0s1 F0s2 F1s1 F1s2 F2s1 B0s2 (F2s2 B0s1) (F3s1 B1s2) (F3s2 B1s1) B2s2 B2s1 I3s2 I3s1 W3s2 W3s1");
  EXPECT_EQ(interleaved(3, 2, 8, 2, dualpipev),
            "F0s2 F0s3 F1s2 F1s3 F2s2 F2s3 F3s2 B0s3 (F3s3 B0s2) (F4s2 B1s3) (F4s3 B1s2) (F5s2 B2s3) (F5s3 B2s2) "
            "(F6s2 B3s3) (F6s3 B3s2) (F7s2 B4s3) (F7s3 B4s2) B5s3 B5s2 B6s3 I6s2 I7s3 I7s2 W6s2 W7s3 W7s2");
  EXPECT_EQ(pipeline_rank_of(dualpipev, 3, 4), 1u);
  EXPECT_EQ(pipeline_rank_of(zbv, 3, 4), 1u);  // the V: stage 2P - 1 - r on rank r
  EXPECT_EQ(pipeline_rank_of(zb1p, 3, 4), 1u);  // the loop: stage r + P on rank r
  EXPECT_EQ(pipeline_rank_of(zbv, 3, 3), 2u);
  EXPECT_EQ(pipeline_rank_of(zb1p, 3, 3), 0u);
}

// ZB1P on pp:2 (four stages; rank 1 holds stages 1 and 3), two micro-batches of 2 x 128 tokens:
// between each I and its W the stage keeps what W starts from, each intermediate's incoming
// gradient (torch 2.15 stage_backward_input's param_groups), checked against PyTorch in
// models.pipeline_parallel.
TEST(PipelineParallel, ZeroBubbleKeepsWhatTheWeightHalfReadsUntilIt) {
  const OneStep run(llama("schedule=interleavedzerobubble,microbatches=2,stage=1"));
  std::vector<std::string> stash;
  std::vector<std::size_t> bytes;
  for (const CommunicationBuffer& b : run.trainer.communication_buffers()) {
    if (b.what.starts_with("stashed gradients")) {
      stash.push_back(b.what + " @ " + b.allocated + " -> " + b.freed);
      bytes.push_back(b.bytes);
    }
  }
  const std::vector<std::string> expected{
      "stashed gradients (stage 3, micro-batch 0) @ step 1 stage 3 backward input 0 -> step 1 stage 3 backward weight 0",
      "stashed gradients (stage 3, micro-batch 1) @ step 1 stage 3 backward input 1 -> step 1 stage 3 backward weight 1",
      "stashed gradients (stage 1, micro-batch 0) @ step 1 stage 1 backward input 0 -> step 1 stage 1 backward weight 0",
      "stashed gradients (stage 1, micro-batch 1) @ step 1 stage 1 backward input 1 -> step 1 stage 1 backward weight 1",
  };
  EXPECT_EQ(stash, expected);
  // The last stage: the final norm's output gradient [2, 128, 512] and lm_head's, the logits'
  // [256, 32000], in bf16.
  constexpr std::size_t kHidden = 2 * 128 * 512 * 2;
  ASSERT_EQ(bytes.size(), 4u);
  EXPECT_EQ(bytes[0], kHidden + 2u * 128 * 32000 * 2);
  // Stage 1's two layers: per layer the two norms', q's, o_proj's and down_proj's output
  // gradients (hidden-sized), k's and v's (4 heads of 64), gate's and up's (1376 wide).
  constexpr std::size_t kLayer = 5 * kHidden + 2 * (2 * 128 * 256 * 2) + 2 * (2 * 128 * 1376 * 2);
  EXPECT_EQ(bytes[2], 2 * kLayer);
  EXPECT_EQ(bytes[1], bytes[0]);
  EXPECT_EQ(bytes[3], bytes[2]);
  // DualPipeV refuses fewer micro-batches than stages.
  EXPECT_NE(error_of([] { (void)train(llama("schedule=dualpipev,microbatches=2")); }).find("at least as many"),
            std::string::npos);
}

// FSDP2 inside ZBV's stages on pp:2xfsdp:2: rank 0 holds stage 0 (the embedding) and stage 3
// (the norm and lm_head), each a root of its own, gathered by the runtime's UNSHARD and
// reduce-scattered by its REDUCE_GRAD after the stage's last W.
TEST(PipelineParallel, FullyShardInsideAVHasARootPerStage) {
  const OneStep run(llama("schedule=zbvzerobubble,microbatches=4,stage=0", "batch=4,seq=128,attn=sdpa", "pp:2xfsdp:2"));
  std::vector<std::string> roots;
  for (const CommunicationBuffer& b : run.trainer.communication_buffers()) {
    if (b.what.starts_with("root reduce-scatter input")) roots.push_back(b.allocated);
  }
  // The last stage's W come first on rank 0 (its cool-down ends with stage 0's).
  EXPECT_EQ(roots, (std::vector<std::string>{"step 1 stage 3 backward weight 3", "step 1 stage 0 backward weight 3"}));
  // Two fully_shard calls' shards (bf16, half of each): the embedding's [16000, 512]; lm_head's
  // and the final norm's [256].
  std::vector<std::size_t> shards;
  for (const CommunicationBuffer& b : run.trainer.communication_buffers()) {
    if (b.what == "root shards") shards.push_back(b.bytes);
  }
  EXPECT_EQ(shards, (std::vector<std::size_t>{16000u * 512 * 2, 16000u * 512 * 2 + 256 * 2}));
}

TEST(PipelineParallel, StagesPerRankAsTorchtitanCountsThem) {
  ParallelConfig config = parse_parallel("pp:4", "schedule=interleaved1f1b");
  EXPECT_EQ(pipeline_stages_per_rank(config, 32), 2u);  // the default of multi-stage schedules
  config.layers_per_stage = 2;                             // ceil(34 / 2) = 17 stages: not a multiple of 4
  EXPECT_NE(error_of([&] { pipeline_stages_per_rank(config, 32); }).find("do not divide"), std::string::npos);
  config.layers_per_stage = 3;  // ceil(34 / 3) = 12 stages, 3 per rank
  EXPECT_EQ(pipeline_stages_per_rank(config, 32), 3u);
  config.layers_per_stage = 9;  // 4 stages, one per rank: a multi-stage schedule needs two
  EXPECT_NE(error_of([&] { pipeline_stages_per_rank(config, 32); }).find("at least two"), std::string::npos);
  config.schedule = PipelineSchedule::OneF1B;
  EXPECT_EQ(pipeline_stages_per_rank(config, 32), 1u);
  config.layers_per_stage = 3;
  EXPECT_NE(error_of([&] { pipeline_stages_per_rank(config, 32); }).find("single-stage"), std::string::npos);
}

// Interleaved 1F1B on pp:3 with two stages per rank, four layers: six stages (the first the
// embedding alone, the last norm and lm_head alone), rank r holding stages r and r + 3.
TEST(PipelineParallel, InterleavedRankHoldsItsStagesAndKeepsWhatTheRuntimeKeeps) {
  constexpr std::int64_t kLayer = 2 * (512 * 512 + 2 * 256 * 512 + 512 * 512 + 3 * 1376 * 512 + 2 * 512);
  constexpr std::int64_t kTable = 2 * 32000 * 512;
  const auto run = [](std::size_t rank) {
    return std::make_unique<OneStep>(llama("schedule=interleaved1f1b,microbatches=2,stage=" + std::to_string(rank),
                                           "batch=2,seq=128,attn=sdpa", "pp:3"));
  };
  const auto first = run(0), middle = run(1), last = run(2);
  EXPECT_EQ(first->trainer.report().parameter_bytes, kTable + kLayer);       // stages 0 and 3: layer 2
  EXPECT_EQ(middle->trainer.report().parameter_bytes, 2 * kLayer);           // stages 1 and 4: layers 0 and 3
  EXPECT_EQ(last->trainer.report().parameter_bytes, kLayer + 2 * 512 + kTable);  // stages 2 and 5: layer 1, lm_head
  // As the runtime's lowered actions run on rank 1 (torch 2.15: 1RECV_F0 1F0 1SEND_F0 1RECV_F1
  // 1F1 1SEND_F1 4RECV_F0 4F0 4SEND_F0 4RECV_F1 4F1 4SEND_F1 4RECV_B0 4B0 4WAIT_SEND_F0 4SEND_B0
  // ... 1B1 1WAIT_SEND_F1 1SEND_B1, then every WAIT_SEND_B): a forward's output lives until that
  // stage's own backward, each gradient sent until the step's last action.
  std::vector<std::string> log;
  for (const CommunicationBuffer& b : middle->trainer.communication_buffers()) {
    if (b.what.find("micro-batch") != std::string::npos) log.push_back(b.what + " @ " + b.allocated + " -> " + b.freed);
  }
  const std::vector<std::string> expected{
      "receive activations (stage 1, micro-batch 0) @ construction -> step 1 stage 1 backward 0",
      "send activations (stage 1, micro-batch 0) @ step 1 stage 1 forward 0 -> step 1 stage 1 backward 0",
      "receive activations (stage 1, micro-batch 1) @ step 1 stage 1 forward 0 -> step 1 stage 1 backward 1",
      "send activations (stage 1, micro-batch 1) @ step 1 stage 1 forward 1 -> step 1 stage 1 backward 1",
      "receive activations (stage 4, micro-batch 0) @ step 1 stage 1 forward 1 -> step 1 stage 4 backward 0",
      "send activations (stage 4, micro-batch 0) @ step 1 stage 4 forward 0 -> step 1 stage 4 backward 0",
      "receive activations (stage 4, micro-batch 1) @ step 1 stage 4 forward 0 -> step 1 stage 4 backward 1",
      "send activations (stage 4, micro-batch 1) @ step 1 stage 4 forward 1 -> step 1 stage 4 backward 1",
      "receive gradients (stage 4, micro-batch 0) @ step 1 stage 4 forward 1 -> step 1 stage 4 backward 0",
      "send gradients (stage 4, micro-batch 0) @ step 1 stage 4 backward 0 -> step 1 stage 1 backward 1",
      "receive gradients (stage 4, micro-batch 1) @ step 1 stage 4 backward 0 -> step 1 stage 4 backward 1",
      "send gradients (stage 4, micro-batch 1) @ step 1 stage 4 backward 1 -> step 1 stage 1 backward 1",
      "receive gradients (stage 1, micro-batch 0) @ step 1 stage 4 backward 1 -> step 1 stage 1 backward 0",
      "send gradients (stage 1, micro-batch 0) @ step 1 stage 1 backward 0 -> step 1 stage 1 backward 1",
      "receive gradients (stage 1, micro-batch 1) @ step 1 stage 1 backward 0 -> step 1 stage 1 backward 1",
      "send gradients (stage 1, micro-batch 1) @ step 1 stage 1 backward 1 -> step 1 stage 1 backward 1",
  };
  EXPECT_EQ(log, expected);
}

TEST(PipelineParallel, StageHoldsItsLayersOnly) {
  // pp:2 of four layers: stage 0 the embedding and layers 0-1, stage 1 layers 2-3, the norm and lm_head.
  constexpr std::int64_t kLayer = 2 * (512 * 512 + 2 * 256 * 512 + 512 * 512 + 3 * 1376 * 512 + 2 * 512);
  constexpr std::int64_t kTable = 2 * 32000 * 512;
  OneStep first(llama("microbatches=2"));
  OneStep last(llama("microbatches=2,stage=1"));
  EXPECT_EQ(first.trainer.report().parameter_bytes, kTable + 2 * kLayer);
  EXPECT_EQ(last.trainer.report().parameter_bytes, 2 * kLayer + 2 * 512 + kTable);
  EXPECT_EQ(first.trainer.model().body().size(), 4u);  // embed_tokens, rotary_emb, 2 layers
  EXPECT_EQ(last.trainer.model().body().size(), 5u);   // rotary_emb, 2 layers, norm, lm_head
}

// Tensor parallel inside each stage (pp:2xtp:2): the stage's part sharded as torchtitan's plan
// shards it (the first stage's embedding rows, the last stage's lm_head columns), the hidden
// states between stages the rank's half of the sequence, the logits kept its half of the vocabulary.
TEST(PipelineParallel, TensorParallelInsideTheStages) {
  constexpr std::int64_t kLayer = 2 * ((256 + 2 * 128) * 512 + 512 * 256 + 3 * 688 * 512 + 2 * 512);
  constexpr std::int64_t kHalfTable = 2 * 16000 * 512;
  OneStep first(llama("microbatches=4", "batch=4,seq=128,attn=sdpa", "pp:2xtp:2"));
  OneStep last(llama("microbatches=4,stage=1", "batch=4,seq=128,attn=sdpa", "pp:2xtp:2"));
  EXPECT_EQ(first.trainer.report().parameter_bytes, kHalfTable + 2 * kLayer);
  EXPECT_EQ(last.trainer.report().parameter_bytes, 2 * kLayer + 2 * 512 + kHalfTable);
  const auto buffers = last.trainer.communication_buffers();
  const auto bytes_of = [&](const std::string& what) {
    const auto it = std::find_if(buffers.begin(), buffers.end(),
                                 [&](const CommunicationBuffer& b) { return b.what.starts_with(what); });
    return it == buffers.end() ? std::size_t{0} : it->bytes;
  };
  EXPECT_EQ(bytes_of("receive activations"), 1u * 64 * 512 * 2);
  EXPECT_EQ(bytes_of("output chunk"), 1u * 128 * 16000 * 2);  // loss_parallel: [b, S, V / 2]
  EXPECT_GT(bytes_of("model.layers.2.self_attn input all-gather"), 0u);  // tensor parallel's own, after
}

// The forward phase (until the first backward) of a middle stage grows, past the batch, by what is made once (the
// cuBLAS workspace) and by each micro-batch in flight: its receive buffer and what its layers
// save. GPipe keeps all M; 1F1B P - s of them, however many there are, and the last one's output,
// not released before the first backward.
TEST(PipelineParallel, MicroBatchesInFlightExactly) {
  const auto growth = [](const std::string& options, int batch) {
    const OneStep run(llama(options, "batch=" + std::to_string(batch) + ",seq=128,attn=sdpa", "pp:4"));
    // Less the batch and the labels every rank uploads ([B, S] i64 each).
    return run.stats.forward.allocated_end - run.stats.forward.allocated_begin - 2 * batch * 128 * 8;
  };
  const std::int64_t gpipe4 = growth("schedule=gpipe,microbatches=4,stage=1", 4);
  const std::int64_t gpipe2 = growth("schedule=gpipe,microbatches=2,stage=1", 2);
  const std::int64_t unit = (gpipe4 - gpipe2) / 2;  // one micro-batch of one sample
  const std::int64_t once = gpipe2 - 2 * unit;
  const std::int64_t output = 1 * 128 * 512 * 2;  // its [1, S, H] bf16 hidden states
  ASSERT_GT(unit, output);
  ASSERT_EQ((gpipe4 - gpipe2) % 2, 0);
  EXPECT_EQ(growth("schedule=gpipe,microbatches=8,stage=1", 8), once + 8 * unit);
  // Stage 1 of 4 under 1F1B: 3 micro-batches in flight, whether there are 4 or 8.
  EXPECT_EQ(growth("microbatches=4,stage=1", 4), once + 3 * unit + output);
  EXPECT_EQ(growth("microbatches=8,stage=1", 8), once + 3 * unit + output);
  // Every buffer received is accounted: stage 1 received 4 micro-batches' activations and
  // gradients, [1, 128, 512] bf16 each.
  const OneStep run(llama("microbatches=4,stage=1", "batch=4,seq=128,attn=sdpa", "pp:4"));
  const auto buffers = run.trainer.communication_buffers();
  const auto count = [&](const std::string& what) {
    return std::count_if(buffers.begin(), buffers.end(), [&](const CommunicationBuffer& b) {
      return b.what.starts_with(what) && b.bytes == static_cast<std::size_t>(output);
    });
  };
  EXPECT_EQ(count("receive activations"), 4);
  EXPECT_EQ(count("receive gradients"), 4);
  EXPECT_EQ(count("send activations"), 4);
  EXPECT_EQ(count("send gradients"), 4);
}

// With every layer checkpointed, each micro-batch in flight keeps its layers' inputs (and its
// own rotary cos and sin for the recompute, as transformers' checkpointed calls hold them), and
// each backward recomputes its own micro-batch: the same in-flight arithmetic, a smaller unit.
TEST(PipelineParallel, CheckpointedMicroBatchesInFlight) {
  const auto run = [](const std::string& options, int batch) {
    return std::make_unique<OneStep>(
        llama(options, "batch=" + std::to_string(batch) + ",seq=128,attn=sdpa,checkpoint=non-reentrant", "pp:4"));
  };
  const auto growth = [](const OneStep& r, int batch) {
    return r.stats.forward.allocated_end - r.stats.forward.allocated_begin - 2 * batch * 128 * 8;
  };
  const auto gpipe4 = run("schedule=gpipe,microbatches=4,stage=1", 4);
  const auto gpipe2 = run("schedule=gpipe,microbatches=2,stage=1", 2);
  const std::int64_t unit = (growth(*gpipe4, 4) - growth(*gpipe2, 2)) / 2;
  const std::int64_t once = growth(*gpipe2, 2) - 2 * unit;
  const std::int64_t output = 1 * 128 * 512 * 2;
  const auto plain = std::make_unique<OneStep>(llama("schedule=gpipe,microbatches=4,stage=1", "batch=4,seq=128,attn=sdpa", "pp:4"));
  EXPECT_LT(growth(*gpipe4, 4), growth(*plain, 4));  // checkpointing keeps less per micro-batch
  EXPECT_GT(unit, output);
  EXPECT_EQ(growth(*run("microbatches=8,stage=1", 8), 8), once + 3 * unit + output);
  // Every recompute found its own call's inputs: each layer reran once per micro-batch, all of
  // the forward but the rotary embedding's cos and sin (computed outside the layers).
  EXPECT_LT(gpipe4->stats.flops.recompute, gpipe4->stats.flops.forward);
  EXPECT_GT(gpipe4->stats.flops.recompute, 0.999 * gpipe4->stats.flops.forward);
}

// The last stage keeps every micro-batch's logits until the next step (return_outputs=True) and
// makes torch.cat of them: the optimizer's phase holds them; without return_outputs it does not.
TEST(PipelineParallel, LastStageKeepsItsOutputs) {
  const std::int64_t logits = 4 * 128 * 32000 * 2;  // the batch's bf16 logits
  const OneStep keeping(llama("microbatches=4,stage=1"));
  const OneStep dropping(llama("microbatches=4,stage=1,return_outputs=false"));
  // Each chunk's 8,192,000 B block may carry a remainder under 1 MiB that the caching allocator
  // does not split off (kLargeBuffer's rule): allocated counts blocks.
  const std::int64_t kept = keeping.stats.optimizer.allocated_begin - dropping.stats.optimizer.allocated_begin;
  EXPECT_GE(kept, logits);
  EXPECT_LT(kept, logits + 4 * (std::int64_t{1} << 20));
  const auto buffers = keeping.trainer.communication_buffers();
  EXPECT_EQ(buffers.back().what, "merged output");
  EXPECT_EQ(buffers.back().bytes, static_cast<std::size_t>(logits));
}

// FSDP2 inside each stage (pp:2xfsdp:2), as torchtitan applies it under pp: the parameters
// gathered once per step (reshard_after_forward=False), every micro-batch's gradients added into
// the unsharded ones, reduce-scattered once after the last backward; with torchtitan's mixed
// precision (f32 parameters, bf16 compute, f32 reduction) those gradients accumulate in f32.
TEST(PipelineParallel, FullyShardInsideTheStages) {
  const ParallelConfig mesh = parse_parallel("pp:4xfsdp:2xtp:8", "microbatches=8,reshard_after_forward=true,stage=1,rank=1");
  EXPECT_EQ(mesh.pipeline_parallel, 4u);
  EXPECT_EQ(mesh.engine, ParallelEngine::Fsdp);
  EXPECT_EQ(mesh.world_size, 2u);
  EXPECT_EQ(mesh.tensor_parallel, 8u);
  EXPECT_EQ(mesh.gpus(), 64u);
  EXPECT_EQ(mesh.rank, 1u);  // FSDP's rank, as in fsdp:MxTP:N
  EXPECT_EQ(parallel_label(mesh), "pp:4xfsdp:2xtp:8 reshard_after_forward=true,rank=1,microbatches=8,stage=1");
  const std::string unknown = error_of([] { parse_parallel("pp:2xfsdp:2", "bucket_cap_mb=5"); });
  EXPECT_NE(unknown.find("not an option of fsdp"), std::string::npos);
  EXPECT_NE(unknown.find("pp's: schedule"), std::string::npos);

  // Stage 0 of a four-layer Llama over two stages: the embedding and layers 0 and 1.
  constexpr std::size_t kLayer = 2 * ((512 + 2 * 256) * 512 + 512 * 512 + 3 * 1376 * 512 + 2 * 512);
  constexpr std::size_t kTable = 2 * 32000 * 512;
  const OneStep plain(llama("microbatches=4", "batch=4,seq=128,attn=sdpa", "pp:2xfsdp:2"));
  EXPECT_EQ(plain.trainer.report().parameter_bytes, static_cast<std::int64_t>((kTable + 2 * kLayer) / 2));
  const auto buffers = plain.trainer.communication_buffers();
  const auto all = [&](const std::string& what) {
    std::vector<std::size_t> out;
    for (const CommunicationBuffer& b : buffers) {
      if (b.what == what) out.push_back(b.bytes);
    }
    return out;
  };
  EXPECT_EQ(all("model.layers.0 all-gather output"), std::vector<std::size_t>{kLayer});  // once, not per micro-batch
  EXPECT_EQ(all("root all-gather output"), std::vector<std::size_t>{kTable});
  EXPECT_EQ(all("model.layers.0 unsharded gradients (accumulated)"), std::vector<std::size_t>{kLayer});
  EXPECT_EQ(all("model.layers.0 reduce-scatter input"), std::vector<std::size_t>{kLayer});
  EXPECT_EQ(all("model.layers.0 reduce-scatter output (sharded gradients)"), std::vector<std::size_t>{kLayer / 2});
  for (const CommunicationBuffer& b : buffers) {
    if (b.what.ends_with("reduce-scatter input")) {
      EXPECT_EQ(b.allocated, "step 1 backward 3") << b.what;
    }
  }
  // reshard_after_forward=True: a micro-batch's forward gathers a layer again once an earlier
  // forward resharded it; a backward, once its parameters stay gathered, does not reshard.
  const OneStep resharding(llama("microbatches=4,reshard_after_forward=true", "batch=4,seq=128,attn=sdpa", "pp:2xfsdp:2"));
  std::size_t gathers = 0;
  for (const CommunicationBuffer& b : resharding.trainer.communication_buffers()) {
    gathers += b.what == "model.layers.0 all-gather output" ? 1 : 0;
  }
  EXPECT_GT(gathers, 1u);
  EXPECT_GT(plain.stats.peak_allocated, 0);

  // Mixed precision: the unsharded parameters in bf16, their gradients kept in f32.
  TrainConfig mixed = llama("microbatches=4,param_dtype=bf16,reduce_dtype=f32", "batch=4,seq=128,attn=sdpa",
                            "pp:2xfsdp:2");
  mixed.precision = Precision::F32;
  const OneStep wide(mixed);
  const auto log = wide.trainer.communication_buffers();
  const auto bytes_of = [&](const std::string& what) {
    const auto it = std::find_if(log.begin(), log.end(), [&](const CommunicationBuffer& b) { return b.what == what; });
    return it == log.end() ? std::size_t{0} : it->bytes;
  };
  EXPECT_EQ(bytes_of("model.layers.0 unsharded parameters"), kLayer);
  EXPECT_EQ(bytes_of("model.layers.0 unsharded gradients (accumulated)"), 2 * kLayer);
  EXPECT_EQ(bytes_of("receive activations (micro-batch 0)"), 0u);  // stage 0 receives none
  // With tensor parallel too, the embedding's gradient is the whole table (a Replicate DTensor
  // gradient of the vocabulary-sharded weight), kept in f32 from the first micro-batch on.
  TrainConfig three_d = mixed;
  three_d.parallel = parse_parallel("pp:2xfsdp:2xtp:2", "microbatches=4,param_dtype=bf16,reduce_dtype=f32");
  const OneStep whole(three_d);
  std::vector<std::size_t> table;
  for (const CommunicationBuffer& b : whole.trainer.communication_buffers()) {
    if (b.what == "root unsharded gradients (accumulated)") table.push_back(b.bytes);
  }
  EXPECT_EQ(table, std::vector<std::size_t>{32000u * 512 * 4});
  TrainConfig mixed_last = mixed;
  mixed_last.parallel.stage = 1;
  const OneStep wide_last(mixed_last);
  for (const CommunicationBuffer& b : wide_last.trainer.communication_buffers()) {
    if (b.what == "receive activations (micro-batch 0)") {
      EXPECT_EQ(b.bytes, 1u * 128 * 512 * 2);  // bf16 hidden states
    }
  }
}

}  // namespace
}  // namespace mem::nn
