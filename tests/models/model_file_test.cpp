// model_file_test.cpp — model files: the zoo's parameter counts against torchvision's,
// every malformed file of bad_files.json rejected with its message, options that do
// not apply refused, and the containers' forward order and peaks.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "expert_routing.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/training.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem::models {
namespace {

using nlohmann::json;

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Zoo, ParameterCountsAreTorchvisions) {
  // torchvision.models.<name>() with 1000 classes: sum(p.numel() for p in m.parameters()).
  EXPECT_EQ(find("resnet18")->describe().parameters, 11'689'512);
  EXPECT_EQ(find("resnet34")->describe().parameters, 21'797'672);
  EXPECT_EQ(find("resnet50")->describe().parameters, 25'557'032);
  EXPECT_EQ(find("resnet101")->describe().parameters, 44'549'160);
  EXPECT_EQ(find("resnet152")->describe().parameters, 60'192'808);
  EXPECT_EQ(find("vgg11")->describe().parameters, 132'863'336);
  EXPECT_EQ(find("vgg11_bn")->describe().parameters, 132'868'840);
  EXPECT_EQ(find("vgg16")->describe().parameters, 138'357'544);
  EXPECT_EQ(find("vgg16_bn")->describe().parameters, 138'365'992);
  EXPECT_EQ(find("mobilenet_v2")->describe().parameters, 3'504'872);
  EXPECT_EQ(find("vit_b_16")->describe().parameters, 86'567'656);
  EXPECT_EQ(find("vit_l_16")->describe().parameters, 304'326'632);
  // mlp: depth x (width^2 + width).
  EXPECT_EQ(find("mlp")->describe().parameters, 16 * (1024 * 1024 + 1024));
  EXPECT_EQ(find("mlp")->describe(nn::ModelOptions::parse("depth=3,width=8")).parameters, 3 * (64 + 8));
  // forum-cnn: convs 20*50*9+50, 50*25*9+25, 25*10*9+10, then the head(s).
  EXPECT_EQ(find("forum-cnn")->describe().parameters, 9050 + 11275 + 2260 + 4180 * 3258 + 3258);
  EXPECT_EQ(find("forum-cnn-full")->describe().parameters, 9050 + 11275 + 2260 + 3 * (19350LL * 29913 + 29913));
}

TEST(Zoo, ResnetsKeepTorchvisionsNamesAndFlattenTheirStages) {
  const auto model = find("resnet50")->build();
  const auto& body = model->body();
  ASSERT_EQ(body.size(), 4u + 16u + 3u);
  EXPECT_EQ(body.children()[4].first, "layer1.0");
  EXPECT_EQ(body.children()[19].first, "layer4.2");
  EXPECT_EQ(body.at(4).type_name(), "Bottleneck");
  std::vector<std::string> names;
  for (const auto& [name, child] : body.at(4).children()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"conv1", "bn1", "relu", "conv2", "bn2", "conv3", "bn3", "downsample"}));
  EXPECT_EQ(body.at(4).children()[7].second->children()[1].second->path(), "layer1.0.downsample.1");
}

TEST(Zoo, VggAndMobilenetKeepTorchvisionsNames) {
  const auto vgg = find("vgg16_bn")->build();
  const auto& v = vgg->body();
  ASSERT_EQ(v.size(), 44u + 2u + 7u);  // 13 x (conv, bn, relu) + 5 pools; avgpool, flatten; classifier
  EXPECT_EQ(v.children()[0].first, "features.0");
  EXPECT_EQ(v.children()[43].first, "features.43");
  EXPECT_EQ(v.children()[44].first, "avgpool");
  EXPECT_EQ(v.children().back().first, "classifier.6");
  EXPECT_EQ(vgg->info().input_shape, (nn::Shape{32, 3, 224, 224}));

  const auto mobile = find("mobilenet_v2")->build();
  const auto& m = mobile->body();
  ASSERT_EQ(m.size(), 19u + 2u + 2u);
  EXPECT_EQ(m.children()[18].first, "features.18");
  // features.3 (24 -> 24, stride 1) adds its input; features.2 (16 -> 24, stride 2) does not.
  EXPECT_EQ(m.at(3).type_name(), "InvertedResidual");
  EXPECT_EQ(m.at(2).type_name(), "Sequential");
  // Its depthwise conv: conv.1.0 of features.2, 96 channels in 96 groups, weight [96, 1, 3, 3].
  const nn::Module& depthwise = *m.at(2).children()[0].second->children()[1].second->children()[0].second;
  EXPECT_EQ(depthwise.path(), "features.2.conv.1.0");
  EXPECT_EQ(depthwise.slots()[0].shape, (nn::Shape{96, 1, 3, 3}));
}

