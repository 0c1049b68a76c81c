// layout_search_test.cpp — `plan --parallel auto`: which meshes of N GPUs are tried for a
// decoder and for another model, and the search's ranking and communication figures, exact
// where the engines determine them.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/planner/errors.hpp"
#include "vramscope/planner/layout_search.hpp"

namespace mem::planner {
namespace {

// The two-layer Llama of tests/data/h100-parallel-2026-11-26 with four layers.
std::shared_ptr<const nn::ModelSource> llama() {
  std::ifstream file(std::string(VRAMSCOPE_TEST_DATA_DIR) + "/h100-parallel-2026-11-26/ref-llama-2layer.json");
  std::string json((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const std::string two = "\"num_hidden_layers\": 2";
  json.replace(json.find(two), two.size(), "\"num_hidden_layers\": 4");
  return models::HfConfig::parse(json, "ref-llama", "test");
}

LayoutSearchSpec llama_spec(std::size_t gpus, std::int64_t global_batch) {
  LayoutSearchSpec spec;
  spec.base.model = llama();
  spec.base.model_options = nn::ModelOptions::parse("seq=128,attn=sdpa");
  spec.base.device = "sim:h100-80g";
  spec.base.precisions = {nn::Precision::BF16};
  spec.base.alloc_confs = {""};
  spec.base.segments = {0};
  spec.gpus = gpus;
  spec.global_batch = global_batch;
  return spec;
}

nn::ModelInfo info_of(const SweepSpec& base) {
  SweepSpec one = base;
  one.model_options.batch = 1;
  return validate_sweep(one);
}

std::set<std::string> meshes(const std::vector<LayoutCandidate>& layouts, const std::string& checkpoint) {
  std::set<std::string> out;
  for (const LayoutCandidate& c : layouts) {
    if (c.checkpoint == checkpoint) out.insert(nn::parallel_label(c.parallel));
  }
  return out;
}

TEST(LayoutSearch, TheMeshesOfEightGpus) {
  const LayoutSearchSpec spec = llama_spec(8, 16);
  const std::vector<LayoutCandidate> layouts = layout_candidates(spec, info_of(spec.base));
  // Data parallel divides the global batch; tensor parallel stays in the node; one sample per
  // micro-batch, at least one per stage; every mesh with and without checkpointing.
  // A pipeline is tried under interleaved 1F1B too (two stages per rank), its micro-batches a
  // multiple of the ranks; context parallel inside FSDP2 with rings up to a node.
  const std::set<std::string> expected{"fsdp:8", "ddp:8", "pp:2xfsdp:4 microbatches=4",
                                       "pp:2xfsdp:4 schedule=interleaved1f1b,microbatches=4",
                                       "pp:4xfsdp:2 microbatches=8", "pp:4xfsdp:2 schedule=interleaved1f1b,microbatches=8",
                                       "pp:8 microbatches=16", "pp:8 schedule=interleaved1f1b,microbatches=16",
                                       "fsdp:4xtp:2", "pp:2xfsdp:2xtp:2 microbatches=8",
                                       "pp:2xfsdp:2xtp:2 schedule=interleaved1f1b,microbatches=8",
                                       "pp:4xtp:2 microbatches=16", "pp:4xtp:2 schedule=interleaved1f1b,microbatches=16",
                                       "fsdp:2xtp:4", "pp:2xtp:4 microbatches=16",
                                       "pp:2xtp:4 schedule=interleaved1f1b,microbatches=16", "tp:8",
                                       // Context parallel inside FSDP2, rings of 2 to 8.
                                       "fsdp:4xcp:2", "fsdp:2xcp:4", "cp:8"};
  EXPECT_EQ(meshes(layouts, "none"), expected);
  EXPECT_EQ(meshes(layouts, "non-reentrant"), expected);
  EXPECT_EQ(layouts.size(), 2 * expected.size());
  for (const LayoutCandidate& c : layouts) {
    EXPECT_EQ(c.batch * static_cast<std::int64_t>(c.replicas), 16) << c.label();
    EXPECT_EQ(c.parallel.gpus(), 8u) << c.label();
  }
  // A global batch 8 ranks do not divide: no 8-way data parallel.
  const LayoutSearchSpec odd = llama_spec(8, 12);
  const std::set<std::string> some = meshes(layout_candidates(odd, info_of(odd.base)), "none");
  EXPECT_EQ(some.count("fsdp:8"), 0u);
  EXPECT_EQ(some.count("fsdp:4xtp:2"), 1u);
  // A model that is no transformers decoder: data parallel alone, its own checkpointing.
  LayoutSearchSpec mlp = llama_spec(8, 16);
  mlp.base.model = models::find("mlp");
  mlp.base.model_options = nn::ModelOptions{};
  mlp.base.precisions = {nn::Precision::F32};
  EXPECT_EQ(meshes(layout_candidates(mlp, info_of(mlp.base)), ""), (std::set<std::string>{"fsdp:8", "ddp:8"}));
  LayoutSearchSpec none = spec;
  none.global_batch = 0;
  EXPECT_THROW((void)layout_candidates(none, info_of(none.base)), UsageError);
  none = spec;
  none.gpus = 0;
  EXPECT_THROW((void)layout_candidates(none, info_of(none.base)), UsageError);
}

// Four GPUs, a batch of 8: everything fits an H100, so the ranking is by recompute first (no
// checkpointing), then by what each GPU sends per step, exact for the engines alone.
TEST(LayoutSearch, RanksByRecomputeThenCommunication) {
  const LayoutSearchResult result = search_layouts(llama_spec(4, 8));
  ASSERT_NE(result.best(), nullptr);
  EXPECT_EQ(result.best()->checkpoint, "none");
  bool fitting = true;
  const LayoutCandidate* previous = nullptr;
  for (const LayoutCandidate& c : result.layouts) {
    if (c.refused || c.dominated) continue;  // pp:4 of 4 layers + 2 splits; none refused here
    EXPECT_TRUE(c.fits) << c.label();
    if (previous != nullptr && fitting && previous->lost_share() == c.lost_share()) {
      EXPECT_LE(previous->communication_bytes, c.communication_bytes) << c.label();
    }
    if (previous != nullptr) {
      EXPECT_LE(previous->lost_share(), c.lost_share()) << c.label();
    }
    previous = &c;
  }
  const auto find = [&](const std::string& mesh) -> const LayoutCandidate& {
    const auto it = std::find_if(result.layouts.begin(), result.layouts.end(), [&](const LayoutCandidate& c) {
      return nn::parallel_label(c.parallel) == mesh && c.checkpoint == "none";
    });
    EXPECT_NE(it, result.layouts.end()) << mesh;
    return *it;
  };
  const double parameters = 2.0 * static_cast<double>(result.model.parameters);  // bf16 bytes
  constexpr double kLayer = 2.0 * ((512 + 2 * 256) * 512 + 512 * 512 + 3 * 1376 * 512 + 2 * 512);
  // DDP: each bucket all-reduced, 2 (n - 1) / n of every gradient.
  EXPECT_DOUBLE_EQ(find("ddp:4").communication_bytes, 1.5 * parameters);
  // FSDP2: every group gathered in forward, the blocks again in backward (the root stays
  // gathered), every gradient reduce-scattered: (n - 1) / n of each, no padding here.
  EXPECT_DOUBLE_EQ(find("fsdp:4").communication_bytes, 0.75 * (2 * parameters + 4 * kLayer));
  // A pipeline's middle stages send each micro-batch's hidden states on and its gradient back.
  EXPECT_DOUBLE_EQ(find("pp:4 microbatches=8").communication_bytes, 2.0 * 8 * (128 * 512 * 2));
  const LayoutCandidate& pipeline = find("pp:4 microbatches=8");
  EXPECT_EQ(pipeline.runs, 4u);  // every stage
  EXPECT_DOUBLE_EQ(pipeline.bubble_share, 3.0 / 11);  // (P - 1) / (M + P - 1)
  // Interleaved: P - 1 idle slots of V x M + P - 1, each 1/V of a micro-batch. Its two stages per
  // rank split the four layers, the embedding and lm_head in four.
  const LayoutCandidate& interleaved = find("pp:2xtp:2 schedule=interleaved1f1b,microbatches=8");
  EXPECT_FALSE(interleaved.refused.has_value()) << interleaved.refused.value_or("");
  EXPECT_TRUE(interleaved.fits);
  EXPECT_DOUBLE_EQ(interleaved.bubble_share, 1.0 / 17);
  EXPECT_LT(interleaved.bubble_share, find("pp:2xtp:2 microbatches=8").bubble_share);
  // Eight stages of six layers: refused, with the reason.
  EXPECT_TRUE(find("pp:4 schedule=interleaved1f1b,microbatches=8").refused.has_value());
  // Every mesh fits without checkpointing, so its checkpointed twin is not run: it could only
  // lose more (recompute) and move as much.
  for (const LayoutCandidate& c : result.layouts) {
    EXPECT_EQ(c.dominated, c.checkpoint == "non-reentrant" && !c.refused) << c.label();
    if (c.dominated) {
      EXPECT_EQ(c.runs, 0u);
    }
  }
  EXPECT_GT(find("tp:4").communication_bytes, 0.0);
}

// A device too small for the unsharded layouts: those that fit come first, and a pipeline whose
// stage runs out says which.
TEST(LayoutSearch, WhatDoesNotFitComesAfter) {
  LayoutSearchSpec spec = llama_spec(4, 8);
  spec.base.device = "sim:capacity=512MiB,context=0";
  const LayoutSearchResult result = search_layouts(spec);
  bool seen_miss = false;
  for (const LayoutCandidate& c : result.layouts) {
    if (c.refused || c.dominated) continue;
    if (!c.fits) seen_miss = true;
    EXPECT_FALSE(seen_miss && c.fits) << c.label() << " ranked after a layout that does not fit";
    if (!c.fits) {
      ASSERT_TRUE(c.oom.has_value()) << c.label();
    }
  }
  EXPECT_TRUE(seen_miss);
  ASSERT_NE(result.best(), nullptr);
}

// A mixture of experts: each expert-parallel size is a recording of its own (the command asks
// the exporter; here tests/data/qwen3moe-ep2.json stands for ep 2, and ep 4 is refused as the
// exporter would refuse experts that do not split). The layouts fsdp:4 with ep_size=2 (and
// ep:2 on 2 GPUs) run that recording; the ones over the plain model, recorded under ep too,
// are refused with the reason.
TEST(LayoutSearch, ExpertParallelRunsEachSizesRecording) {
  const auto recorded = models::ModelFile::load(std::string(VRAMSCOPE_TEST_DATA_DIR) + "/qwen3moe-ep2.json");
  for (const std::size_t gpus : {2u, 4u}) {
    LayoutSearchSpec spec = llama_spec(gpus, static_cast<std::int64_t>(2 * gpus));
    spec.base.model = recorded;
    spec.base.model_options = nn::ModelOptions::parse("seq=16");
    std::vector<std::size_t> asked;
    spec.record_expert_parallel = [&](std::size_t ranks) -> std::shared_ptr<const nn::ModelSource> {
      asked.push_back(ranks);
      if (ranks != 2) throw Error("the 8 experts do not split evenly over " + std::to_string(ranks) + " ranks");
      return recorded;
    };
    const LayoutSearchResult result = search_layouts(spec);
    const std::vector<std::size_t> sizes = gpus == 2 ? std::vector<std::size_t>{2} : std::vector<std::size_t>{2, 4};
    EXPECT_EQ(asked, sizes);
    const auto find = [&](const std::string& label) -> const LayoutCandidate* {
      for (const LayoutCandidate& c : result.layouts) {
        if (nn::parallel_label(c.parallel) == label) return &c;
      }
      return nullptr;
    };
    const LayoutCandidate* ep = find(gpus == 2 ? "ep:2" : "fsdp:4 ep_size=2");
    ASSERT_NE(ep, nullptr);
    EXPECT_TRUE(ep->fits);
    EXPECT_EQ(ep->batch, 2);
    EXPECT_GT(ep->communication_bytes, 0.0);
    ASSERT_NE(result.best(), nullptr);
    EXPECT_EQ(result.best(), ep);  // the only layout this recording runs under
    const LayoutCandidate* plain = find("fsdp:" + std::to_string(gpus));
    ASSERT_NE(plain, nullptr);
    ASSERT_TRUE(plain->refused.has_value());
    EXPECT_NE(plain->refused->find("recording under expert parallel"), std::string::npos) << *plain->refused;
    if (gpus == 4) {
      const LayoutCandidate* four = find("ep:4");
      ASSERT_NE(four, nullptr);
      ASSERT_TRUE(four->refused.has_value());
      EXPECT_NE(four->refused->find("do not split evenly"), std::string::npos);
      EXPECT_EQ(four->runs, 0u);
    }
  }
}

}  // namespace
}  // namespace mem::planner
