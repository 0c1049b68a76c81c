// gradcheck_test.cpp — every op's backward against central finite differences in f64.
//
// For an op y = f(x1..xn) and a fixed random cotangent r, the analytic gradient of
// L = sum(y * r) comes from backward(y, r); the numeric one from (L(x+h) - L(x-h)) / 2h
// per element. Inputs are random, so kinks (relu at 0, max-pool ties) are not hit.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "test_util.hpp"

namespace mem::nn {
namespace {

using Fn = std::function<Tensor(const TensorList&)>;

double dot(const Tensor& y, const std::vector<double>& r) {
  const auto v = to_values(y);
  double s = 0;
  for (std::size_t i = 0; i < v.size(); ++i) s += v[i] * r[i];
  return s;
}

/// Checks d(sum(f(inputs) * r))/d(inputs[i]) for every input that requires grad.
void gradcheck(Runtime& rt, const Fn& f, TensorList inputs, double tol = 1e-6) {
  Tensor y = f(inputs);
  ASSERT_TRUE(y.requires_grad());
  const Tensor r = uniform(rt, y.shape(), -1, 1, DType::F64, 99);
  const auto rv = to_values(r);
  backward(y, r);
  y = Tensor{};
  const double h = 1e-6;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    Tensor& x = inputs[i];
    if (!x.requires_grad()) continue;
    ASSERT_TRUE(x.grad().defined()) << "input " << i << " got no gradient";
    const auto analytic = to_values(x.grad());
    double* data = x.data<double>();
    for (std::int64_t j = 0; j < x.numel(); ++j) {
      const double orig = data[j];
      NoGradGuard no_grad;
      data[j] = orig + h;
      const double lp = dot(f(inputs), rv);
      data[j] = orig - h;
      const double lm = dot(f(inputs), rv);
      data[j] = orig;
      const double numeric = (lp - lm) / (2 * h);
      ASSERT_NEAR(analytic[static_cast<std::size_t>(j)], numeric, tol * (1 + std::abs(numeric)))
          << "input " << i << " element " << j;
    }
  }
}

class GradCheck : public ::testing::Test {
 protected:
  Tensor leaf(const Shape& shape, double lo = -1, double hi = 1) {
    Tensor t = uniform(env_.rt, shape, lo, hi, DType::F64, ++seed_);
    t.set_requires_grad(true);
    return t;
  }
  test::Env env_{ExecMode::Compute};
  std::uint64_t seed_ = 0;
};

TEST_F(GradCheck, Linear) {
  gradcheck(env_.rt, [](const TensorList& in) { return linear(in[0], in[1], in[2]); },
            {leaf({3, 4}), leaf({5, 4}), leaf({5})});
  gradcheck(env_.rt, [](const TensorList& in) { return linear(in[0], in[1]); }, {leaf({2, 3, 4}), leaf({5, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return linear_kn(in[0], in[1], in[2]); },
            {leaf({2, 3, 4}), leaf({4, 6}), leaf({6})});
}

TEST_F(GradCheck, BmmAndMatmulOnPermutedViews) {
  gradcheck(env_.rt, [](const TensorList& in) { return bmm(in[0], in[1]); }, {leaf({2, 3, 4}), leaf({2, 4, 5})});
  gradcheck(env_.rt,
            [](const TensorList& in) {
              const Tensor q = in[0].permute({0, 2, 1, 3});  // [B, H, T, D] from [B, T, H, D]
              const Tensor k = in[1].permute({0, 2, 3, 1});  // [B, H, D, T]
              return matmul(q, k);
            },
            {leaf({2, 3, 2, 4}), leaf({2, 3, 2, 4})});
}

TEST_F(GradCheck, Conv2d) {
  gradcheck(env_.rt, [](const TensorList& in) { return conv2d(in[0], in[1], in[2], 1, 1); },
            {leaf({2, 3, 5, 4}), leaf({4, 3, 3, 3}), leaf({4})});
  gradcheck(env_.rt, [](const TensorList& in) { return conv2d(in[0], in[1], Tensor{}, 2, 0); },
            {leaf({1, 2, 6, 5}), leaf({3, 2, 3, 3})});
  gradcheck(env_.rt, [](const TensorList& in) { return conv2d(in[0], in[1], in[2], 1, 0); },
            {leaf({2, 3, 3, 3}), leaf({4, 3, 1, 1}), leaf({4})});
  // Dilated, grouped (2 groups of 2 -> 3 channels) and depthwise (groups = channels).
  gradcheck(env_.rt, [](const TensorList& in) { return conv2d(in[0], in[1], in[2], 1, 2, 2, 1); },
            {leaf({1, 2, 6, 5}), leaf({3, 2, 3, 3}), leaf({3})});
  gradcheck(env_.rt, [](const TensorList& in) { return conv2d(in[0], in[1], in[2], 2, 1, 1, 2); },
            {leaf({2, 4, 5, 5}), leaf({6, 2, 3, 3}), leaf({6})});
  gradcheck(env_.rt, [](const TensorList& in) { return conv2d(in[0], in[1], Tensor{}, 1, 1, 1, 3); },
            {leaf({1, 3, 4, 4}), leaf({3, 1, 3, 3})});
  gradcheck(env_.rt, [](const TensorList& in) { return conv2d(in[0], in[1], Tensor{}, 1, 0, 1, 2); },
            {leaf({1, 4, 3, 3}), leaf({4, 2, 1, 1})});
  // conv1d: padding, stride and dilation act on the length only.
  gradcheck(env_.rt, [](const TensorList& in) { return conv1d(in[0], in[1], in[2], 2, 2, 2, 2); },
            {leaf({2, 4, 9}), leaf({6, 2, 3}), leaf({6})});
  gradcheck(env_.rt, [](const TensorList& in) { return conv1d(in[0], in[1]); }, {leaf({1, 3, 5}), leaf({2, 3, 1})});
  // Transposed: stride 2 with output_padding, and dilated.
  gradcheck(env_.rt, [](const TensorList& in) { return conv_transpose2d(in[0], in[1], in[2], 2, 1, 1); },
            {leaf({2, 3, 3, 4}), leaf({3, 2, 3, 3}), leaf({2})});
  gradcheck(env_.rt, [](const TensorList& in) { return conv_transpose2d(in[0], in[1], Tensor{}, 1, 0, 0, 2); },
            {leaf({1, 2, 3, 3}), leaf({2, 3, 2, 2})});
}

TEST_F(GradCheck, ConvTransposeIsTheAdjointOfConv) {
  // <conv2d(y, W), x> = <y, conv_transpose2d(x, W)> for every x and y: the transposed
  // convolution's forward is the convolution's transpose, as PyTorch defines it.
  NoGradGuard no_grad;
  const Tensor w = uniform(env_.rt, {3, 2, 3, 3}, -1, 1, DType::F64, 11);  // conv: 2 -> 3 channels
  const Tensor y = uniform(env_.rt, {2, 2, 7, 8}, -1, 1, DType::F64, 12);
  const Tensor conv = conv2d(y, w, Tensor{}, 2, 1);                      // [2, 3, 4, 4]
  const Tensor x = uniform(env_.rt, conv.shape(), -1, 1, DType::F64, 13);
  const Tensor back = conv_transpose2d(x, w, Tensor{}, 2, 1, 0);         // [2, 2, 7, 7]
  ASSERT_EQ(back.shape(), (Shape{2, 2, 7, 7}));
  const Tensor back8 = conv_transpose2d(x, w, Tensor{}, 2, 1, 1);        // output_padding 1: [2, 2, 8, 8]
  ASSERT_EQ(back8.shape(), (Shape{2, 2, 8, 8}));
  const auto cv = to_values(conv), xv = to_values(x), yv = to_values(y), bv = to_values(back8);
  double lhs = 0, rhs = 0;
  for (std::size_t i = 0; i < cv.size(); ++i) lhs += cv[i] * xv[i];
  // y is 7 x 8; back8 is 8 x 8 (its last row lies past y): compare over y's rows.
  for (std::int64_t p = 0; p < 4; ++p) {
    for (std::int64_t r = 0; r < 7; ++r) {
      for (std::int64_t c = 0; c < 8; ++c) rhs += yv[(p * 7 + r) * 8 + c] * bv[(p * 8 + r) * 8 + c];
    }
  }
  EXPECT_NEAR(lhs, rhs, 1e-9 * (1 + std::abs(lhs)));
}

TEST_F(GradCheck, Pooling) {
  gradcheck(env_.rt, [](const TensorList& in) { return max_pool2d(in[0], 3, 2, 1); }, {leaf({2, 2, 5, 6})});
  gradcheck(env_.rt, [](const TensorList& in) { return adaptive_avg_pool2d(in[0]); }, {leaf({2, 3, 4, 5})});
  // Overlapping bins (5 -> 3) and more bins than inputs (2 -> 3).
  gradcheck(env_.rt, [](const TensorList& in) { return adaptive_avg_pool2d(in[0], 3, 2); }, {leaf({2, 2, 5, 2})});
  gradcheck(env_.rt, [](const TensorList& in) { return adaptive_avg_pool2d(in[0], 3, 3); }, {leaf({1, 2, 2, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return avg_pool2d(in[0], 3, 2, 1, true); }, {leaf({2, 2, 5, 6})});
  gradcheck(env_.rt, [](const TensorList& in) { return avg_pool2d(in[0], 3, 2, 1, false); }, {leaf({2, 2, 5, 6})});
  gradcheck(env_.rt, [](const TensorList& in) { return avg_pool2d(in[0], 2, 2); }, {leaf({1, 3, 4, 4})});
}

TEST_F(GradCheck, PoolingValuesAreTorchs) {
  NoGradGuard no_grad;
  // adaptive_avg_pool2d of one row 0..4 into 3 bins [floor(i 5/3), ceil((i+1) 5/3)):
  // [0,2) [1,4) [3,5) -> 0.5, 2, 3.5.
  Tensor row = empty(env_.rt, {1, 1, 1, 5}, DType::F64);
  for (int i = 0; i < 5; ++i) row.data<double>()[i] = i;
  EXPECT_EQ(to_values(adaptive_avg_pool2d(row, 1, 3)), (std::vector<double>{0.5, 2.0, 3.5}));
  // avg_pool2d(k 3, s 2, p 1) of a 5x5 image whose value is its column: the middle output
  // row's windows cover columns [-1,2) [1,4) [3,6). With count_include_pad the divisor counts
  // the padding (3 x 3), without it only the cells inside (3 x 2).
  Tensor square = empty(env_.rt, {1, 1, 5, 5}, DType::F64);
  for (int i = 0; i < 25; ++i) square.data<double>()[i] = i % 5;
  const std::vector<double> inc = to_values(avg_pool2d(square, 3, 2, 1, true));
  const std::vector<double> exc = to_values(avg_pool2d(square, 3, 2, 1, false));
  ASSERT_EQ(inc.size(), 9u);
  EXPECT_NEAR(inc[3], 3.0 / 9.0, 1e-12);
  EXPECT_NEAR(exc[3], 3.0 / 6.0, 1e-12);
  EXPECT_NEAR(inc[4], 18.0 / 9.0, 1e-12);
  EXPECT_NEAR(inc[5], 21.0 / 9.0, 1e-12);
  EXPECT_NEAR(exc[5], 21.0 / 6.0, 1e-12);
}

TEST_F(GradCheck, Normalisation) {
  const Tensor mean = zeros(env_.rt, {3}, DType::F64);
  const Tensor var = full(env_.rt, {3}, 1.0, DType::F64);
  gradcheck(env_.rt,
            [&](const TensorList& in) { return batch_norm(in[0], in[1], in[2], mean, var, true, 0.1, 1e-5); },
            {leaf({4, 3, 2, 2}), leaf({3}), leaf({3})}, 1e-5);
  gradcheck(env_.rt,
            [&](const TensorList& in) { return batch_norm(in[0], in[1], in[2], mean, var, false, 0.1, 1e-5); },
            {leaf({4, 3, 2, 2}), leaf({3}), leaf({3})});
  gradcheck(env_.rt, [](const TensorList& in) { return layer_norm(in[0], in[1], in[2], 1e-5); },
            {leaf({2, 3, 5}), leaf({5}), leaf({5})}, 1e-5);
  gradcheck(env_.rt, [](const TensorList& in) { return group_norm(in[0], in[1], in[2], 2, 1e-5); },
            {leaf({2, 4, 3, 2}), leaf({4}), leaf({4})}, 1e-5);
  gradcheck(env_.rt, [](const TensorList& in) { return group_norm(in[0], Tensor{}, Tensor{}, 3, 1e-5); },
            {leaf({2, 3, 5})}, 1e-5);
}

TEST_F(GradCheck, Activations) {
  gradcheck(env_.rt, [](const TensorList& in) { return relu(in[0]); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return relu_(mul_scalar(in[0], 1.0)); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return sigmoid(in[0]); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return tanh(in[0]); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return gelu(in[0], false); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return gelu(in[0], true); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return softmax(in[0]); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return log_softmax(in[0]); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return leaky_relu(in[0], 0.1); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return leaky_relu_(mul_scalar(in[0], 1.0), 0.2); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return hardtanh(in[0], -0.5, 0.5); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return hardtanh_(mul_scalar(in[0], 1.0), -0.5, 0.5); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return silu(in[0]); }, {leaf({3, 7})});
  gradcheck(env_.rt, [](const TensorList& in) { return silu_(mul_scalar(in[0], 1.0)); }, {leaf({3, 7})});
}

TEST_F(GradCheck, DropoutWithAFixedRngState) {
  const RngState state{7, 0};
  gradcheck(env_.rt,
            [&](const TensorList& in) {
              in[0].runtime().set_rng_state(state);  // same mask on every evaluation
              return dropout(in[0], 0.3, true);
            },
            {leaf({4, 9})});
}

TEST_F(GradCheck, MulOfTwoTensors) {
  gradcheck(env_.rt, [](const TensorList& in) { return mul(in[0], in[1]); }, {leaf({3, 4}), leaf({3, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return mul(in[0], sigmoid(in[0])); }, {leaf({2, 5})});
}

TEST_F(GradCheck, ElementwiseAndShape) {
  gradcheck(env_.rt, [](const TensorList& in) { return add(in[0], in[1]); }, {leaf({3, 4}), leaf({3, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return add(in[0], in[1]); }, {leaf({2, 3, 4}), leaf({1, 3, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return add_(mul_scalar(in[0], 2.0), in[1]); },
            {leaf({3, 4}), leaf({3, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return causal_mask(in[0], -5.0); }, {leaf({2, 4, 4})});
  gradcheck(env_.rt,
            [](const TensorList& in) {
              const Tensor parts[] = {in[0], in[1]};
              return cat(parts, 1);
            },
            {leaf({2, 3}), leaf({2, 5})});
  gradcheck(env_.rt,
            [](const TensorList& in) {
              const std::int64_t sizes[] = {2, 3, 1};
              auto p = split(in[0], sizes, 1);
              const Tensor parts[] = {mul_scalar(p[2], 3.0), p[0], mul_scalar(p[1], -1.0)};
              return cat(parts, 1);
            },
            {leaf({3, 6})});
  gradcheck(env_.rt, [](const TensorList& in) { return in[0].view({6, 2}).transpose(0, 1).reshape({3, 4}); },
            {leaf({3, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return in[0].permute({2, 0, 1}).contiguous().flatten(); },
            {leaf({2, 3, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return sum(in[0]); }, {leaf({3, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return mul_scalar(in[0], -2.5); }, {leaf({3, 4})});
}

TEST_F(GradCheck, Embedding) {
  const Tensor idx = from_values(env_.rt, {2, 3}, {0, 4, 2, 2, 1, 4}, DType::I64);
  gradcheck(env_.rt, [&](const TensorList& in) { return embedding(in[0], idx); }, {leaf({5, 3})});
}

// The pointwise math Hugging Face's modules are written in (issue 19).
TEST_F(GradCheck, PointwiseMathAndBroadcasting) {
  gradcheck(env_.rt, [](const TensorList& in) { return square(in[0]); }, {leaf({3, 5})});
  gradcheck(env_.rt, [](const TensorList& in) { return rsqrt(in[0]); }, {leaf({3, 5}, 0.5, 2)});
  gradcheck(env_.rt, [](const TensorList& in) { return neg(in[0]); }, {leaf({3, 5})});
  gradcheck(env_.rt, [](const TensorList& in) { return add_scalar(in[0], 0.25); }, {leaf({3, 5})});
  gradcheck(env_.rt, [](const TensorList& in) { return mean_last(in[0]); }, {leaf({2, 3, 5})});
  // Broadcasting: [2, 3, 5] with [3, 1], [5] and [1, 1, 5]; the gradients sum back down.
  gradcheck(env_.rt, [](const TensorList& in) { return mul(in[0], in[1]); }, {leaf({2, 3, 5}), leaf({3, 1})});
  gradcheck(env_.rt, [](const TensorList& in) { return mul(in[0], in[1]); }, {leaf({5}), leaf({2, 3, 5})});
  gradcheck(env_.rt, [](const TensorList& in) { return add(in[0], in[1]); }, {leaf({2, 3, 5}), leaf({1, 1, 5})});
  // On a transposed view the output keeps the view's layout (TensorIterator), same values.
  gradcheck(env_.rt, [](const TensorList& in) { return mul(in[0].transpose(0, 1), in[1]); },
            {leaf({3, 2, 4}), leaf({1, 4})});
}

TEST_F(GradCheck, NarrowExpandUnsqueeze) {
  gradcheck(env_.rt, [](const TensorList& in) { return mul_scalar(in[0].narrow(-1, 2, 3), 2.0); }, {leaf({2, 6})});
  // In place into an output that keeps a transposed input's layout (TensorIterator's order).
  gradcheck(env_.rt, [](const TensorList& in) { return relu_(mul_scalar(in[0].transpose(0, 1), 2.0)); },
            {leaf({3, 4})});
  gradcheck(env_.rt, [](const TensorList& in) { return mul_scalar(in[0].unsqueeze(1).expand({2, 3, 4}), 1.5); },
            {leaf({2, 4})});
  // repeat_kv: expand over a new dimension, then a reshape that copies.
  gradcheck(env_.rt,
            [](const TensorList& in) { return in[0].unsqueeze(2).expand({1, 2, 3, 4, 5}).reshape({1, 6, 4, 5}); },
            {leaf({1, 2, 4, 5})});
}

TEST_F(GradCheck, ScaledDotProductAttention) {
  // Causal, with grouped keys (4 query heads over 2 key heads), and full attention.
  gradcheck(env_.rt,
            [](const TensorList& in) {
              return scaled_dot_product_attention(in[0], in[1], in[2], SdpaBackend::Efficient, true);
            },
            {leaf({2, 4, 5, 3}), leaf({2, 2, 5, 3}), leaf({2, 2, 5, 3})});
  gradcheck(env_.rt,
            [](const TensorList& in) {
              return scaled_dot_product_attention(in[0], in[1], in[2], SdpaBackend::Efficient, false);
            },
            {leaf({1, 2, 4, 3}), leaf({1, 2, 6, 3}), leaf({1, 2, 6, 3})});
}

TEST_F(GradCheck, TransformerLayersOfModelFiles) {
  MultiheadAttention mha(6, 2, 0.0, true, true);
  mha.set_path("attn");
  mha.materialize(env_.rt, DType::F64);
  gradcheck(env_.rt, [&](const TensorList& in) { return mha(in[0]); }, {leaf({2, 3, 6})});
  TorchRMSNorm norm(5, 1e-6);
  norm.set_path("norm");
  norm.materialize(env_.rt, DType::F64);
  gradcheck(env_.rt, [&](const TensorList& in) { return norm(in[0]); }, {leaf({3, 5})});
  ClassToken cls(4);
  cls.set_path("cls");
  cls.materialize(env_.rt, DType::F64);
  PositionEmbedding pos(4, 4);
  pos.set_path("pos");
  pos.materialize(env_.rt, DType::F64);
  SelectToken select(1, 0);
  gradcheck(env_.rt, [&](const TensorList& in) { return select(pos(cls(in[0]))); }, {leaf({2, 3, 4})});
}

// LlamaRMSNorm's arithmetic in f64 (the module itself computes in f32, as HF's does, which
// finite differences in f64 cannot check): weight * (x * rsqrt(mean(x^2) + eps)).
TEST_F(GradCheck, RmsNormArithmetic) {
  gradcheck(env_.rt,
            [](const TensorList& in) {
              return mul(in[1], mul(in[0], rsqrt(add_scalar(mean_last(square(in[0])), 1e-6))));
            },
            {leaf({3, 5}), leaf({5})});
}

TEST_F(GradCheck, Losses) {
  const Tensor target = uniform(env_.rt, {3, 4}, 0, 1, DType::F64, 5);
  gradcheck(env_.rt, [&](const TensorList& in) { return mse_loss(in[0], target); }, {leaf({3, 4})});
  const Tensor classes = from_values(env_.rt, {3}, {1, 0, 3}, DType::I64);
  gradcheck(env_.rt, [&](const TensorList& in) { return cross_entropy(in[0], classes); }, {leaf({3, 4})});
  gradcheck(env_.rt, [&](const TensorList& in) { return bce_with_logits(in[0], target); }, {leaf({3, 4}, -8, 8)});
}

TEST_F(GradCheck, BceWithLogitsValueIsTorchs) {
  // F.binary_cross_entropy_with_logits([[0, 2], [-3, 40]], [[1, 0], [0.5, 1]]): the mean of
  // log(2), 2 + log(1 + e^-2), 1.5 + log(1 + e^-3), log(1 + e^-40) (no overflow at 40).
  NoGradGuard no_grad;
  const Tensor x = from_values(env_.rt, {2, 2}, {0, 2, -3, 40}, DType::F64);
  const Tensor t = from_values(env_.rt, {2, 2}, {1, 0, 0.5, 1}, DType::F64);
  const double expected = (std::log(2.0) + 2 + std::log1p(std::exp(-2.0)) + 1.5 + std::log1p(std::exp(-3.0)) +
                           std::log1p(std::exp(-40.0))) / 4;
  EXPECT_NEAR(to_values(bce_with_logits(x, t))[0], expected, 1e-12);
}

TEST_F(GradCheck, GradientsAccumulateIntoLeaves) {
  Tensor x = leaf({2, 3});
  backward(sum(x));
  backward(sum(mul_scalar(x, 2.0)));
  for (double g : to_values(x.grad())) EXPECT_DOUBLE_EQ(g, 3.0);
}

TEST(Dtype, HalfConversionsRoundToNearestEven) {
  EXPECT_EQ(float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half(1e6f), 0x7c00);
  EXPECT_EQ(float_to_half(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_FLOAT_EQ(half_to_float(0x3555), 0.333251953125f);
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    ASSERT_EQ(float_to_half(half_to_float(static_cast<std::uint16_t>(h))), h);
  }
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_FLOAT_EQ(bf16_to_float(float_to_bf16(3.140625f)), 3.140625f);
}

TEST(Tensors, ViewsShareStorageAndReshapeCopiesOnlyWhenNeeded) {
  test::Env env(ExecMode::DryRun);
  const Tensor x = empty(env.rt, {8, 16});
  const auto before = env.allocated();
  const Tensor v = x.view({16, 8});
  const Tensor t = x.transpose(0, 1);
  EXPECT_TRUE(same_storage(x, v));
  EXPECT_TRUE(same_storage(x, t));
  EXPECT_EQ(env.allocated(), before);
  const Tensor r = t.reshape({128});  // transposed: must copy
  EXPECT_FALSE(same_storage(t, r));
  EXPECT_EQ(env.allocated(), before + 512);
  EXPECT_THROW((void)t.view({128}), Error);
  EXPECT_THROW((void)x.raw_data(), Error);  // no host memory in a dry run
}

}  // namespace
}  // namespace mem::nn