TEST(Zoo, SizesScaleTheFamily) {
  const auto r = find("resnet50")->describe(nn::ModelOptions::parse("image=64,classes=10,batch=2"));
  EXPECT_EQ(r.input_shape, (nn::Shape{2, 3, 64, 64}));
  EXPECT_EQ(r.parameters, 25'557'032 - 2048 * 990 - 990);  // fc shrinks to 10 classes
  EXPECT_EQ(r.target_classes, 10);
}

TEST(ModelFileOptions, AnOptionTheModelDoesNotTakeIsAnError) {
  EXPECT_NE(message_of([] { find("resnet18")->describe(nn::ModelOptions::parse("depth=3")); })
                .find("resnet18 has no depth option; it takes batch, image, classes"),
            std::string::npos);
  EXPECT_NE(message_of([] { find("mlp")->describe(nn::ModelOptions::parse("seq=7")); }).find("mlp has no seq option"),
            std::string::npos);
}

// --- malformed files ------------------------------------------------------------------------

json bad_files() {
  std::ifstream in(VRAMSCOPE_BAD_FILES);
  return json::parse(in);
}

/// Sets `value` at a path like "layers[4].in_features" (null removes the key).
void patch(json& doc, const std::string& path, const json& value) {
  json* at = &doc;
  std::string key;
  std::istringstream parts(path);
  std::vector<std::string> steps;
  for (std::string part; std::getline(parts, part, '.');) steps.push_back(part);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    std::string step = steps[i];
    std::optional<std::size_t> index;
    if (const auto open = step.find('['); open != std::string::npos) {
      index = std::stoul(step.substr(open + 1));
      step = step.substr(0, open);
    }
    const bool last = i + 1 == steps.size();
    if (last && !index) {
      if (value.is_null()) {
        at->erase(step);
      } else {
        (*at)[step] = value;
      }
      return;
    }
    at = &(*at)[step];
    if (index) at = &(*at)[*index];
    if (last) *at = value;
  }
}

std::string case_text(const json& all, const json& c) {
  if (c.contains("text")) return c.at("text").get<std::string>();
  json doc = all.at("base");
  for (const auto& [path, value] : c.at("patch").items()) patch(doc, path, value);
  return doc.dump();
}

TEST(ModelFileErrors, TheBaseOfTheBadFilesIsGood) {
  const json all = bad_files();
  const auto file = ModelFile::parse(all.at("base").dump(), "tiny.json");
  EXPECT_EQ(file->describe().parameters, 3 * 8 * 9 + 8 + 8 * 10 + 10);
}

