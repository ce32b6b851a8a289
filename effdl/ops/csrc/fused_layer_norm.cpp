// Fused LayerNorm as a C++ autograd op over the Triton kernels of effdl/ops/layer_norm.py.
//
// An eager LayerNorm at LM shapes runs for tens of microseconds on the GPU, so its step time is
// the host's: a Python autograd.Function and Triton's Python launcher cost several times what
// torch's own LayerNorm (a C++ autograd node and C++ launches) does. Here the view, the
// allocations, the autograd node and the launches are C++. Python still owns the kernels and
// every launch decision: the first time a key (shapes, strides, dtypes, pointer alignment) is
// seen, a planner written in Python compiles the kernels with Triton and returns, for each, the
// binary's handle, grid, block and argument layout, and the plan is kept here; later calls with
// that key launch the binaries with cuLaunchKernel directly.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using CuLaunchKernel = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                               unsigned block_x, unsigned block_y, unsigned block_z,
                               unsigned shared_bytes, void* stream, void** params, void** extra);

CuLaunchKernel cu_launch_kernel() {
  static const CuLaunchKernel launch = [] {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(driver != nullptr, "fused_layer_norm: cannot open libcuda.so.1: ", dlerror());
    void* symbol = dlsym(driver, "cuLaunchKernel");
    TORCH_CHECK(symbol != nullptr, "fused_layer_norm: libcuda.so.1 has no cuLaunchKernel");
    return reinterpret_cast<CuLaunchKernel>(symbol);
  }();
  return launch;
}

// One runtime argument of a kernel, in the kernel's signature order.
struct Arg {
  int64_t integer;  // an integer, or a pointer's address
  float real;       // a float argument (eps)
  Arg(const at::Tensor& t) : integer(reinterpret_cast<int64_t>(t.data_ptr())), real(0) {}
  Arg(int64_t i) : integer(i), real(0) {}
  Arg(double f) : integer(0), real(static_cast<float>(f)) {}
};

// A compiled Triton kernel and how to call it, as the Python planner describes it.
struct Binary {
  void* function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 0;
  unsigned shared = 0;
  std::string params;  // per runtime argument: 'p' pointer, 'i' int32, 'l' int64, 'f' float32,
                       // '-' folded into the binary by Triton's specialization
  int scratch = 0;     // null pointers Triton's calling convention appends

  static Binary from(const py::handle& described) {
    auto t = described.cast<py::tuple>();
    Binary b;
    b.function = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
    auto grid = t[1].cast<py::tuple>();
    for (int d = 0; d < 3; ++d) b.grid[d] = grid[d].cast<unsigned>();
    b.threads = t[2].cast<unsigned>();
    b.shared = t[3].cast<unsigned>();
    b.params = t[4].cast<std::string>();
    b.scratch = t[5].cast<int>();
    return b;
  }

  void launch(std::initializer_list<Arg> args, void* stream) const {
    TORCH_CHECK(args.size() == params.size(), "fused_layer_norm: a kernel takes ", params.size(),
                " runtime arguments, got ", args.size());
    uint64_t slots[24];
    void* pointers[24];
    TORCH_CHECK(params.size() + scratch <= 24, "fused_layer_norm: too many kernel parameters");
    int n = 0;
    auto arg = args.begin();
    for (char kind : params) {
      uint64_t& slot = slots[n];
      slot = 0;
      switch (kind) {
        case 'p':
        case 'l':
          std::memcpy(&slot, &arg->integer, sizeof(int64_t));
          break;
        case 'i': {
          int32_t value = static_cast<int32_t>(arg->integer);
          std::memcpy(&slot, &value, sizeof(value));
          break;
        }
        case 'f':
          std::memcpy(&slot, &arg->real, sizeof(float));
          break;
        default:  // '-': specialized away, not a parameter of the binary
          ++arg;
          continue;
      }
      pointers[n] = &slot;
      ++n;
      ++arg;
    }
    for (int s = 0; s < scratch; ++s, ++n) {
      slots[n] = 0;
      pointers[n] = &slots[n];
    }
    int status = cu_launch_kernel()(function, grid[0], grid[1], grid[2], threads, 1, 1, shared,
                                    stream, pointers, nullptr);
    TORCH_CHECK(status == 0, "fused_layer_norm: cuLaunchKernel failed with CUresult ", status);
  }
};

struct ForwardPlan {
  Binary kernel;
};

struct BackwardPlan {
  Binary kernel, sum_kernel;
  int64_t programs = 0, rows_per_program = 0, parts = 0;
};

