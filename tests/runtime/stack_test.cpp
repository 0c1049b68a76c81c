// stack_test.cpp — the modelled stack: --stack specs as users write them, what an unknown
// version or package says, and the behaviours each version answers.
#include <gtest/gtest.h>

#include <string>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/stack.hpp"

namespace mem::nn {
namespace {

std::string refusal(const std::string& spec) {
  try {
    (void)Stack::parse(spec);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Stack, TheDefaultIsTheNewestValidatedOnAGpu) {
  const Stack s = Stack::parse("");
  EXPECT_EQ(s, Stack::validated());
  EXPECT_EQ(s.spec(), "torch=2.11,transformers=5.17,peft=0.21");
  EXPECT_EQ(s.to_string(), "PyTorch 2.11, transformers 5.17, PEFT 0.21");
}

TEST(Stack, KeysLeftOutKeepTheDefaultAndPatchVersionsAreAccepted) {
  const Stack s = Stack::parse("transformers=4.50.3");
  EXPECT_EQ(s.spec(), "torch=2.11,transformers=4.50,peft=0.21");
  // What Python prints as torch.__version__.
  EXPECT_EQ(Stack::parse("peft=0.14, torch=2.15.0+cu132").spec(), "torch=2.15,transformers=5.17,peft=0.14");
  EXPECT_EQ(Stack::parse(Stack::parse("torch=2.5,transformers=4.50,peft=0.14").spec()).spec(),
            "torch=2.5,transformers=4.50,peft=0.14");
}

TEST(Stack, AnUnknownVersionOrPackageNamesWhatIsKnown) {
  EXPECT_EQ(refusal("torch=3.0"), "torch 3.0 is not a version vramscope models; known: 2.5, 2.11, 2.15 "
                                  "(docs/VALIDATION.md says what each was checked against)");
  EXPECT_NE(refusal("transformers=4.46").find("known: 4.50, 5.17, 5.24"), std::string::npos);
  EXPECT_EQ(refusal("jax=0.4"), "unknown package \"jax\"; valid: torch, transformers, peft");
  EXPECT_EQ(refusal("torch=2.11,torch=2.15"), "torch is given twice");
  EXPECT_NE(refusal("torch"), "");
  EXPECT_NE(refusal("torch=2.11,"), "");
  EXPECT_NE(refusal("torch=two"), "");
  EXPECT_NE(refusal("torch=2.11x"), "");
  EXPECT_NE(refusal("torch=2.99999999999999999999"), "");
  EXPECT_EQ(refusal("torch="), "torch has no version; give e.g. torch=2.15");
  EXPECT_NE(refusal("torch=2.11+"), "");
  EXPECT_EQ(Stack::parse("torch==2.15.0,peft==0.21.2").spec(), "torch=2.15,transformers=5.17,peft=0.21");
}

TEST(Stack, TransformersFiveKeepsTheKeyHeadsAndTheProjectionLayout) {
  const Stack five = Stack::parse("transformers=5.17"), four = Stack::parse("transformers=4.50");
  EXPECT_TRUE(five.sdpa_enable_gqa());
  EXPECT_FALSE(five.sdpa_contiguous_inputs());
  EXPECT_FALSE(four.sdpa_enable_gqa());
  EXPECT_TRUE(four.sdpa_contiguous_inputs());
  EXPECT_EQ(five.checkpoint_default(), "non-reentrant");
  EXPECT_EQ(four.checkpoint_default(), "reentrant");
  EXPECT_EQ(Stack::parse("transformers=5.24").checkpoint_default(), "non-reentrant");
}

}  // namespace
}  // namespace mem::nn
