// The norm kernels of src/ops/cuda/norm.cu run on the host (emulation.h), float32 and bf16, each
// path against a float64 reference of what it computes: the gated norm 16 bytes a lane (a warp or
// part of one a row) and element by element, its backward with the partial dw in registers (PK > 0)
// and in memory (PK = 0), the residual add with the norm a warp a row and a block a row, and the
// packed add. Exits non-zero, naming the check, where one is off; prints one line per check.
#include "emulation.h"
#include "../../src/ops/cuda/norm.cu"

#include <cstdio>
#include <random>
#include <string>

namespace {
std::mt19937 rng(11);
int failures = 0;

template <class T> std::vector<T> draw(size_t len, float mean, float sd) {
  std::normal_distribution<float> d(mean, sd);
  std::vector<T> x(len);
  for (auto &v : x) v = from_f<T>(d(rng));
  return x;
}
template <class T> std::vector<double> wide(const std::vector<T> &x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); i++) y[i] = to_f(x[i]);
  return y;
}
template <class T> constexpr const char *name() { return sizeof(T) == 4 ? "f32" : "bf16"; }
template <class T> constexpr double tol() { return sizeof(T) == 4 ? 2e-5 : 1e-2; }

// max |got - want| / max |want|, reported and checked against `bound`.
void check(const std::string &what, const std::vector<double> &got, const std::vector<double> &want, double bound) {
  double err = 0.0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); i++) {
    err = std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  const double rel = err / scale;
  std::printf("%s %.3e\n", what.c_str(), rel);
  if (!(rel <= bound)) {
    std::fprintf(stderr, "%s: off by %.3e (bound %.1e)\n", what.c_str(), rel, bound);
    failures++;
  }
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// The lanes a row takes in gated_rms (norm_lanes in src/ops/cuda/norm.rs).
template <class T> int lanes(int n, bool vec) {
  const int packs = n / (16 / int(sizeof(T)));
  return vec && packs >= 1 && packs < 32 && 32 % packs == 0 ? packs : 32;
}

template <class T> void gated_norm(int rows, int n, bool gated) {
  const auto x = draw<T>(size_t(rows) * n, 0.0f, 1.0f), g = draw<T>(size_t(rows) * n, 0.0f, 1.0f);
  const auto w = draw<float>(n, 1.0f, 0.2f);
  const float eps = 1e-6f;
  std::vector<double> want(x.size());
  for (int r = 0; r < rows; r++) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += double(to_f(x[r * n + i])) * to_f(x[r * n + i]);
    const double inv = 1.0 / std::sqrt(ss / n + eps);
    for (int i = 0; i < n; i++)
      want[r * n + i] = to_f(x[r * n + i]) * inv * w[i] * (gated ? silu(to_f(g[r * n + i])) : 1.0);
  }
  for (int vec = 0; vec < 2; vec++) {
    if (vec && n % (16 / sizeof(T))) continue;
    const int l = lanes<T>(n, vec);
    std::vector<T> y(x.size());
    const unsigned blocks = (rows + 8 * (32 / l) - 1) / (8 * (32 / l));
    emu::launch(dim3{blocks, 1, 1}, dim3{256, 1, 1},
                [&] { gated_rms<T>(x.data(), g.data(), w.data(), y.data(), rows, n, eps, gated, vec, l); });
    check(std::string("gated_rms ") + name<T>() + " n " + std::to_string(n) + (gated ? " gated" : "") + " vec " +
              std::to_string(vec) + " lanes " + std::to_string(l),
          wide(y), want, tol<T>());
  }
}