using Key = std::vector<int64_t>;

std::mutex plans_mutex;
std::map<Key, ForwardPlan> forward_plans;
std::map<Key, BackwardPlan> backward_plans;
py::object* forward_planner = nullptr;   // set once by set_planners, never freed: it must
py::object* backward_planner = nullptr;  // outlive the interpreter's teardown of this module

// The plan kept for key, made (under the GIL, outside the lock) where there is none yet.
template <typename Plan, typename Make>
const Plan& kept(std::map<Key, Plan>& plans, Key key, Make make) {
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    auto found = plans.find(key);
    if (found != plans.end()) return found->second;
  }
  Plan plan;
  {
    py::gil_scoped_acquire gil;
    make(plan);
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  return plans.emplace(std::move(key), std::move(plan)).first->second;
}

int64_t aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

int64_t dtype_code(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1;
}

py::object to_python(const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

// x as (M, width) rows with unit column stride; the same rule as layer_norm.py's _rows.
at::Tensor as_rows(const at::Tensor& t, int64_t width) {
  if (t.dim() == 2 && t.size(1) == width && t.stride(1) == 1) return t;
  at::Tensor rows = t.reshape({-1, width});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

// A parameter as width contiguous elements; the same rule as layer_norm.py's _flat.
at::Tensor as_flat(const std::optional<at::Tensor>& p, int64_t width) {
  if (!p || !p->defined()) return at::Tensor();
  if (p->dim() == 1 && p->stride(0) == 1) return *p;
  return p->reshape({width}).contiguous();
}

at::Tensor shaped(const at::Tensor& t, at::IntArrayRef shape) {
  return t.sizes() == shape ? t : t.view(shape);
}

void* current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

const ForwardPlan& forward_plan(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,
                                const at::Tensor& b, const at::Tensor& stats) {
  Key key{x.get_device(), dtype_code(x), dtype_code(w), dtype_code(b), x.size(0), x.size(1),
          x.stride(0), y.stride(0), aligned(x), aligned(y),
          w.defined() ? aligned(w) : -1, b.defined() ? aligned(b) : -1, aligned(stats)};
  return kept(forward_plans, std::move(key), [&](ForwardPlan& plan) {
    TORCH_CHECK(forward_planner != nullptr, "fused_layer_norm: set_planners was not called");
    plan.kernel = Binary::from(
        (*forward_planner)(to_python(x), to_python(y), to_python(w), to_python(b),
                           to_python(stats)));
  });
}

const BackwardPlan& backward_plan(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dx,
                                  const at::Tensor& w, const at::Tensor& stats,
                                  const at::Tensor& dw, const at::Tensor& db) {
  Key key{x.get_device(), dtype_code(x), dtype_code(dy), dtype_code(w), dtype_code(dw),
          dtype_code(db), x.size(0), x.size(1), x.stride(0), dy.stride(0), dx.stride(0),
          aligned(x), aligned(dy), aligned(dx), w.defined() ? aligned(w) : -1, aligned(stats)};
  return kept(backward_plans, std::move(key), [&](BackwardPlan& plan) {
    TORCH_CHECK(backward_planner != nullptr, "fused_layer_norm: set_planners was not called");
    auto described = (*backward_planner)(to_python(x), to_python(dy), to_python(dx),
                                         to_python(w), to_python(stats), to_python(dw),
                                         to_python(db))
                         .cast<py::tuple>();
    plan.programs = described[0].cast<int64_t>();
    plan.rows_per_program = described[1].cast<int64_t>();
    plan.parts = described[2].cast<int64_t>();
    plan.kernel = Binary::from(described[3]);
    if (plan.parts > 0) plan.sum_kernel = Binary::from(described[4]);
  });
}

class FusedLayerNormOp : public torch::autograd::Function<FusedLayerNormOp> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps, int64_t width) {
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor rows = as_rows(x, width);
    at::Tensor w = as_flat(weight, width), b = as_flat(bias, width);
    at::Tensor y = at::empty(rows.sizes(), rows.options());
    at::Tensor stats = at::empty({2, rows.size(0)}, rows.options().dtype(at::kFloat));
    const ForwardPlan& plan = forward_plan(rows, y, w, b, stats);
    plan.kernel.launch({rows, y, w.defined() ? w : rows, b.defined() ? b : rows, stats,
                        rows.stride(0), y.stride(0), rows.size(0), rows.size(1), eps},
                       current_stream(rows));
    ctx->save_for_backward({rows, w, stats});
    ctx->saved_data["x_shape"] = x.sizes().vec();
    bool has_bias = bias && bias->defined();
    ctx->saved_data["bias_dtype"] = has_bias ? static_cast<int64_t>(bias->scalar_type()) : -1;
    if (has_bias) ctx->saved_data["bias_shape"] = bias->sizes().vec();
    if (weight && weight->defined()) ctx->saved_data["weight_shape"] = weight->sizes().vec();
    return shaped(y, x.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "fused_layer_norm has no second derivative (double backward); use "
                "torch.nn.functional.layer_norm where higher-order gradients are needed");
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &stats = saved[2];
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor dy = as_rows(grads[0], x.size(1));
    int64_t bias_code = ctx->saved_data["bias_dtype"].toInt();
    // needs_input_grad counts the tensor inputs given (a None weight or bias is not one)
    int64_t input = 1;
    at::Tensor dw, db;
    if (w.defined() && ctx->needs_input_grad(input++)) {
      dw = at::empty(ctx->saved_data["weight_shape"].toIntVector(), w.options());
    }
    if (bias_code >= 0 && ctx->needs_input_grad(input)) {
      db = at::empty(ctx->saved_data["bias_shape"].toIntVector(),
                     x.options().dtype(static_cast<at::ScalarType>(bias_code)));
    }
    int64_t m = x.size(0), n = x.size(1);
    at::Tensor dx = at::empty({m, n}, x.options());
    const BackwardPlan& plan = backward_plan(x, dy, dx, w, stats, dw, db);
    void* stream = current_stream(x);
    at::Tensor partial = at::empty({std::max<int64_t>(plan.parts, 1), plan.programs, n},
                                   x.options().dtype(at::kFloat));
    plan.kernel.launch({x, dy, dx, w.defined() ? w : x, stats, partial, x.stride(0), dy.stride(0),
                        dx.stride(0), m, n, plan.rows_per_program},
                       stream);
    if (plan.parts > 0) {
      const at::Tensor& first = dw.defined() ? dw : db;
      plan.sum_kernel.launch({partial, first, db.defined() ? db : first, plan.programs, n},
                             stream);
    }
    return {shaped(dx, ctx->saved_data["x_shape"].toIntVector()), dw, db, at::Tensor(),
            at::Tensor()};
  }
};

