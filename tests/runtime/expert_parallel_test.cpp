// expert_parallel_test.cpp — expert parallel (issue 50): one GPU's recording of a tiny Qwen3-MoE
// under transformers' DistributedConfig(ep_size=2) (tests/data/qwen3moe-ep2.json, written by
// `python3 -m vramscope.export --hf-config tests/data/qwen3moe-tiny.config.json --expert-parallel
// 2 --batch 2 --seq 16`), run under ep:2 and fsdp:4 with ep_size=2. The byte counts follow from
// the config: 8 experts of moe_intermediate_size 32 on hidden 64, top-2, batch 2 x 16 tokens.
// models.expert_parallel checks the same against PyTorch and transformers on the CPU.
#include <cstdint>
#include <functional>
#include <tuple>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::nn {
namespace {

const std::string kRecording = std::string(VRAMSCOPE_TEST_DATA_DIR) + "/qwen3moe-ep2.json";

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(ExpertParallel, MeshesOptionsAndRefusals) {
  const ParallelConfig alone = parse_parallel("ep:4");
  EXPECT_EQ(alone.engine, ParallelEngine::Fsdp);
  EXPECT_EQ(alone.world_size, 4u);
  EXPECT_EQ(alone.expert_parallel, 4u);
  EXPECT_EQ(alone.gpus(), 4u);
  EXPECT_EQ(parallel_label(alone), "ep:4");
  const ParallelConfig inside = parse_parallel("fsdp:8", "ep_size=4,rank=5");
  EXPECT_EQ(inside.world_size, 8u);
  EXPECT_EQ(inside.expert_parallel, 4u);
  EXPECT_EQ(parallel_label(inside), "fsdp:8 ep_size=4,rank=5");
  EXPECT_EQ(parse_parallel("fsdp:4", "ep_size=4"), parse_parallel("ep:4"));
  EXPECT_EQ(parse_parallel("ep:4", "ep_size=4"), parse_parallel("ep:4"));  // a list's options apply to each
  for (const auto& [spec, options, words] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"ep:1", "", "ep:1 splits no experts"},
           {"ep:2xtp:2", "", "expert parallel is modelled alone"},
           {"pp:2xep:2", "", "expert parallel is modelled alone"},
           {"pp:2xfsdp:4", "ep_size=2", "expert parallel inside pipeline stages"},
           {"fsdp:8", "ep_size=3", "expected a divisor of 8"},
           {"fsdp:8", "ep_size=1", "expected a divisor of 8"},
           {"fsdp:2xtp:2", "ep_size=2", "with tp or cp is not modelled"},
           {"ep:4", "reshard_after_forward=false", "passes its own"},
           {"fsdp:4", "ep_size=2,reshard_after_forward=2", "passes its own"},
           {"ep:4", "ep_size=2", "give ep_size with fsdp:M instead"},
           {"ep:4", "ep_size=8", "expected a divisor of 4"},
           {"ddp:4", "ep_size=2", "not an option of ddp"},
       }) {
    EXPECT_NE(test::error_of([&] { parse_parallel(spec, options); }).find(words), std::string::npos)
        << spec << " " << options << ": " << test::error_of([&] { parse_parallel(spec, options); });
  }
}