TEST(ModelFileErrors, EachBadFileGetsItsMessage) {
  const json all = bad_files();
  ASSERT_GE(all.at("cases").size(), 20u);
  for (const json& c : all.at("cases")) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    const std::string text = case_text(all, c);
    const std::string message = message_of([&] { ModelFile::parse(text, "bad.json"); });
    EXPECT_EQ(message.rfind("bad.json: ", 0), 0u) << message;
    EXPECT_NE(message.find(c.at("message").get<std::string>()), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(ModelFileErrors, AFileThatCannotBeReadSaysSo) {
  EXPECT_NE(message_of([] { ModelFile::load("/nonexistent/net.json"); })
                .find("the model file '/nonexistent/net.json' does not exist"),
            std::string::npos);
  EXPECT_NE(message_of([] { ModelFile::parse(std::string(kMaxModelFileBytes + 1, ' '), "big.json"); })
                .find("a model file may have at most 16 MiB"),
            std::string::npos);
}

TEST(ModelFileErrors, DeepNestingStopsAtTheLimit) {
  std::string layers = R"({"type": "Identity"})";
  for (int i = 0; i < 200; ++i) layers = R"({"type": "Sequential", "layers": [)" + layers + "]}";
  const std::string text = R"({"format": "vramscope-model", "version": 1, "name": "deep", "options": {"batch": 1},
    "input": {"shape": ["batch", 4]}, "loss": {"type": "sum"}, "layers": [)" + layers + "]}";
  EXPECT_NE(message_of([&] { ModelFile::parse(text, "deep.json"); }).find("modules nest deeper than 64"),
            std::string::npos);
}

}  // namespace
}  // namespace mem::models

namespace mem::models {
namespace {

/// Peaks of one dry-run training step (no optimizer) of a model file on an A100 80 GB.
nn::TrainReport one_step(const std::string& text) {
  nn::TrainConfig cfg;
  cfg.model = ModelFile::parse(text, "peak.json");
  cfg.device = "sim:a100-80g";
  cfg.steps = 1;
  cfg.optimizer.kind = nn::OptimizerKind::None;
  return nn::train(cfg);
}

// Both models: input x [1024, 1024] f32 that requires grad, A = 4 MiB per activation;
// loss = output.sum(), a 512 B scalar, and backward's seed ones_like(loss), 512 B, alive for
// the whole backward (loss.backward() holds it). The training loop holds the output, as
// `out = model(x); out.sum().backward()` does. Every A-sized block is a 4 MiB request:
// the large pool, in 20 MiB segments (requests under 10 MiB), five blocks per segment;
// the two scalars share a 2 MiB small-pool segment.
constexpr std::int64_t A = 1024 * 1024 * 4;
constexpr std::int64_t kScalars = 2 * 512;

TEST(ModelFilePeaks, AResidualBlockPeaksAsDerivedByHand) {
  // block: out = sigmoid(x) + x (out of place); then t = tanh(out); loss = t.sum().
  // Forward: s = sigmoid(x) (saved by SigmoidBackward), out = s + x (AddBackward saves
  // nothing), t = tanh(out) (saved by TanhBackward; also the output), then out dies.
  // Backward: SumBackward expands the seed (a view); TanhBackward allocates g = grad of
  // out; AddBackward hands g to both branches (no allocation): one waits in x's input
  // buffer, the other enters SigmoidBackward, which allocates its gradient while x, s, t
  // and g live: 5 A, the peak. Then s is released and x's buffer sums the two in place
  // (the buffer holds the last reference to g, PyTorch's InputBuffer::accumulate).
  const nn::TrainReport r = one_step(R"({
    "format": "vramscope-model", "version": 1, "name": "res", "options": {"batch": 1024},
    "input": {"shape": ["batch", 1024], "requires_grad": true}, "loss": {"type": "sum"},
    "layers": [{"name": "block", "type": "Residual", "body": [{"name": "act", "type": "Sigmoid"}]},
               {"name": "out", "type": "Tanh"}]})");
  EXPECT_EQ(r.peak_allocated, 5 * A + kScalars);
  EXPECT_EQ(r.peak_reserved, 20 * MiB + 2 * MiB);  // 5 A fill one 20 MiB segment exactly
}

TEST(ModelFilePeaks, TheSameResidualBlockAsAnOperatorGraphPeaksTheSame) {
  // The block above as the exporter records it (docs/MODEL_FILES.md, Operator graphs): sigmoid
  // in block.act, the add in block, tanh in out; s goes when block returns, out when the root
  // rebinds its variable. The generic backward (TanhBackward0 and SigmoidBackward0 allocate
  // their input's gradient, AddBackward0 hands it on) gives the hand-derived peak.
  const nn::TrainReport r = one_step(R"({
    "format": "vramscope-model", "version": 1, "name": "res-ops", "options": {"batch": 1024},
    "input": {"shape": ["batch", 1024], "requires_grad": true}, "loss": {"type": "sum"},
    "graph": {"format": 1,
      "calls": [{"module": "", "class": "Net", "parent": -1}, {"module": "block", "class": "Block", "parent": 0},
                {"module": "block.act", "class": "Sigmoid", "parent": 1}, {"module": "out", "class": "Tanh", "parent": 0}],
      "tensors": [{"kind": "input", "shape": ["batch", 1024], "dtype": "float", "requires_grad": true},
                  {"kind": "op", "shape": ["batch", 1024], "dtype": "float"},
                  {"kind": "op", "shape": ["batch", 1024], "dtype": "float"},
                  {"kind": "op", "shape": ["batch", 1024], "dtype": "float"}],
      "inputs": [0], "output": 3,
      "ops": [{"op": "aten.sigmoid.default", "in": [0], "out": [1], "call": 2, "node": "SigmoidBackward0", "saves": [1]},
              {"op": "aten.add.Tensor", "in": [1, 0], "out": [2], "call": 1, "node": "AddBackward0", "saves": [],
               "frees_after": [[0, 1]]},
              {"op": "aten.tanh.default", "in": [2], "out": [3], "call": 3, "node": "TanhBackward0", "saves": [3],
               "frees_after": [[0, 2]]}]}})");
  EXPECT_EQ(r.peak_allocated, 5 * A + kScalars);
  EXPECT_EQ(r.peak_reserved, 20 * MiB + 2 * MiB);
}

