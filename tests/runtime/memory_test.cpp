// memory_test.cpp — exact memory: what each op keeps for backward, the peak of an
// mlp with n layers and k checkpoint segments derived by hand, the minimum over k
// near sqrt(n), checkpointing one ReLU saving nothing, and identical statistics in
// compute and dry-run modes.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <tuple>

#include "test_util.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/checkpoint.hpp"

namespace mem::nn {
namespace {

/// Bytes an op keeps alive for backward beyond its inputs: run it, drop the output
/// handle but keep its node (the graph), and compare with the inputs alone.
std::int64_t kept_bytes(test::Env& env, const std::function<Tensor()>& op) {
  const std::int64_t before = env.allocated();
  Tensor out = op();
  const std::shared_ptr<Node> node = out.grad_fn();
  out = Tensor{};
  const std::int64_t kept = env.allocated() - before;
  return node ? kept : -1;
}

class SavedBytes : public ::testing::Test {
 protected:
  // The cuBLAS workspaces are taken at the first matrix product and kept for good:
  // take them now, so that kept_bytes counts only what autograd saves.
  SavedBytes() { env_.rt.gemm_workspace(/*lt=*/true); }
  Tensor leaf(const Shape& shape) {
    Tensor t = empty(env_.rt, shape);
    t.set_requires_grad(true);
    return t;
  }
  test::Env env_{ExecMode::DryRun};
};

// Shapes: activations [64, 1024] f32 = 256 KiB; images [8, 16, 32, 32] f32 = 512 KiB.
TEST_F(SavedBytes, TheObserverSeesEachSaveAsTheStorageKept) {
  // saved_tensors_hooks' pack hook, observing: linear saves x (the weight's gradient reads
  // it) and the weight; sigmoid saves its output. Inside a non-reentrant checkpoint only the
  // checkpoint's own input is kept: the placeholders keep nothing and are not reported.
  const Tensor x = leaf({64, 1024}), w = leaf({1024, 1024});
  std::vector<const Storage*> seen;
  std::vector<std::size_t> bytes;
  {
    SavedTensorsObserver observe([&](const Tensor& t) {
      seen.push_back(t.storage().get());
      bytes.push_back(t.storage()->nbytes());
    });
    const Tensor h = linear(x, w);
    const Tensor y = sigmoid(h);
    ASSERT_EQ(seen.size(), 3u);
    EXPECT_EQ(seen[0], x.storage().get());
    EXPECT_EQ(seen[1], w.storage().get());
    EXPECT_EQ(seen[2], y.storage().get());
    EXPECT_EQ(bytes[2], std::size_t{64 * 1024 * 4});
    seen.clear();
    const TensorList out = checkpoint([&](const TensorList& in) { return TensorList{sigmoid(linear(in[0], w))}; },
                                      {x}, CheckpointOptions{});
    ASSERT_EQ(seen.size(), 1u);  // the segment's input, for the rerun
    EXPECT_EQ(seen[0], x.storage().get());
    {
      std::size_t inner = 0;
      SavedTensorsObserver nested([&](const Tensor&) { ++inner; });
      const Tensor z = sigmoid(x);
      EXPECT_EQ(inner, 1u);  // the innermost observer sees it, the outer one does not
    }
    EXPECT_EQ(seen.size(), 1u);
  }
  const Tensor after = sigmoid(x);  // no observer any more
  EXPECT_EQ(seen.size(), 1u);
}

TEST_F(SavedBytes, EachOpKeepsWhatDerivativesYamlSaves) {
  const Tensor x = leaf({64, 1024}), w = leaf({1024, 1024}), b = leaf({1024});
  const Tensor img = leaf({8, 16, 32, 32}), kernel = leaf({16, 16, 3, 3}), gamma = leaf({16}), beta = leaf({16});
  const Tensor rm = zeros(env_.rt, {16}), rv = zeros(env_.rt, {16});
  const Tensor ln_w = leaf({1024}), ln_b = leaf({1024});
  const Tensor idx = empty(env_.rt, {64}, DType::I64);
  const Tensor classes = empty(env_.rt, {64}, DType::I64);
  const Tensor emb = leaf({1000, 1024});
  const Tensor target = empty(env_.rt, {64, 1024});
  constexpr std::int64_t act = 64 * 1024 * 4;

  // Inputs and weights it saves are alive anyway: nothing extra.
  EXPECT_EQ(kept_bytes(env_, [&] { return linear(x, w, b); }), 0);
  EXPECT_EQ(kept_bytes(env_, [&] { return conv2d(img, kernel, Tensor{}, 1, 1); }), 0);
  EXPECT_EQ(kept_bytes(env_, [&] { return gelu(x); }), 0);               // its input
  EXPECT_EQ(kept_bytes(env_, [&] { return mse_loss(x, target); }), 0);   // input + target
  EXPECT_EQ(kept_bytes(env_, [&] { return embedding(emb, idx); }), 0);   // indices
  EXPECT_EQ(kept_bytes(env_, [&] { return add(x, x); }), 0);             // nothing
  EXPECT_EQ(kept_bytes(env_, [&] { return adaptive_avg_pool2d(img); }), 0);  // mean: sizes only
  // Their own output.
  EXPECT_EQ(kept_bytes(env_, [&] { return relu(x); }), act);
  EXPECT_EQ(kept_bytes(env_, [&] { return sigmoid(x); }), act);
  EXPECT_EQ(kept_bytes(env_, [&] { return tanh(x); }), act);
  EXPECT_EQ(kept_bytes(env_, [&] { return softmax(x); }), act);
  EXPECT_EQ(kept_bytes(env_, [&] { return log_softmax(x); }), act);
  // A bool mask as on CUDA: 1 byte per element.
  EXPECT_EQ(kept_bytes(env_, [&] { return dropout(x, 0.1, true); }), 64 * 1024);
  // max_pool2d 2x2: input (alive) + i64 indices of the output's size.
  EXPECT_EQ(kept_bytes(env_, [&] { return max_pool2d(img, 2, 2); }), 8 * 16 * 16 * 16 * 8);
  // batch_norm: f32 mean and invstd per channel, 64 B each, rounded to 512 B blocks.
  EXPECT_EQ(kept_bytes(env_, [&] { return batch_norm(img, gamma, beta, rm, rv, true); }), 2 * 512);
  // layer_norm: f32 mean and rstd per row (64 rows: 256 B -> 512 B each).
  EXPECT_EQ(kept_bytes(env_, [&] { return layer_norm(x, ln_w, ln_b); }), 2 * 512);
  // cross_entropy: log_softmax output [64, 1024] + nll_loss's total_weight scalar.
  EXPECT_EQ(kept_bytes(env_, [&] { return cross_entropy(x, classes); }), act + 512);
  // matmul of permuted operands: reshape copies both, bmm saves both copies.
  const Tensor q = leaf({2, 64, 4, 32});
  EXPECT_EQ(kept_bytes(env_, [&] { return matmul(q.permute({0, 2, 1, 3}), q.permute({0, 2, 3, 1})); }),
            2 * (2 * 64 * 4 * 32 * 4));
  // Views and in-place ops allocate nothing at all.
  EXPECT_EQ(kept_bytes(env_, [&] { return x.view({1024, 64}); }), 0);
  EXPECT_EQ(kept_bytes(env_, [&] { return relu_(mul_scalar(x, 1.0)); }), act);  // the one buffer
}

// A head of a fused qkv projection is a view with gaps ([B, H, S, d] over [B, S, 3C]): an op's
// output on it is dense in the view's dimension order, [B, S, H, d] in memory (TensorIterator's
// output permutation; empty_like's infer_dense_strides for SDPA's output), so transposing back
// to [B, S, H, d] and .contiguous() copies nothing.
TEST_F(SavedBytes, AnOutputFollowsTheMemoryOrderOfAViewWithGaps) {
  const Tensor qkv = leaf({2, 64, 3 * 128});
  const Tensor q = qkv.narrow(2, 0, 128).view({2, 64, 4, 32}).permute({0, 2, 1, 3});
  const Tensor out = mul_scalar(q, 2.0);
  EXPECT_EQ(out.strides(), (Shape{64 * 128, 32, 128, 1}));
  const std::int64_t before = env_.allocated();
  const Tensor back = out.transpose(1, 2).contiguous();
  EXPECT_EQ(env_.allocated(), before);
  EXPECT_EQ(back.storage(), out.storage());
  // An expanded dimension (stride 0) decides nothing in infer_dense_strides: torch 2.15 gives
  // strides (1, 2, 6) for this product, and (12, 4, 1) without the transpose.
  const Tensor x = leaf({4, 2});
  EXPECT_EQ(mul_scalar(x.transpose(0, 1).unsqueeze(1).expand({2, 3, 4}), 1.5).strides(), (Shape{1, 2, 6}));
  EXPECT_EQ(mul_scalar(leaf({2, 4}).unsqueeze(1).expand({2, 3, 4}), 1.5).strides(), (Shape{12, 4, 1}));
}

// The layers model files added (issue 18). act = [64, 1024] f32 = 256 KiB; img =
// [8, 16, 32, 32] f32 = 512 KiB. What each saves, from derivatives.yaml and checked on
// PyTorch 1.13 with grad_fn._saved_* and saved_tensors_hooks.
TEST_F(SavedBytes, TheModelFileLayersKeepWhatPyTorchKeeps) {
  const Tensor x = leaf({64, 1024});
  const Tensor img = leaf({8, 16, 32, 32});
  constexpr std::int64_t act = 64 * 1024 * 4, image = 8 * 16 * 32 * 32 * 4;
  // Saving their input (alive anyway): nothing extra.
  EXPECT_EQ(kept_bytes(env_, [&] { return leaky_relu(x, 0.01); }), 0);   // LeakyReluBackward0: self
  EXPECT_EQ(kept_bytes(env_, [&] { return hardtanh(x, 0, 6); }), 0);     // HardtanhBackward0: self
  EXPECT_EQ(kept_bytes(env_, [&] { return silu(x); }), 0);               // SiluBackward0: self
  EXPECT_EQ(kept_bytes(env_, [&] { return avg_pool2d(img, 2, 2); }), 0);  // AvgPool2DBackward0: self
  EXPECT_EQ(kept_bytes(env_, [&] { return adaptive_avg_pool2d(img, 7, 7); }), 0);  // self
  // Grouped, dilated and depthwise convolutions save input and weight, as any other.
  const Tensor depthwise = leaf({16, 1, 3, 3}), grouped = leaf({32, 4, 3, 3});
  EXPECT_EQ(kept_bytes(env_, [&] { return conv2d(img, depthwise, Tensor{}, 1, 1, 1, 16); }), 0);
  EXPECT_EQ(kept_bytes(env_, [&] { return conv2d(img, grouped, Tensor{}, 1, 2, 2, 4); }), 0);
  // In place on a fresh buffer, the output kept (as the next layer keeps it): leaky_relu_
  // saves its result (LeakyReluBackward1), the buffer itself: one buffer. hardtanh_
  // (ReLU6(inplace=True)) and silu(inplace=True) save a copy of the input taken before the
  // write: two, so in place saves nothing over out of place for them.
  Tensor kept_output;
  const auto keeping = [&](auto op) {
    const std::int64_t kept = kept_bytes(env_, [&] { return kept_output = op(); });
    kept_output = Tensor{};
    return kept;
  };
  EXPECT_EQ(keeping([&] { return leaky_relu_(mul_scalar(x, 1.0), 0.01); }), act);
  EXPECT_EQ(keeping([&] { return hardtanh_(mul_scalar(x, 1.0), 0, 6); }), 2 * act);
  EXPECT_EQ(keeping([&] { return silu_(mul_scalar(x, 1.0)); }), 2 * act);
  EXPECT_EQ(keeping([&] { return hardtanh(mul_scalar(x, 1.0), 0, 6); }), 2 * act);  // input + output
  // Out of place on a fresh buffer: the buffer (their saved input) plus the output they
  // return, which nothing saves here and which is dropped: one buffer.
  EXPECT_EQ(kept_bytes(env_, [&] { return hardtanh(mul_scalar(x, 1.0), 0, 6); }), act);
  // Pooling of a fresh image keeps the whole image (only its shape is read in backward).
  EXPECT_EQ(kept_bytes(env_, [&] { return avg_pool2d(mul_scalar(img, 1.0), 2, 2); }), image);
  EXPECT_EQ(kept_bytes(env_, [&] { return adaptive_avg_pool2d(mul_scalar(img, 1.0), 7, 7); }), image);
  // ... except the 1x1 adaptive pool, computed as a mean that keeps only sizes.
  EXPECT_EQ(kept_bytes(env_, [&] { return adaptive_avg_pool2d(mul_scalar(img, 1.0), 1, 1); }), 0);
  // conv1d saves input and weight (views of them for the 2-d kernel: no copies).
  const Tensor seq = leaf({8, 16, 1024}), kernel1d = leaf({32, 4, 5});
  EXPECT_EQ(kept_bytes(env_, [&] { return conv1d(seq, kernel1d, Tensor{}, 1, 4, 2, 4); }), 0);
  // conv_transpose2d saves input and weight: nothing extra (its columns are workspace).
  const Tensor up = leaf({16, 8, 4, 4});
  EXPECT_EQ(kept_bytes(env_, [&] { return conv_transpose2d(img, up, Tensor{}, 2, 1, 1); }), 0);
  // group_norm: input and weight, plus mean and rstd [N, G] in the input's dtype:
  // [8, 4] f32 = 128 B each, one 512 B block each.
  const Tensor gn_w = leaf({16}), gn_b = leaf({16});
  EXPECT_EQ(kept_bytes(env_, [&] { return group_norm(img, gn_w, gn_b, 4); }), 2 * 512);
  // mul saves both operands (each for the other's gradient): of fresh buffers, both stay.
  EXPECT_EQ(kept_bytes(env_, [&] { return mul(x, x); }), 0);
  EXPECT_EQ(keeping([&] { return mul(mul_scalar(x, 1.0), mul_scalar(x, 2.0)); }), 3 * act);  // a, b, out
  // reshape of a permuted tensor copies (CloneBackward saves nothing); a view does not.
  EXPECT_EQ(keeping([&] { return img.permute({0, 2, 3, 1}).reshape({8, -1}); }), image);
  EXPECT_EQ(keeping([&] { return img.reshape({8, -1}); }), 0);
  // bce_with_logits saves input and target (alive): nothing but the scalar, dropped here.
  const Tensor probs = empty(env_.rt, {64, 1024});
  EXPECT_EQ(kept_bytes(env_, [&] { return bce_with_logits(x, probs); }), 0);
  // A leaf that requires grad cannot be modified in place, as in PyTorch.
  EXPECT_THROW(hardtanh_(x, 0, 6), AutogradError);
  EXPECT_THROW(leaky_relu_(mul_scalar(x, 1.0), -0.1), Error);
}

// The transformer layers of model files (issue 18): nn.MultiheadAttention on PyTorch 2.5's
// SDPA path, nn.RMSNorm, and the ViT token layers. x = [4, 64, 256] f32 (batch first).
TEST_F(SavedBytes, TheTransformerLayersKeepWhatPyTorch25Keeps) {
  constexpr std::int64_t B = 4, S = 64, E = 256, H = 8;
  constexpr std::int64_t tokens = B * S * E * 4;  // one [B, S, E] f32: 256 KiB
  const Tensor x = leaf({B, S, E});
  MultiheadAttention mha(E, H, 0.0, true, true);
  mha.set_path("attn");
  mha.materialize(env_.rt, DType::F32);
  // in_proj's linear on the transposed [S, B, E] view copies it (matmul's fold) and saves the
  // copy; the packed q, k, v copy [3, S, B, E] is saved by SDPA (three views of it), with its
  // output [B, S, H, d] and the f32 logsumexp [B, H, S] (efficient kernel: f32 input);
  // out_proj saves the permute(2, 0, 1, 3).contiguous() copy of the output.
  EXPECT_EQ(kept_bytes(env_, [&] { return mha(x); }), tokens + 3 * tokens + tokens + B * H * S * 4 + tokens);
  // nn.RMSNorm (F.rms_norm in the input's dtype): rsqrt's [rows, 1] (1 KiB) and x * rsqrt,
  // which the weight's product saves.
  TorchRMSNorm norm(E, 1e-6);
  norm.set_path("norm");
  norm.materialize(env_.rt, DType::F32);
  EXPECT_EQ(kept_bytes(env_, [&] { return norm(x); }), B * S * 4 + tokens);
  // The token layers keep nothing: cat, add and a select view save no tensor.
  ClassToken cls(E);
  cls.set_path("cls");
  cls.materialize(env_.rt, DType::F32);
  EXPECT_EQ(kept_bytes(env_, [&] { return cls(x); }), 0);
  PositionEmbedding pos(S, E);
  pos.set_path("pos");
  pos.materialize(env_.rt, DType::F32);
  EXPECT_EQ(kept_bytes(env_, [&] { return pos(x); }), 0);
  SelectToken select(1, 0);
  select.set_path("select");
  EXPECT_EQ(kept_bytes(env_, [&] { return select(x); }), 0);
}

// binary_cross_entropy_with_logits (Loss.cpp): log_sigmoid(input) and the elementwise loss
// (1 - target).mul_(input).sub_(...) exist together while it runs, beside the scalar.
// cuBLAS's workspace: 2.11 keeps one per thread from its first product on; 2.15 makes one per
// product after the output and frees it when the product returns (CublasHandlePool.cpp).
TEST(GemmWorkspace, TorchTwoFifteenTakesOnePerProductAndGivesItBack) {
  constexpr std::int64_t out = 64 * 1024 * 4, w = 1024 * 1024 * 4, x_bytes = 64 * 1024 * 4;
  const auto ws = static_cast<std::int64_t>(cublas_workspace_bytes(0));
  const auto lt = static_cast<std::int64_t>(cublaslt_workspace_bytes());
  for (const bool today : {false, true}) {
    test::Env env(ExecMode::DryRun);
    env.rt.set_stack(Stack::parse(today ? "torch=2.15" : "torch=2.11"));
    const Tensor x = empty(env.rt, {64, 1024});
    const Tensor weight = empty(env.rt, {1024, 1024});
    const Tensor bias = empty(env.rt, {1024});
    const std::int64_t inputs = env.allocated();
    ASSERT_EQ(inputs, x_bytes + w + 4096);
    Tensor y = linear(x, weight);         // mm: cuBLAS's workspace
    Tensor z = linear(x, weight, bias);   // addmm with a bias: cublasLt's
    if (today) {
      EXPECT_EQ(env.allocated(), inputs + 2 * out) << "nothing kept";
      EXPECT_EQ(env.peak(), inputs + out + ws) << "the first product's output and its workspace";
      EXPECT_EQ(env.rt.gemm_workspace_bytes(), 0u);
    } else {
      EXPECT_EQ(env.allocated(), inputs + 2 * out + ws + lt);
      EXPECT_EQ(env.rt.gemm_workspace_bytes(), static_cast<std::size_t>(ws + lt));
    }
  }
}

TEST(LossMemory, BceWithLogitsPeaksAtTwoInputSizedTemporaries) {
  test::Env env(ExecMode::DryRun);
  Tensor x = empty(env.rt, {64, 1024});
  x.set_requires_grad(true);
  const Tensor target = empty(env.rt, {64, 1024});
  constexpr std::int64_t act = 64 * 1024 * 4;
  ASSERT_EQ(env.peak(), 2 * act);
  const Tensor loss = bce_with_logits(x, target);
  EXPECT_EQ(env.peak(), 4 * act + 512);
  EXPECT_EQ(env.allocated(), 2 * act + 512);
}

TEST_F(SavedBytes, LinearReluLinearKeepsOneActivationPerBlockAndGeluTwo) {
  const Tensor x = leaf({64, 1024});
  const Tensor w1 = leaf({1024, 1024}), w2 = leaf({1024, 1024});
  constexpr std::int64_t act = 64 * 1024 * 4;
  // relu output is saved by ReLU and by the next Linear: one storage.
  EXPECT_EQ(kept_bytes(env_, [&] { return linear(relu(linear(x, w1)), w2); }), act);
  // gelu saves its input (linear output), the next Linear saves gelu's output: two.
  EXPECT_EQ(kept_bytes(env_, [&] { return linear(gelu(linear(x, w1)), w2); }), 2 * act);
}

TEST_F(SavedBytes, CheckpointingOneReluSavesNothing) {
  const Tensor x = leaf({64, 1024});
  const Tensor w1 = leaf({1024, 1024}), w2 = leaf({1024, 1024});
  constexpr std::int64_t act = 64 * 1024 * 4;
  const std::int64_t plain = kept_bytes(env_, [&] { return linear(relu(linear(x, w1)), w2); });
  const std::int64_t ckpt = kept_bytes(env_, [&] {
    const Tensor h = linear(x, w1);
    const Tensor r = checkpoint([](const TensorList& in) { return TensorList{relu(in[0])}; }, {h})[0];
    return linear(r, w2);
  });
  // The next Linear keeps the ReLU output anyway, and the checkpoint keeps its input:
  // one activation more, not less.
  EXPECT_EQ(plain, act);
  EXPECT_EQ(ckpt, 2 * act);
}

// ---------------------------------------------------------------------------------------------
// mlp with n layers (2n modules: Linear(256, 256) + ReLU, the last activation a Sigmoid),
// batch 256, f32, no optimizer, first step, input not requiring grad, k segments with
// 2n/k even (segments hold whole Linear+ReLU pairs: L = n/k layers each).
//
// Every block here is <= 1 MiB, so it comes from the small pool, which always splits:
// a block is exactly its request rounded up to 512 B. Units:
//   a = 256*256*4     = 262144 B  an activation (also a weight),
//   K = 256*4         = 1024 B    a bias (and its gradient),
//   G = a + K                     the gradients of one layer, P = n*G the parameters,
//   s = 512 B                     a scalar (the implicit ones gradient).
// The loss is a scalar whose storage is an input-sized block a (PyTorch's structured
// mse_loss resizes a full-size output to 0-dim and never shrinks it: pytorch/pytorch#185647),
// and the op's squared-difference temporary is another a while it runs.
// Kept between forward and backward: input x, target t, sigmoid output y (held by the
// step like `out = model(x)`), the loss, the k-1 segment boundaries (each the input of
// the next checkpoint), and in the tail of T = n - (k-1)L layers its T-1 ReLU outputs
// (each saved once: by its ReLU and by the next Linear, the same storage).
//
// Forward: memory only grows in the tail; at its last Sigmoid the Linear output and the
// Sigmoid output coexist: P + (k + T + 2) a; the Linear output then dies, and mse_loss's
// output and temporary make the forward's peak F = P + (k + T + 3) a.
// Backward of the tail. Once the loss exists the base is B = P + a + (k + T + 1) a. The
// loss backward, then Sigmoid backward leave one incoming gradient a. The Linear m-th
// from the end then allocates grad_input a and its gradients G while its incoming
// gradient a is alive; m layers are done, each having added G and freed one ReLU
// output a:  B + a + a + (m + 1) G - m a = P + s + (k + T + 4) a + (m + 1) K.
// It is largest for the tail's first layer m = T - 1, except without checkpointing,
// where the model's first Linear computes no grad_input (x does not require grad) and
// the largest is m = T - 2 (and the last Linear, m = 0, for one layer).
// Backward of checkpointed segment j (j = 0 is the last one). When it starts, the tail
// and j later segments are done and their boundaries freed:
//   S = P + s + (k + 2 - j) a + (T + j L) G   (includes the incoming gradient a).
// The rerun rebuilds the segment's L ReLU outputs, peaking at S + (L + 1) a with one
// Linear output in flight; then, as in the tail, its Linear m-th from the end peaks at
// S + L a - m a + (m + 1) G = S + (L + 1) a + (m + 1) K, largest at m = L - 1, or at
// m = L - 2 for the first segment, whose first Linear computes no grad_input.
// cuBLAS workspaces (kept once taken): the forward's first Linear takes the Python
// thread's, W + Lt (addmm with a bias goes through cublasLt); the backward's first
// product takes the engine thread's W, and a rerun's first Linear its Lt. All of them
// exist at every peak of their phase.
std::int64_t expected_mlp_peak(std::int64_t n, std::int64_t k) {
  const std::int64_t a = 262144, K = 1024, G = a + K;
  const auto W = static_cast<std::int64_t>(cublas_workspace_bytes(0));
  const auto Lt = static_cast<std::int64_t>(cublaslt_workspace_bytes());
  const std::int64_t P = n * G + W + Lt;  // parameters, and the forward's workspaces
  const std::int64_t L = k == 1 ? 0 : n / k;
  const std::int64_t T = n - (k - 1) * L;
  // Forward: at mse_loss, its output block and its squared temporary (both a) beside y.
  std::int64_t peak = P + (k + T + 3) * a;
  // Backward: the loss holds an input-sized block (l = a, not a scalar) until the step ends,
  // and the seed ones_like(loss) (s, one 512 B block) lives through the whole backward:
  // torch.autograd.backward keeps it in grad_tensors_ while the engine runs.
  const std::int64_t l = a, s = 512;
  const std::int64_t tail_m = k == 1 ? T - 2 : T - 1;
  if (tail_m >= 0) peak = std::max(peak, P + W + l + s + (k + T + 4) * a + (tail_m + 1) * K);
  peak = std::max(peak, P + W + l + s + (k + T + 3) * a + G);  // the last Linear, in any case
  for (std::int64_t j = 0; j + 1 < k; ++j) {
    const std::int64_t S = P + W + Lt + l + s + (k + 2 - j) * a + (T + j * L) * G;
    const std::int64_t m = j + 2 == k ? L - 2 : L - 1;
    peak = std::max(peak, S + (L + 1) * a + (m >= 0 ? (m + 1) * K : 0));
  }
  return peak;
}

std::int64_t measured_mlp_peak(std::int64_t n, std::int64_t k, ExecMode mode = ExecMode::DryRun,
                               std::int64_t width = 256, std::int64_t batch = 256) {
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.model_options.depth = n;
  cfg.model_options.width = width;
  cfg.model_options.batch = batch;
  cfg.segments = static_cast<std::size_t>(k);
  cfg.optimizer.kind = OptimizerKind::None;
  cfg.mode = mode;
  auto device = make_device(mode == ExecMode::Compute ? "sim:capacity=80GiB,context=0,backing=host"
                                                      : "sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  return trainer.step().peak_allocated;
}

TEST(MlpMemory, MaxAllocatedEqualsTheHandDerivation) {
  for (std::int64_t k : {1, 2, 4, 8, 16}) {
    EXPECT_EQ(measured_mlp_peak(16, k), expected_mlp_peak(16, k)) << "n=16 k=" << k;
  }
  for (std::int64_t k : {1, 3, 5, 15}) {
    EXPECT_EQ(measured_mlp_peak(15, k), expected_mlp_peak(15, k)) << "n=15 k=" << k;
  }
}

TEST(MlpMemory, MinimumOverSegmentsFallsNearSqrtN) {
  // Activations (batch 8192 x 128 x 4 B = 4 MiB) dwarf weights (64 KiB): the regime
  // where checkpointing pays. (With batch == width, as above, gradients grow exactly as
  // fast as activations are freed and no k helps.)
  const std::int64_t n = 64;  // 128 modules
  std::int64_t best_k = 0, best = 0;
  for (std::int64_t k = 1; k <= 2 * n; ++k) {
    const std::int64_t peak = measured_mlp_peak(n, k, ExecMode::DryRun, 128, 8192);
    if (best_k == 0 || peak < best) {
      best = peak;
      best_k = k;
    }
  }
  // peak ~ k a + (n / k) a: minimised near k = sqrt(n) = 8.
  EXPECT_GE(best_k, 4);
  EXPECT_LE(best_k, 16);
  EXPECT_LT(2 * best, measured_mlp_peak(n, 1, ExecMode::DryRun, 128, 8192));
  EXPECT_LT(best, measured_mlp_peak(n, 2 * n, ExecMode::DryRun, 128, 8192));
}

/// Records every allocation and free the allocator sees: (action, requested size, context).
class Recorder final : public AllocatorObserver {
 public:
  void on_event(const TraceEvent& e) noexcept override {
    if (e.action == TraceAction::Alloc || e.action == TraceAction::FreeRequested) {
      events.push_back({static_cast<int>(e.action), e.requested_size, e.context});
    }
  }
  std::vector<std::tuple<int, std::size_t, std::uint32_t>> events;
};

struct ModeRun {
  std::vector<std::tuple<int, std::size_t, std::uint32_t>> events;
  std::vector<DeviceStats> stats;
};

ModeRun run_mode(TrainConfig cfg, ExecMode mode) {
  cfg.mode = mode;
  auto device = make_device(mode == ExecMode::Compute ? "sim:capacity=80GiB,context=0,backing=host"
                                                      : "sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  attach(alloc);
  Recorder recorder;
  alloc.add_observer(&recorder);
  ModeRun r;
  {
    Trainer trainer(cfg, alloc);
    for (std::size_t i = 0; i < cfg.steps; ++i) r.stats.push_back(trainer.step().stats);
  }
  alloc.remove_observer(&recorder);
  r.events = std::move(recorder.events);
  return r;
}

// The models whose two modes are compared. gpt2's compute step (124M parameters, each
// initialised, updated and accumulated element by element) takes minutes under ASan and
// TSan; its transformer ops are covered there by the op tests, and its modes here in the
// plain build.
#ifdef VRAMSCOPE_SANITIZED
constexpr std::array kModeModels = {"mlp", "forum-cnn", "resnet18"};
#else
constexpr std::array kModeModels = {"mlp", "forum-cnn", "resnet18", "gpt2"};
#endif

// Shapes small enough for a compute-mode step of each model in a unit test.
ModelOptions small_options(const std::string& model) {
  return ModelOptions::parse(model == "resnet18" ? "batch=2,image=32,classes=10"
                             : model == "gpt2"   ? "batch=1,seq=8"
                             : model == "mlp"    ? "batch=4,depth=4,width=64"
                                                 : "batch=4");
}

// The runtime's half of "identical statistics": both modes make the same requests, in
// the same order, with the same sizes, attributed to the same module scopes.
TEST(ModesAgree, ComputeAndDryRunMakeTheSameAllocationsAndFrees) {
  for (const char* model : kModeModels) {
    for (std::size_t segments : {1u, 3u}) {
      TrainConfig cfg;
      cfg.model = models::find(model);
      const std::string m = model;
      cfg.model_options = small_options(m);
      cfg.segments = segments;
      cfg.steps = 2;
      cfg.precision = segments == 3 ? Precision::Amp : Precision::F32;
      if (m == "gpt2") {  // 124M parameters: keep the compute run short
        cfg.steps = 1;
        cfg.precision = Precision::F32;
        cfg.optimizer.kind = OptimizerKind::SGD;
      }
      const ModeRun compute = run_mode(cfg, ExecMode::Compute);
      const ModeRun dry = run_mode(cfg, ExecMode::DryRun);
      EXPECT_GT(compute.events.size(), 10u);
      EXPECT_TRUE(compute.events == dry.events) << model << " segments " << segments;
    }
  }
}

// And the allocator's statistics come out identical, field by field. Best fit breaks
// ties between equal free blocks by address, so this also relies on the simulated
// device placing host-backed segments at the same offsets as address-only ones.
TEST(ModesAgree, ComputeAndDryRunProduceIdenticalAllocatorStatistics) {
  for (const char* model : kModeModels) {
    for (std::size_t segments : {1u, 2u}) {  // 1 segment = no checkpointing
      TrainConfig cfg;
      cfg.model = models::find(model);
      const std::string m = model;
      cfg.model_options = small_options(m);
      cfg.steps = 2;
      cfg.segments = segments;
      if (m == "gpt2") {  // 124M parameters: keep the compute run short
        cfg.steps = 1;
        cfg.optimizer.kind = OptimizerKind::SGD;
      }
      const ModeRun compute = run_mode(cfg, ExecMode::Compute);
      const ModeRun dry = run_mode(cfg, ExecMode::DryRun);
      ASSERT_EQ(compute.stats.size(), dry.stats.size());
      for (std::size_t i = 0; i < dry.stats.size(); ++i) {
        EXPECT_TRUE(compute.stats[i] == dry.stats[i])
            << model << " segments " << segments << " step " << i + 1;
      }
    }
  }
}

TEST(MlpMemory, ComputeModeMatchesTheDerivationToo) {
  EXPECT_EQ(measured_mlp_peak(8, 4, ExecMode::Compute), expected_mlp_peak(8, 4));
}

}  // namespace
}  // namespace mem::nn

namespace mem::nn {
namespace {

// A graph deeper than any model vramscope builds (a model file may hold a million modules)
// must be released without recursing once per node: 200,000 nodes overflowed the 8 MiB stack.
TEST(GraphRelease, ADeepChainIsReleasedWithoutRecursion) {
  test::Env env(ExecMode::DryRun);
  const std::int64_t before = env.allocated();
  {
    Tensor x = empty(env.rt, Shape{4}, DType::F32);
    x.set_requires_grad(true);
    Tensor y = x;
    for (int i = 0; i < 400'000; ++i) y = mul_scalar(y, 1.0);
    EXPECT_NE(y.grad_fn(), nullptr);
  }  // y's grad_fn, then the whole chain, released here
  EXPECT_EQ(env.allocated(), before);
}

}  // namespace
}  // namespace mem::nn

namespace mem::nn {
namespace {

// memory_viz labels (issue 22): a gradient is allocated by its consumer's backward and
// becomes the parameter's .grad when AccumulateGrad takes it; the snapshot's block and the
// history's alloc entry then name it "<parameter>.grad", and nothing else changes.
TEST(GradientLabels, EveryGradIsNamedAfterItsParameter) {
  TrainConfig cfg;
  cfg.model = models::find("resnet18");
  cfg.model_options = ModelOptions::parse("batch=2,image=32");
  cfg.optimizer.kind = OptimizerKind::SGD;
  auto device = make_device("sim:capacity=8GiB,context=0");
  CachingAllocator alloc(device);
  attach(alloc);
  History history{alloc, 1 << 15};  // one step: a few thousand events
  Trainer trainer(cfg, alloc);
  trainer.step();

  std::map<std::uintptr_t, ContextId> owner;
  for (const SegmentInfo& seg : alloc.segments()) {
    for (const BlockInfo& b : seg.blocks) owner[b.address] = b.context;
  }
  const std::vector<Tensor> params = trainer.model().parameters();
  ASSERT_EQ(params.size(), 62u);
  for (const Tensor& p : params) {
    ASSERT_TRUE(p.grad().defined()) << p.name();
    const auto address = reinterpret_cast<std::uintptr_t>(p.grad().storage()->data());
    ASSERT_TRUE(owner.count(address)) << p.name();
    EXPECT_EQ(context_info(owner[address]).path, p.name() + ".grad");
  }
  std::size_t labelled = 0;
  for (const HistoryEntry& e : history.entries()) {
    ASSERT_NE(e.action, TraceAction::Relabel);
    const std::string& path = context_info(e.context).path;
    if (e.action == TraceAction::Alloc && path.size() > 5 && path.ends_with(".grad")) ++labelled;
  }
  EXPECT_EQ(labelled, params.size());
}

}  // namespace
}  // namespace mem::nn

namespace mem::nn {
namespace {

// torch.optim.SGD's default momentum is 0: no state at all. With momentum, the first step
// clones every gradient into a momentum_buffer (torch/optim/sgd.py, _single_tensor_sgd):
// one buffer of each parameter's size (issue 36: `sgd` was momentum 0.9 and plain SGD missing).
TEST(Optimizers, PlainSgdKeepsNoStateAndMomentumOneBufferPerParameter) {
  EXPECT_EQ(parse_optimizer_config("sgd").momentum, 0.0);
  EXPECT_EQ(parse_optimizer_config("sgd-momentum").momentum, 0.9);
  EXPECT_EQ(optimizer_label(parse_optimizer_config("sgd-momentum")), "sgd-momentum");
  EXPECT_EQ(optimizer_label(parse_optimizer_config("adam8bit")), "adam8bit");
  EXPECT_THROW(parse_optimizer_config("lion"), Error);
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.model_options = ModelOptions::parse("depth=2,width=256,batch=8");
  cfg.steps = 2;
  cfg.optimizer = parse_optimizer_config("sgd");
  const TrainReport plain = train(cfg);
  EXPECT_EQ(plain.optimizer_state_bytes, 0);
  cfg.optimizer = parse_optimizer_config("sgd-momentum");
  const TrainReport momentum = train(cfg);
  EXPECT_EQ(momentum.optimizer_state_bytes, momentum.parameter_bytes);
  EXPECT_GT(momentum.peak_allocated, plain.peak_allocated);
}

// Gradient accumulation: the micro-batches after the first of an optimizer step run with every
// gradient live, and only the last one steps. mlp depth 2, width 256, f32: 2 x (256 x 256 + 256)
// parameters, 526,336 B of gradients.
TEST(Accumulation, LaterMicroBatchesRunWithTheGradientsLiveAndOnlyTheLastSteps) {
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.model_options = ModelOptions::parse("depth=2,width=256,batch=8");
  cfg.device = "sim:capacity=1GiB,context=0";
  cfg.accumulation = 2;
  cfg.steps = 4;
  const TrainReport r = train(cfg);
  ASSERT_EQ(r.steps.size(), 4u);
  const std::int64_t grads = 2 * (256 * 256 + 256) * 4;
  EXPECT_EQ(r.parameter_bytes, grads);
  // Micro-batch 1 makes no optimizer state; micro-batch 2 steps: Adam's two moments appear.
  EXPECT_EQ(r.steps[0].optimizer.allocations, 0);
  EXPECT_GT(r.steps[1].optimizer.allocations, 0);
  EXPECT_EQ(r.steps[1].allocated_end - r.steps[0].allocated_end, 2 * grads);
  // Micro-batch 2 of the second optimizer step runs its forward with the first's gradients
  // live; micro-batch 1 runs after zero_grad freed them.
  EXPECT_EQ(r.steps[3].forward.peak_allocated - r.steps[2].forward.peak_allocated, grads);
  // Accumulation into live gradients allocates no second copy.
  EXPECT_EQ(r.steps[3].allocated_end, r.steps[1].allocated_end);
  cfg.parallel = parse_parallel("ddp:2");
  EXPECT_THROW((void)train(cfg), Error);
}

}  // namespace
}  // namespace mem::nn