/// One step of rank 0: the all-to-alls' buffers (the received rows, forward and backward), the
/// experts' shards (whole under ep:2, halved over efsdp = 2 under fsdp:4) and FSDP2's groups as
/// transformers calls fully_shard.
TEST(ExpertParallel, RunsTheRecordingOfOneRank) {
  const auto model = models::ModelFile::load(kRecording);
  ASSERT_EQ(model->describe().expert_parallel, 2u);
  const auto run = [&](const std::string& parallel, const std::string& options, const std::string& skew = "1") {
    TrainConfig cfg;
    cfg.model = model;
    cfg.model_options = ModelOptions::parse("batch=2,seq=16,expert_skew=" + skew);
    cfg.precision = Precision::BF16;
    cfg.device = "sim:h100-80g";
    cfg.parallel = parse_parallel(parallel, options);
    test::OneStep step(cfg);
    return std::make_pair(step.trainer.communication_buffers(), step.stats);
  };
  const auto [buffers, stats] = run("ep:2", "");
  // tokens x top_k = 64 rows of hidden 64 in bf16, sent to the experts' GPUs and back; in
  // backward each gradient goes back the same way.
  std::vector<std::string> all_to_all;
  for (const CommunicationBuffer& b : buffers) {
    if (b.what.starts_with("_c10d_functional.all_to_all_single")) {
      all_to_all.push_back(b.allocated + " " + std::to_string(b.bytes));
    }
  }
  const std::vector<std::string> expected = {"step 1 forward 8192",  "step 1 forward 8192",  "step 1 forward 8192",
                                             "step 1 forward 8192",  "step 1 backward 8192", "step 1 backward 8192",
                                             "step 1 backward 8192", "step 1 backward 8192"};
  EXPECT_EQ(all_to_all, expected);
  EXPECT_GT(stats.communication_bytes, 0);
  const auto shards = [](const std::vector<CommunicationBuffer>& log, const std::string& group) {
    for (const CommunicationBuffer& b : log) {
      if (b.what == group + " shards") return static_cast<std::int64_t>(b.bytes);
    }
    return std::int64_t{-1};
  };
  // 4 local experts: gate_up_proj [4, 64, 64] and down_proj [4, 64, 32], bf16.
  EXPECT_EQ(shards(buffers, "model.layers.0.mlp.experts"), (4 * 64 * 64 + 4 * 64 * 32) * 2);
  // transformers' fully_shard([norm, lm_head]): one group of both, kept gathered after forward.
  EXPECT_EQ(shards(buffers, "model.norm+lm_head"), (64 + 128 * 64) / 2 * 2);
  EXPECT_EQ(shards(buffers, "root"), -1);  // the root holds no parameter of its own
  // expert_skew=2: the GPU shown receives twice its share, so the dispatch's output and the
  // gradient of what its experts return are twice as large (at most every pair: 2 x 64 rows here).
  for (const std::string skew : {"2", "3"}) {
    std::vector<std::int64_t> skewed;
    for (const CommunicationBuffer& b : run("ep:2", "", skew).first) {
      if (b.what.starts_with("_c10d_functional.all_to_all_single")) skewed.push_back(static_cast<std::int64_t>(b.bytes));
    }
    EXPECT_EQ(skewed, (std::vector<std::int64_t>{16384, 8192, 16384, 8192, 16384, 8192, 16384, 8192})) << skew;
  }
  const auto described = model->describe(ModelOptions::parse("batch=2,seq=16,expert_skew=3")).assumed;
  EXPECT_NE(described.back().find("receives 128 rows, the most it can"), std::string::npos) << described.back();
  const auto [halved, _] = run("fsdp:4", "ep_size=2");
  EXPECT_EQ(shards(halved, "model.layers.0.mlp.experts"), (4 * 64 * 64 + 4 * 64 * 32) * 2 / 2);
  EXPECT_EQ(shards(halved, "model.embed_tokens"), 128 * 64 * 2 / 4);
}

/// A recording under expert parallel runs only as what it recorded, and expert parallel runs only
/// on such a recording; the file's expert_parallel is checked as any other key.
TEST(ExpertParallel, RefusesWhatDoesNotMatch) {
  const auto step = [](std::shared_ptr<const ModelSource> model, const std::string& options, const std::string& parallel) {
    TrainConfig cfg;
    cfg.model = std::move(model);
    cfg.model_options = ModelOptions::parse(options);
    cfg.device = "sim:h100-80g";
    cfg.precision = Precision::BF16;
    cfg.parallel = parse_parallel(parallel);
    return test::error_of([&] { test::OneStep run(cfg); });
  };
  const auto recorded = models::ModelFile::load(kRecording);
  EXPECT_NE(step(recorded, "batch=2,seq=16", "fsdp:2").find("give --parallel ep:2"), std::string::npos);
  EXPECT_NE(step(recorded, "batch=2,seq=16", "none").find("give --parallel ep:2"), std::string::npos);
  EXPECT_NE(step(recorded, "batch=2,seq=16", "ep:4").find("--expert-parallel 4"), std::string::npos);
  EXPECT_NE(step(models::find("mlp"), "", "ep:2").find("record it with"), std::string::npos);

  const nlohmann::json doc = nlohmann::json::parse(read_text(kRecording));
  const auto refused = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json bad = doc;
    edit(bad);
    return test::error_of([&] { models::ModelFile::parse(bad.dump(), "bad.json")->describe(); });
  };
  EXPECT_NE(refused([](nlohmann::json& d) { d["expert_parallel"]["ranks"] = 1; }).find("2 to"), std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) { d["expert_parallel"]["modules"] = {"model.nowhere"}; })
                .find("'model.nowhere' is no module"),
            std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) { d["expert_parallel"]["extra"] = 1; }).find("unknown key 'extra'"),
            std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) { d["expert_parallel"].erase("received"); }).find("received: is required"),
            std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) { d["expert_parallel"]["received"] = "2*batch*seq+1"; })
                .find("a multiple of top_k"),
            std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) { d["options"].erase("expert_skew"); }).find("declares the option expert_skew"),
            std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) { d["expert_parallel"]["fsdp"].erase(d["expert_parallel"]["fsdp"].size() - 1); })
                .find("the root (\"\") is the last call's"),
            std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) { d["expert_parallel"]["fsdp"][1] = d["expert_parallel"]["fsdp"][0]; })
                .find("is in two groups"),
            std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) { d["expert_parallel"]["fsdp"][0]["mesh"] = "tp"; }).find("\"efsdp\""),
            std::string::npos);
  EXPECT_NE(refused([](nlohmann::json& d) {
              d.erase("graph");
              d["layers"] = nlohmann::json::array({{{"type", "Linear"}, {"in", 4}, {"out", 4}}});
            }).find("goes with \"graph\""),
            std::string::npos);
}

}  // namespace
}  // namespace mem::nn