// A mixture of experts recorded with its per-expert loop: each expert's rows are the name
// expert_rows_<e>, computed from "routing" and the option expert_skew (expert_routing.hpp).
// Here one op gathers expert 7's rows ([rows, 1024] f32, 4 KiB a row) from a [batch, 1024] input.
std::string routed_file(const std::string& routing, const std::string& options = R"("batch": 16, "expert_skew": 1)",
                        const std::string& rows = "expert_rows_7") {
  return R"({"format": "vramscope-model", "version": 1, "name": "moe-ops", "options": {)" + options + R"(},
    "input": {"shape": ["batch", 1024], "requires_grad": true}, "loss": {"type": "sum"},
    "graph": {"format": 1, "routing": )" + routing + R"(,
      "calls": [{"module": "", "class": "Net", "parent": -1}, {"module": "experts", "class": "Experts", "parent": 0}],
      "tensors": [{"kind": "input", "shape": ["batch", 1024], "dtype": "float", "requires_grad": true},
                  {"kind": "op", "shape": [")" + rows + R"(", 1024], "dtype": "float"}],
      "inputs": [0], "output": 1,
      "ops": [{"op": "aten.index.Tensor", "in": [0], "out": [1], "call": 1, "node": "IndexBackward0", "saves": []}]}})";
}