// rms_bwd against float64 (dx as res + dx, dg, dw summed over the partial rows), by the
// dispatcher (whichever PK the width takes) and by the PK = 0 path; dx and dg of the two paths
// bit for bit (the same arithmetic per element).
template <class T> void norm_backward(int rows, int n, bool gated, bool has_res) {
  const size_t len = size_t(rows) * n;
  const auto x = draw<T>(len, 0.0f, 1.0f), g = draw<T>(len, 0.0f, 1.0f), dy = draw<T>(len, 0.0f, 1.0f);
  const auto res = draw<T>(len, 0.0f, 1.0f);
  const auto w = draw<float>(n, 1.0f, 0.2f);
  const float eps = 1e-6f;
  std::vector<double> dx(len), dg(len), dw(n, 0.0);
  for (int r = 0; r < rows; r++) {
    double ss = 0.0, dot = 0.0;
    for (int i = 0; i < n; i++) {
      const double xv = to_f(x[r * n + i]), u = to_f(dy[r * n + i]) * (gated ? silu(to_f(g[r * n + i])) : 1.0);
      ss += xv * xv;
      dot += u * w[i] * xv;
    }
    const double inv = 1.0 / std::sqrt(ss / n + eps), m = inv * dot / n;
    for (int i = 0; i < n; i++) {
      const double xh = to_f(x[r * n + i]) * inv, d = to_f(dy[r * n + i]), gv = to_f(g[r * n + i]);
      const double sig = 1.0 / (1.0 + std::exp(-gv)), u = d * (gated ? gv * sig : 1.0);
      dx[r * n + i] = inv * (u * w[i] - xh * m) + (has_res ? to_f(res[r * n + i]) : 0.0);
      dg[r * n + i] = d * xh * w[i] * sig * (1.0 + gv * (1.0 - sig));
      dw[i] += u * xh;
    }
  }
  constexpr int V = 16 / sizeof(T);
  const bool vec = n % V == 0;
  const int blocks = (rows + RMS_BWD_ROWS - 1) / RMS_BWD_ROWS;
  std::vector<T> dxt[2], dgt[2];
  for (int path = 0; path < 2; path++) {
    // path 0: the dispatcher; 1: PK = 0 (a warp's partial row in memory).
    const bool reg = path == 0 && vec && n >= 32 * V && (n + 32 * V - 1) / (32 * V) <= RMS_BWD_PACKS;
    const int count = reg ? blocks : blocks * 8;
    dxt[path].assign(len, from_f<T>(0.0f));
    dgt[path].assign(len, from_f<T>(0.0f));
    std::vector<float> parts(size_t(count) * n, NAN);
    emu::launch(dim3{unsigned(blocks), 1, 1}, dim3{256, 1, 1}, [&] {
      const T *r = has_res ? res.data() : nullptr;
      if (path == 0)
        rms_bwd<T>(x.data(), g.data(), w.data(), dy.data(), r, dxt[path].data(), dgt[path].data(), parts.data(),
                   rows, n, eps, gated, vec);
      else
        rms_bwd_rows<T, 0>(x.data(), g.data(), w.data(), dy.data(), r, dxt[path].data(), dgt[path].data(),
                           parts.data(), rows, n, eps, gated, vec);
    });
    std::vector<double> sum(n, 0.0);
    for (int p = 0; p < count; p++)
      for (int i = 0; i < n; i++) sum[i] += parts[size_t(p) * n + i];
    const std::string what = std::string("rms_bwd ") + name<T>() + " n " + std::to_string(n) +
                             (gated ? " gated" : "") + (has_res ? " res" : "") +
                             (path == 0 ? (reg ? " registers" : " memory") : " PK 0");
    check(what + " dx", wide(dxt[path]), dx, tol<T>());
    if (gated) check(what + " dg", wide(dgt[path]), dg, tol<T>());
    check(what + " dw", sum, dw, 1e-5);
  }
  const auto same = [](const std::vector<T> &a, const std::vector<T> &b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
  };
  if (!same(dxt[0], dxt[1]) || (gated && !same(dgt[0], dgt[1]))) {
    std::fprintf(stderr, "rms_bwd %s n %d: the two paths' dx or dg differ\n", name<T>(), n);
    failures++;
  }
}

// add_rms_rows (the sum bit for bit as a rounded add, the norm against float64) and add_packs.
template <class T> void residual(int rows, int n) {
  const size_t len = size_t(rows) * n;
  const auto a = draw<T>(len, 0.0f, 1.0f), b = draw<T>(len, 0.0f, 1.0f);
  const auto w = draw<float>(n, 1.0f, 0.2f);
  std::vector<T> sum(len), h(len), y(len), packed(len);
  for (size_t i = 0; i < len; i++) sum[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
  std::vector<double> want(len);
  for (int r = 0; r < rows; r++) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += double(to_f(sum[r * n + i])) * to_f(sum[r * n + i]);
    const double inv = 1.0 / std::sqrt(ss / n + 1e-6);
    for (int i = 0; i < n; i++) want[r * n + i] = to_f(sum[r * n + i]) * inv * w[i];
  }
  emu::launch(dim3{unsigned((rows + 7) / 8), 1, 1}, dim3{256, 1, 1},
              [&] { add_rms_rows<T>(a.data(), b.data(), w.data(), h.data(), y.data(), rows, n, 1e-6f); });
  const std::string what = std::string(name<T>()) + " " + std::to_string(rows) + " x " + std::to_string(n);
  check("add_rms_rows " + what, wide(y), want, tol<T>());
  // The block-a-row kernel (a decoding step's few rows) takes the same arguments.
  std::vector<T> hb(len), yb(len);
  emu::launch(dim3{unsigned(rows), 1, 1}, dim3{256, 1, 1},
              [&] { add_rms<T>(a.data(), b.data(), w.data(), hb.data(), yb.data(), rows, n, 1e-6f); });
  check("add_rms " + what, wide(yb), want, tol<T>());
  const long long packs = (long long)(len / (16 / sizeof(T)));
  emu::launch(dim3{3, 1, 1}, dim3{256, 1, 1}, [&] { add_packs<T>(a.data(), b.data(), packed.data(), packs); });
  for (const auto *out : {&h, &hb, &packed})
    if (std::memcmp(out->data(), sum.data(), len * sizeof(T)) != 0) {
      std::fprintf(stderr, "%s: a sum differs from the rounded add\n", what.c_str());
      failures++;
    }
  std::printf("sums %s bit for bit\n", what.c_str());
}

template <class T> void all() {
  for (auto [n, gated] : {std::pair{2048, false}, {2048, true}, {128, true}, {64, false}, {130, true}})
    gated_norm<T>(37, n, gated);
  for (auto [n, gated, res] : {std::tuple{2048, false, true}, {2048, true, false}, {256, false, false},
                               {512, true, true}, {128, true, true}, {130, false, false}})
    norm_backward<T>(150, n, gated, res);
  for (int n : {2048, 128}) residual<T>(37, n);
}
}  // namespace

int main() {
  all<float>();
  all<__nv_bfloat16>();
  if (failures) std::fprintf(stderr, "%d checks failed\n", failures);
  return failures ? 1 : 0;
}
