// models_test.cpp — the model registry and a dry-run training step of every model.
#include <gtest/gtest.h>

#include <cmath>

#include "test_util.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::nn {
namespace {

TEST(Models, RegistryListsEveryModel) {
  const auto names = models::names();
  const std::vector<std::string> expected = {"mlp",       "forum-cnn", "forum-cnn-full", "resnet18",
                                             "resnet34",  "resnet50",  "resnet101",      "resnet152",
                                             "vgg11",     "vgg11_bn",  "vgg16",          "vgg16_bn",
                                             "mobilenet_v2", "vit_b_16", "vit_l_16", "gpt2",   "gpt2-medium",    "gpt2-large",
                                             "gpt2-xl", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b",
                                             "llama-3.1-70b", "llama-3.1-405b", "mistral-7b", "qwen2.5-0.5b", "qwen2.5-7b"};
  EXPECT_EQ(names, expected);
}

TEST(Models, UnknownNameListsValidOnes) {
  try {
    models::find("resnet51")->describe();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("resnet50"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("gpt2-xl"), std::string::npos);
  }
  EXPECT_THROW(ModelOptions::parse("depth=0"), Error);
  EXPECT_THROW(ModelOptions::parse("colour=3"), Error);
  // A key given twice is an error, not the last one silently (issue 36).
  try {
    (void)ModelOptions::parse("depth=4,depth=8");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "model option depth is given twice; give it once");
  }
}

TEST(Models, ParameterCountsMatchTheReferenceImplementations) {
  EXPECT_EQ(models::find("resnet18")->describe().parameters, 11689512);  // torchvision
  EXPECT_EQ(models::find("resnet50")->describe().parameters, 25557032);
  EXPECT_EQ(models::find("gpt2")->describe().parameters, 124439808);     // HF, tied lm_head
  EXPECT_EQ(models::find("gpt2-medium")->describe().parameters, 354823168);
  EXPECT_EQ(models::find("gpt2-large")->describe().parameters, 774030080);
  EXPECT_EQ(models::find("gpt2-xl")->describe().parameters, 1557611200);
  // forum-cnn: 9050 + 11275 + 2260 conv + 4180 * 3258 + 3258 linear.
  EXPECT_EQ(models::find("forum-cnn")->describe().parameters, 9050 + 11275 + 2260 + 4180 * 3258 + 3258);
  EXPECT_EQ(models::find("forum-cnn-full")->describe().parameters, 9050 + 11275 + 2260 + 3 * (19350LL * 29913 + 29913));
  const auto mlp = models::find("mlp")->describe(ModelOptions::parse("depth=3,width=8"));
  EXPECT_EQ(mlp.parameters, 3 * (8 * 8 + 8));
  EXPECT_EQ(mlp.sequence_length, 6u);
  EXPECT_EQ(models::find("resnet50")->describe().sequence_length, 4u + 16u + 3u);
  EXPECT_EQ(models::find("gpt2")->describe().sequence_length, 15u);
}

// Sizes never wrap (issue 22, item 1): a shape, a parameter count or its bytes that would
// overflow is an error naming the sizes, and a description's cost stays bounded (item 11).
TEST(Models, SizesThatWouldOverflowAreErrors) {
  const auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Shapes: [2^62, 1024] elements, built from a batch and a width.
  EXPECT_NE(message([] { Shape{std::int64_t{1} << 62, 1024}; }).find("more than 2^63 elements"),
            std::string::npos);
  Shape s{std::int64_t{1} << 40};
  EXPECT_THROW(s.push_back(std::int64_t{1} << 30), Error);
  EXPECT_EQ(s.size(), 1u);  // unchanged
  ModelOptions wide;
  wide.width = std::int64_t{1} << 31;  // w*w = 2^62 per layer; three layers overflow the count
  wide.depth = 3;
  EXPECT_NE(message([&] { models::find("mlp")->describe(wide); }).find("more than 2^63 parameters"),
            std::string::npos);
  wide.depth = 1;  // 2^62 parameters fit in the count, not in f32 bytes
  EXPECT_NE(message([&] { models::find("mlp")->describe(wide); }).find("more than 2^64 bytes"),
            std::string::npos);
  ModelOptions image;
  image.image = std::int64_t{1} << 20;
  image.batch = std::int64_t{1} << 40;
  EXPECT_NE(message([&] { models::find("resnet18")->describe(image); }).find("2^63"), std::string::npos);
}

TEST(Models, OptionSizesAreBounded) {
  ModelOptions deep;
  deep.depth = kMaxDepth + 1;
  EXPECT_THROW(models::find("mlp")->describe(deep), Error);
  EXPECT_THROW(ModelOptions::parse("depth=1000000000000"), Error);
  EXPECT_THROW(ModelOptions::parse("batch=99999999999999999999"), Error);
  ModelOptions negative;
  negative.batch = -1;
  EXPECT_THROW(models::find("mlp")->describe(negative), Error);
  deep.depth = 4;
  EXPECT_NO_THROW(models::find("mlp")->describe(deep));
}

TEST(Models, OptionsAModelDoesNotTakeAreErrors) {
  ModelOptions o;
  o.depth = 12;
  try {
    models::find("gpt2")->describe(o);
    FAIL() << "gpt2 took a depth";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gpt2 has no depth option; it takes batch, seq, dropout"),
              std::string::npos) << e.what();
  }
  o = {};
  o.dropout = 0.0;
  EXPECT_THROW(models::find("resnet50")->describe(o), Error);
  o = {};
  o.batch = 8;  // every model has a batch
  for (const std::string& name : models::names()) EXPECT_NO_THROW(models::find(name)->describe(o)) << name;
}

TEST(Models, OptionsRoundTrip) {
  const auto o = ModelOptions::parse("depth=200,width=1024,batch=32,dropout=0,inplace=1");
  EXPECT_EQ(ModelOptions::parse(o.to_string()).to_string(), o.to_string());
  EXPECT_EQ(o.depth, 200);
  EXPECT_TRUE(*o.inplace_relu);
}

class EveryModel : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryModel, DryRunStepReturnsEverythingButParametersAndState) {
  TrainConfig cfg;
  cfg.model = models::find(GetParam());
  cfg.model_options.batch = 2;
  if (GetParam().rfind("gpt2", 0) == 0) cfg.model_options.seq = 64;
  cfg.steps = 2;
  const auto device = make_device("sim:capacity=200GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  const auto s1 = trainer.step();
  const auto s2 = trainer.step();
  const auto info = trainer.info();
  EXPECT_EQ(s1.params_without_grad, 0u);
  EXPECT_TRUE(std::isnan(s1.loss));
  EXPECT_GT(s1.flops.forward, 0);
  EXPECT_GT(s1.flops.backward, s1.flops.forward * 0.9);
  const auto report = trainer.report();
  // Adam state appears at the first step and stays: the second step starts higher.
  EXPECT_GE(s2.forward.allocated_begin, s1.forward.allocated_begin + report.optimizer_state_bytes);
  (void)info;
  EXPECT_EQ(report.optimizer_state_bytes, 2 * report.parameter_bytes);
  alloc.validate();
}

INSTANTIATE_TEST_SUITE_P(Runtime, EveryModel,
                         ::testing::Values("mlp", "forum-cnn", "resnet18", "resnet50", "gpt2"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

}  // namespace
}  // namespace mem::nn