TEST(ModelFileRouting, EachExpertsRowsFollowTheRoutingAndTheSkew) {
  // 16 x 4 = 64 tokens, top-2 over 8 experts: 128 assignments, 16 rows each. expert_skew=3
  // gives the busiest (the last) ceil(3 x 128 / 8) = 48, the other seven share 80: 12, 12,
  // 12, 11, 11, 11, 11. expert_skew=100 is capped at every token, 64.
  detail::ExpertRouting routing{8, 2, 64, 1, ""};
  for (std::int64_t e = 0; e < 8; ++e) EXPECT_EQ(routing.rows(e), 16);
  routing.skew = 3;
  std::int64_t total = 0;
  for (std::int64_t e = 0; e < 8; ++e) total += routing.rows(e);
  EXPECT_EQ(total, 128);
  EXPECT_EQ(routing.rows(0), 12);
  EXPECT_EQ(routing.rows(6), 11);
  EXPECT_EQ(routing.rows(7), 48);
  routing.skew = 100;
  EXPECT_EQ(routing.rows(7), 64);
  EXPECT_NE(routing.describe().find("the busiest expert gets 64 rows"), std::string::npos) << routing.describe();
  EXPECT_EQ((detail::ExpertRouting{1, 1, 64, 5, ""}.rows(0)), 64);
  EXPECT_EQ((detail::ExpertRouting{4, 4, 10, 1, ""}.rows(3)), 10);  // top_k = experts: every expert sees every token

  const std::string routing_json = R"({"experts": 8, "top_k": 2, "tokens": "batch * 4"})";
  const auto model = ModelFile::parse(routed_file(routing_json), "moe.json");
  const nn::ModelInfo even = model->describe(nn::ModelOptions{});
  ASSERT_FALSE(even.assumed.empty());
  EXPECT_NE(even.assumed.back().find("batch * 4 tokens (64 here) x top-2 over 8 experts, spread evenly"),
            std::string::npos)
      << even.assumed.back();
  const nn::ModelInfo skewed = model->describe(nn::ModelOptions::parse("expert_skew=3"));
  EXPECT_NE(skewed.assumed.back().find("the busiest expert gets 48 rows"), std::string::npos) << skewed.assumed.back();
  // The gathered rows are the step's output: 32 rows more are 128 KiB more at the peak.
  nn::TrainConfig cfg;
  cfg.model = model;
  cfg.device = "sim:a100-80g";
  cfg.steps = 1;
  cfg.optimizer.kind = nn::OptimizerKind::None;
  const std::int64_t plain = nn::train(cfg).peak_allocated;
  cfg.model_options = nn::ModelOptions::parse("expert_skew=3");
  EXPECT_EQ(nn::train(cfg).peak_allocated - plain, (48 - 16) * 1024 * 4);
}

TEST(ModelFileRouting, AMalformedRoutingIsRefusedByName) {
  const auto error = [](const std::string& text) {
    try {
      (void)ModelFile::parse(text, "moe.json")->describe(nn::ModelOptions{});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(error(routed_file(R"({"experts": 2, "top_k": 3, "tokens": 8})")).find("top_k: more than the experts"),
            std::string::npos);
  EXPECT_NE(error(routed_file(R"({"experts": 2, "top_k": 1, "tokens": 8, "capacity": 2})")).find("unknown key 'capacity'"),
            std::string::npos);
  EXPECT_NE(error(routed_file(R"([2, 1])")).find("graph.routing: expected {"), std::string::npos);
  EXPECT_NE(error(routed_file(R"({"experts": 8, "top_k": 2, "tokens": 8})", R"("batch": 16)")).find("expert_skew"),
            std::string::npos);
  EXPECT_NE(error(routed_file(R"({"experts": 8, "top_k": 2, "tokens": 9223372036854775807})")).find("overflows"),
            std::string::npos);
  // An expert past the routing's is not a size option.
  EXPECT_NE(error(routed_file(R"({"experts": 8, "top_k": 2, "tokens": 8})", R"("batch": 16, "expert_skew": 1)",
                              "expert_rows_8")).find("expert_rows_8"),
            std::string::npos);
  // Without a routing the name means nothing either.
  std::string plain = routed_file(R"({"experts": 8, "top_k": 2, "tokens": 8})");
  plain.erase(plain.find(R"("routing": )"), std::string(R"("routing": {"experts": 8, "top_k": 2, "tokens": 8},)").size());
  EXPECT_NE(error(plain).find("expert_rows_7"), std::string::npos) << error(plain);
}

TEST(ModelFileLosses, NoneTrainsOnTheModelsOwnScalarOutput) {
  // A model that computes its loss itself: the output, a scalar, is what backward starts
  // from. Linear(1024 -> 1) on a [1, 1024] input: no target is made.
  const nn::TrainReport r = one_step(R"({
    "format": "vramscope-model", "version": 1, "name": "own-loss", "options": {"batch": 1},
    "input": {"shape": ["batch", 1024]}, "loss": {"type": "none"},
    "layers": [{"name": "score", "type": "Linear", "in_features": 1024, "out_features": 1}]})");
  EXPECT_EQ(r.steps.size(), 1u);
  EXPECT_FALSE(r.gradients_missing);
}

TEST(ModelFilePeaks, ParallelBranchesJoinedByConcatPeakAsDerivedByHand) {
  // branch: c = cat([sigmoid(x), tanh(x)], dim 1) [1024, 2048] = 2 A; loss = c.sum().
  // Forward ends with x, s (saved by SigmoidBackward), t (saved by TanhBackward) and c (the
  // output; CatBackward saves only sizes): 5 A. Backward: CatBackward splits the expanded
  // seed into views. TanhBackward runs first (created last, highest sequence number) and
  // allocates g_t: 6 A; t is released. SigmoidBackward allocates g_s while g_t waits in x's
  // buffer: 6 A again, the peak. Segments: x, s, t and c (8 MiB) fill the first 20 MiB
  // segment; g_t and g_s take a second.
  const nn::TrainReport r = one_step(R"({
    "format": "vramscope-model", "version": 1, "name": "par", "options": {"batch": 1024},
    "input": {"shape": ["batch", 1024], "requires_grad": true}, "loss": {"type": "sum"},
    "layers": [{"name": "branch", "type": "Parallel", "join": "concat", "dim": 1,
                "branches": [[{"name": "gate", "type": "Sigmoid"}], [{"name": "value", "type": "Tanh"}]]}]})");
  EXPECT_EQ(r.peak_allocated, 6 * A + kScalars);
  EXPECT_EQ(r.peak_reserved, 2 * 20 * MiB + 2 * MiB);
}

