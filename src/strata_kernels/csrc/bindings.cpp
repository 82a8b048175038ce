// The Python module of the CPU kernels (see cpu_kernels.h).
#include "cpu_kernels.h"
#include "lanes.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  // Every kernel runs with the GIL released (its arguments are converted before, its result after): a
  // Python thread beside the model's (the engine's pings, the next grammar mask) runs while it computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("gemv", &strata_cpu::gemv, nogil, "x @ W_i.T for GGUF blocks W_i and 1..8 rows of x, by integer dot products",
        py::arg("x"), py::arg("blocks"), py::arg("qtypes"), py::arg("K"));
  m.def("gemv_experts", &strata_cpu::gemv_experts, nogil,
        "a mixture-of-experts step's GEMVs: runs of at most 8 rows of x, each times its expert's matrix",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("N"), py::arg("experts"), py::arg("starts"),
        py::arg("counts"));
  m.def("dequantize", &strata_cpu::dequantize, nogil, "GGUF blocks into a dense float32 or bfloat16 tensor");
  m.def("rms_norm", &strata_cpu::rms_norm, nogil, "RMSNorm (none without a weight), optionally then RoPE and a residual add", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(), py::arg("cos") = py::none(),
        py::arg("sin") = py::none());
  m.def("attention_decode", &strata_cpu::attention_decode, nogil,
        "one query per sequence over float32 or bfloat16 K/V blocks read through block tables, after writing "
        "each query's own key and value",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("positions"), py::arg("window"), py::arg("scale"),
        py::arg("tables"), py::arg("table_lengths"), py::arg("block_size"), py::arg("new_k") = py::none(),
        py::arg("new_v") = py::none());
  m.def("gated_mul", &strata_cpu::gated_mul, nogil, "act(gate) * up (act 0: gelu_tanh, 1: silu), in float32 inside",
        py::arg("gate"), py::arg("up"), py::arg("act"));
  m.def("attention_block", &strata_cpu::attention_block, nogil,
        "a decoder layer's attention half for one position per sequence: x + o(attention(rope(q), rope(k), v)), fused");
  m.def("mlp_block", &strata_cpu::mlp_block, nogil, "a decoder layer's MLP half for rows of hidden states: x + down(act(gate) * up)");
  m.def("delta_rule_step", &strata_cpu::delta_rule_step, nogil,
        "the gated delta rule's step for one token per sequence, each state in its slot, in place");
  m.def("delta_rule_scan", &strata_cpu::delta_rule_scan, nogil,
        "the gated delta rule over one sequence's tokens in order, heads in parallel, its state in place");
  m.def("conv_step", &strata_cpu::conv_step, nogil,
        "the causal depthwise convolution's next output per sequence, its window shifted in place");
  m.attr("max_m") = strata_cpu::kMaxM;
  m.attr("simd") = strata_cpu::kSimd;  // the Lanes the kernels were built with
}