int64_t max_width = 0;  // the widest row the kernels take, from set_planners

// The op on x where the kernels take it, else None (the caller's Python path then serves x, or
// raises its error for a shape that does not end in normalized_shape): the checks of
// layer_norm.py's _apply and uses_triton, made here because in Python they cost an eager step
// more host time than the rest of the op.
py::object fused_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps,
                            at::IntArrayRef normalized_shape) {
  auto dtype = x.scalar_type();
  auto dims = static_cast<int64_t>(normalized_shape.size());
  if (!x.is_cuda() || x.numel() == 0 || dims == 0 || x.dim() < dims ||
      (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16)) {
    return py::none();
  }
  int64_t width = 1;
  for (int64_t d = 0; d < dims; ++d) {
    if (x.size(x.dim() - dims + d) != normalized_shape[d]) return py::none();
    width *= normalized_shape[d];
  }
  if (width > max_width) return py::none();
  return py::cast(FusedLayerNormOp::apply(x, weight, bias, eps, width));
}

void set_planners(py::object forward, py::object backward, int64_t widest) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  forward_plans.clear();
  backward_plans.clear();
  forward_planner = new py::object(std::move(forward));
  backward_planner = new py::object(std::move(backward));
  max_width = widest;
}

void clear_plans() {
  std::lock_guard<std::mutex> lock(plans_mutex);
  forward_plans.clear();
  backward_plans.clear();
}

int64_t plan_count() {
  std::lock_guard<std::mutex> lock(plans_mutex);
  return static_cast<int64_t>(forward_plans.size() + backward_plans.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_layer_norm", &fused_layer_norm,
        "LayerNorm of x over its trailing normalized_shape, or None where the kernels do not "
        "take x (not CUDA, empty, a dtype other than fp32/fp16/bf16, rows too wide, a shape "
        "that does not end in normalized_shape)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"),
        py::arg("normalized_shape"));
  m.def("set_planners", &set_planners,
        "The Python functions that compile and describe the kernels for a new key, and the "
        "widest row the kernels take",
        py::arg("forward"), py::arg("backward"), py::arg("max_width"));
  m.def("clear_plans", &clear_plans, "Forget every kept plan");
  m.def("plan_count", &plan_count, "How many plans (forward and backward) are kept");
}