// What the exporter writes for `x = x + self.attn(self.ln1(x)); return x + self.mlp(...)`:
// two residuals inside one module's forward, as inline code. Its children are named as the
// module's, and it runs exactly as the same blocks written as modules of their own.
constexpr const char* kBlockFile = R"({
  "format": "vramscope-model", "version": 1, "name": "inline", "options": {"batch": 1024},
  "input": {"shape": ["batch", 1024], "requires_grad": true}, "loss": {"type": "sum"},
  "layers": [{"name": "block", "type": "Sequential", "layers": [
    {"type": "Residual", %s "body": [{"name": "act1", "type": "Sigmoid"}]},
    {"type": "Residual", %s "body": [{"name": "act2", "type": "Tanh"}]}]}]})";

std::string block_file(bool inline_code) {
  const std::string flag = inline_code ? R"("inline": true,)" : "";
  std::string text = kBlockFile;
  for (int i = 0; i < 2; ++i) text.replace(text.find("%s"), 2, flag);
  return text;
}

void collect_paths(const nn::Module& m, std::vector<std::string>& out) {
  out.push_back(m.path());
  for (const auto& [name, child] : m.children()) collect_paths(*child, out);
}

TEST(ModelFileInline, InlineCodeNamesItsChildrenAsTheEnclosingModule) {
  std::vector<std::string> paths;
  collect_paths(ModelFile::parse(block_file(true), "inline.json")->build()->body(), paths);
  EXPECT_EQ(paths, (std::vector<std::string>{"", "block", "block", "block.act1", "block", "block.act2"}));
  paths.clear();
  collect_paths(ModelFile::parse(block_file(false), "named.json")->build()->body(), paths);
  EXPECT_EQ(paths, (std::vector<std::string>{"", "block", "block.0", "block.0.act1", "block.1", "block.1.act2"}));
}

TEST(ModelFileInline, InlineCodeRunsAsTheBlocksItStandsFor) {
  const nn::TrainReport inline_code = one_step(block_file(true));
  const nn::TrainReport named = one_step(block_file(false));
  EXPECT_EQ(inline_code.peak_allocated, named.peak_allocated);
  EXPECT_EQ(inline_code.peak_reserved, named.peak_reserved);
  EXPECT_GT(inline_code.peak_allocated, 3 * A);  // x, sigmoid's output, the sum, ...
}

