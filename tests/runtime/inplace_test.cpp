// inplace_test.cpp — version counters and PyTorch's check on saved tensors.
//
// Every in-place op bumps a counter shared by a tensor and all its views; a
// tensor saved for backward records it and the backward that unpacks it after
// a change throws InplaceModifiedError with PyTorch's message. What PyTorch
// refuses is refused (a checkpointed segment that begins with an in-place ReLU
// on its saved input: resnet50 at 8 segments), what it accepts still runs
// (every plain run, and the segment counts that start no segment with an
// in-place op), and a refused training step unwinds like an out-of-memory one.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>

#include "test_util.hpp"
#include "vramscope/models/zoo.hpp"

/// `text` contains `piece` (printed in full when not).
#define EXPECT_CONTAINS(text, piece) \
  EXPECT_NE(std::string(text).find(piece), std::string::npos) << "missing: " << (piece) << "\nin: " << (text)

namespace mem::nn {
namespace {

Tensor leaf(test::Env& env, const Shape& shape, bool requires_grad = true) {
  Tensor t = uniform(env.rt, shape, -1, 1, DType::F32, 7);
  if (requires_grad) t.set_requires_grad(true);
  return t;
}

/// The message of the InplaceModifiedError `fn` throws (fails the test if it throws none).
template <class F>
std::string inplace_message(F&& fn) {
  try {
    fn();
  } catch (const InplaceModifiedError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InplaceModifiedError";
  return {};
}

// --- the counter ------------------------------------------------------------------------

TEST(VersionCounter, SharedByViewsAndBumpedByEveryInPlaceOp) {
  test::Env env(ExecMode::DryRun);
  const Tensor x = empty(env.rt, {4, 6});
  EXPECT_EQ(x.version(), 0u);
  EXPECT_EQ(full(env.rt, {3}, 1.0).version(), 0u);  // factories return fresh tensors
  const Tensor v = x.view({24});
  const Tensor d = x.detach();
  const Tensor t = x.transpose(0, 1);
  (void)relu_(v);
  EXPECT_EQ(x.version(), 1u);
  EXPECT_EQ(d.version(), 1u);
  EXPECT_EQ(t.version(), 1u);
  (void)add_(x, x);
  EXPECT_EQ(v.version(), 2u);
  fill_(t, 0.0);
  copy_(d, x);
  uniform_(x, 0, 1, 3);
  EXPECT_EQ(x.version(), 5u);
  // Out-of-place ops leave their input alone and return version 0.
  const Tensor y = relu(x);
  EXPECT_EQ(x.version(), 5u);
  EXPECT_EQ(y.version(), 0u);
  EXPECT_EQ(x.contiguous().version(), 5u);     // contiguous already: x itself
  EXPECT_EQ(t.contiguous().version(), 0u);     // a copy
  // Under no_grad too, as PyTorch's ADInplaceOrView kernel does.
  NoGradGuard no_grad;
  (void)relu_(x);
  EXPECT_EQ(x.version(), 6u);
}

TEST(VersionCounter, OptimizerStepAndGradientAccumulationBump) {
  test::Env env(ExecMode::Compute);
  Tensor w = leaf(env, {3, 3});
  w.set_name("w");
  const Tensor x = uniform(env.rt, {2, 3}, -1, 1, DType::F32, 1);
  backward(sum(linear(x, w)));
  const Tensor g = w.grad();
  ASSERT_TRUE(g.defined());
  const std::uint32_t g0 = g.version();
  backward(sum(linear(x, w)));  // accumulates in place into the same gradient
  EXPECT_TRUE(w.grad().is_same(g));
  EXPECT_EQ(g.version(), g0 + 1);
  auto opt = make_optimizer(OptimizerConfig{}, {w});
  const std::uint32_t w0 = w.version();
  opt->step();
  EXPECT_GT(w.version(), w0);
}

// --- the check at unpack --------------------------------------------------------------------

TEST(SavedTensorCheck, InPlaceOpOnASavedOutputThrowsPyTorchsMessage) {
  for (const ExecMode mode : {ExecMode::Compute, ExecMode::DryRun}) {
    test::Env env(mode);
    const Tensor x = leaf(env, {2, 3});
    const Tensor y = sigmoid(x);  // SigmoidBackward0 saves its result
    (void)relu_(y);
    const std::string m = inplace_message([&] { backward(sum(y)); });
    EXPECT_CONTAINS(m, "one of the variables needed for gradient computation has been modified by an "
                       "inplace operation: [torch.cuda.FloatTensor [2, 3]], which is output 0 of "
                       "SigmoidBackward0, is at version 1; expected version 0 instead.");
    EXPECT_CONTAINS(m, "Hint: a tensor kept for backward was modified in place");
    EXPECT_EQ(m.find("checkpointed segment"), std::string::npos) << m;
  }
}

TEST(SavedTensorCheck, SavedInputNamesTheInPlaceOpThatRebasedIt) {
  // PyTorch names data_.grad_fn() of a saved input: after relu_, ReluBackward0.
  test::Env env(ExecMode::DryRun);
  const Tensor x = leaf(env, {4, 5});
  const Tensor h = mul_scalar(x, 2.0);
  const Tensor g = gelu(h);  // saves h
  const Tensor r = relu_(h);
  const std::string m = inplace_message([&] { backward(sum(add(g, r))); });
  EXPECT_CONTAINS(m, "[torch.cuda.FloatTensor [4, 5]], which is output 0 of ReluBackward0, is at "
                     "version 1; expected version 0 instead.");
}

TEST(SavedTensorCheck, LeafAndDtypeInTheMessage) {
  test::Env env(ExecMode::DryRun);
  const Tensor w = leaf(env, {3, 4});
  const Tensor x = to_dtype(uniform(env.rt, {2, 4}, -1, 1), DType::F64);
  const Tensor w64 = to_dtype(w, DType::F64);
  const Tensor y = linear(x, w64);  // saves x (a leaf not requiring grad): no "output of"
  fill_(x, 1.0);
  try {
    backward(sum(y));
    FAIL() << "no error";
  } catch (const InplaceModifiedError& e) {
    EXPECT_CONTAINS(std::string(e.what()), "[torch.cuda.DoubleTensor [2, 4]] is at version 1; expected "
                                           "version 0 instead.");
    EXPECT_EQ(e.details().grad_fn, "");
    EXPECT_EQ(e.details().shape, (Shape{2, 4}));
    EXPECT_FALSE(e.details().checkpoint_input);
    EXPECT_EQ(e.phase(), current_phase());  // no PhaseGuard here: the thread's default
  }
}

TEST(SavedTensorCheck, TwoInPlaceReluOnOneTensorFailAsInPyTorch) {
  // relu_ saves its result at the bumped version; a second relu_ bumps it again, so the
  // first ReluBackward0 finds version 2 where it saved 1. PyTorch raises the same.
  test::Env env(ExecMode::DryRun);
  const Tensor x = leaf(env, {3});
  const Tensor h = mul_scalar(x, 1.0);
  const Tensor a = relu_(h);
  const Tensor b = relu_(a);
  const std::string m = inplace_message([&] { backward(sum(b)); });
  EXPECT_CONTAINS(m, "which is output 0 of ReluBackward0, is at version 2; expected version 1 instead.");
}

TEST(SavedTensorCheck, InPlaceOpsOnTensorsNobodySavedPass) {
  // Bottleneck's pattern: bn output += identity, then relu_ (nothing saved either before).
  test::Env env(ExecMode::Compute);
  const Tensor x = leaf(env, {2, 4});
  const Tensor w = leaf(env, {4, 4});
  Tensor out = linear(x, w);      // saves x and w, not its output
  out = add_(out, x);             // AddBackward0 saves nothing
  out = relu_(out);               // saves its result at version 2
  const Tensor y = linear(out, w);  // saves out at version 2
  EXPECT_NO_THROW(backward(sum(y)));
  EXPECT_TRUE(w.grad().defined());
  EXPECT_TRUE(x.grad().defined());
}

TEST(SavedTensorCheck, InPlaceOnALeafRequiringGradIsRefused) {
  test::Env env(ExecMode::DryRun);
  const Tensor x = leaf(env, {3});
  EXPECT_THROW((void)relu_(x), AutogradError);
  EXPECT_THROW((void)add_(x, x), AutogradError);
  EXPECT_EQ(x.version(), 0u);  // refused before writing
  NoGradGuard no_grad;
  EXPECT_NO_THROW((void)relu_(x));
}

// --- checkpointing ----------------------------------------------------------------------------

TEST(SavedTensorCheck, NonReentrantCheckpointChecksItsSavedInput) {
  test::Env env(ExecMode::Compute);
  const Tensor x = leaf(env, {2, 4});
  const Tensor w = leaf(env, {4, 4});
  const Tensor h = linear(x, w);
  const SegmentFunction starts_in_place = [&](const TensorList& in) {
    return TensorList{linear(relu_(in[0]), w)};
  };
  const Tensor y = checkpoint(starts_in_place, {h})[0];
  EXPECT_EQ(h.version(), 1u);
  try {
    backward(sum(y));
    FAIL() << "no error";
  } catch (const InplaceModifiedError& e) {
    EXPECT_CONTAINS(std::string(e.what()),
                    "[torch.cuda.FloatTensor [2, 4]], which is output 0 of ReluBackward0, is at version 1; "
                    "expected version 0 instead. Hint: a checkpointed segment modified its own input");
    EXPECT_TRUE(e.details().checkpoint_input);
  }
  // Inside the segment nothing is checked (PyTorch's saved-tensor hooks), so an in-place
  // op after the first one passes, and so does one on a tensor only the segment uses.
  const SegmentFunction in_place_later = [&](const TensorList& in) {
    return TensorList{linear(relu_(linear(in[0], w)), w)};
  };
  const Tensor z = checkpoint(in_place_later, {linear(x, w)})[0];
  EXPECT_NO_THROW(backward(sum(z)));
}

TEST(SavedTensorCheck, ReentrantCheckpointFailsInTheRerunAsPyTorchDoes) {
  // CheckpointFunction's SavedVariables are built after forward() returned: the input's
  // version after the segment's relu_ passes the check, and the rerun's relu_ on the
  // detached input (a leaf requiring grad) raises PyTorch's leaf error instead.
  test::Env env(ExecMode::DryRun);
  const Tensor x = leaf(env, {2, 4});
  const Tensor w = leaf(env, {4, 4});
  const SegmentFunction starts_in_place = [&](const TensorList& in) {
    return TensorList{linear(relu_(in[0]), w)};
  };
  CheckpointOptions reentrant;
  reentrant.mode = CheckpointMode::Reentrant;
  const Tensor y = checkpoint(starts_in_place, {linear(x, w)}, reentrant)[0];
  try {
    backward(sum(y));
    FAIL() << "no error";
  } catch (const InplaceModifiedError&) {
    FAIL() << "the version check passes in PyTorch's reentrant checkpoint";
  } catch (const AutogradError& e) {
    EXPECT_STREQ(e.what(), "a leaf Variable that requires grad is being used in an in-place operation.");
  }
}

// --- the built-in models ------------------------------------------------------------------------

/// Whether checkpoint_sequential(body, segments) lets some checkpointed segment begin at
/// module `first_inplace` (PyTorch's split: segments - 1 segments of n / segments modules).
bool segment_begins_at(std::size_t modules, std::size_t segments, std::size_t index) {
  const SegmentPlan plan = plan_segments(modules, segments);
  for (const auto& [first, last] : plan.checkpointed) {
    if (first == index && first > 0) return true;
  }
  return false;
}

enum class Outcome { Runs, InplaceModified, LeafInPlace };

Outcome train_once(const std::string& model, const std::string& options, std::size_t segments,
                   CheckpointMode mode = CheckpointMode::NonReentrant, bool input_requires_grad = false,
                   ExecMode exec = ExecMode::DryRun) {
  TrainConfig cfg;
  cfg.model = models::find(model);
  cfg.model_options = ModelOptions::parse(options);
  cfg.mode = exec;
  cfg.segments = segments;
  cfg.checkpoint_mode = mode;
  cfg.input_requires_grad = input_requires_grad;
  cfg.steps = 1;
  auto device = make_device(exec == ExecMode::Compute ? "sim:capacity=16GiB,context=0,backing=host"
                                                      : "sim:capacity=16GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  try {
    (void)trainer.step();
  } catch (const InplaceModifiedError&) {
    return Outcome::InplaceModified;
  } catch (const AutogradError& e) {
    EXPECT_CONTAINS(std::string(e.what()), "a leaf Variable that requires grad");
    return Outcome::LeafInPlace;
  }
  return Outcome::Runs;
}

TEST(InplaceModels, Resnet50AtEightSegmentsIsRefusedWithPyTorchsMessage) {
  TrainConfig cfg;
  cfg.model = models::find("resnet50");
  cfg.model_options = ModelOptions::parse("batch=2,image=32,classes=10");
  cfg.segments = 8;
  auto device = make_device("sim:capacity=16GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  try {
    (void)trainer.step();
    FAIL() << "resnet50 at 8 segments must fail as on PyTorch";
  } catch (const InplaceModifiedError& e) {
    // PyTorch 2.11 on an H100, batch 64 at 224: [torch.cuda.FloatTensor [64, 64, 112, 112]].
    EXPECT_CONTAINS(std::string(e.what()),
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    "operation: [torch.cuda.FloatTensor [2, 64, 16, 16]], which is output 0 of "
                    "ReluBackward0, is at version 1; expected version 0 instead.");
    EXPECT_EQ(e.phase(), Phase::Backward);
    EXPECT_EQ(context_info(e.context()).path, "maxpool");  // the first node of segment 2 to run
  }
}

TEST(InplaceModels, ResnetsFailExactlyWhereACheckpointedSegmentBeginsWithTheStemRelu) {
  // The stem's ReLU(inplace=True) is module 2. resnet50 (23 modules): segments 0..7 run,
  // 8..23 are refused; resnet18 (15 modules): 0..5 run, 6..15 are refused.
  const struct {
    const char* model;
    std::size_t modules;
    std::size_t first_refused;
  } cases[] = {{"resnet50", 23, 8}, {"resnet18", 15, 6}};
  for (const auto& c : cases) {
    for (std::size_t k = 1; k <= c.modules; ++k) {
      SCOPED_TRACE(std::string(c.model) + " segments " + std::to_string(k));
      const bool refused = k >= c.first_refused;
      ASSERT_EQ(segment_begins_at(c.modules, k, 2), refused);
      EXPECT_EQ(train_once(c.model, "batch=2,image=32,classes=10", k),
                refused ? Outcome::InplaceModified : Outcome::Runs);
    }
  }
}

TEST(InplaceModels, ResnetReentrantFailsInTheRerunOnlyWhenTheInputRequiresGrad) {
  // Without an input requiring grad the segments get no history at all (the pitfall):
  // nothing reruns, nothing fails, gradients are missing. With one, the rerun's relu_ on
  // its detached input raises PyTorch's leaf error.
  EXPECT_EQ(train_once("resnet18", "batch=2,image=32,classes=10", 6, CheckpointMode::Reentrant, false),
            Outcome::Runs);
  EXPECT_EQ(train_once("resnet18", "batch=2,image=32,classes=10", 6, CheckpointMode::Reentrant, true),
            Outcome::LeafInPlace);
  EXPECT_EQ(train_once("resnet18", "batch=2,image=32,classes=10", 5, CheckpointMode::Reentrant, true),
            Outcome::Runs);
}

TEST(InplaceModels, MlpWithInPlaceReluFailsWhenACheckpointedSegmentBeginsWithIt) {
  // depth 4: Linear, ReLU, Linear, ReLU, Linear, ReLU, Linear, Sigmoid (8 modules). Segment
  // size 8 / k: 4, 2, 2 for k = 2..4 start every segment on a Linear; k >= 5 gives size 1,
  // so segment 1 is the ReLU, which modifies the input its checkpoint saved. Reentrant
  // checkpointing fails at the same counts in the rerun (the input requires grad here).
  for (std::size_t k = 1; k <= 8; ++k) {
    SCOPED_TRACE("segments " + std::to_string(k));
    const bool refused = k >= 5;
    EXPECT_EQ(train_once("mlp", "depth=4,width=32,batch=4,inplace=1", k),
              refused ? Outcome::InplaceModified : Outcome::Runs);
    EXPECT_EQ(train_once("mlp", "depth=4,width=32,batch=4,inplace=0", k), Outcome::Runs);
    EXPECT_EQ(train_once("mlp", "depth=4,width=32,batch=4,inplace=1", k, CheckpointMode::Reentrant, true),
              refused ? Outcome::LeafInPlace : Outcome::Runs);
  }
  // The tail may begin with the ReLU: nothing saved the last checkpoint's output as a plain
  // saved tensor (the Linear that made it saved only its input, behind the checkpoint), so
  // PyTorch runs depth 3 at 2 segments ([Linear, ReLU, Linear] checkpointed, tail ReLU, ...).
  EXPECT_EQ(train_once("mlp", "depth=3,width=32,batch=4,inplace=1", 2), Outcome::Runs);
  EXPECT_EQ(train_once("mlp", "depth=3,width=32,batch=4,inplace=1", 2, CheckpointMode::Reentrant, true),
            Outcome::Runs);
  // depth 16 (32 modules): odd segment sizes 32 / k put ReLUs first: k = 6 (5), 9 and 10 (3), 17+ (1).
  for (std::size_t k : {2u, 4u, 5u, 6u, 8u, 9u, 11u, 16u, 17u, 32u}) {
    SCOPED_TRACE("depth 16, segments " + std::to_string(k));
    const std::size_t size = 32 / k;
    bool refused = false;
    for (std::size_t s = 1; s + 1 < k; ++s) refused = refused || (s * size) % 2 == 1;
    EXPECT_EQ(refused, k == 6 || k == 9 || k >= 17);
    EXPECT_EQ(train_once("mlp", "depth=16,width=16,batch=2,inplace=1", k),
              refused ? Outcome::InplaceModified : Outcome::Runs);
  }
}

TEST(InplaceModels, MatchesWhatPyTorchDidOnAnH100) {
  // scripts/pytorch_sweep.py with PyTorch 2.11 on an H100 (f32, one step): mlp depth 6,
  // width 64, inplace ReLU ran at 0, 1, 2, 3, 5, 6 segments and raised the version error at
  // 4 and 7; resnet18 ran at 0..5 and failed at 6..15; resnet50 ran at 0..7, failed at 8..18.
  // (PyTorch's 0 and 1 are both no checkpointing: 1 here.)
  for (std::size_t k = 1; k <= 7; ++k) {
    SCOPED_TRACE("mlp segments " + std::to_string(k));
    EXPECT_EQ(train_once("mlp", "depth=6,width=64,batch=4,inplace=1", k),
              k == 4 || k == 7 ? Outcome::InplaceModified : Outcome::Runs);
  }
  for (std::size_t k = 1; k <= 18; ++k) {
    SCOPED_TRACE("resnet50 segments " + std::to_string(k));
    EXPECT_EQ(train_once("resnet50", "batch=2,image=32,classes=10", k),
              k >= 8 ? Outcome::InplaceModified : Outcome::Runs);
  }
}

TEST(InplaceModels, AcceptedInPlaceConfigurationsComputeTheSameAsWithout) {
  // The in-place ReLU changes memory, never results, where PyTorch accepts it.
  const auto losses = [](const std::string& options, std::size_t segments) {
    TrainConfig cfg;
    cfg.model = models::find("mlp");
    cfg.model_options = ModelOptions::parse(options);
    cfg.mode = ExecMode::Compute;
    cfg.segments = segments;
    cfg.steps = 2;
    auto device = make_device("sim:capacity=4GiB,context=0,backing=host");
    CachingAllocator alloc(device);
    Trainer trainer(cfg, alloc);
    std::vector<double> out;
    for (int i = 0; i < 2; ++i) out.push_back(trainer.step().loss);
    for (const Tensor& p : trainer.model().parameters()) {
      const auto g = to_values(p.grad());
      out.insert(out.end(), g.begin(), g.end());
    }
    return out;
  };
  const auto base = losses("depth=4,width=8,batch=3,inplace=0", 1);
  for (std::size_t k : {1u, 2u, 3u, 4u}) {
    EXPECT_EQ(losses("depth=4,width=8,batch=3,inplace=1", k), base) << "segments " << k;
  }
  EXPECT_EQ(train_once("resnet18", "batch=2,image=32,classes=10", 1, CheckpointMode::NonReentrant, false,
                       ExecMode::Compute),
            Outcome::Runs);
  EXPECT_EQ(train_once("resnet18", "batch=2,image=32,classes=10", 4, CheckpointMode::NonReentrant, false,
                       ExecMode::Compute),
            Outcome::Runs);
}

TEST(InplaceModels, EveryModelRunsPlainAndAtItsSquareRootSegmentCount) {
  const struct {
    const char* model;
    const char* options;
  } models[] = {{"mlp", "depth=4,width=16,batch=2"},
                {"mlp", "depth=4,width=16,batch=2,inplace=1"},
                {"forum-cnn", "batch=2"},
                {"resnet18", "batch=2,image=32,classes=10"},
                {"resnet50", "batch=2,image=32,classes=10"},
                {"gpt2", "batch=1,seq=16"}};
  for (const auto& m : models) {
    const std::size_t n = models::find(m.model)->describe(ModelOptions::parse(m.options)).sequence_length;
    for (std::size_t k : {std::size_t{1}, static_cast<std::size_t>(std::lround(std::sqrt(static_cast<double>(n))))}) {
      for (auto mode : {CheckpointMode::NonReentrant, CheckpointMode::Reentrant}) {
        SCOPED_TRACE(std::string(m.model) + " " + m.options + " segments " + std::to_string(k) + " " +
                     std::string(checkpoint_mode_name(mode)));
        EXPECT_EQ(train_once(m.model, m.options, k, mode, mode == CheckpointMode::Reentrant), Outcome::Runs);
      }
    }
  }
}

// --- unwinding ----------------------------------------------------------------------------------

struct UnwindCase {
  const char* name;
  const char* model;
  const char* options;
  std::size_t segments;
  CheckpointMode mode = CheckpointMode::NonReentrant;
  ExecMode exec = ExecMode::DryRun;
};

void PrintTo(const UnwindCase& c, std::ostream* os) { *os << c.name; }

class InplaceUnwind : public ::testing::TestWithParam<UnwindCase> {};

TEST_P(InplaceUnwind, ARefusedStepLeavesTheAllocatorAsAnOutOfMemoryOneDoes) {
  const UnwindCase& c = GetParam();
  TrainConfig cfg;
  cfg.model = models::find(c.model);
  cfg.model_options = ModelOptions::parse(c.options);
  cfg.mode = c.exec;
  cfg.segments = c.segments;
  cfg.checkpoint_mode = c.mode;
  cfg.input_requires_grad = c.mode == CheckpointMode::Reentrant;
  auto device = make_device(c.exec == ExecMode::Compute ? "sim:capacity=16GiB,context=0,backing=host"
                                                        : "sim:capacity=16GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  const Phase phase_before = current_phase();
  const std::int64_t before = alloc.stats().allocated_bytes[0].current;
  const std::int64_t requested_before = alloc.stats().requested_bytes[0].current;
  for (int attempt = 0; attempt < 2; ++attempt) {
    SCOPED_TRACE("attempt " + std::to_string(attempt + 1));
    EXPECT_THROW((void)trainer.step(), AutogradError);
    ASSERT_NO_THROW(alloc.validate());
    // The thread's autograd state is back: grad mode on, no phase, no checkpoint hook.
    EXPECT_TRUE(grad_enabled());
    EXPECT_EQ(current_phase(), phase_before);
    EXPECT_EQ(current_context(), kNoContext);
    // What remains is what the user holds: the gradients accumulated before the error (the
    // optimizer never ran: no state) and the cuBLAS workspaces, nothing of the step.
    const auto workspaces = static_cast<std::int64_t>(trainer.runtime().gemm_workspace_bytes());
    std::set<const Storage*> grad_blocks;
    std::int64_t grads = 0;
    for (const Tensor& p : trainer.model().parameters()) {
      if (p.grad().defined() && grad_blocks.insert(p.grad().storage().get()).second) {
        grads += static_cast<std::int64_t>(p.grad().storage()->nbytes());
      }
    }
    ASSERT_NE(trainer.optimizer(), nullptr);
    EXPECT_EQ(trainer.optimizer()->state_bytes(), 0u);
    EXPECT_EQ(alloc.stats().requested_bytes[0].current, requested_before + grads + workspaces);
    trainer.optimizer()->zero_grad(true);
    EXPECT_EQ(alloc.stats().requested_bytes[0].current, requested_before + workspaces);
    EXPECT_EQ(alloc.stats().allocated_bytes[0].current, before + workspaces);
  }
  EXPECT_TRUE(trainer.report().steps.empty());
  // The same runtime still trains a model PyTorch accepts (nothing stuck in its state).
  test::Env env(c.exec);
  const Tensor x = leaf(env, {2, 3});
  EXPECT_NO_THROW(backward(sum(sigmoid(x))));
}

INSTANTIATE_TEST_SUITE_P(
    Models, InplaceUnwind,
    ::testing::Values(UnwindCase{"resnet50_seg8", "resnet50", "batch=2,image=32,classes=10", 8},
                      UnwindCase{"resnet18_seg15", "resnet18", "batch=2,image=32,classes=10", 15},
                      UnwindCase{"mlp_inplace_seg5_compute", "mlp", "depth=4,width=32,batch=4,inplace=1", 5,
                                 CheckpointMode::NonReentrant, ExecMode::Compute},
                      UnwindCase{"mlp_inplace_seg6_reentrant", "mlp", "depth=4,width=32,batch=4,inplace=1", 6,
                                 CheckpointMode::Reentrant}),
    [](const ::testing::TestParamInfo<UnwindCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace mem::nn