// The forum's `x = checkpoint(self.block1, x)`, block1 a method calling conv1, relu and
// conv2 (here Linear layers): an inline Sequential with a checkpoint mark. Its layers keep
// the enclosing module's names, and the step's memory is that of the same layers as one
// checkpointed module of their own.
constexpr const char* kRegionFile = R"({
  "format": "vramscope-model", "version": 1, "name": "region", "options": {"batch": 1024},
  "input": {"shape": ["batch", 1024], "requires_grad": true}, "loss": {"type": "sum"},
  "layers": [{"name": "stem", "type": "Linear", "in_features": 1024, "out_features": 1024},
             {%s "type": "Sequential", "checkpoint": true, "layers": [
               {"name": "fc1", "type": "Linear", "in_features": 1024, "out_features": 1024},
               {"name": "relu", "type": "ReLU"},
               {"name": "fc2", "type": "Linear", "in_features": 1024, "out_features": 1024}]},
             {"name": "head", "type": "Linear", "in_features": 1024, "out_features": 1024}]})";

std::string region_file(bool inline_code) {
  std::string text = kRegionFile;
  text.replace(text.find("%s"), 2, inline_code ? R"("inline": true,)" : R"("name": "block1",)");
  return text;
}

TEST(ModelFileInline, ACheckpointedInlineRegionNamesItsLayersAsTheEnclosingModule) {
  std::vector<std::string> paths;
  collect_paths(ModelFile::parse(region_file(true), "region.json")->build()->body(), paths);
  EXPECT_EQ(paths, (std::vector<std::string>{"", "stem", "", "fc1", "relu", "fc2", "head"}));
  EXPECT_EQ(ModelFile::parse(region_file(true), "region.json")->describe().checkpointed_modules, 1u);
}

TEST(ModelFileInline, ACheckpointedInlineRegionRunsAsTheCheckpointedModuleItStandsFor) {
  const nn::TrainReport region = one_step(region_file(true));
  const nn::TrainReport named = one_step(region_file(false));
  EXPECT_EQ(region.peak_allocated, named.peak_allocated);
  EXPECT_EQ(region.peak_reserved, named.peak_reserved);
  EXPECT_EQ(region.steps.back().allocated_end, named.steps.back().allocated_end);
  EXPECT_GT(region.recompute_ratio, 0.0);
  // Unchecked, the region keeps relu's output after the forward (saved by relu and by fc2;
  // fc1's output dies with relu): one activation more than the checkpoint, which keeps
  // only its input (stem's output, which fc1 would have kept anyway).
  std::string plain = region_file(true);
  plain.erase(plain.find(R"("checkpoint": true, )"), std::string(R"("checkpoint": true, )").size());
  EXPECT_EQ(one_step(plain).steps[0].forward.allocated_end - region.steps[0].forward.allocated_end, A);
}

TEST(ModelFileInline, AnActivationCalledTwiceInASequentialIsUsedAgain) {
  // `x = self.act(self.fc2(self.act(self.fc1(x))))`: {"use": "act"} runs it again under its name.
  const std::string used = R"({
    "format": "vramscope-model", "version": 1, "name": "use", "options": {"batch": 1024},
    "input": {"shape": ["batch", 1024]}, "loss": {"type": "sum"},
    "layers": [{"name": "fc1", "type": "Linear", "in_features": 1024, "out_features": 1024},
               {"name": "act", "type": "ReLU"},
               {"name": "fc2", "type": "Linear", "in_features": 1024, "out_features": 1024},
               {"use": "act"}]})";
  const auto model = ModelFile::parse(used, "use.json")->build();
  std::vector<std::string> names;
  for (const auto& [name, child] : model->body().children()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1", "act", "fc2", "act"}));
  std::string twice = used;
  twice.replace(twice.find(R"({"use": "act"})"), 14, R"({"name": "act2", "type": "ReLU"})");
  EXPECT_EQ(one_step(used).peak_allocated, one_step(twice).peak_allocated);
  EXPECT_EQ(ModelFile::parse(used, "use.json")->describe().parameters, 2 * (1024 * 1024 + 1024));
}

}  // namespace
}  // namespace mem::models

// Every (module, phase) pair of the largest model a file may describe fits the context
// registry (issue 36: 150,000 Linear layers failed in intern_context at 2^20 pairs).
static_assert(mem::kMaxContexts > mem::kNumPhases * mem::models::kMaxModules);
